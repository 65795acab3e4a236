"""Colocated transport without buffers: the engine reads the trainer's own tensors.

With ``refit.transport.ipc_sharing: weights`` the trainer shares the memory its source's
tensors live in (CUDA IPC handles of their storages; on CPU, storages that are shared-memory
files in the private directory) and shares it again only when that memory moved (an offload and
reload, a replaced parameter, a restarted engine: the engine names the layout it holds in its
reply to every start). A refit is then one request: the engine copies every planned tensor
straight from the trainer's memory into its weights — one device copy, no packing, no slots —
synchronises and replies. Verification compares digests as the buffered transport does.

It needs one trainer rank that holds every tensor (colocated TP1/PP1 per engine) and a source
whose tensors stay valid while referenced (``stable_tensors``: a
:class:`~mcore_refit.refit.export.ModelExport` whose tensors are all views of parameters);
anything else is refused with the reason. The messages and socket are those of
:class:`~mcore_refit.refit.ipc_sender.IpcSender` (:mod:`.wire`).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence

import torch

from mcore_refit.refit.checksum import DigestRecorder
from mcore_refit.refit.ipc_memory import describe_storage
from mcore_refit.refit.ipc_sender import IpcSender
from mcore_refit.refit.plan import RefitPlan
from mcore_refit.refit.source import Piecewise, RefitPass
from mcore_refit.refit.telemetry import RefitTelemetry
from mcore_refit.refit.transport import RefitError
from mcore_refit.refit.wire import (
    Ack,
    Hello,
    Ready,
    SharedTensor,
    ShareWeights,
    SlotHandle,
    WeightsReady,
    to_fields,
)


class SharedWeightsSender(IpcSender):
    """Trainer end of the colocated transport that shares the source's tensors in place.

    Takes :class:`IpcSender`'s arguments; the plan's tensors must all come from ``rank``.
    """

    transport_name = "ipc_shared"

    def __init__(self, *, plan: RefitPlan, **kwargs) -> None:
        super().__init__(plan=plan, **kwargs)
        if self._trainers is not None:
            raise ValueError("refit.transport.ipc_sharing=weights needs one trainer rank per "
                             "engine holding every tensor; with several trainer ranks use "
                             "ipc_sharing=buffers")
        self._weights_final = self._streams.new_event()
        # The tensors the last refit checked, and the layout of their memory last described.
        self._checked: list[torch.Tensor | Piecewise] = []
        self._described: list[torch.Tensor | Piecewise] = []
        self._layout_key: str | None = None
        self._storages: list[torch.Tensor] = []
        self._layout: list[SharedTensor] = []

    def prepare(self) -> None:
        """Nothing to allocate: the engine maps the source's own memory at the first refit."""
        if self._hello is None:
            self._hello = Hello(plan=self.plan.to_json(), device_key=self._key, slots=(),
                                shares_weights=True)

    @property
    def held_bytes(self) -> int:
        return 0

    def send(self, refit_pass: RefitPass, *, refit_index: int,
             verify: bool = False) -> RefitTelemetry:
        assert self._hello is not None, "call prepare() before send()"
        plan = self.plan
        telemetry = RefitTelemetry(
            role="sender", transport=self.transport_name, refit_index=refit_index,
            device=str(self._streams.device), num_tensors=plan.num_tensors, num_buffers=0,
            payload_bytes=plan.payload_bytes, held_bytes=0, checksums=False)
        start = time.perf_counter()
        self._memory.start()
        started = self._start(refit_index=refit_index, verify=verify)
        exported = time.perf_counter()
        tensors, failure = self._tensors(refit_pass)
        telemetry.export_s = time.perf_counter() - exported
        engine_failure: RefitError | None = None
        if failure is None:
            failure = self._share_if_moved(tensors, started.shared_key, refit_index=refit_index)
        if failure is None:
            engine_failure = self._load(refit_index, telemetry)
        digests = None
        if verify and failure is None:
            recorder = DigestRecorder(self._streams.device)
            for tensor in tensors:
                recorder(tensor)
            digests = recorder.table(plan.num_tensors).cpu()
            telemetry.verify_s = recorder.seconds
        return self._finish(refit_index=refit_index, failure=failure,
                            engine_failure=engine_failure, digests=digests, verify=verify,
                            telemetry=telemetry, started=start)

    def _tensors(self, refit_pass: RefitPass
                 ) -> tuple[list[torch.Tensor | Piecewise], str | None]:
        """The pass's tensors in plan order, checked against the plan (those the last refit
        already checked pass as they are); or why they cannot be shared in place."""
        if not refit_pass.stable_tensors:
            return [], ("refit.transport.ipc_sharing=weights needs a source whose tensors stay "
                        "valid while referenced (views of the parameters); this source makes "
                        "them one at a time: use ipc_sharing=buffers")
        tensors: list[torch.Tensor | Piecewise] = []
        checked = self._checked
        weights = refit_pass.own_weights()
        for planned in self.plan.tensors:
            name, tensor = next(weights, (None, None))
            position = len(tensors)
            if position < len(checked) and tensor is checked[position]:
                tensors.append(tensor)
                continue
            spec = planned.spec
            if not isinstance(tensor, (torch.Tensor, Piecewise)) or name != spec.name:
                return [], (f"expected {spec.name!r} (plan position {planned.index}), the "
                            f"source gave {name!r}")
            if tuple(tensor.shape) != tuple(spec.shape) or tensor.dtype != spec.dtype:
                return [], (f"{name}: the source gave {tuple(tensor.shape)} {tensor.dtype}, the "
                            f"plan has {tuple(spec.shape)} {spec.dtype}")
            devices = {t.device for t in _views(tensor)}
            if devices - {self._streams.device}:
                return [], (f"{name} is on {', '.join(map(str, devices))}, the refit on "
                            f"{self._streams.device}")
            tensors.append(tensor)
        extra = next(weights, None)
        if extra is not None:
            return [], (f"the weight source yielded more than the plan's tensors (next: "
                        f"{extra[0]!r}); rebuild the plan when the model changes")
        self._checked = tensors
        return tensors, None

    def _share_if_moved(self, tensors: list[torch.Tensor | Piecewise], engine_key: str | None,
                        *, refit_index: int) -> str | None:
        """Share the tensors' memory again unless the engine holds it mapped as it is now; why
        not, if it cannot be described."""
        if not _same_objects(tensors, self._described):
            try:
                self._layout_key, self._storages, self._layout = _layout(tensors, self.plan)
            except ValueError as error:
                return f"cannot share the weights with the engine: {error}"
            # Held, so the memory under them stays theirs: the same objects, the same layout.
            self._described = tensors
        if self._layout_key == engine_key:
            return None
        return self._share(self._layout_key, self._storages, self._layout, refit_index=refit_index)

    def _share(self, key: str, storages: list[torch.Tensor], layout: list[SharedTensor], *,
               refit_index: int) -> str | None:
        """Have the engine map ``storages``; why not, if this side cannot describe them (an
        engine that refuses raises)."""
        handles: list[SlotHandle] = []
        blobs: list[bytes] = []
        for tensor in storages:
            try:
                handle, own = describe_storage(tensor, directory=self._dir,
                                               first_blob=len(blobs))
            except ValueError as error:
                return f"cannot share the weights with the engine: {error}"
            handles.append(handle)
            blobs.extend(own)
        self._request(ShareWeights(key=key, storages=tuple(handles), tensors=tuple(layout),
                                   blobs=tuple(blobs)), Ready,
                      timeout_s=self._options.timeout_s,
                      what=f"the engine's mapping of the weights (refit {refit_index})")
        return None

    def _load(self, refit_index: int, telemetry: RefitTelemetry) -> RefitError | None:
        """Once the weights are final, have the engine load them; the error it reports."""
        # The engine reads the tensors from another process: they must be complete.
        self._streams.record(self._weights_final)
        self._streams.host_wait(self._weights_final, timeout_s=self._options.timeout_s,
                                what=f"the weights of refit {refit_index}")
        transfer = time.perf_counter()
        try:
            reply = self._request(WeightsReady(refit_index=refit_index), Ack,
                                  timeout_s=self._options.timeout_s,
                                  what=f"the engine's load of refit {refit_index}")
        except RefitError as error:
            return error
        finally:
            telemetry.transfer_s = telemetry.wait_s = time.perf_counter() - transfer
        if not reply.ok:
            return RefitError(f"the engine failed to load refit {refit_index}: {reply.message}")
        return None


