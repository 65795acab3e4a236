"""Does my model and layout convert exactly? Export and gradient parity against Hugging Face.

    torchrun --nproc-per-node N recipes/verify_export.py --hf-path DIR --tp T --pp P [--vpp V]
        [--ep E]

Builds the Megatron model from the checkpoint with the given layout, exports it through
Megatron-Bridge and compares every tensor with the checkpoint's, then runs one forward/backward
through Megatron's pipeline schedule on a fixed batch and compares loss and gradients (exported to
HF names) with the HF model's. The last line of stdout is one JSON object; the exit code is 0 only
when every check passes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import typing

from mcore_refit.config import ConfigError, Dtype, ModelConfig, ParallelConfig
from mcore_refit.launch import LaunchError, TorchrunRanks
from mcore_refit.verify import TOLERANCES

LAUNCH = "torchrun --nproc-per-node N recipes/verify_export.py --hf-path DIR --tp T --pp P"


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def parse_args(argv: list[str]) -> argparse.Namespace:
    tolerances = "; ".join(f"{dtype}: loss {t['loss']:g}, grad {t['grad']:g}"
                           for dtype, t in TOLERANCES.items())
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=(
            "Pass criteria: every exported tensor bitwise equal to the checkpoint's (cast to "
            "--dtype when the checkpoint is stored in another dtype), none missing "
            "or unexpected; a gradient compared for every HF parameter (fused MoE experts one "
            "by one), none missing or unexpected; and max |loss diff| and max |grad diff| "
            f"(elementwise, over all parameters) within the tolerance of --dtype ({tolerances}). "
            "The HF reference always runs in float32; MoE routers' auxiliary losses are off."
        ),
    )
    parser.add_argument("--hf-path", required=True, help="Hugging Face checkpoint directory")
    parser.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel size")
    parser.add_argument("--pp", type=positive_int, default=1, help="pipeline-parallel size")
    parser.add_argument("--vpp", type=positive_int, default=None,
                        help="model chunks per pipeline rank")
    parser.add_argument("--ep", type=positive_int, default=1,
                        help="expert-parallel size (mixture-of-experts models)")
    parser.add_argument("--dtype", choices=typing.get_args(Dtype), default="float32",
                        help="Megatron parameter dtype (the checkpoint is cast to it)")
    parser.add_argument("--layer-spec", choices=("auto", "te", "local"), default="auto")
    parser.add_argument("--micro-batches", type=positive_int, default=4)
    parser.add_argument("--micro-batch-size", type=positive_int, default=2)
    parser.add_argument("--seq-length", type=positive_int, default=16)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)
    try:
        args.ranks = TorchrunRanks.from_environment(os.environ, command=LAUNCH)
        ModelConfig(hf_path=args.hf_path).check_local()
    except LaunchError as error:
        parser.error(str(error))
    except ConfigError:
        parser.error(f"--hf-path {args.hf_path!r} is not a local directory")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    from mcore_refit import distributed
    from mcore_refit.model import read_model_shape
    from mcore_refit.verify import verify_layout

    parallel = ParallelConfig(tensor=args.tp, pipeline=args.pp, virtual_pipeline=args.vpp,
                              expert=args.ep)
    model_config = ModelConfig(hf_path=args.hf_path, dtype=args.dtype,
                               layer_spec=args.layer_spec)
    # A layout the checkpoint cannot be split into fails here, from its config.json, before the
    # ranks spend their start-up on Megatron (the model build checks it again).
    shape = read_model_shape(args.hf_path)
    parallel.validate_for_model(world_size=args.ranks.world_size, num_layers=shape.num_layers,
                                num_attention_heads=shape.num_attention_heads,
                                num_query_groups=shape.num_query_groups,
                                num_experts=shape.num_experts)
    context = distributed.init_distributed(rank=args.ranks.rank,
                                           world_size=args.ranks.world_size,
                                           local_rank=args.ranks.local_rank)
    try:
        report = verify_layout(model_config, parallel, device=context.device, seed=args.seed,
                               num_micro_batches=args.micro_batches,
                               micro_batch_size=args.micro_batch_size,
                               seq_length=args.seq_length)
    finally:
        distributed.shutdown()
    if context.rank == 0:
        verdict = "PASS" if report.passed else "FAIL"
        print(f"verify_export {verdict}: {report.tensors} tensors, "
              f"loss diff {report.loss_max_abs_diff:.3e}, grad diff {report.grad_max_abs_diff:.3e} "
              f"(worst {report.worst_grad}), {report.grads_compared} gradients compared"
              + (f", not compared: {report.grads_missing}" if report.grads_missing else ""),
              file=sys.stderr)
        print(json.dumps(report.as_dict()), flush=True)
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
