"""torchrun --nproc-per-node N refit_layouts.py --workdir DIR --out RESULTS.json --placement P
                 --cases CASE [CASE ...]

Refits a tiny Megatron model, laid out as each case's layout, into engines and checks every engine
tensor bit for bit against Megatron-Bridge's own (full) export of the same model, twice (the
weights change in between, so stale bytes would show). A case is a layout's name, or
``LAYOUT~MAPPING[,MAPPING...]``: the layout with the row probe refused for those mapping classes
(as for a mapping that does more than move rows). The cases run one after another in the same
ranks, so the launch's start-up is paid once.

- ``--placement non_colocated``: the first ranks train (as many as the layout needs), the rest
  are inference ranks of a non-colocated job; each tensor goes from the trainer rank that
  exports it.
- ``--placement colocated``: every rank trains and refits an engine in a thread of its own
  process over the IPC transport (shared memory); buffers move between trainer ranks first.

Mixture-of-experts layouts (``moe_*``, Qwen3-MoE with 8 experts) refit into the HF model itself
(:class:`~mcore_refit.refit.HFModelEngine`: per-expert names written into transformers' fused
expert tensors) and are checked through it by name.

Rank 0 writes ``{case: {"rank<r>": result}}`` to --out; a case that raised on a rank has
``{"error": traceback}`` there, and the next case still runs.
"""

import argparse
import json
import os
import sys
import threading
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from mcore_refit import distributed, non_colocated
from mcore_refit.config import ModelConfig, ParallelConfig
from mcore_refit.control import ControlGroup
from mcore_refit.refit import (
    ColocatedInitInfo,
    ColocatedSender,
    HFModelEngine,
    ModelExport,
    NonColocatedInitInfo,
    NonColocatedSender,
    PlanConfig,
    Refitter,
    TensorDictEngine,
    TensorDigester,
    TransportOptions,
    WeightTransferEndpoint,
    mismatched_names,
    plan_for_source,
)
from mcore_refit.refit.export_probe import ConversionProbe
from mcore_refit.tiny import TinyModelSpec, write_tiny_checkpoint

CHECKPOINTS = {
    "llama8": TinyModelSpec(architecture="llama", num_layers=8),
    "llama8_tied": TinyModelSpec(architecture="llama", num_layers=8, tie_word_embeddings=True),
    "qwen2": TinyModelSpec(architecture="qwen2", num_layers=8),
    "qwen2_tied": TinyModelSpec(architecture="qwen2", num_layers=8, tie_word_embeddings=True),
    "qwen3_moe": TinyModelSpec(architecture="qwen3_moe", num_layers=4, num_experts=8,
                               num_experts_per_token=2),
}
# Checkpoints refitted into the HF model rather than into tensors of the plan's shapes.
HF_ENGINE = {"qwen3_moe"}

LAYOUTS = {
    "llama8_tp2": ("llama8", ParallelConfig(tensor=2)),
    "llama8_pp2": ("llama8", ParallelConfig(pipeline=2)),
    "qwen2_tied_tp2": ("qwen2_tied", ParallelConfig(tensor=2)),
    "llama8_tied_pp2_vpp2": ("llama8_tied", ParallelConfig(pipeline=2, virtual_pipeline=2)),
    "qwen2_pp2_vpp2": ("qwen2", ParallelConfig(pipeline=2, virtual_pipeline=2)),
    "llama8_tp2_pp2_vpp2": ("llama8", ParallelConfig(tensor=2, pipeline=2, virtual_pipeline=2)),
    "qwen2_tied_tp2_pp2_vpp2": ("qwen2_tied",
                                ParallelConfig(tensor=2, pipeline=2, virtual_pipeline=2)),
    "moe_ep2": ("qwen3_moe", ParallelConfig(expert=2)),
    "moe_pp2": ("qwen3_moe", ParallelConfig(pipeline=2)),
}

CPU = torch.device("cpu")
OPTIONS = TransportOptions(checksums=True, timeout_s=60, start_timeout_s=120)
# Small slots: many buffers, so shards and sources interleave.
PLAN = PlanConfig(slot_bytes=65536, num_slots=2)


class SkippingProbe(ConversionProbe):
    """The row probe, refused for some mapping classes (tests the paths for conversions that
    are not row moves: Bridge's conversion on the rank, or its full export)."""

    skipped: frozenset[str] = frozenset()

    def _probe(self, task, full, local):
        if type(task.mapping).__name__ in self.skipped:
            return None
        return super()._probe(task, full, local)


class SkippingExport(ModelExport):
    """The export, learning its conversions with :class:`SkippingProbe`."""

    probe_class = SkippingProbe


