"""torchrun --nproc-per-node N export_parity.py --workdir DIR --out RESULTS.json
                 [--only SCENARIO ...] [--checks corrupted fresh] [--corrupt-layout SCENARIO]

Runs the export verifier over several layouts and architectures in one process group, plus two
negative checks (a corrupted weight is caught; a replaced Parameter is exported fresh). Without
--only, the scenarios run are those whose tensor × pipeline size equals the number of ranks (2:
TP2, PP2, PP2×VPP2, ...; 4: TP2×PP2×VPP2). Rank 0 writes {scenario: result} to --out; a
scenario that raised on rank 0 has {"error": traceback} there, and the next one still runs.
"""

import argparse
import json
import os
import sys
import traceback
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from mcore_refit import distributed
from mcore_refit.config import ModelConfig, ParallelConfig
from mcore_refit.tiny import TinyModelSpec, write_tiny_checkpoint

CHECKPOINTS = {
    "llama8": TinyModelSpec(architecture="llama", num_layers=8),
    "llama8_tied": TinyModelSpec(architecture="llama", num_layers=8, tie_word_embeddings=True),
    "qwen2": TinyModelSpec(architecture="qwen2", num_layers=4),
    "qwen2_tied": TinyModelSpec(architecture="qwen2", num_layers=4, tie_word_embeddings=True),
}
# Mixture of experts (8 experts, top-2) and an architecture whose bridge brings its own layer
# spec; written only when a scenario needs them.
MOE_CHECKPOINTS = {
    "qwen3_moe": TinyModelSpec(architecture="qwen3_moe", num_layers=4, num_experts=8,
                               num_experts_per_token=2),
    "gemma2": TinyModelSpec(architecture="gemma2", num_layers=4, tie_word_embeddings=True),
}

LAYOUTS = {
    "llama8_tp2": ("llama8", ParallelConfig(tensor=2), "float32"),
    "llama8_pp2": ("llama8", ParallelConfig(pipeline=2), "float32"),
    "llama8_pp2_vpp2": ("llama8", ParallelConfig(pipeline=2, virtual_pipeline=2), "float32"),
    "llama8_pp2_vpp4": ("llama8", ParallelConfig(pipeline=2, virtual_pipeline=4), "float32"),
    "llama8_tied_pp2_vpp2": ("llama8_tied", ParallelConfig(pipeline=2, virtual_pipeline=2),
                             "float32"),
    "qwen2_pp2_vpp2": ("qwen2", ParallelConfig(pipeline=2, virtual_pipeline=2), "float32"),
    "qwen2_tied_tp2": ("qwen2_tied", ParallelConfig(tensor=2), "float32"),
    "llama8_pp2_vpp2_bf16": ("llama8", ParallelConfig(pipeline=2, virtual_pipeline=2),
                             "bfloat16"),
    "llama8_tp2_pp2_vpp2": ("llama8", ParallelConfig(tensor=2, pipeline=2, virtual_pipeline=2),
                            "float32"),
    "llama8_tp2_pp2_vpp2_bf16": ("llama8",
                                 ParallelConfig(tensor=2, pipeline=2, virtual_pipeline=2),
                                 "bfloat16"),
}
# Not run by default: launch with --only (2 ranks: TP1 (DP2), PP2, PP2×VPP2, EP2; 4 ranks:
# EP2×PP2).
MOE_LAYOUTS = {
    "moe_tp1": ("qwen3_moe", ParallelConfig(), "float32"),
    "moe_pp2": ("qwen3_moe", ParallelConfig(pipeline=2), "float32"),
    "moe_pp2_vpp2": ("qwen3_moe", ParallelConfig(pipeline=2, virtual_pipeline=2), "float32"),
    "moe_ep2": ("qwen3_moe", ParallelConfig(expert=2), "float32"),
    "moe_ep2_pp2": ("qwen3_moe", ParallelConfig(expert=2, pipeline=2), "float32"),
}


def corrupted_weight_is_caught(path, device, parallel: ParallelConfig):
    """Perturb one weight on the last stage: the comparison must name exactly that tensor.

    Without TP, the final norm; with TP, tensor-parallel rank 1's shard of the last layer's
    attention output projection (row-parallel: one HF tensor, gathered across TP ranks).
    """
    from megatron.core import parallel_state

    from mcore_refit.model import build_model
    from mcore_refit.verify import compare_export, hf_reference_state

    model_parallel = distributed.init_model_parallel(parallel, seed=0)
    try:
        model = build_model(ModelConfig(hf_path=str(path)), model_parallel, device=device)
        if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
            decoder = model.unwrapped()[-1].decoder
            if parallel.tensor == 1:
                target = decoder.final_layernorm.weight
            elif parallel_state.get_tensor_model_parallel_rank() == 1:
                target = decoder.layers[-1].self_attention.linear_proj.weight
            else:
                target = None
            if target is not None:
                with torch.no_grad():
                    target.add_(1e-3)
        _, mismatched, missing, unexpected = compare_export(model, hf_reference_state(str(path)))
        return {"mismatched": mismatched, "missing": missing, "unexpected": unexpected}
    finally:
        distributed.destroy_model_parallel()


