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
anything else is refused with the reason. The engine end maps each tensor from the trainer's
storages (:func:`shared_views`), checked to lie inside them. The messages and socket are those of
:class:`~mcore_refit.refit.transports.colocated.sender.ColocatedSender` (:mod:`..wire`).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import uuid
from collections.abc import Sequence

import torch

from mcore_refit.refit.buffers import packed_offsets, typed_view
from mcore_refit.refit.checksum import DigestRecorder
from mcore_refit.refit.errors import RefitError
from mcore_refit.refit.plan import RefitPlan
from mcore_refit.refit.source import Piecewise, RefitPass
from mcore_refit.refit.specs import Region, TensorSpec
from mcore_refit.refit.telemetry import RefitTelemetry
from mcore_refit.refit.transports.colocated.sender import ColocatedSender
from mcore_refit.refit.transports.ipc_files import (
    claim_owner,
    create_shared_cpu_slot,
    describe_storage,
    private_runtime_dir,
)
from mcore_refit.refit.transports.wire import (
    Ack,
    Hello,
    Ready,
    SharedTensor,
    ShareWeights,
    SlotHandle,
    WeightsReady,
    to_fields,
)

# Offsets of parameters in the shared-memory file (bytes): enough for any dtype.
_ALIGNMENT = 64


class _Unshareable(RefitError):
    """The trainer's tensors cannot be shared in place (this side's failure: the refit is
    aborted on the engine and raised here)."""


class SharedWeightsSender(ColocatedSender):
    """Trainer end of the colocated transport that shares the source's tensors in place.

    Takes :class:`ColocatedSender`'s arguments; the plan's tensors must all come from ``rank``.
    """

    transport_name = "colocated_weights"

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
        telemetry = RefitTelemetry.for_plan(
            plan, role="sender", transport=self.transport_name, refit_index=refit_index,
            device=self._streams.device, held_bytes=0, num_buffers=0)
        start = time.perf_counter()
        self._memory.start()
        started = self._start(refit_index=refit_index, verify=verify)
        exported = time.perf_counter()
        failure: _Unshareable | None = None
        engine_failure: RefitError | None = None
        try:
            tensors = self._tensors(refit_pass)
            telemetry.export_s = time.perf_counter() - exported
            self._share_if_moved(tensors, started.shared_key, refit_index=refit_index)
        except _Unshareable as error:
            failure = error
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

    def _tensors(self, refit_pass: RefitPass) -> list[torch.Tensor | Piecewise]:
        """The pass's tensors in plan order, checked against the plan (those the last refit
        already checked pass as they are); :class:`_Unshareable` says why they cannot be
        shared in place."""
        if not refit_pass.stable_tensors:
            raise _Unshareable("refit.transport.ipc_sharing=weights needs a source whose tensors "
                               "stay valid while referenced (views of the parameters); this "
                               "source makes them one at a time: use ipc_sharing=buffers")
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
                raise _Unshareable(f"expected {spec.name!r} (plan position {planned.index}), "
                                   f"the source gave {name!r}")
            if tuple(tensor.shape) != tuple(spec.shape) or tensor.dtype != spec.dtype:
                raise _Unshareable(f"{name}: the source gave {tuple(tensor.shape)} "
                                   f"{tensor.dtype}, the plan has {tuple(spec.shape)} "
                                   f"{spec.dtype}")
            devices = {t.device for t in _views(tensor)}
            if devices - {self._streams.device}:
                raise _Unshareable(f"{name} is on {', '.join(map(str, devices))}, the refit on "
                                   f"{self._streams.device}")
            tensors.append(tensor)
        extra = next(weights, None)
        if extra is not None:
            raise _Unshareable(f"the weight source yielded more than the plan's tensors (next: "
                               f"{extra[0]!r}); rebuild the plan when the model changes")
        self._checked = tensors
        return tensors

    def _share_if_moved(self, tensors: list[torch.Tensor | Piecewise], engine_key: str | None,
                        *, refit_index: int) -> None:
        """Share the tensors' memory again unless the engine holds it mapped as it is now
        (:class:`_Unshareable` if it cannot be described)."""
        if not _same_objects(tensors, self._described):
            try:
                self._layout_key, self._storages, self._layout = _layout(tensors, self.plan)
            except ValueError as error:
                raise _Unshareable(f"cannot share the weights with the engine: {error}") from None
            # Held, so the memory under them stays theirs: the same objects, the same layout.
            self._described = tensors
        if self._layout_key != engine_key:
            self._share(self._layout_key, self._storages, self._layout, refit_index=refit_index)

    def _share(self, key: str, storages: list[torch.Tensor], layout: list[SharedTensor], *,
               refit_index: int) -> None:
        """Have the engine map ``storages`` (:class:`_Unshareable` if this side cannot describe
        them; an engine that refuses raises :class:`RefitError`)."""
        handles: list[SlotHandle] = []
        blobs: list[bytes] = []
        for tensor in storages:
            try:
                handle, own = describe_storage(tensor, directory=self._dir,
                                               first_blob=len(blobs))
            except ValueError as error:
                raise _Unshareable(f"cannot share the weights with the engine: {error}") from None
            handles.append(handle)
            blobs.extend(own)
        self._request(ShareWeights(key=key, storages=tuple(handles), tensors=tuple(layout),
                                   blobs=tuple(blobs)), Ready,
                      timeout_s=self._options.timeout_s,
                      what=f"the engine's mapping of the weights (refit {refit_index})")

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


