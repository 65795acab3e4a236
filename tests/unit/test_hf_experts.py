"""transformers' fused expert tensors under per-expert names: the mapping, and the HF engine
loading a MoE model's per-expert tensors into its fused layout."""

import pytest
import torch

from mcore_refit.hf_experts import expert_slices, expert_views, is_fused
from mcore_refit.refit import HFModelEngine


def tiny_qwen3_moe(seed: int):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=8, num_experts=4, num_experts_per_tok=2, vocab_size=64,
                            mlp_only_layers=[], decoder_sparse_step=1, norm_topk_prob=True)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.02, generator=torch.Generator().manual_seed(seed + param.numel()))
    return model


def test_slices_follow_the_fused_layout():
    gate_up = torch.arange(3 * 4 * 2).float().view(3, 4, 2)  # 3 experts, I = 2, H = 2
    down = torch.arange(3 * 2 * 2).float().view(3, 2, 2)
    views = dict(expert_views([("m.layers.0.mlp.experts.gate_up_proj", gate_up),
                               ("m.layers.0.mlp.experts.down_proj", down),
                               ("m.norm.weight", torch.ones(2))]))
    assert sorted(views) == sorted(
        [f"m.layers.0.mlp.experts.{e}.{p}.weight" for e in range(3)
         for p in ("gate_proj", "up_proj", "down_proj")] + ["m.norm.weight"])
    assert torch.equal(views["m.layers.0.mlp.experts.1.gate_proj.weight"], gate_up[1, :2])
    assert torch.equal(views["m.layers.0.mlp.experts.1.up_proj.weight"], gate_up[1, 2:])
    assert torch.equal(views["m.layers.0.mlp.experts.2.down_proj.weight"], down[2])
    assert views["m.layers.0.mlp.experts.1.up_proj.weight"].data_ptr() == gate_up[1, 2:].data_ptr()
    assert is_fused("a.experts.down_proj") and not is_fused("a.experts.0.down_proj.weight")
    assert expert_slices("a.mlp.down_proj", (4, 2, 2)) == {}
    with pytest.raises(ValueError, match="a fused gate/up projection needs an even row count"):
        expert_slices("a.experts.gate_up_proj", (2, 3, 4))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_engine_loads_per_expert_tensors_into_the_fused_experts():
    trained, serving = tiny_qwen3_moe(seed=1), tiny_qwen3_moe(seed=2)
    tokens = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(0))
    # What the trainer exports: the checkpoint's per-expert names.
    exported = dict(expert_views(trained.state_dict().items()))
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in exported
    assert not any(is_fused(name) for name in exported)
    engine = HFModelEngine(serving)
    # The engine releases its memory and takes it again (colocated): views follow the parameter.
    for param in serving.parameters():
        param.data = torch.empty_like(param.data)
    engine.load_weights(exported.items())
    for name, tensor in trained.state_dict().items():
        assert torch.equal(serving.state_dict()[name], tensor), name
    for name, tensor in exported.items():
        assert torch.equal(engine.get_weight(name), tensor), name
    with torch.no_grad():
        assert torch.equal(trained(tokens).logits, serving(tokens).logits)
    with pytest.raises(ValueError, match="unknown weight name 'model.layers.0.mlp.experts.4.gate"):
        engine.load_weights([("model.layers.0.mlp.experts.4.gate_proj.weight",
                              torch.zeros(16, 32))])
