"""What the tests' fork server imports once (``tests.ranks.process_context``): torch, the library,
Megatron-Core with this machine's compatibility patches, and Megatron-Bridge with the bridges of
the tests' tiny models. A rank forked from it skips ~10-15 s of CPU for these imports. What the
imports print (Megatron-Core's warnings that transformer-engine and apex are absent) stays off
the terminal."""

from mcore_refit.logs import output_to_log

with output_to_log("the tests' fork server imports"):
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401
    import zmq  # noqa: F401

    import mcore_refit.bench.synthetic  # noqa: F401
    import mcore_refit.control  # noqa: F401
    import mcore_refit.distributed  # noqa: F401
    import mcore_refit.model  # noqa: F401
    import mcore_refit.refit  # noqa: F401
    from mcore_refit import compat

    for _architecture in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3MoeForCausalLM"):
        compat.import_auto_bridge(_architecture)