# --- the engine end: the trainer's tensors mapped in place ------------------------------


def shared_views(storages: list[torch.UntypedStorage], where: SharedTensor, spec: TensorSpec,
                  device: torch.device) -> list[tuple[TensorSpec, torch.Tensor]]:
    """``spec``'s tensor in the trainer's storages: the whole view, or its runs as pieces,
    each checked to lie inside its storage; the runs must cover the tensor exactly."""
    if where.storage == -1:
        if spec.numel:
            raise ValueError(f"{spec.name}: shared without memory, the plan has "
                             f"{tuple(spec.shape)}")
        return [(spec, torch.empty(spec.shape, dtype=spec.dtype, device=device))]
    if not 0 <= where.storage < len(storages):
        raise ValueError(f"{spec.name}: storage {where.storage} of {len(storages)}")
    storage = storages[where.storage]
    if not where.run_starts:
        if tuple(where.shape) != tuple(spec.shape):
            raise ValueError(f"{spec.name}: shared as {where.shape}, the plan has "
                             f"{tuple(spec.shape)}")
        return [(spec, view_in(storage, where.offset, where, spec))]
    dim, length = where.dim, where.shape[where.dim] if 0 <= where.dim < len(where.shape) else 0
    full = spec.shape[dim] if 0 <= dim < len(spec.shape) else -1
    run_shape = list(spec.shape[:dim]) + [length] + list(spec.shape[dim + 1:])
    starts = list(where.run_starts)
    if (tuple(where.shape) != tuple(run_shape) or len(where.run_offsets) != len(starts)
            or starts != list(range(0, full, length or 1)) or length * len(starts) != full):
        raise ValueError(f"{spec.name}: {len(starts)} runs of {tuple(where.shape)} along dim "
                         f"{dim} starting at {starts} do not tile the plan's "
                         f"{tuple(spec.shape)}")
    return [(TensorSpec(spec.name, tuple(run_shape), spec.dtype,
                        region=Region(dim=dim, start=start, full=full)),
             view_in(storage, offset, where, spec))
            for start, offset in zip(starts, where.run_offsets, strict=True)]


def view_in(storage: torch.UntypedStorage, offset: int, where: SharedTensor, spec: TensorSpec
          ) -> torch.Tensor:
    """The view of ``where``'s shape and stride at ``offset`` in ``storage``, checked to lie
    inside it."""
    if len(where.stride) != len(where.shape):
        raise ValueError(f"{spec.name}: shared as {where.shape} with strides {where.stride}")
    itemsize = spec.dtype.itemsize
    last = offset + sum((size - 1) * step for size, step in
                        zip(where.shape, where.stride, strict=True) if size > 0)
    if offset < 0 or any(step < 0 for step in where.stride) or (
            (last + 1) * itemsize > storage.nbytes()):
        raise ValueError(f"{spec.name}: elements {offset}..{last} lie outside its shared "
                         f"storage of {storage.nbytes()} bytes")
    return torch.empty(0, dtype=spec.dtype, device=storage.device).set_(
        storage, offset, tuple(where.shape), tuple(where.stride))


class SharedMemoryParameters:
    """The CPU parameters of ``modules`` moved into one shared-memory file of the transport's
    private directory (``ipc_dir`` as in :class:`~mcore_refit.refit.TransportOptions`).

    On CPU, :class:`SharedWeightsSender` shares only memory that another process can map: a
    parameter of a module built the usual way lives in private memory and is refused. Moved here,
    each parameter keeps its identity and value (its ``data`` becomes a view of the file), so an
    optimizer or export keeps working on it, and the engine reads it in place. CUDA parameters
    need none of this. The file is claimed like the transport's slots (an owner record), so a
    process that dies leaves nothing a later sender's sweep does not remove. :meth:`close`
    removes it (the memory stays valid while mapped).
    """

    def __init__(self, modules: Sequence[torch.nn.Module], *, ipc_dir: str | None) -> None:
        parameters: dict[int, torch.nn.Parameter] = {}
        for module in modules:
            for name, parameter in module.named_parameters():
                if parameter.device.type != "cpu":
                    raise ValueError(f"parameter {name!r} is on {parameter.device}: only CPU "
                                     "parameters move to shared memory (CUDA memory is shared "
                                     "as it is)")
                parameters.setdefault(id(parameter), parameter)
        offsets, end = packed_offsets([(p.shape, p.dtype) for p in parameters.values()],
                                      alignment=_ALIGNMENT)
        directory = private_runtime_dir(ipc_dir)
        key = f"parameters-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._owner = claim_owner(directory, key)
        self.path = directory / f"{key}.slot0"
        self.nbytes = end
        try:
            memory = create_shared_cpu_slot(self.path, max(end, 1))
            for parameter, offset in zip(parameters.values(), offsets, strict=True):
                shared = typed_view(memory, offset, parameter.shape, parameter.dtype)
                shared.copy_(parameter.data)
                parameter.data = shared
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Remove the file and its owner record (idempotent)."""
        self.path.unlink(missing_ok=True)
        self._owner.release()