def export_reads_current_parameters(path, device):
    """In-place updates and replaced Parameter objects both reach Bridge's export and the refit
    source (whose compiled tensors are views of the parameters)."""
    from megatron.core import parallel_state

    from mcore_refit.control import ControlGroup
    from mcore_refit.model import build_model
    from mcore_refit.refit import ModelExport, PlanConfig, plan_for_source

    parallel = ParallelConfig(pipeline=2, virtual_pipeline=2)
    model_parallel = distributed.init_model_parallel(parallel, seed=0)
    try:
        model = build_model(ModelConfig(hf_path=str(path)), model_parallel, device=device)
        control = ControlGroup(None, timeout_s=60)
        export = ModelExport(model, control=control, device=device)
        plan = plan_for_source(export, config=PlanConfig(slot_bytes=1 << 20), device=device)
        last_stage = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        norm_owner = model.unwrapped()[-1].decoder
        first_tasks = model.conversion_tasks()
        if last_stage:
            with torch.no_grad():
                norm_owner.final_layernorm.weight.fill_(3.0)
        in_place = dict(model.export_hf_weights())["model.norm.weight"].unique().tolist()
        source_in_place = _source_norm(export, plan, control)
        reused = model.conversion_tasks() is first_tasks
        if last_stage:
            weight = norm_owner.final_layernorm.weight
            norm_owner.final_layernorm.weight = torch.nn.Parameter(torch.full_like(weight, 5.0))
        agreed = any(control.all_gather_json(model.parameters_replaced(), what="replaced"))
        replaced = dict(model.export_hf_weights(rebuild=agreed))["model.norm.weight"]
        replaced = replaced.unique().tolist()
        rebuilt = model.conversion_tasks() is not first_tasks
        source_replaced = _source_norm(export, plan, control)
        reshaped = None
        if last_stage:
            weight = norm_owner.final_layernorm.weight
            norm_owner.final_layernorm.weight = torch.nn.Parameter(weight.detach()[:-1].clone())
            try:
                export.begin(plan)
            except RuntimeError as error:
                reshaped = str(error)
        reshaped = control.all_gather_json(reshaped, what="the reshaped replacement's error")
        return {"in_place": in_place, "tasks_reused": reused, "replaced": replaced,
                "tasks_rebuilt": rebuilt, "source_in_place": source_in_place,
                "source_replaced": source_replaced, "reshaped": reshaped}
    finally:
        distributed.destroy_model_parallel()


def _source_norm(export, plan, control) -> list[float]:
    """The distinct values of ``model.norm.weight`` in one pass of ``export``, from the rank
    that sends it (every rank checks its own tensors against the plan's specs)."""
    refit_pass = export.begin(plan)
    own = refit_pass.own_weights()
    found = None
    for buffer in plan.buffers:
        refit_pass.exchange(buffer, timeout_s=60)
        if buffer.source != control.rank:
            continue
        for planned in plan.tensors_of(buffer):
            name, tensor = next(own)
            assert name == planned.spec.name and tuple(tensor.shape) == planned.spec.shape
            if name == "model.norm.weight":
                found = tensor.unique().tolist()
    return next(v for v in control.all_gather_json(found, what="the norm") if v is not None)


def gemma2_error(path, device) -> str | None:
    """Gemma2's bridge brings its own layer spec, built from transformer-engine modules: without
    TE the verifier must stop with an error naming the architecture (None: it built)."""
    from mcore_refit.verify import verify_layout

    try:
        verify_layout(ModelConfig(hf_path=str(path)), ParallelConfig(), device=device, seed=1234)
    except ValueError as error:
        return str(error)
    return None


def verified(model_config: ModelConfig, parallel: ParallelConfig, device) -> dict:
    """The export verifier's report of one layout."""
    from mcore_refit.verify import verify_layout

    report = verify_layout(model_config, parallel, device=device, seed=1234)
    return {**report.as_dict(), "passed": report.passed}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", nargs="*", default=None,
                        choices=sorted({**LAYOUTS, **MOE_LAYOUTS}))
    parser.add_argument("--checks", nargs="*", default=["corrupted", "fresh"],
                        choices=("corrupted", "fresh", "gemma2"))
    parser.add_argument("--corrupt-layout", default="llama8_pp2_vpp2", choices=sorted(LAYOUTS))
    args = parser.parse_args()
    context = distributed.init_distributed(rank=int(os.environ["RANK"]),
                                           world_size=int(os.environ["WORLD_SIZE"]),
                                           local_rank=int(os.environ["LOCAL_RANK"]))
    only = args.only if args.only is not None else [
        name for name, (_, parallel, _) in LAYOUTS.items()
        if parallel.model_parallel_size == context.world_size]
    workdir = Path(args.workdir)
    layouts = {**LAYOUTS, **MOE_LAYOUTS}
    needed = {layouts[name][0] for name in only} | ({"gemma2"} & set(args.checks))
    if context.rank == 0:
        for name, spec in {**CHECKPOINTS, **MOE_CHECKPOINTS}.items():
            if name in CHECKPOINTS or name in needed:
                write_tiny_checkpoint(workdir / name, spec)
    dist.barrier()
    scenarios = {}
    for scenario, (checkpoint, parallel, dtype) in layouts.items():
        if scenario in only:
            model_config = ModelConfig(hf_path=str(workdir / checkpoint), dtype=dtype)
            scenarios[scenario] = partial(verified, model_config, parallel, context.device)
    if "corrupted" in args.checks:
        checkpoint, parallel, _ = LAYOUTS[args.corrupt_layout]
        scenarios["corrupted"] = partial(corrupted_weight_is_caught, workdir / checkpoint,
                                         context.device, parallel)
    if "gemma2" in args.checks:
        scenarios["gemma2"] = partial(gemma2_error, workdir / "gemma2", context.device)
    if "fresh" in args.checks:
        scenarios["fresh"] = partial(export_reads_current_parameters, workdir / "llama8",
                                     context.device)
    results = {}
    try:
        for scenario, run in scenarios.items():
            try:
                results[scenario] = run()
            except Exception:  # this scenario's test reports it; the next one runs
                results[scenario] = {"error": traceback.format_exc()}
                print(f"{scenario} failed on rank {context.rank}:\n{results[scenario]['error']}",
                      file=sys.stderr, flush=True)
    finally:
        distributed.shutdown()
    if context.rank == 0:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
