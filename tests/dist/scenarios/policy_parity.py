"""torchrun --nproc-per-node N policy_parity.py --hf-path DIR --out-dir DIR --layouts L [L ...]
                  [--clip-layouts L ...] [--dtypes float32 bfloat16]
                  [--tied-hf-path DIR --tied-layouts L ...] [--temperature-layouts L ...]

Trains the same three steps (cross entropy, cross entropy, vanilla policy gradient) with the policy
worker in each layout and dtype in turn and writes, per run, ``<layout>_<dtype>[_clip].pt`` (and
``tied_<layout>_<dtype>.pt`` for the tied-embedding checkpoint) on rank 0: the step metrics, the
exported weights, logprobs before and after training, reference logprobs after training, and the
policy-gradient loss recomputed from logprobs. ``<layout>_float32_temperature.pt`` holds logprobs
of a fresh policy at ``--temperature``. The tests compare the files across layouts and launches (a
1-rank launch gives the non-pipelined reference ``pp1``).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from policy_common import (
    LAYOUTS,
    exported,
    init_from_env,
    layout,
    make_batch,
    metrics_dict,
    model_config,
    policy_config,
    save,
    with_fields,
)

from mcore_refit import distributed
from mcore_refit.losses import CrossEntropyLoss, VanillaPolicyGradientLoss

TRAIN_SEEDS = (11, 12, 13)
EVAL_SEED = 99


def run_layout(name: str, *, hf_path: Path, dtype: str, clip_grad: float | None,
               device: torch.device) -> dict:
    from mcore_refit.policy.worker import build_policy

    parallel = layout(name)
    model_parallel = distributed.init_model_parallel(parallel, seed=1234)
    try:
        start = time.perf_counter()
        policy = build_policy(model_config(hf_path, dtype), model_parallel,
                              policy_config(clip_grad=clip_grad), device=device)
        eval_batch = make_batch(EVAL_SEED, device=device)
        result = {"layout": name, "dtype": dtype, "clip_grad": clip_grad,
                  "eval_tokens": eval_batch.tokens.cpu(), "eval_lengths": eval_batch.lengths.cpu(),
                  "logprobs_initial": policy.logprobs(eval_batch).cpu(), "steps": []}
        for seed in TRAIN_SEEDS[:2]:
            metrics = policy.train_step(make_batch(seed, device=device),
                                        loss_fn=CrossEntropyLoss())
            result["steps"].append(metrics_dict(metrics))
        pg_batch = make_batch(TRAIN_SEEDS[2], device=device)
        old_logprobs = policy.logprobs(pg_batch)
        pg_batch = with_fields(pg_batch, old_logprobs=old_logprobs)
        metrics = policy.train_step(pg_batch, loss_fn=VanillaPolicyGradientLoss())
        result["steps"].append(metrics_dict(metrics))
        result["pg_loss_from_logprobs"] = _vanilla_pg_loss(pg_batch, old_logprobs)
        result["logprobs_final"] = policy.logprobs(eval_batch).cpu()
        result["reference_logprobs_final"] = policy.reference_logprobs(eval_batch).cpu()
        result["logprobs_after_reference"] = policy.logprobs(eval_batch).cpu()
        result["weights"] = exported(policy)
        result["seconds"] = time.perf_counter() - start
        return result
    finally:
        distributed.destroy_model_parallel()


def temperature_logprobs(name: str, *, hf_path: Path, temperature: float,
                         device: torch.device) -> dict:
    """Logprobs of the evaluation batch from a fresh fp32 policy sampling at ``temperature``."""
    from mcore_refit.policy.worker import build_policy

    parallel = layout(name)
    model_parallel = distributed.init_model_parallel(parallel, seed=1234)
    try:
        policy = build_policy(model_config(hf_path, "float32"), model_parallel,
                              policy_config(clip_grad=None, temperature=temperature),
                              device=device)
        eval_batch = make_batch(EVAL_SEED, device=device)
        return {"layout": name, "temperature": temperature,
                "eval_tokens": eval_batch.tokens.cpu(), "eval_lengths": eval_batch.lengths.cpu(),
                "logprobs": policy.logprobs(eval_batch).cpu()}
    finally:
        distributed.destroy_model_parallel()


def _vanilla_pg_loss(batch, logprobs: torch.Tensor) -> float:
    """−Σ advantage · logprob over the loss mask, per token, computed outside the pipeline."""
    mask = batch.loss_mask
    advantages = batch.fields["advantages"].unsqueeze(1)
    return float(-(advantages * logprobs * mask).sum() / mask.sum())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hf-path", required=True, type=Path)
    parser.add_argument("--out-dir", required=True, type=Path)
    parser.add_argument("--layouts", nargs="+", required=True, choices=sorted(LAYOUTS))
    parser.add_argument("--clip-layouts", nargs="*", default=[], choices=sorted(LAYOUTS))
    parser.add_argument("--clip-grad", type=float, default=0.05)
    parser.add_argument("--dtypes", nargs="+", default=["float32"],
                        choices=("float32", "bfloat16"))
    parser.add_argument("--tied-hf-path", type=Path, default=None,
                        help="a checkpoint with tied embeddings, trained in --tied-layouts")
    parser.add_argument("--tied-layouts", nargs="*", default=[], choices=sorted(LAYOUTS))
    parser.add_argument("--temperature-layouts", nargs="*", default=[], choices=sorted(LAYOUTS))
    parser.add_argument("--temperature", type=float, default=0.7)
    args = parser.parse_args()
    if args.tied_layouts and args.tied_hf_path is None:
        parser.error("--tied-layouts needs --tied-hf-path")
    context = init_from_env()
    try:
        # (result file stem, checkpoint, layout, dtype, clip_grad)
        runs = []
        for dtype in args.dtypes:
            runs += [(f"{name}_{dtype}", args.hf_path, name, dtype, None)
                     for name in args.layouts]
            runs += [(f"{name}_{dtype}_clip", args.hf_path, name, dtype, args.clip_grad)
                     for name in args.clip_layouts]
            runs += [(f"tied_{name}_{dtype}", args.tied_hf_path, name, dtype, None)
                     for name in args.tied_layouts]
        for stem, hf_path, name, dtype, clip_grad in runs:
            result = run_layout(name, hf_path=hf_path, dtype=dtype, clip_grad=clip_grad,
                                device=context.device)
            save(result, args.out_dir / f"{stem}.pt")
            if context.rank == 0:
                losses = [round(step["loss"], 6) for step in result["steps"]]
                norms = [round(step["grad_norm"], 6) for step in result["steps"]]
                print(f"{stem}: losses {losses} grad norms {norms} ({result['seconds']:.1f}s)",
                      flush=True)
        for name in args.temperature_layouts:
            result = temperature_logprobs(name, hf_path=args.hf_path,
                                          temperature=args.temperature, device=context.device)
            save(result, args.out_dir / f"{name}_float32_temperature.pt")
    finally:
        distributed.shutdown()


if __name__ == "__main__":
    main()
