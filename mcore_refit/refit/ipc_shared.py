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

import torch

from mcore_refit.refit.checksum import DigestRecorder
from mcore_refit.refit.ipc_memory import describe_storage
from mcore_refit.refit.ipc_sender import IpcSender
from mcore_refit.refit.plan import RefitPlan
from mcore_refit.refit.source import RefitPass
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
            key, storages, layout = _layout(tensors)
            if key != started.shared_key:
                failure = self._share(key, storages, layout, refit_index=refit_index)
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

    def _tensors(self, refit_pass: RefitPass) -> tuple[list[torch.Tensor], str | None]:
        """The pass's tensors in plan order, checked against the plan; or why they cannot be
        shared in place."""
        if not refit_pass.stable_tensors:
            return [], ("refit.transport.ipc_sharing=weights needs a source whose tensors stay "
                        "valid while referenced (views of the parameters); this source makes "
                        "them one at a time: use ipc_sharing=buffers")
        tensors = []
        weights = refit_pass.own_weights()
        for planned in self.plan.tensors:
            name, tensor = next(weights, (None, None))
            spec = planned.spec
            if not isinstance(tensor, torch.Tensor) or name != spec.name:
                return [], (f"expected {spec.name!r} (plan position {planned.index}) as one "
                            f"tensor, the source gave {name!r}")
            if tuple(tensor.shape) != tuple(spec.shape) or tensor.dtype != spec.dtype:
                return [], (f"{name}: the source gave {tuple(tensor.shape)} {tensor.dtype}, the "
                            f"plan has {tuple(spec.shape)} {spec.dtype}")
            if tensor.device != self._streams.device:
                return [], f"{name} is on {tensor.device}, the refit on {self._streams.device}"
            tensors.append(tensor)
        extra = next(weights, None)
        if extra is not None:
            return [], (f"the weight source yielded more than the plan's tensors (next: "
                        f"{extra[0]!r}); rebuild the plan when the model changes")
        return tensors, None

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


def _layout(tensors: list[torch.Tensor]) -> tuple[str, list[torch.Tensor], list[SharedTensor]]:
    """The storages under ``tensors`` (one tensor standing for each) and where every tensor lies
    in them; the key changes whenever any of it does."""
    storage_index: dict[int, int] = {}
    storages: list[torch.Tensor] = []
    layout = []
    for tensor in tensors:
        storage = tensor.untyped_storage()
        address = storage.data_ptr()
        if address not in storage_index:
            storage_index[address] = len(storages)
            storages.append(tensor)
        layout.append(SharedTensor(storage=storage_index[address],
                                   offset=tensor.storage_offset(), shape=tuple(tensor.shape),
                                   stride=tuple(tensor.stride())))
    described = [[t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()]
                 for t in storages] + [[s.storage, s.offset, s.shape, s.stride] for s in layout]
    key = hashlib.sha256(json.dumps(described).encode()).hexdigest()[:32]
    return key, storages, layout


def colocated_sender(*, plan: RefitPlan, options, **kwargs) -> IpcSender:
    """The colocated sender ``options.ipc_sharing`` asks for (same arguments as
    :class:`IpcSender`)."""
    cls = SharedWeightsSender if options.ipc_sharing == "weights" else IpcSender
    return cls(plan=plan, options=options, **kwargs)
