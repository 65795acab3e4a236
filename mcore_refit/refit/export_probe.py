"""Learning Megatron-Bridge's conversion once: dry runs of each task and who exports what.

Each conversion task of a rank is run twice without real weights (:class:`ConversionProbe`):

- on meta tensors: its HF outputs, and whether it gathers tensor-parallel shards (a task that
  gathers more than its own parameter is not shard-local);
- on index probes (a tensor of row numbers, every TP rank's probe standing in for its shard): the
  rows that come out say where each row of the shard goes (:class:`RowRun`), with no QKV,
  gated-MLP or vocabulary-padding rule written here. A task whose conversion only moves rows is
  *compiled* (its outputs become views of its parameter); one that does more is *converted* by
  Bridge at each refit, or, when sharded, takes Bridge's full export (*fallback*).

Every rank reports what it found (:func:`task_report`), and :func:`assign_sources` picks each
task's source rank from all reports, identically on every rank (:class:`ExportLayout`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.distributed as dist

from mcore_refit import compat
from mcore_refit.refit.specs import Region, TensorSpec, spec_from_json, spec_to_json

logger = logging.getLogger(__name__)

COMPILED, CONVERTED, FALLBACK = "compiled", "converted", "fallback"

# Bridge's export of a list of conversion tasks: ``(hf_name, tensor)`` pairs.
TaskStream = Callable[[list], Iterator[tuple[str, torch.Tensor]]]


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
class LocalGroups:
    """The process groups a shard-local conversion task sees (Bridge's ``pg_collection``)."""

    tp: object
    expt_tp: object
    pp: _SoloGroup = _SoloGroup()
    ep: _SoloGroup = _SoloGroup()


@dataclass(frozen=True)
class RowRun:
    """Rows ``[local, local + length)`` of the parameter (along its partition dimension) go to
    ``[offset, offset + length)`` of the piece."""

    offset: int
    local: int
    length: int


@dataclass(frozen=True)
class ProbedOutput:
    """One HF tensor a rank's task yields: its spec (a piece where the rank holds a shard) and,
    for a compiled task, where its rows come from."""

    spec: TensorSpec
    runs: tuple[RowRun, ...] = ()


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
class LocalTask:
    """This rank's view of a conversion task: Bridge's task and what the dry runs found."""

    task: object
    kind: str
    outputs: list[ProbedOutput] = field(default_factory=list)
    # Trainer ranks holding the task's TP shards, in TP order (None: the task is not sharded).
    shard_ranks: tuple[int, ...] | None = None
    partition_dim: int = 0


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
               dim: int) -> ProbedOutput:
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
            runs[-1] = RowRun(offset=runs[-1].offset, local=runs[-1].local,
                            length=runs[-1].length + 1)
        else:
            runs.append(RowRun(offset=offset, local=local, length=1))
        offset += 1
    shape = list(spec.shape)
    shape[dim] = length
    whole = length == spec.shape[dim]
    region = None if whole else Region(dim=dim, start=start, full=spec.shape[dim])
    return ProbedOutput(spec=TensorSpec(name=spec.name, shape=tuple(shape), dtype=spec.dtype,
                                   region=region), runs=tuple(runs))


def assign_sources(reports: list[list[dict]], *, fallback: list[TensorSpec],
                   fallback_keys: set[str], prefer: frozenset[int]) -> ExportLayout:
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


def task_report(key: str, local: LocalTask) -> dict:
    return {"key": key, "kind": local.kind,
            "shard_ranks": None if local.shard_ranks is None else list(local.shard_ranks),
            "outputs": [spec_to_json(o.spec) for o in local.outputs]}


def parse_task_report(data: dict) -> dict:
    return {"key": data["key"], "kind": data["kind"], "shard_ranks": data["shard_ranks"],
            "outputs": tuple(spec_from_json(o) for o in data["outputs"])}


class ConversionProbe:
    """Dry runs of this rank's conversion tasks (see the module docstring); ``stream`` runs
    Bridge's conversion of a list of tasks on this rank. Mappings without a shard-local
    conversion are logged once per mapping type."""

    def __init__(self, stream: TaskStream, *, rank: int) -> None:
        self._stream = stream
        self._rank = rank
        self._logged: set[str] = set()

    def describe(self, task) -> LocalTask:
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
        local = LocalTask(task=task, kind=COMPILED, shard_ranks=shard_ranks, partition_dim=dim)
        outputs = self._probe(task, full, local)
        if outputs is not None:
            local.outputs = outputs
            return local
        if shard_ranks is not None:
            return self._fallback(task, "its conversion does more than move rows")
        local.kind = CONVERTED
        local.outputs = [ProbedOutput(spec=spec) for spec in full]
        return local

    def _probe(self, task, full: list[TensorSpec], local: LocalTask) -> list[ProbedOutput] | None:
        """Where each row of this rank's parameter goes in each HF tensor, from Bridge's own
        conversion of row-number probes; None when the conversion does more than move rows."""
        weight, dim = task.param_weight, local.partition_dim
        if weight.dim() not in (1, 2) or not full:
            return None
        ranks = local.shard_ranks or (self._rank,)
        position = ranks.index(self._rank)
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

    def _fallback(self, task, reason: str) -> LocalTask:
        kind = type(task.mapping).__name__
        if kind not in self._logged:
            self._logged.add(kind)
            logger.warning("refit export: %s (e.g. %s) has no shard-local conversion (%s); its "
                           "tensors use Megatron-Bridge's full export", kind,
                           task.global_param_name, reason)
        return LocalTask(task=task, kind=FALLBACK)

