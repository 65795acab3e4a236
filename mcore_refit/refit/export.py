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
  HF tensor that its shard makes up (:class:`~mcore_refit.refit.specs.Region`), and the engine
  writes each piece into its place. Which rows of which HF tensor a shard makes up is learned
  once (:mod:`.export_probe`), by running Bridge's own conversion of the task on index probes
  (a tensor of row numbers, every TP rank's probe standing in for its shard): the rows that come
  out say where each row of the shard goes, with no QKV, gated-MLP or vocabulary-padding rule
  written here;
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

import torch

from mcore_refit.control import ControlGroup
from mcore_refit.model import ParameterSnapshot
from mcore_refit.refit.export_probe import (
    COMPILED,
    FALLBACK,
    ConversionProbe,
    ExportLayout,
    ExportTask,
    LocalGroups,
    ProbedOutput,
    assign_sources,
    parse_task_report,
    task_report,
)
from mcore_refit.refit.plan import PlannedBuffer, RefitPlan
from mcore_refit.refit.source import Piecewise, SourceLayout
from mcore_refit.refit.specs import TensorSpec

logger = logging.getLogger(__name__)


class ModelExport:
    """A refit source over Megatron model chunks (see the module docstring).

    ``control`` is a gloo group over all trainer ranks (its ranks are the trainer ranks and the
    plan's sources); ``prefer`` names trainer ranks to make sources where there is a choice;
    ``guard()`` runs before every pass and raises when the weights may not be read now (a policy
    whose weights are offloaded).
    """

    # Learns each conversion task once (a subclass may refuse some tasks' row probe).
    probe_class: type[ConversionProbe] = ConversionProbe

    def __init__(self, model, *, control: ControlGroup, device: torch.device,
                 prefer: Collection[int] = (), guard: Callable[[], None] | None = None) -> None:
        self._model = model
        self._guard = guard
        self._control = control
        self._device = torch.device(device)
        self._prefer = frozenset(prefer)
        self.rank = control.rank
        self._params = ParameterSnapshot(model.chunks)
        self._fallback_tasks: list = []  # Bridge's tasks for the fallback tensors
        probe = self.probe_class(self._stream, rank=self.rank)
        self._local = {key: probe.describe(task) for key, task in self._conversion_tasks()}
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
                [task_report(key, local) for key, local in self._local.items()],
                what="the conversion tasks of every trainer rank")
            reports = [[parse_task_report(r) for r in rank_reports] for rank_reports in shared]
            fallback = {r["key"] for rank_reports in reports for r in rank_reports
                        if r["kind"] == FALLBACK}
            self._layout = assign_sources(reports, fallback=self._fallback_specs(fallback),
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

    # --- Bridge's conversion ----------------------------------------------------------------

    def _conversion_tasks(self):
        """This rank's conversion tasks (its own parameters), with shard-local groups."""
        from megatron.core import parallel_state

        bridge = self._model.bridge
        tasks = bridge._model_bridge.build_conversion_tasks(bridge.hf_pretrained,
                                                            self._model.unwrapped())
        groups = LocalGroups(tp=self._model.model_parallel.tp_group,
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


def _tensor(weight: torch.Tensor, output: ProbedOutput, dim: int) -> torch.Tensor | Piecewise:
    """The output's rows of ``weight``: a view, or a :class:`Piecewise` of views."""
    views = [weight.narrow(dim, run.local, run.length) for run in output.runs]
    if len(views) == 1:
        return views[0]
    spec = output.spec
    return Piecewise(shape=spec.shape, dtype=spec.dtype, dim=dim,
                     offsets=[run.offset for run in output.runs], runs=views)


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


