"""torchrun --nproc-per-node 2 policy_state.py --hf-path DIR --workdir DIR --out RESULTS.pt
                                             [--cases NAME ...]

Offload/onload and checkpoint save/load against an uninterrupted run, per case (layout, dtype,
optimizer). For each case three policies train the same three steps:

- ``straight``: steps 0, 1, two steps refused (a NaN loss; an infinite gradient norm under a
  finite loss), saves a checkpoint, step 2 (the refused steps must change nothing the other
  runs would see);
- ``offload``: step 0, reference logprobs, offload, onload, steps 1, 2 (exports before offload
  and after onload);
- ``resumed``: a fresh policy loads the checkpoint, then step 2.

Rank 0 writes {case: {run: metrics, weights, logprobs, ...}} to --out.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from policy_common import (
    exported,
    init_from_env,
    layout,
    make_batch,
    metrics_dict,
    model_config,
    policy_config,
    save,
)

from mcore_refit import distributed
from mcore_refit.losses import CrossEntropyLoss, LossOutput, count_tokens, masked_sum
from mcore_refit.numerics import NonFiniteError

# case -> (layout, dtype, distributed optimizer)
CASES = {
    "pp2_vpp2_fp32": ("pp2_vpp2", "float32", False),
    "dp2_bf16_distopt": ("dp2", "bfloat16", True),
}
SEEDS = (21, 22, 23)
EVAL_SEED = 98


def build(case: str, hf_path: Path, device: torch.device):
    from mcore_refit.policy.worker import build_policy

    name, dtype, distopt = CASES[case]
    parallel = layout(name)
    model_parallel = distributed.init_model_parallel(parallel, seed=1234)
    config = policy_config(clip_grad=1.0, use_distributed_optimizer=distopt)
    return build_policy(model_config(hf_path, dtype), model_parallel, config, device=device)


def train(policy, seeds, device) -> list[dict]:
    return [metrics_dict(policy.train_step(make_batch(seed, device=device))) for seed in seeds]


class NanLoss(CrossEntropyLoss):
    """Cross entropy times NaN."""

    def __call__(self, logprobs, micro_batch):
        output = super().__call__(logprobs, micro_batch)
        return LossOutput(loss_sum=output.loss_sum * float("nan"),
                          num_tokens=output.num_tokens, metrics=output.metrics)


class InfiniteGradient(CrossEntropyLoss):
    """A loss of 0 whose gradient is infinite: sqrt(x − x) at x = logprobs."""

    def __call__(self, logprobs, micro_batch):
        mask = micro_batch["loss_mask"]
        loss_sum = masked_sum(torch.sqrt(logprobs - logprobs.detach()), mask)
        return LossOutput(loss_sum=loss_sum, num_tokens=count_tokens(mask),
                          metrics={"nll": loss_sum.detach().clone()})


def refused_steps(policy, device) -> dict:
    """Steps the non-finite guard must stop before the update: their messages, and whether the
    weights and the step count stayed as they were."""
    before, step = exported(policy), policy.step
    messages = {}
    for name, loss_fn in (("loss", NanLoss()), ("grad_norm", InfiniteGradient())):
        try:
            policy.train_step(make_batch(SEEDS[1], device=device), loss_fn=loss_fn)
            messages[name] = None
        except NonFiniteError as error:
            messages[name] = str(error)
    after = exported(policy)
    return {"messages": messages, "step_unchanged": policy.step == step,
            "weights_unchanged": all(torch.equal(before[k], after[k]) for k in before)}


def run_straight(case, hf_path, checkpoint_dir, device) -> dict:
    policy = build(case, hf_path, device)
    try:
        steps = train(policy, SEEDS[:2], device)
        refused = refused_steps(policy, device)
        policy.save_checkpoint(checkpoint_dir)
        steps += train(policy, SEEDS[2:], device)
        eval_batch = make_batch(EVAL_SEED, device=device)
        return {"steps": steps, "weights": exported(policy), "step": policy.step,
                "refused": refused,
                "logprobs": policy.logprobs(eval_batch).cpu(),
                "reference_logprobs": policy.reference_logprobs(eval_batch).cpu()}
    finally:
        distributed.destroy_model_parallel()


def run_offload(case, hf_path, device) -> dict:
    policy = build(case, hf_path, device)
    try:
        steps = train(policy, SEEDS[:1], device)
        # Swapping the reference weights in and out must not disturb the weights or the optimizer.
        policy.reference_logprobs(make_batch(EVAL_SEED, device=device))
        before = exported(policy)
        parameters = list(policy.model.parameters())
        parameter_ids = [id(p) for p in parameters]
        allocated_before = _device_allocated(device)
        start = time.perf_counter()
        freed_bytes = policy.offload()
        offload_s = time.perf_counter() - start
        allocated_offloaded = _device_allocated(device)
        # While offloaded every parameter's storage (and every gradient buffer) is empty.
        empty_params = sum(p.untyped_storage().nbytes() == 0 for p in parameters)
        empty_grad_buffers = sum(buffer.grad_data.untyped_storage().nbytes() == 0
                                 for chunk in policy.model.chunks for buffer in chunk.buffers)
        num_grad_buffers = sum(len(chunk.buffers) for chunk in policy.model.chunks)
        try:
            policy.train_step(make_batch(SEEDS[1], device=device))
            refused = ""
        except RuntimeError as error:
            refused = str(error)
        start = time.perf_counter()
        policy.onload()
        onload_s = time.perf_counter() - start
        after_onload = exported(policy)
        steps += train(policy, SEEDS[1:], device)
        return {
            "steps": steps, "weights": exported(policy), "step": policy.step,
            "freed_bytes": freed_bytes, "param_bytes": sum(p.numel() * p.element_size()
                                                           for p in parameters),
            "num_params": len(parameters), "empty_params": empty_params,
            "num_grad_buffers": num_grad_buffers, "empty_grad_buffers": empty_grad_buffers,
            "same_parameter_objects": [id(p) for p in policy.model.parameters()] == parameter_ids,
            "refused_while_offloaded": refused,
            "export_before_offload": before, "export_after_onload": after_onload,
            "offload_s": offload_s, "onload_s": onload_s,
            "device_allocated_before_offload": allocated_before,
            "device_allocated_offloaded": allocated_offloaded,
        }
    finally:
        distributed.destroy_model_parallel()


def _device_allocated(device: torch.device) -> int | None:
    """Bytes the CUDA caching allocator hands out on ``device`` (None on the CPU)."""
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


def run_resumed(case, hf_path, checkpoint_dir, device) -> dict:
    policy = build(case, hf_path, device)
    try:
        eval_batch = make_batch(EVAL_SEED, device=device)
        initial_reference = policy.reference_logprobs(eval_batch).cpu()
        policy.load_checkpoint(checkpoint_dir)
        step_after_load = policy.step
        steps = train(policy, SEEDS[2:], device)
        return {"steps": steps, "weights": exported(policy), "step": policy.step,
                "step_after_load": step_after_load,
                "logprobs": policy.logprobs(eval_batch).cpu(),
                "reference_logprobs": policy.reference_logprobs(eval_batch).cpu(),
                "reference_logprobs_before_load": initial_reference}
    finally:
        distributed.destroy_model_parallel()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hf-path", required=True, type=Path)
    parser.add_argument("--workdir", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--cases", nargs="+", default=sorted(CASES), choices=sorted(CASES))
    args = parser.parse_args()
    context = init_from_env()
    results = {}
    try:
        for case in args.cases:
            checkpoint_dir = args.workdir / f"checkpoint_{case}"
            results[case] = {
                "straight": run_straight(case, args.hf_path, checkpoint_dir, context.device),
                "offload": run_offload(case, args.hf_path, context.device),
                "resumed": run_resumed(case, args.hf_path, checkpoint_dir, context.device),
            }
            if context.rank == 0:
                print(f"{case}: losses "
                      f"{[round(s['loss'], 6) for s in results[case]['straight']['steps']]}",
                      flush=True)
        save(results, args.out)
    finally:
        distributed.shutdown()


if __name__ == "__main__":
    main()
