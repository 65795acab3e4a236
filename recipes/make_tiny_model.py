"""Write a tiny random-weight Hugging Face checkpoint (with tokenizer) for demos and smoke runs.

    python recipes/make_tiny_model.py OUT_DIR [--arch llama|qwen2|qwen3_moe|gemma2] [--layers 8]
        [--tie] [--dtype D] [--experts 8 --experts-per-token 2]
"""

from __future__ import annotations

import argparse
import sys

from mcore_refit.tiny import TinyModelSpec, write_tiny_checkpoint


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--arch", choices=("llama", "qwen2", "qwen3_moe", "gemma2"),
                        default="llama")
    parser.add_argument("--layers", type=int, default=8)
    # 128 / 4 heads: heads of size 32, the smallest vLLM's CPU attention kernels take.
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=128)
    parser.add_argument("--tie", action="store_true", help="tie input and output embeddings")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--experts", type=int, default=8, help="qwen3_moe: experts per layer")
    parser.add_argument("--experts-per-token", type=int, default=2,
                        help="qwen3_moe: experts each token is routed to")
    parser.add_argument("--moe-intermediate-size", type=int, default=None,
                        help="qwen3_moe: each expert's MLP width (default: hidden size / 2)")
    args = parser.parse_args(argv)
    spec = TinyModelSpec(architecture=args.arch, num_layers=args.layers,
                         hidden_size=args.hidden_size, intermediate_size=2 * args.hidden_size,
                         num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                         vocab_size=args.vocab_size,
                         tie_word_embeddings=args.tie, dtype=args.dtype, seed=args.seed,
                         num_experts=args.experts, num_experts_per_token=args.experts_per_token,
                         moe_intermediate_size=(args.moe_intermediate_size
                                                if args.moe_intermediate_size is not None
                                                else args.hidden_size // 2))
    # Writing a tiny checkpoint takes a moment: no "Writing model shards" bar from transformers.
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    path = write_tiny_checkpoint(args.out_dir, spec)
    print(f"wrote {spec.architecture} tiny checkpoint ({spec.num_layers} layers) to {path}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except ValueError as error:  # a refused directory or size: the message says which
        sys.exit(f"make_tiny_model.py: error: {error}")