def kinds(export) -> dict[str, int]:
    counts: dict[str, int] = {}
    for task in export.assignment().tasks:
        counts[task.kind] = counts.get(task.kind, 0) + len(task.outputs)
    return counts


def parse_case(case: str) -> tuple[str, frozenset[str]]:
    """``(layout, mapping classes that skip the row probe)`` of a case name."""
    layout, _, skipped = case.partition("~")
    if layout not in LAYOUTS:
        raise SystemExit(f"unknown layout {layout!r} in case {case!r}; choose from "
                         f"{sorted(LAYOUTS)}")
    return layout, frozenset(filter(None, skipped.split(",")))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--placement", choices=["colocated", "non_colocated"], required=True)
    parser.add_argument("--cases", nargs="+", required=True)
    args = parser.parse_args()
    cases = {case: parse_case(case) for case in args.cases}
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    trainers = max(LAYOUTS[name][1].model_parallel_size * LAYOUTS[name][1].expert
                   for name, _ in cases.values())
    workdir = Path(args.workdir)
    context, job = start(args.placement, rank=rank, world=world,
                         num_inference_ranks=world - trainers)
    results = {}
    for case, (name, skipped) in cases.items():
        SkippingProbe.skipped = skipped
        checkpoint, parallel = LAYOUTS[name]
        try:
            path = written_checkpoint(workdir / checkpoint, CHECKPOINTS[checkpoint], rank=rank,
                                      job=job)
            if job is None:
                results[case] = colocated(path, parallel, context=context)
            elif job.is_trainer:
                results[case] = trainer(path, parallel, job=job)
            else:
                results[case] = receiver(job, path)
        except Exception:  # this case's test reports it; the next case runs
            results[case] = {"error": traceback.format_exc()}
            print(f"case {case} failed on rank {rank}:\n{results[case]['error']}",
                  file=sys.stderr, flush=True)
    gathered = share(results, job, rank)
    if rank == 0:
        Path(args.out).write_text(json.dumps(gathered))
    distributed.shutdown()


def launch_id() -> str:
    """This launch's name among the host's: its rendezvous port (its agent's pid would not do for
    ranks forked from a fork server that serves several launches)."""
    return os.environ["MASTER_PORT"]


def start(placement: str, *, rank: int, world: int, num_inference_ranks: int):
    """``(context, job)`` of this launch: a colocated job (``job`` None) or a non-colocated one
    whose last ``num_inference_ranks`` ranks serve the engines."""
    if placement == "colocated":
        return distributed.init_distributed(rank=rank, world_size=world, local_rank=rank), None
    job = non_colocated.init_non_colocated_job(
        rank=rank, world_size=world, local_rank=rank, num_inference_ranks=num_inference_ranks,
        store_host=os.environ["MASTER_ADDR"], store_port=int(os.environ["MASTER_PORT"]))
    return job.context, job


def written_checkpoint(path: Path, spec: TinyModelSpec, *, rank: int, job) -> Path:
    """``path``, where rank 0 writes the checkpoint ``spec`` once, before any trainer reads it."""
    if rank == 0 and not path.exists():
        write_tiny_checkpoint(path, spec)
    if job is None or job.is_trainer:
        dist.barrier()
    return path


def share(results: dict, job, rank: int) -> dict:
    """Every rank's results on rank 0, over a gloo group spanning the launch."""
    if job is None:
        control = ControlGroup(dist.new_group(backend="gloo"), timeout_s=120)
    else:
        control = ControlGroup(job.refit_control, timeout_s=120)
    rows = control.all_gather_json(results, what="the scenario results")
    return {name: {f"rank{r}": row[name] for r, row in enumerate(rows)} for name in results}


def build(path: Path, parallel: ParallelConfig, device: torch.device):
    from mcore_refit.model import build_model

    model_parallel = distributed.init_model_parallel(parallel, seed=0)
    return build_model(ModelConfig(hf_path=str(path)), model_parallel, device=device)


def reference(model) -> tuple[list[str], torch.Tensor]:
    """Names and digests of Megatron-Bridge's full export (collective over the trainers)."""
    digester = TensorDigester(CPU)
    names, rows = [], []
    for name, tensor in model.export_hf_weights():
        names.append(name)
        rows.append(digester.digest(tensor.detach().cpu()))
    return names, torch.stack(rows)


def make_engine(path: Path, specs, device: torch.device):
    """The HF model of ``path`` (MoE checkpoints) or zero tensors of the plan's shapes."""
    if path.name not in HF_ENGINE:
        return TensorDictEngine.from_specs(specs, device=device)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).to(device)
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()  # the refit must fill every weight
    return HFModelEngine(model)


def bump(model) -> None:
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.5)


