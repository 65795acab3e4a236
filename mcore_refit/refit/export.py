"""The Megatron model's weights in HF format, exported on the ranks that hold them.

Megatron-Bridge's ``export_hf_weights`` hands every full tensor to every rank: a pipeline
broadcast per tensor (into a freshly allocated tensor) and a tensor-parallel all-gather per
sharded tensor. :class:`ModelExport` keeps Bridge as the authority on what the HF tensors are —
its mapping registry, conversion tasks and export loop — and has each trainer rank send what it
holds:

- **what each rank holds**: the conversion tasks' mappings get process groups of size one for the
  pipeline and expert-parallel dimensions, so a rank converts exactly the parameters of its own
  model chunks (every virtual-pipeline chunk) and nothing crosses a stage;
- **tensor parallelism without gathers**: a rank that holds a TP shard sends the *piece* of each
  HF tensor that its shard makes up (:class:`~mcore_refit.refit.plan.Region`), and the engine
  writes each piece into its place. Which rows of which HF tensor a shard makes up is learned
  once, by running Bridge's own conversion of the task on index probes (a tensor of row numbers,
  every TP rank's probe standing in for its shard): the rows that come out say where each row of
  the shard goes, with no QKV, gated-MLP or vocabulary-padding rule written here;
- **compiled**: every task whose conversion only moves rows (all standard Llama/Qwen mappings,
  sharded or not) becomes views of its parameter, so a refit runs no conversion at all and packs
  a buffer with one batched copy per dtype; a task that does more is converted by Bridge on its
  rank at each refit;
- **duplicates** (data-parallel replicas, tied embeddings on two stages) are sent once;
  single-rank tasks go to the rank with the fewest bytes so far among those that hold them,
  ranks in ``prefer`` first (a rank on the same device as an inference rank hands its buffers
  over without crossing a link).

A sharded task whose conversion is not row moves (its probe fails) uses Bridge's full export for
its tensors, in step on every trainer rank; each such mapping type is logged once.

Building the layout (:meth:`ModelExport.layout`) is collective over the trainer ranks; so is each
:meth:`ModelExport.begin` and every :meth:`ExportPass.exchange` (they read Bridge's full export in
step where there are fallback tensors, and nothing else): call them on every trainer rank, in the
same order. A pass without fallback tensors waits for no other rank.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.distributed as dist

from mcore_refit import compat
from mcore_refit.control import ControlGroup
from mcore_refit.model import ParameterSnapshot
from mcore_refit.refit.plan import (
    PlannedBuffer,
    RefitPlan,
    Region,
    TensorSpec,
    spec_from_json,
    spec_to_json,
)
from mcore_refit.refit.source import Piecewise, SourceLayout

logger = logging.getLogger(__name__)

COMPILED, CONVERTED, FALLBACK = "compiled", "converted", "fallback"


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
class _Run:
    """Rows ``[local, local + length)`` of the parameter (along its partition dimension) go to
    ``[offset, offset + length)`` of the piece."""

    offset: int
    local: int
    length: int


@dataclass(frozen=True)
class _Output:
    """One HF tensor a rank's task yields: its spec (a piece where the rank holds a shard) and,
    for a compiled task, where its rows come from."""

    spec: TensorSpec
    runs: tuple[_Run, ...] = ()


@dataclass(frozen=True)
class ExportTask:
    """One conversion task as the layout sees it: what its source rank yields."""

    key: str  # Bridge's global parameter name
    kind: str  # COMPILED, CONVERTED or FALLBACK
    source: int
    outputs: tuple[TensorSpec, ...]


@dataclass(frozen=True)
class ExportLayout:
    """Who exports what, identical on every trainer rank."""

    tasks: tuple[ExportTask, ...]
    # Bridge's parameter names whose tensors take its full export (one task in ``tasks``).
    fallback_keys: frozenset[str] = frozenset()

    @cached_property
    def ordered(self) -> list[ExportTask]:
        """Fallback tensors first (every rank reads Bridge's full export for them in step),
        then by source."""
        return sorted(self.tasks, key=lambda t: (t.kind != FALLBACK, t.source))

    @cached_property
    def specs(self) -> list[TensorSpec]:
        """Every exported tensor or piece, grouped by source in source order (the plan's
        input)."""
        return [o for t in self.ordered for o in t.outputs]

    @cached_property
    def sources(self) -> list[int]:
        return [t.source for t in self.ordered for _ in t.outputs]


@dataclass
class _LocalTask:
    """This rank's view of a conversion task: Bridge's task and what the dry runs found."""

    task: object
    kind: str
    outputs: list[_Output] = field(default_factory=list)
    # Trainer ranks holding the task's TP shards, in TP order (None: the task is not sharded).
    shard_ranks: tuple[int, ...] | None = None
    partition_dim: int = 0


class ModelExport:
    """A refit source over Megatron model chunks (see the module docstring).

    ``control`` is a gloo group over all trainer ranks (its ranks are the trainer ranks and the
    plan's sources); ``prefer`` names trainer ranks to make sources where there is a choice;
    ``guard()`` runs before every pass and raises when the weights may not be read now (a policy
    whose weights are offloaded).
    """

    def __init__(self, model, *, control: ControlGroup, device: torch.device,
                 prefer: Collection[int] = (), guard: Callable[[], None] | None = None) -> None:
        self._model = model
        self._guard = guard
        self._control = control
        self._device = torch.device(device)
        self._prefer = frozenset(prefer)
        self.rank = control.rank
        self._logged: set[str] = set()
        self._params = ParameterSnapshot(model.chunks)
        self._fallback_tasks: list = []  # Bridge's tasks for the fallback tensors
        self._local = {key: self._describe(task) for key, task in self._conversion_tasks()}
        self._layout: ExportLayout | None = None
        # Per compiled task: its parameter's data address and the views made of it.
        self._views: dict[str, tuple[int, list]] = {}

    @property
    def model(self):
        return self._model

    def layout(self) -> SourceLayout:
        """Every tensor's spec and source rank (collective over the trainer ranks, once)."""
        layout = self.assignment()
        return SourceLayout(specs=layout.specs, sources=layout.sources)

    def assignment(self) -> ExportLayout:
        """Who exports what (collective over the trainer ranks on first call)."""
        if self._layout is None:
            shared = self._control.all_gather_json(
                [_report(key, local) for key, local in self._local.items()],
                what="the conversion tasks of every trainer rank")
            reports = [[_parse_report(r) for r in rank_reports] for rank_reports in shared]
            fallback = {r["key"] for rank_reports in reports for r in rank_reports
                        if r["kind"] == FALLBACK}
            self._layout = _assign(reports, fallback=self._fallback_specs(fallback),
                                   fallback_keys=fallback, prefer=self._prefer)
        return self._layout

    def begin(self, plan: RefitPlan) -> ExportPass:
        """One refit's pass over the weights (see the module docstring for who takes part).

        Compiled tensors are views of the ``Parameter`` objects, which follow in-place updates
        and ``.data`` moves. A parameter object replaced since the last pass is followed by this
        rank alone: its tasks read the new object from now on. A replacement of another shape or
        dtype raises (the plan no longer matches the model).
        """
        if self._guard is not None:
            self._guard()
        replacements = self._params.replacements()
        if replacements:
            self._follow(replacements)
        return ExportPass(self, plan)

    def compiled_views(self, task: ExportTask) -> list[tuple[str, torch.Tensor | Piecewise]]:
        """The views a compiled task yields, made once and kept while its parameter's memory
        stays where it was (a ``.data`` move or an offload makes them again)."""
        local = self._local[task.key]
        weight = local.task.param_weight
        address = weight.data_ptr()
        cached = self._views.get(task.key)
        if cached is None or cached[0] != address:
            sent = {(o.name, o.region) for o in task.outputs}
            data = weight.detach()
            views = [(o.spec.name, _tensor(data, o, local.partition_dim))
                     for o in local.outputs if (o.spec.name, o.spec.region) in sent]
            cached = self._views[task.key] = (address, views)
        return cached[1]

    def _follow(self, replacements: dict[int, torch.nn.Parameter]) -> None:
        """Point this rank's tasks at the parameter objects that replaced theirs."""
        for key, local in self._local.items():
            local.task = _followed(key, local.task, replacements)
        self._fallback_tasks = [_followed(t.global_param_name, t, replacements)
                                for t in self._fallback_tasks]
        self._params = ParameterSnapshot(self._model.chunks)

    # --- dry runs -------------------------------------------------------------------------

    def _conversion_tasks(self):
        """This rank's conversion tasks (its own parameters), with shard-local groups."""
        from megatron.core import parallel_state

        bridge = self._model.bridge
        tasks = bridge._model_bridge.build_conversion_tasks(bridge.hf_pretrained,
                                                            self._model.unwrapped())
        groups = _LocalGroups(tp=self._model.model_parallel.tp_group,
                              expt_tp=parallel_state.get_expert_tensor_parallel_group())
        for task in tasks:
            if task is not None and task.param_weight is not None:
                task.mapping.set_process_groups_from_pg_collection(groups)
                yield task.global_param_name, task

    def _stream(self, tasks) -> Iterator[tuple[str, torch.Tensor]]:
        bridge = self._model.bridge
        return bridge._model_bridge.stream_weights_megatron_to_hf(
            self._model.chunks, bridge.hf_pretrained, cpu=False, show_progress=False,
            conversion_tasks=list(tasks), merge_adapter_weights=False)

    def _describe(self, task) -> _LocalTask:
        """Dry runs of ``task``: on meta tensors (its outputs; does it gather TP shards?), then on
        index probes (which rows go where)."""
        weight = task.param_weight
        gathers: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

        def record(mapping, tensor):
            ranks = tuple(dist.get_process_group_ranks(mapping.tp_group))
            gathers.append((ranks, tuple(tensor.shape)))
            return [tensor] * len(ranks)

        meta = dataclasses.replace(task, param_weight=torch.empty(weight.shape, dtype=weight.dtype,
                                                                  device="meta"))
        try:
            with compat.pregathered_tp_shards(record):
                full = [TensorSpec.of(name, tensor) for name, tensor in self._stream([meta])]
        except Exception as error:  # noqa: BLE001 - any failure means: not local
            return self._fallback(task, f"{type(error).__name__}: {error}")
        if len(gathers) > 1 or (gathers and gathers[0][1] != tuple(weight.shape)):
            return self._fallback(task, "it gathers more than its own parameter")
        shard_ranks = gathers[0][0] if gathers else None
        dim = getattr(weight, "partition_dim", 0) if shard_ranks is not None else 0
        local = _LocalTask(task=task, kind=COMPILED, shard_ranks=shard_ranks, partition_dim=dim)
        outputs = self._probe(task, full, local)
        if outputs is not None:
            local.outputs = outputs
            return local
        if shard_ranks is not None:
            return self._fallback(task, "its conversion does more than move rows")
        local.kind = CONVERTED
        local.outputs = [_Output(spec=spec) for spec in full]
        return local

    def _probe(self, task, full: list[TensorSpec], local: _LocalTask) -> list[_Output] | None:
        """Where each row of this rank's parameter goes in each HF tensor, from Bridge's own
        conversion of row-number probes; None when the conversion does more than move rows."""
        weight, dim = task.param_weight, local.partition_dim
        if weight.dim() not in (1, 2) or not full:
            return None
        ranks = local.shard_ranks or (self.rank,)
        position = ranks.index(self.rank)
        rows = weight.shape[dim]
        for whole_rows in (False, True):
            try:
                outputs = _row_map(self._stream, task, full, dim=dim, rows=rows,
                                   num_shards=len(ranks), position=position,
                                   whole_rows=whole_rows)
                return [_pieces_of(spec, sources, position=position, rows=rows, dim=dim)
                        for spec, sources in outputs]
            except (ValueError, RuntimeError):  # e.g. the mapping wants real row widths
                continue
        return None

    def _fallback(self, task, reason: str) -> _LocalTask:
        kind = type(task.mapping).__name__
        if kind not in self._logged:
            self._logged.add(kind)
            logger.warning("refit export: %s (e.g. %s) has no shard-local conversion (%s); its "
                           "tensors use Megatron-Bridge's full export", kind,
                           task.global_param_name, reason)
        return _LocalTask(task=task, kind=FALLBACK)

    def _fallback_specs(self, keys: set[str]) -> list[TensorSpec]:
        """Specs of the tensors Bridge's full export yields for ``keys`` (every rank, in step)."""
        if not keys:
            return []
        return [TensorSpec.of(name, tensor) for name, tensor in self._fallback_stream(keys)]

    def _fallback_stream(self, keys: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
        if {t.global_param_name for t in self._fallback_tasks} != keys:
            self._fallback_tasks = [t for t in self._model.conversion_tasks()
                                    if t is not None and t.global_param_name in keys]
        return self._model.bridge.export_hf_weights(
            self._model.chunks, cpu=False, show_progress=False,
            conversion_tasks=self._fallback_tasks, merge_adapter_weights=False)


class ExportPass:
    """One refit's pass of :class:`ModelExport` on one trainer rank.

    The refit calls :meth:`exchange` for every buffer of the plan, in plan order, on every trainer
    rank (it reads Bridge's full export in step for fallback tensors), and pulls
    :meth:`own_weights` while packing the buffers this rank is the source of.
    """

    def __init__(self, export: ModelExport, plan: RefitPlan) -> None:
        self._export = export
        self._rank = export.rank
        layout = export.assignment()
        self._own = [t for t in layout.ordered if t.source == self._rank]
        # Compiled outputs are views of parameters: they stay valid for the whole pass.
        self.stable_tensors = all(t.kind == COMPILED for t in self._own)
        keys = set(layout.fallback_keys)
        self._fallback = export._fallback_stream(keys) if keys else None
        self._fallback_in = _fallback_counts(layout, plan)

    def exchange(self, buffer: PlannedBuffer, *, timeout_s: float) -> None:
        """Read Bridge's full export in step with ``buffer``'s source for the fallback tensors it
        packs (a collective over the trainer ranks); nothing else moves between trainers."""
        if self._rank != buffer.source:
            for _ in range(self._fallback_in.get(buffer.index, 0)):
                next(self._fallback)

    def own_weights(self) -> Iterator[tuple[str, torch.Tensor | Piecewise]]:
        """This rank's tensors and pieces in plan order."""
        locals_ = self._export._local
        for task in self._own:
            if task.kind == FALLBACK:
                for _ in task.outputs:
                    yield next(self._fallback)
            elif task.kind == COMPILED:
                yield from self._export.compiled_views(task)
            else:
                sent = {o.name for o in task.outputs}
                for name, tensor in self._export._stream([locals_[task.key].task]):
                    if name in sent:
                        yield name, tensor


def _row_map(stream, task, full: list[TensorSpec], *, dim: int, rows: int, num_shards: int,
             position: int, whole_rows: bool) -> list[tuple[TensorSpec, list[int]]]:
    """Run the task's conversion on row-number probes; per output, the probe row behind each of
    its rows along ``dim`` (shard ``k``'s row ``i`` is ``k * rows + i``).

    Probes are one column wide unless ``whole_rows`` (mappings that check row widths against the
    model config get rows of the parameter's real width, every column equal). Raises
    ``ValueError`` where the conversion does more than move rows.
    """
    weight = task.param_weight
    shape = list(weight.shape) if whole_rows else [rows if d == dim else 1
                                                   for d in range(weight.dim())]
    dtype = torch.float32 if whole_rows else torch.float64  # exact row numbers either way

    def probe(shard: int) -> torch.Tensor:
        numbers = torch.arange(shard * rows, (shard + 1) * rows, dtype=dtype)
        view = [rows if d == dim else 1 for d in range(weight.dim())]
        return numbers.view(view).expand(shape).contiguous()

    probes = [probe(k) for k in range(num_shards)]

    def shards_of(mapping, tensor):
        return probes

    probed = dataclasses.replace(task, param_weight=probes[position])
    with compat.pregathered_tp_shards(shards_of):
        outputs = dict(stream([probed]))
    by_name = {spec.name: spec for spec in full}
    if set(outputs) != set(by_name):
        raise ValueError("the probe's outputs differ from the conversion's")
    mapped = []
    for name, out in outputs.items():
        spec = by_name[name]
        if out.dim() != len(spec.shape) or out.shape[dim] != spec.shape[dim]:
            raise ValueError(f"{name}: rows do not map along dim {dim}")
        others = [d for d in range(out.dim()) if d != dim]
        if any(spec.shape[d] != weight.shape[d] for d in others):
            raise ValueError(f"{name}: the other dimensions change")
        column = out
        for d in reversed(others):
            if not bool((column == column.narrow(d, 0, 1)).all()):
                raise ValueError(f"{name}: not a row move")
            column = column.narrow(d, 0, 1)
        numbers = column.reshape(-1)
        if not bool((numbers == numbers.round()).all()) or bool((numbers < 0).any()) or \
                bool((numbers >= num_shards * rows).any()):
            raise ValueError(f"{name}: values are not row numbers")
        mapped.append((spec, [int(v) for v in numbers.tolist()]))
    return mapped


def _pieces_of(spec: TensorSpec, sources: list[int], *, position: int, rows: int,
               dim: int) -> _Output:
    """This rank's piece of one output and its runs; ``sources[j]`` is the probe row behind row
    ``j`` of the output."""
    mine = [j for j, source in enumerate(sources) if source // rows == position]
    if not mine or mine != list(range(mine[0], mine[-1] + 1)):
        raise ValueError(f"{spec.name}: this rank's rows are not one block")
    start, length = mine[0], len(mine)
    runs, offset = [], 0
    for j in mine:
        local = sources[j] % rows
        if runs and runs[-1].local + runs[-1].length == local:
            runs[-1] = _Run(offset=runs[-1].offset, local=runs[-1].local,
                            length=runs[-1].length + 1)
        else:
            runs.append(_Run(offset=offset, local=local, length=1))
        offset += 1
    shape = list(spec.shape)
    shape[dim] = length
    whole = length == spec.shape[dim]
    region = None if whole else Region(dim=dim, start=start, full=spec.shape[dim])
    return _Output(spec=TensorSpec(name=spec.name, shape=tuple(shape), dtype=spec.dtype,
                                   region=region), runs=tuple(runs))


def _tensor(weight: torch.Tensor, output: _Output, dim: int) -> torch.Tensor | Piecewise:
    """The output's rows of ``weight``: a view, or a :class:`Piecewise` of views."""
    views = [weight.narrow(dim, run.local, run.length) for run in output.runs]
    if len(views) == 1:
        return views[0]
    spec = output.spec
    return Piecewise(shape=spec.shape, dtype=spec.dtype, dim=dim,
                     offsets=[run.offset for run in output.runs], runs=views)


def _assign(reports: list[list[dict]], *, fallback: list[TensorSpec], fallback_keys: set[str],
            prefer: frozenset[int]) -> ExportLayout:
    """Every task's source, deterministic from what every rank reported (see the module doc)."""
    holders: dict[str, list[tuple[int, dict]]] = {}
    for rank, rank_reports in enumerate(reports):
        for report in rank_reports:
            if report["key"] not in fallback_keys:
                holders.setdefault(report["key"], []).append((rank, report))
    claimed: set[str] = {s.name for s in fallback}
    load: dict[int, int] = {}
    tasks: list[ExportTask] = []
    if fallback:
        tasks.append(ExportTask(key="<fallback>", kind=FALLBACK, source=0,
                                outputs=tuple(fallback)))
        load[0] = sum(s.num_bytes for s in fallback)
    for key, candidates in holders.items():
        first = candidates[0][1]
        names = {o.name for o in first["outputs"]} - claimed
        if not names:
            continue
        if first["shard_ranks"] is not None:
            # Every rank of the lowest TP group holding the task sends its own pieces.
            group = min((tuple(r["shard_ranks"]) for _, r in candidates), key=min)
            chosen = [(rank, r) for rank, r in candidates if rank in group]
        else:
            source = min((rank for rank, _ in candidates),
                         key=lambda r: (r not in prefer, load.get(r, 0), r))
            chosen = [(rank, r) for rank, r in candidates if rank == source]
        for rank, report in chosen:
            outputs = tuple(o for o in report["outputs"] if o.name in names)
            load[rank] = load.get(rank, 0) + sum(o.num_bytes for o in outputs)
            tasks.append(ExportTask(key=key, kind=report["kind"], source=rank, outputs=outputs))
        claimed |= names
    return ExportLayout(tasks=tuple(tasks), fallback_keys=frozenset(fallback_keys))


def _followed(key: str, task, replacements: dict[int, torch.nn.Parameter]):
    """``task`` reading the parameter that replaced its own, if one did."""
    old = task.param_weight
    new = replacements.get(id(old)) if old is not None else None
    if new is None:
        return task
    if new.shape != old.shape or new.dtype != old.dtype:
        raise RuntimeError(
            f"{key}: the parameter was replaced by one of shape {tuple(new.shape)} and dtype "
            f"{new.dtype}; the refit plan has {tuple(old.shape)} and {old.dtype}: build a new "
            "plan and refitter for the changed model")
    return dataclasses.replace(task, param_weight=new)


def _fallback_counts(layout: ExportLayout, plan: RefitPlan) -> dict[int, int]:
    """How many fallback tensors each buffer packs (the others read the export in step)."""
    fallback = {o.name for t in layout.tasks if t.kind == FALLBACK for o in t.outputs}
    counts: dict[int, int] = {}
    for planned in plan.tensors:
        if planned.spec.name in fallback:
            counts[planned.buffer_index] = counts.get(planned.buffer_index, 0) + 1
    return counts


def _report(key: str, local: _LocalTask) -> dict:
    return {"key": key, "kind": local.kind,
            "shard_ranks": None if local.shard_ranks is None else list(local.shard_ranks),
            "outputs": [spec_to_json(o.spec) for o in local.outputs]}


def _parse_report(data: dict) -> dict:
    return {"key": data["key"], "kind": data["kind"], "shard_ranks": data["shard_ranks"],
            "outputs": tuple(spec_from_json(o) for o in data["outputs"])}


class BridgeExport:
    """Megatron-Bridge's own export as a refit source: the baseline.

    Every trainer rank yields every full tensor (Bridge's pipeline broadcast and tensor-parallel
    all-gather per tensor); trainer rank 0 is the source of every buffer and the other trainer
    ranks read the export in step with it (in ``exchange``). The refit benchmark measures it as
    ``bridge_export``; its specs come from one export pass. ``control`` is a gloo group over the
    trainer ranks.
    """

    def __init__(self, model, *, control: ControlGroup) -> None:
        self._model = model
        self._control = control
        self._rank = control.rank
        self._specs: list[TensorSpec] | None = None

    def layout(self) -> SourceLayout:
        if self._specs is None:
            self._specs = [TensorSpec.of(name, tensor)
                           for name, tensor in self._model.export_hf_weights()]
        return SourceLayout(specs=list(self._specs), sources=[0] * len(self._specs))

    def begin(self, plan: RefitPlan) -> _BridgePass:
        """One export pass (collective over the trainer ranks); Bridge's conversion tasks are
        built again when any rank replaced a parameter object."""
        replaced = self._control.any_true(self._model.parameters_replaced(),
                                          what="whether a trainer rank replaced a parameter")
        return _BridgePass(self._model.export_hf_weights(rebuild=replaced), rank=self._rank)


class _BridgePass:
    stable_tensors = False

    def __init__(self, stream: Iterator[tuple[str, torch.Tensor]], *, rank: int) -> None:
        self._stream = stream
        self._rank = rank

    def exchange(self, buffer: PlannedBuffer, *, timeout_s: float) -> None:
        if self._rank != buffer.source:
            for _ in range(buffer.num_tensors):
                next(self._stream)

    def own_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self._stream if self._rank == 0 else iter(())
