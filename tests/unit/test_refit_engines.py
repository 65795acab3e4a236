"""Engine adapters (copy by name, checked) and the engine-side control surface.

One test refits a real Hugging Face model through the colocated transport, with the engine end
in a thread of this process (shared-memory buffers): the model's parameters and its logits must
equal those of the trainer-side model afterwards.
"""

import threading

import pytest
import torch

from mcore_refit.bench.synthetic import TensorListSource
from mcore_refit.refit import (
    ColocatedInitInfo,
    ColocatedSender,
    HFModelEngine,
    LocalSource,
    NamedTensorEngine,
    NonColocatedInitInfo,
    Placement,
    PlanConfig,
    Refitter,
    TransportOptions,
    WeightTransferEndpoint,
    init_info_from_dict,
    plan_for_source,
)

CPU = torch.device("cpu")


def test_named_engine_copies_and_checks():
    targets = {"a": torch.zeros(2, 3), "b": torch.zeros(4, dtype=torch.bfloat16)}
    engine = NamedTensorEngine(targets, description="the test engine")
    a, b = torch.randn(3, 2).t(), torch.randn(4).bfloat16()
    engine.load_weights([("a", a), ("b", b)])
    assert torch.equal(targets["a"], a) and torch.equal(targets["b"], b)
    assert engine.get_weight("a") is not a and torch.equal(engine.get_weight("a"), a)
    before = {k: v.clone() for k, v in targets.items()}
    with pytest.raises(ValueError) as error:
        engine.load_weights([("a", a + 1), ("c", b)])
    assert str(error.value) == ("unknown weight name 'c': the test engine has no parameter or "
                                "buffer of that name")
    assert torch.equal(targets["a"], before["a"])  # validated before any copy
    with pytest.raises(ValueError) as error:
        engine.load_weights([("b", b.float())])
    assert str(error.value) == ("weight 'b': received (4,) torch.float32, the test engine holds "
                                "(4,) torch.bfloat16")
    with pytest.raises(ValueError, match=r"weight 'a': received \(3, 2\)"):
        engine.load_weights([("a", a.t())])
    with pytest.raises(ValueError, match="unknown weight name 'zz' in the test engine"):
        engine.get_weight("zz")


def _tiny_llama(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                         tie_word_embeddings=True)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


@pytest.mark.timeout(120)
def test_refit_into_a_hugging_face_model_over_the_colocated_transport(ipc_dir):
    trained, serving = _tiny_llama(seed=1), _tiny_llama(seed=2)
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert not torch.equal(trained(tokens).logits, serving(tokens).logits)
    # The export a trainer would produce: every state-dict name, tied lm_head included.
    source = LocalSource(TensorListSource(list(trained.state_dict().items())))
    options = TransportOptions(checksums=True, timeout_s=10, start_timeout_s=30, ipc_dir=ipc_dir)
    plan = plan_for_source(source, config=PlanConfig(slot_bytes=16384, num_slots=2), device=CPU)
    sender = ColocatedSender(plan=plan, device=CPU, options=options, cpu_device_id="hf-engine-test")
    engine = HFModelEngine(serving)
    outcome = {}

    def serve():
        with WeightTransferEndpoint(engine=engine, device=CPU, options=options) as endpoint:
            endpoint.init_weight_transfer_engine(ColocatedInitInfo(address=sender.address))
            endpoint.start_weight_update()
            outcome["telemetry"] = endpoint.update_weights()
            endpoint.finish_weight_update(weight_version=7)
            outcome["version"] = endpoint.weight_version

    thread = threading.Thread(target=serve)
    thread.start()
    with Refitter(source=source, sender=sender) as refitter:
        refitter.prepare()
        telemetry = refitter.refit(verify=True)
    thread.join(30)
    assert telemetry.verified is True and outcome["telemetry"].verified is True
    assert outcome["version"] == 7
    assert "lm_head.weight" in plan.names and "model.embed_tokens.weight" in plan.names
    for name, tensor in trained.state_dict().items():
        assert torch.equal(serving.state_dict()[name], tensor), name
    with torch.no_grad():
        assert torch.equal(trained(tokens).logits, serving(tokens).logits)


def test_endpoint_call_order_is_enforced():
    endpoint = WeightTransferEndpoint(engine=NamedTensorEngine({}, description="e"), device=CPU,
                                      options=TransportOptions())
    with pytest.raises(RuntimeError, match="call init_weight_transfer_engine before"):
        endpoint.start_weight_update()
    with pytest.raises(RuntimeError, match="call start_weight_update before update_weights"):
        endpoint.update_weights()
    with pytest.raises(RuntimeError, match="finish_weight_update without start_weight_update"):
        endpoint.finish_weight_update(1)
    assert endpoint.weight_version is None


@pytest.mark.parametrize("data, message", [
    ({"transport": "nccl"}, "init_info.transport must be one of 'colocated', 'colocated_weights' "
                            "(the non_colocated transport takes a "
                            "NonColocatedInitInfo), got 'nccl'"),
    ({"transport": "colocated"}, "init_info for transport 'colocated' lacks 'address'"),
    ({"transport": "colocated", "address": "tcp://x"},
     "init_info.address must be an ipc:// address, got 'tcp://x'"),
    ({"transport": "colocated", "address": "ipc:///x", "port": 1},
     "unknown init_info key 'port' for transport 'colocated' (known: address)"),
])
def test_init_info_parsing(data, message):
    with pytest.raises(ValueError) as error:
        init_info_from_dict(data)
    assert str(error.value) == message


def test_init_info_parsing_ok_and_broadcast_info_checks_its_rank():
    assert init_info_from_dict({"transport": "colocated", "address": "ipc:///a/b.sock"}) == \
        ColocatedInitInfo(address="ipc:///a/b.sock")
    placement = Placement(num_trainers=2, num_receivers=1)
    with pytest.raises(ValueError) as error:
        NonColocatedInitInfo(placement=placement, receiver=1, control=None)
    assert str(error.value) == ("init_info.receiver=1 is not an inference rank of the placement "
                                "(1 inference ranks)")
