"""The Megatron model's weights in HF format, exported on the ranks that hold them.

Megatron-Bridge's ``export_hf_weights`` hands every full tensor to every rank: a pipeline
broadcast per tensor (into a freshly allocated tensor) and a tensor-parallel all-gather per
sharded tensor. :class:`ModelExport` runs Bridge's own export loop, with its mapping registry and
conversion tasks, on each trainer rank for the parameters that rank holds, and makes each HF
tensor the job of one *source* rank:

- **pipeline and expert parallelism**: the conversion tasks' mappings are given process groups of
  size one for the pipeline and expert-parallel dimensions, so a rank converts exactly the
  parameters of its own model chunks (every virtual-pipeline chunk) and no tensor crosses a stage;
- **tensor parallelism**: a tensor's source converts it from every TP rank's shard. The shards of
  a whole buffer travel in one exchange per peer (:meth:`ExportPass.exchange`), and Bridge's
  per-tensor gather is pointed at them (:func:`mcore_refit.compat.pregathered_tp_shards`);
- **duplicates** (data-parallel replicas, tied embeddings on two stages) are produced once;
- **sources** are balanced by bytes over the ranks that can produce a tensor, ranks in ``prefer``
  first (a rank on the same device as an inference rank hands its buffers over without crossing a
  link).

A conversion that is not local (its dry run on meta tensors fails, or it gathers more than its
parameter) uses Bridge's full export for that tensor, in step on every trainer rank; each such
mapping type is logged once.

All of it is collective over the trainer ranks: build, :meth:`ModelExport.layout`,
:meth:`ModelExport.begin` and every :meth:`ExportPass.exchange` run on every trainer rank, in the
same order.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.distributed as dist

from mcore_refit import compat
from mcore_refit.control import ControlGroup
from mcore_refit.refit.group import GroupCollectives, PendingTransfer
from mcore_refit.refit.plan import (
    PlannedBuffer,
    RefitPlan,
    TensorSpec,
    dtype_from_name,
    dtype_name,
)
from mcore_refit.refit.source import SourceLayout
from mcore_refit.refit.streams import DeviceStreams

logger = logging.getLogger(__name__)

# Shards of one buffer start at multiples of this many bytes in the exchange buffers.
_SHARD_ALIGNMENT = 256


class _SoloGroup:
    """A process group of one, as Megatron's ``get_pg_size``/``get_pg_rank`` see it.

    Anything that would communicate over it fails, which the dry run reports as a conversion
    that is not local.
    """

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 1


@dataclass(frozen=True)
class _LocalGroups:
    """The process groups a shard-local conversion task sees (Bridge's ``pg_collection``)."""

    tp: object
    expt_tp: object
    pp: _SoloGroup = _SoloGroup()
    ep: _SoloGroup = _SoloGroup()


@dataclass(frozen=True)
class Gather:
    """A task's TP shards: one of ``shape``/``dtype`` on each rank of ``ranks`` (TP order)."""

    ranks: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def num_bytes(self) -> int:
        return TensorSpec(name="", shape=self.shape, dtype=self.dtype).num_bytes


@dataclass(frozen=True)
class ExportTask:
    """One conversion task as the layout sees it: what it yields and who produces it."""

    key: str  # Bridge's global parameter name
    source: int
    outputs: tuple[TensorSpec, ...]
    gather: Gather | None
    fallback: bool


@dataclass(frozen=True)
class ExportLayout:
    """Who exports what, identical on every trainer rank."""

    tasks: tuple[ExportTask, ...]

    @cached_property
    def specs(self) -> list[TensorSpec]:
        """Every exported tensor, grouped by source in source order (the plan's input)."""
        return [o for t in self._ordered for o in t.outputs]

    @cached_property
    def sources(self) -> list[int]:
        return [t.source for t in self._ordered for _ in t.outputs]

    @cached_property
    def _ordered(self) -> list[ExportTask]:
        # Fallback tensors first: every rank reads Bridge's full export for them in step.
        return sorted(self.tasks, key=lambda t: (not t.fallback, t.source))


class ModelExport:
    """A weight source over Megatron model chunks for the refit engine (see the module doc).

    ``control`` is a gloo group over all trainer ranks (its ranks are the trainer ranks and the
    plan's sources); ``prefer`` names trainer ranks to make sources where they can be.
    """

    def __init__(self, model, *, control: ControlGroup, device: torch.device,
                 prefer: Collection[int] = ()) -> None:
        self._model = model
        self._control = control
        self._streams = DeviceStreams(device)
        self._prefer = frozenset(prefer)
        self.rank = control.rank
        self._tasks = self._local_tasks()
        self._layout: ExportLayout | None = None
        self._exchanges: tuple[str, list[ShardExchange | None]] | None = None
        self._logged_fallbacks: set[str] = set()

    # --- layout ---------------------------------------------------------------------------

    def layout(self) -> SourceLayout:
        """Every tensor's spec and source rank (collective over the trainer ranks, once)."""
        assignment = self.assignment()
        return SourceLayout(specs=assignment.specs, sources=assignment.sources)

    def assignment(self) -> ExportLayout:
        """Who exports what (collective over the trainer ranks on first call)."""
        if self._layout is None:
            described = [self._describe(key, task) for key, task in self._tasks.items()]
            shared = self._control.all_gather_json(
                [_info_to_json(info) for info in described if info is not None],
                what="the conversion tasks of every trainer rank")
            infos = [[_info_from_json(data) for data in rank_infos] for rank_infos in shared]
            fallback_keys = {i["key"] for rank_infos in infos for i in rank_infos
                             if i["fallback"]}
            fallback = self._fallback_specs(fallback_keys)
            self._layout = _assign(infos, fallback=fallback, prefer=self._prefer)
        return self._layout

    def begin(self, plan: RefitPlan) -> ExportPass:
        """One refit's pass over the weights. Collective over the trainer ranks."""
        return ExportPass(self, plan)

    @property
    def model(self):
        return self._model

    @property
    def held_bytes(self) -> int:
        """Device bytes held by the TP shard exchange buffers (0 without tensor parallelism)."""
        if self._exchanges is None:
            return 0
        return sum(e.held_bytes for e in self._exchanges[1] if e is not None)

    # --- internals ------------------------------------------------------------------------

    def _local_tasks(self) -> dict[str, object]:
        """This rank's conversion tasks (its own parameters), with shard-local groups."""
        from megatron.core import parallel_state

        bridge = self._model.bridge
        tasks = bridge._model_bridge.build_conversion_tasks(bridge.hf_pretrained,
                                                            self._model.unwrapped())
        groups = _LocalGroups(tp=parallel_state.get_tensor_model_parallel_group(),
                              expt_tp=parallel_state.get_expert_tensor_parallel_group())
        local = {}
        for task in tasks:
            if task is None or task.param_weight is None:
                continue
            task.mapping.set_process_groups_from_pg_collection(groups)
            local[task.global_param_name] = task
        return local

    def _stream(self, tasks) -> Iterator[tuple[str, torch.Tensor]]:
        bridge = self._model.bridge
        return bridge._model_bridge.stream_weights_megatron_to_hf(
            self._model.chunks, bridge.hf_pretrained, cpu=False, show_progress=False,
            conversion_tasks=list(tasks), merge_adapter_weights=False)

    def _describe(self, key: str, task) -> dict | None:
        """A dry run of ``task`` on meta tensors: its outputs and TP gather, or a fallback."""
        gathers: list[Gather] = []

        def record(mapping, tensor):
            ranks = tuple(dist.get_process_group_ranks(mapping.tp_group))
            gathers.append(Gather(ranks=ranks, shape=tuple(tensor.shape), dtype=tensor.dtype))
            return [tensor] * len(ranks)

        weight = task.param_weight
        meta = dataclasses.replace(task, param_weight=torch.empty(weight.shape, dtype=weight.dtype,
                                                                  device="meta"))
        try:
            with compat.pregathered_tp_shards(record):
                outputs = [TensorSpec.of(name, tensor) for name, tensor in self._stream([meta])]
        except Exception as error:  # noqa: BLE001 - any failure means: not shard-local
            return self._fallback_info(key, task, f"{type(error).__name__}: {error}")
        if len(gathers) > 1 or (gathers and gathers[0].shape != tuple(weight.shape)):
            return self._fallback_info(key, task, "it gathers more than its own parameter")
        if not outputs:
            return None
        return {"key": key, "outputs": tuple(outputs),
                "gather": gathers[0] if gathers else None, "fallback": False}

    def _fallback_info(self, key: str, task, reason: str) -> dict:
        kind = type(task.mapping).__name__
        if kind not in self._logged_fallbacks:
            self._logged_fallbacks.add(kind)
            logger.warning("refit export: %s (e.g. %s) has no shard-local conversion (%s); its "
                           "tensors use Megatron-Bridge's full export", kind, key, reason)
        return {"key": key, "outputs": (), "gather": None, "fallback": True}

    def _fallback_specs(self, keys: set[str]) -> list[TensorSpec]:
        """Specs of the tensors Bridge's full export yields for ``keys`` (every rank, in step)."""
        if not keys:
            return []
        return [TensorSpec.of(name, tensor) for name, tensor in self._fallback_stream(keys)]

    def _fallback_stream(self, keys: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
        tasks = [t for t in self._model.conversion_tasks()
                 if t is not None and t.global_param_name in keys]
        bridge = self._model.bridge
        return bridge.export_hf_weights(self._model.chunks, cpu=False, show_progress=False,
                                        conversion_tasks=tasks, merge_adapter_weights=False)

    def _exchange_buffers(self, plan: RefitPlan,
                          by_buffer: dict[int, list[ExportTask]]) -> list[ShardExchange | None]:
        """One :class:`ShardExchange` per slot this rank exchanges shards through (per plan)."""
        if self._exchanges is not None and self._exchanges[0] == plan.fingerprint:
            return self._exchanges[1]
        incoming = [0] * plan.num_held_slots
        outgoing = [0] * plan.num_held_slots
        peers = 0
        for buffer in plan.buffers:
            tasks = [t for t in by_buffer.get(buffer.index, ())
                     if t.gather is not None and self.rank in t.gather.ranks]
            if not tasks:
                continue
            size = shard_layout(tasks)[-1][-1]
            if self.rank == buffer.source:
                incoming[buffer.slot] = max(incoming[buffer.slot], size)
                peers = max(peers, *(len(t.gather.ranks) - 1 for t in tasks))
            else:
                outgoing[buffer.slot] = max(outgoing[buffer.slot], size)
        exchanges = [ShardExchange(incoming=incoming[slot], outgoing=outgoing[slot],
                                   num_peers=peers, streams=self._streams)
                     if incoming[slot] or outgoing[slot] else None
                     for slot in range(plan.num_held_slots)]
        self._exchanges = (plan.fingerprint, exchanges)
        return exchanges


class ExportPass:
    """One refit's pass of :class:`ModelExport`: this rank's tensors and its part in exchanges.

    The refit calls :meth:`exchange` for every buffer of the plan, in plan order, on every trainer
    rank, and pulls :meth:`own_weights` while packing the buffers this rank is the source of
    (each buffer after its exchange). A tensor is valid until the next one is pulled.
    """

    stable_tensors = False

    def __init__(self, export: ModelExport, plan: RefitPlan) -> None:
        self._export = export
        self._rank = export.rank
        layout = export.assignment()
        self._by_buffer = _tasks_by_buffer(layout, plan)
        self._own = [t for t in layout._ordered if t.source == self._rank]
        self._exchanges = export._exchange_buffers(plan, self._by_buffer)
        # id(local parameter) -> every TP rank's shard of it, for the buffer being packed.
        self._shards: dict[int, list[torch.Tensor]] = {}
        keys = {t.key for t in layout.tasks if t.fallback}
        self._fallback = export._fallback_stream(keys) if keys else None

    def own_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's tensors in plan order (the buffers it is the source of)."""
        for _ in range(sum(len(t.outputs) for t in self._own if t.fallback)):
            yield next(self._fallback)
        planned = {o.name for t in self._own for o in t.outputs}
        tasks = [self._export._tasks[t.key] for t in self._own if not t.fallback]
        stream = self._export._stream(tasks)
        while True:
            with compat.pregathered_tp_shards(self._shards_of):
                item = next(stream, None)
            if item is None:
                return
            if item[0] in planned:
                yield item

    def exchange(self, buffer: PlannedBuffer, *, timeout_s: float) -> None:
        """This rank's part in moving the TP shards of the tasks that start in ``buffer`` to its
        source (and in reading the fallback export for tensors landing there). Every trainer rank
        calls it for every buffer, in plan order; ranks with no part return at once."""
        tasks = self._by_buffer.get(buffer.index, ())
        for task in tasks:
            if task.fallback and self._rank != task.source:
                for _ in task.outputs:
                    next(self._fallback)
        gathered = [t for t in tasks if t.gather is not None and self._rank in t.gather.ranks]
        if not gathered:
            return
        exchange = self._exchanges[buffer.slot]
        if self._rank == buffer.source:
            self._shards = exchange.collect(buffer, gathered, self._export._tasks,
                                            timeout_s=timeout_s)
        else:
            exchange.contribute(buffer, gathered, self._export._tasks, timeout_s=timeout_s)

    def _shards_of(self, mapping, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        return self._shards.get(id(tensor))


class ShardExchange:
    """Persistent buffers for one slot's TP shard exchanges (allocated once per plan).

    A source receives each peer's shards of a buffer into a region of its own; a peer packs its
    shards into ``outgoing`` and sends them, one message per gather group. Shards sit at aligned
    offsets in the order of the buffer's tasks, the same on every rank (:func:`shard_layout`).
    """

    def __init__(self, *, incoming: int, outgoing: int, num_peers: int,
                 streams: DeviceStreams) -> None:
        device = streams.device
        self.streams = streams
        self.outgoing = torch.zeros(outgoing, dtype=torch.uint8, device=device)
        self.incoming = [torch.zeros(incoming, dtype=torch.uint8, device=device)
                         for _ in range(num_peers if incoming else 0)]
        self._sending: list[PendingTransfer] = []

    @property
    def held_bytes(self) -> int:
        return self.outgoing.numel() + sum(region.numel() for region in self.incoming)

    def collect(self, buffer: PlannedBuffer, tasks, local_tasks, *,
                timeout_s: float) -> dict[int, list[torch.Tensor]]:
        """Receive every peer's shards of ``tasks``; every TP rank's shard per local parameter."""
        shards: dict[int, list[torch.Tensor]] = {}
        for ranks, group_tasks, offsets, start, stop in shard_layout(tasks):
            collectives = _GatherGroup(local_tasks[group_tasks[0].key].mapping.tp_group, ranks,
                                       self.streams)
            peers = [rank for rank in ranks if rank != buffer.source]
            pending = [collectives.recv_async(
                region[start:stop], src_rank=collectives.group_rank_of(peer),
                what=f"trainer rank {peer}'s TP shards for buffer {buffer.index}")
                for region, peer in zip(self.incoming, peers, strict=False)]
            for transfer in pending:
                transfer.wait_stream(self.streams, timeout_s=timeout_s)
            incoming = dict(zip(peers, self.incoming, strict=False))
            for task, offset in zip(group_tasks, offsets, strict=True):
                own = local_tasks[task.key].param_weight
                shards[id(own)] = [own if rank not in incoming else _view(
                    incoming[rank], offset, task.gather) for rank in ranks]
        return shards

    def contribute(self, buffer: PlannedBuffer, tasks, local_tasks, *, timeout_s: float) -> None:
        """Pack this rank's shards of ``tasks`` and send them to the buffer's source."""
        for transfer in self._sending:
            transfer.wait_stream(self.streams, timeout_s=timeout_s)
        self._sending.clear()
        for ranks, group_tasks, offsets, start, stop in shard_layout(tasks):
            collectives = _GatherGroup(local_tasks[group_tasks[0].key].mapping.tp_group, ranks,
                                       self.streams)
            with torch.no_grad():
                torch._foreach_copy_(
                    [_view(self.outgoing, offset, task.gather) for task, offset in
                     zip(group_tasks, offsets, strict=True)],
                    [local_tasks[task.key].param_weight.detach() for task in group_tasks])
            self._sending.append(collectives.send_async(
                self.outgoing[start:stop], dst_rank=collectives.group_rank_of(buffer.source),
                what=f"this rank's TP shards for buffer {buffer.index} to trainer rank "
                     f"{buffer.source}"))


class _GatherGroup(GroupCollectives):
    """A TP (or expert-TP) group with the trainer ranks of its members, in TP order."""

    def __init__(self, group, ranks: tuple[int, ...], streams: DeviceStreams) -> None:
        super().__init__(group=group, streams=streams)
        self._ranks = ranks

    def group_rank_of(self, rank: int) -> int:
        return self._ranks.index(rank)


def shard_layout(tasks) -> list[tuple[tuple[int, ...], list[ExportTask], list[int], int, int]]:
    """Where a buffer's shards sit in the exchange buffers: per gather group (in order of first
    appearance), its ranks, tasks, each task's byte offset, and the group's ``[start, stop)``."""
    groups: dict[tuple[int, ...], list[ExportTask]] = {}
    for task in tasks:
        groups.setdefault(task.gather.ranks, []).append(task)
    layout, cursor = [], 0
    for ranks, group_tasks in groups.items():
        start, offsets = cursor, []
        for task in group_tasks:
            offsets.append(cursor)
            cursor = _align_up(cursor + task.gather.num_bytes, _SHARD_ALIGNMENT)
        layout.append((ranks, group_tasks, offsets, start, cursor))
    return layout


def _assign(infos: list[list[dict]], *, fallback: list[TensorSpec],
            prefer: frozenset[int]) -> ExportLayout:
    """Every task's source, deterministic from what every rank reported (see the module doc)."""
    holders: dict[str, list[tuple[int, dict]]] = {}
    for rank, rank_infos in enumerate(infos):
        for info in rank_infos:
            if not info["fallback"]:
                holders.setdefault(info["key"], []).append((rank, info))
    claimed: set[str] = {s.name for s in fallback}
    load: dict[int, int] = {}
    tasks: list[ExportTask] = []
    if fallback:
        tasks.append(ExportTask(key="<fallback>", source=0, outputs=tuple(fallback), gather=None,
                                fallback=True))
        load[0] = sum(s.num_bytes for s in fallback)
    for key, candidates in holders.items():
        info = candidates[0][1]
        outputs = tuple(o for o in info["outputs"] if o.name not in claimed)
        if not outputs:
            continue
        gather = info["gather"]
        ranks = [r for r, _ in candidates if gather is None or r in gather.ranks]
        source = min(ranks, key=lambda r: (r not in prefer, load.get(r, 0), r))
        load[source] = load.get(source, 0) + sum(o.num_bytes for o in outputs)
        claimed.update(o.name for o in outputs)
        tasks.append(ExportTask(key=key, source=source, outputs=outputs, gather=gather,
                                fallback=False))
    return ExportLayout(tasks=tuple(tasks))


def _tasks_by_buffer(layout: ExportLayout, plan: RefitPlan) -> dict[int, list[ExportTask]]:
    """The tasks whose first tensor lands in each buffer (their shards move with that buffer)."""
    buffer_of = {t.spec.name: t.buffer_index for t in plan.tensors}
    by_buffer: dict[int, list[ExportTask]] = {}
    for task in layout.tasks:
        if task.fallback:
            # Fallback tensors are read one by one, in step, wherever they land.
            for output in task.outputs:
                by_buffer.setdefault(buffer_of[output.name], []).append(
                    dataclasses.replace(task, outputs=(output,)))
            continue
        by_buffer.setdefault(buffer_of[task.outputs[0].name], []).append(task)
    return by_buffer


def _view(region: torch.Tensor, offset: int, gather: Gather) -> torch.Tensor:
    return region[offset:offset + gather.num_bytes].view(gather.dtype).view(gather.shape)


def _align_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


def _info_to_json(info: dict) -> dict:
    gather = info["gather"]
    return {"key": info["key"], "fallback": info["fallback"],
            "outputs": [[o.name, list(o.shape), dtype_name(o.dtype)] for o in info["outputs"]],
            "gather": None if gather is None else [list(gather.ranks), list(gather.shape),
                                                   dtype_name(gather.dtype)]}


def _info_from_json(data: dict) -> dict:
    gather = data["gather"]
    return {"key": data["key"], "fallback": data["fallback"],
            "outputs": tuple(TensorSpec(name=n, shape=tuple(s), dtype=dtype_from_name(d))
                             for n, s, d in data["outputs"]),
            "gather": None if gather is None else Gather(
                ranks=tuple(gather[0]), shape=tuple(gather[1]), dtype=dtype_from_name(gather[2]))}


class BridgeExport:
    """Megatron-Bridge's own export as a refit source: the baseline.

    Every trainer rank yields every full tensor (Bridge's pipeline broadcast and tensor-parallel
    all-gather per tensor); trainer rank 0 is the source of every buffer and the other trainer
    ranks read the export in step with it (in :meth:`exchange`). The refit benchmark measures it
    as ``bridge_export``; specs come from one export pass.
    """

    stable_tensors = False

    def __init__(self, model, *, rank: int) -> None:
        self._model = model
        self._rank = rank
        self._specs: list[TensorSpec] | None = None

    def layout(self) -> SourceLayout:
        if self._specs is None:
            self._specs = [TensorSpec.of(name, tensor)
                           for name, tensor in self._model.export_hf_weights()]
        return SourceLayout(specs=list(self._specs), sources=[0] * len(self._specs))

    def begin(self, plan: RefitPlan) -> BridgeExport:
        self._stream = self._model.export_hf_weights()
        return self

    def exchange(self, buffer: PlannedBuffer, *, timeout_s: float) -> None:
        if self._rank != buffer.source:
            for _ in range(buffer.num_tensors):
                next(self._stream)

    def own_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self._stream if self._rank == 0 else iter(())