def trainer(path: Path, parallel: ParallelConfig, *, job) -> dict:
    """A trainer rank of the non-colocated job: two refits, then Bridge's export for the check."""
    trainers = dist.new_group(backend="gloo")
    try:
        model = build(path, parallel, job.context.device)
        control = ControlGroup(trainers, timeout_s=120)
        export = SkippingExport(model, control=control, device=job.context.device,
                                prefer={t for t, _ in job.placement.shared})
        plan = plan_for_source(export, config=PLAN, device=job.context.device)
        sender = NonColocatedSender(plan=plan, placement=job.placement, rank=job.context.rank,
                                 control=ControlGroup(job.refit_control, timeout_s=120),
                                 data_group=job.data_groups.get(job.context.rank),
                                 device=job.context.device, options=OPTIONS,
                                 cpu_device_id=f"layouts{launch_id()}")
        refits = []
        with Refitter(source=export, sender=sender) as refitter:
            refitter.prepare()
            for _ in range(2):
                telemetry = refitter.refit(verify=True)
                names, table = reference(model)
                check = ControlGroup(job.refit_control, timeout_s=120)
                check.broadcast_json([names, table.tolist()] if job.context.rank == 0 else None,
                                     src=0, what="Bridge's export digests")
                refits.append({"verified": telemetry.verified,
                               "num_buffers": plan.num_buffers, "sources": list(plan.sources),
                               "payload_bytes": plan.payload_bytes})
                bump(model)
        return {"refits": refits, "num_tensors": plan.num_tensors, "kinds": kinds(export)}
    finally:
        distributed.destroy_model_parallel()


def receiver(job, path: Path) -> dict:
    """An inference rank: takes the trainers' plan, receives two refits, checks each against
    Bridge's export."""
    control = ControlGroup(job.refit_control, timeout_s=120)
    info = NonColocatedInitInfo(placement=job.placement, receiver=job.context.rank,
                             control=control, data_groups=job.data_groups)
    receiver_ = info.connect(device=job.context.device, options=OPTIONS, plan=None)
    receiver_.prepare()
    engine = make_engine(path, receiver_.plan.specs(), job.context.device)
    checks = []
    for _ in range(2):
        telemetry = receiver_.receive(engine)
        names, table = control.broadcast_json(None, src=0, what="Bridge's export digests")
        actual = TensorDigester(CPU).table(engine.get_weight(n).cpu() for n in names)
        checks.append({"verified": telemetry.verified,
                       "mismatched": mismatched_names(names, torch.tensor(table), actual),
                       "same_names": sorted(names) == sorted(set(receiver_.plan.names))})
    receiver_.close()
    return {"checks": checks}


def colocated(path: Path, parallel: ParallelConfig, *, context) -> dict:
    """Every rank trains and refits its own engine (a thread here) over IPC."""
    trainers = dist.new_group(backend="gloo")
    try:
        model = build(path, parallel, context.device)
        control = ControlGroup(trainers, timeout_s=120)
        export = SkippingExport(model, control=control, device=context.device)
        plan = plan_for_source(export, config=PLAN, device=context.device)
        options = TransportOptions(**{**OPTIONS.__dict__,
                                      "ipc_dir": f"/tmp/layouts-{launch_id()}"})
        Path(options.ipc_dir).mkdir(exist_ok=True)
        sender = ColocatedSender(plan=plan, device=context.device, options=options,
                           cpu_device_id=f"layouts{launch_id()}-rank{context.rank}",
                           trainers=dist.group.WORLD, control=control, rank=context.rank)
        engine = make_engine(path, plan.specs(), context.device)
        served: list = []

        def serve():
            with WeightTransferEndpoint(engine=engine, device=context.device,
                                        options=options) as endpoint:
                endpoint.init_weight_transfer_engine(ColocatedInitInfo(address=sender.address))
                for version in range(2):
                    endpoint.start_weight_update()
                    served.append(endpoint.update_weights().verified)
                    endpoint.finish_weight_update(version)

        thread = threading.Thread(target=serve)
        thread.start()
        checks = []
        with Refitter(source=export, sender=sender) as refitter:
            refitter.prepare()
            for _ in range(2):
                telemetry = refitter.refit(verify=True)
                names, table = reference(model)
                actual = TensorDigester(CPU).table(engine.get_weight(n).cpu() for n in names)
                checks.append({"verified": telemetry.verified,
                               "mismatched": mismatched_names(names, table, actual),
                               "same_names": sorted(names) == sorted(set(plan.names)),
                               "sources": list(plan.sources)})
                bump(model)
        thread.join(60)
        return {"checks": checks, "engine_verified": served, "kinds": kinds(export)}
    finally:
        distributed.destroy_model_parallel()


if __name__ == "__main__":
    main()