def _same_objects(first: list, second: list) -> bool:
    return len(first) == len(second) and all(a is b for a, b in zip(first, second))


def _views(tensor: torch.Tensor | Piecewise) -> Sequence[torch.Tensor]:
    return tensor.runs if isinstance(tensor, Piecewise) else (tensor,)


def _layout(tensors: list[torch.Tensor | Piecewise], plan: RefitPlan
            ) -> tuple[str, list[torch.Tensor], list[SharedTensor]]:
    """The storages under ``tensors`` (one tensor standing for each) and where every tensor lies
    in them; the key changes whenever any of it does. :class:`ValueError` names a tensor that
    cannot be described (runs of different shapes, or in different storages)."""
    storage_index: dict[int, int] = {}
    storages: list[torch.Tensor] = []

    def index_of(view: torch.Tensor) -> int:
        address = view.untyped_storage().data_ptr()
        if address not in storage_index:
            storage_index[address] = len(storages)
            storages.append(view)
        return storage_index[address]

    layout = []
    for planned, tensor in zip(plan.tensors, tensors, strict=True):
        if not planned.spec.numel:
            layout.append(SharedTensor(storage=-1, offset=0, shape=tuple(tensor.shape),
                                       stride=()))
        elif isinstance(tensor, torch.Tensor):
            layout.append(SharedTensor(storage=index_of(tensor), offset=tensor.storage_offset(),
                                       shape=tuple(tensor.shape), stride=tuple(tensor.stride())))
        else:
            layout.append(_runs(planned.spec.name, tensor, index_of))
    described = [[t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()]
                 for t in storages] + [to_fields(s) for s in layout]
    key = hashlib.sha256(json.dumps(described).encode()).hexdigest()[:32]
    return key, storages, layout


def _runs(name: str, tensor: Piecewise, index_of) -> SharedTensor:
    """A piecewise tensor as equal runs of one storage."""
    first = tensor.runs[0]
    shapes = {(tuple(r.shape), tuple(r.stride())) for r in tensor.runs}
    storages = {index_of(r) for r in tensor.runs}
    if len(shapes) > 1 or len(storages) > 1:
        raise ValueError(f"{name} is made of {len(tensor.runs)} runs of different shapes or "
                         "storages; share it through buffers (ipc_sharing=buffers)")
    return SharedTensor(storage=storages.pop(), offset=first.storage_offset(),
                        shape=tuple(first.shape), stride=tuple(first.stride()), dim=tensor.dim,
                        run_starts=tuple(tensor.offsets),
                        run_offsets=tuple(r.storage_offset() for r in tensor.runs))


def colocated_sender(*, plan: RefitPlan, options, **kwargs) -> IpcSender:
    """The colocated sender ``options.ipc_sharing`` asks for (same arguments as
    :class:`IpcSender`)."""
    cls = SharedWeightsSender if options.ipc_sharing == "weights" else IpcSender
    return cls(plan=plan, options=options, **kwargs)
