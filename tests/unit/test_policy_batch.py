"""Policy pieces that need no process group: micro-batches, losses, offload, reference weights."""

from __future__ import annotations

import pytest
import torch

from mcore_refit.losses import (
    CrossEntropyLoss,
    PolicyGradientInputs,
    PolicyGradientLoss,
    VanillaPolicyGradientLoss,
    check_loss_inputs,
)
from mcore_refit.policy.batch import SequenceBatch, build_micro_batches, scatter_rows
from mcore_refit.policy.offload import HostOffloader
from mcore_refit.policy.reference import ReferenceWeights

CPU = torch.device("cpu")


def _batch(**overrides) -> SequenceBatch:
    tokens = torch.arange(1, 4 * 6 + 1).reshape(4, 6)
    values = dict(
        tokens=tokens,
        lengths=torch.tensor([6, 2, 4, 3]),
        loss_mask=torch.tensor([[0, 0, 1, 1, 1, 1]] * 4),
        fields={"advantages": torch.tensor([1.0, -2.0, 0.5, 3.0]),
                "old_logprobs": -torch.rand(4, 6, generator=torch.Generator().manual_seed(0))},
    )
    values.update(overrides)
    return SequenceBatch(**values)


def test_micro_batches_share_one_padded_shape():
    batch = _batch()
    micro_batches = build_micro_batches(batch, [(0, 3), (1,)], pad_to_multiple=4, device=CPU)
    assert [tuple(mb["tokens"].shape) for mb in micro_batches] == [(2, 8), (2, 8)]
    first, second = micro_batches
    assert first["tokens"].tolist() == [[1, 2, 3, 4, 5, 6, 0, 0], [19, 20, 21, 0, 0, 0, 0, 0]]
    assert first["labels"].tolist() == [[2, 3, 4, 5, 6, 0, 0, 0], [20, 21, 0, 0, 0, 0, 0, 0]]
    assert first["valid_mask"].tolist() == [[0, 1, 1, 1, 1, 1, 0, 0], [0, 1, 1, 0, 0, 0, 0, 0]]
    assert first["loss_mask"].tolist() == [[0, 0, 1, 1, 1, 1, 0, 0], [0, 0, 1, 0, 0, 0, 0, 0]]
    assert first["position_ids"].tolist() == [list(range(8))] * 2
    assert first["advantages"].tolist() == [1.0, 3.0]
    assert torch.equal(first["old_logprobs"][:, :6], batch.fields["old_logprobs"][[0, 3]])
    assert torch.all(first["old_logprobs"][:, 6:] == 0)
    # A bin with fewer sequences gets all-padding rows that count nowhere.
    assert second["tokens"][1].tolist() == [0] * 8
    assert second["loss_mask"][1].sum() == 0 and second["valid_mask"][1].sum() == 0


def test_default_loss_mask_counts_every_token_but_the_first():
    batch = _batch(loss_mask=None)
    (micro_batch,) = build_micro_batches(batch, [(0, 1, 2, 3)], pad_to_multiple=1, device=CPU)
    assert torch.equal(micro_batch["loss_mask"], micro_batch["valid_mask"])
    assert micro_batch["loss_mask"].sum() == (6 - 1) + (2 - 1) + (4 - 1) + (3 - 1)


def test_scatter_rows_restores_batch_order():
    batch = _batch()
    bins = [(2, 0), (3,), (1,)]
    per_bin = [torch.tensor([[2.0] * 7, [0.0] * 7]), torch.tensor([[3.0] * 7, [9.0] * 7]),
               torch.tensor([[1.0] * 7, [9.0] * 7])]
    out = scatter_rows(per_bin, bins, out=torch.zeros(4, 6))
    assert out[:, 0].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert out.shape == batch.tokens.shape


@pytest.mark.parametrize("overrides, message", [
    (dict(tokens=torch.zeros(4, 6)),
     "tokens must be an integer [num_sequences, max_len] tensor, got torch.float32 (4, 6)"),
    (dict(lengths=torch.tensor([6, 2, 4])), "lengths must have shape (4,), got (3,)"),
    (dict(lengths=torch.tensor([7, 2, 4, 3])), "lengths must lie in [1, 6], got [2, 7]"),
    (dict(lengths=torch.tensor([0, 2, 4, 3])), "lengths must lie in [1, 6], got [0, 4]"),
    (dict(loss_mask=torch.ones(4, 5)),
     "loss_mask must have the shape of tokens (4, 6), got (4, 5)"),
    (dict(fields={"labels": torch.zeros(4)}),
     "batch field 'labels' clashes with a reserved micro-batch key (tokens, labels, "
     "position_ids, attention_mask, valid_mask, loss_mask)"),
    (dict(fields={"advantages": torch.zeros(4, 2)}),
     "batch field 'advantages' must have shape (4,) or (4, 6), got (4, 2)"),
])
def test_bad_batches_are_rejected(overrides, message):
    with pytest.raises(ValueError) as error:
        _batch(**overrides)
    assert str(error.value) == message


def _micro_batch_and_logprobs():
    (micro_batch,) = build_micro_batches(_batch(), [(0, 1, 2, 3)], pad_to_multiple=1, device=CPU)
    logprobs = -torch.rand(4, 6, generator=torch.Generator().manual_seed(1))
    logprobs = torch.where(micro_batch["valid_mask"] > 0, logprobs, 0.0).requires_grad_()
    return micro_batch, logprobs


def test_cross_entropy_sums_over_the_loss_mask():
    micro_batch, logprobs = _micro_batch_and_logprobs()
    output = CrossEntropyLoss()(logprobs, micro_batch)
    mask = micro_batch["loss_mask"]
    assert output.num_tokens.dtype == torch.int32 and int(output.num_tokens) == int(mask.sum())
    assert torch.allclose(output.loss_sum, -(logprobs * mask).sum())
    assert not output.metrics["nll"].requires_grad
    output.loss_sum.backward()
    assert torch.equal(logprobs.grad, -mask)


def test_vanilla_policy_gradient_weights_tokens_by_their_sequence_advantage():
    micro_batch, logprobs = _micro_batch_and_logprobs()
    output = VanillaPolicyGradientLoss()(logprobs, micro_batch)
    advantages = micro_batch["advantages"].unsqueeze(1)
    mask = micro_batch["loss_mask"]
    assert torch.allclose(output.loss_sum, -(advantages * logprobs * mask).sum())
    assert torch.allclose(output.metrics["advantage"], (advantages * mask).sum())
    output.loss_sum.backward()
    assert torch.allclose(logprobs.grad, -advantages * mask)


def test_policy_gradient_interface_passes_old_and_reference_logprobs():
    seen = {}

    class Recording(PolicyGradientLoss):
        metric_names = ("ratio",)

        def per_token_loss(self, inputs: PolicyGradientInputs):
            seen["inputs"] = inputs
            ratio = torch.exp(inputs.logprobs - inputs.old_logprobs)
            return -inputs.advantages * ratio, {"ratio": ratio}

    micro_batch, logprobs = _micro_batch_and_logprobs()
    Recording()(logprobs, micro_batch)
    inputs = seen["inputs"]
    assert inputs.old_logprobs is micro_batch["old_logprobs"]
    assert inputs.ref_logprobs is None
    assert inputs.advantages.shape == (4, 1)


def test_policy_gradient_loss_errors():
    micro_batch, logprobs = _micro_batch_and_logprobs()
    del micro_batch["advantages"]
    with pytest.raises(ValueError, match=r"^VanillaPolicyGradientLoss needs the batch field "
                                         r"'advantages' \(per sequence or per token\)$"):
        VanillaPolicyGradientLoss()(logprobs, micro_batch)

    class Undeclared(PolicyGradientLoss):
        metric_names = ("a",)

        def per_token_loss(self, inputs):
            return -inputs.logprobs, {"b": inputs.logprobs}

    micro_batch, logprobs = _micro_batch_and_logprobs()
    with pytest.raises(ValueError, match=r"^Undeclared.per_token_loss returned metrics \['b'\], "
                                         r"metric_names is \('a',\)$"):
        Undeclared()(logprobs, micro_batch)


def test_offload_empties_storages_and_onload_restores_them():
    flat = torch.randn(10)
    weight = torch.nn.Parameter(flat[:6].view(2, 3))  # a view into a flat buffer, like DDP's
    bias = torch.nn.Parameter(torch.randn(4))
    state = torch.randn(4)
    grads = torch.randn(10)
    grad_view = grads[2:5]
    expected = (weight.detach().clone(), bias.detach().clone(), state.clone())
    offloader = HostOffloader()
    offloader.offload(keep=[weight, bias, flat, state, state], discard=[grads, bias])
    assert offloader.offloaded
    assert offloader.freed_bytes == (10 + 4 + 4 + 10) * 4
    assert all(t.untyped_storage().nbytes() == 0 for t in (weight, bias, flat, state, grad_view))
    with pytest.raises(RuntimeError, match="already offloaded"):
        offloader.offload(keep=[], discard=[])
    host_buffers = list(offloader._host_buffers)

    offloader.onload()
    assert not offloader.offloaded
    assert torch.equal(weight, expected[0]) and torch.equal(bias, expected[1])
    assert torch.equal(state, expected[2])
    assert torch.all(grad_view == 0) and torch.all(grads == 0)
    weight.data.mul_(2)  # the view still aliases the flat buffer
    assert torch.equal(flat[:6], 2 * expected[0].flatten())

    offloader.offload(keep=[weight, bias, flat, state], discard=[grads])
    assert all(a is b for a, b in zip(offloader._host_buffers, host_buffers, strict=True))
    offloader.onload()
    assert torch.equal(weight, 2 * expected[0])
    with pytest.raises(RuntimeError, match="not offloaded"):
        offloader.onload()
    offloader.close()


def test_reference_weights_swap_in_and_back_out():
    model = torch.nn.Linear(3, 2)
    parameters = list(model.parameters())
    reference = ReferenceWeights(parameters)
    initial = [p.detach().clone() for p in parameters]
    with torch.no_grad():
        for p in parameters:
            p.add_(1.0)
    live = [p.data for p in parameters]
    inputs = torch.randn(5, 3)
    with reference.swapped_in():
        assert all(torch.equal(p, q) for p, q in zip(parameters, initial, strict=True))
        reference_out = model(inputs)
    assert all(p.data_ptr() == d.data_ptr() for p, d in zip(parameters, live, strict=True))
    assert torch.allclose(reference_out, torch.nn.functional.linear(inputs, *initial))
    # The copy lives on the host, not on the parameters' device.
    assert all(t.device.type == "cpu" and t.data_ptr() not in {d.data_ptr() for d in live}
               for t in reference._host)

    with pytest.raises(KeyError), reference.swapped_in():
        raise KeyError("failure inside the block")
    assert all(p.data_ptr() == d.data_ptr() for p, d in zip(parameters, live, strict=True))


def test_loss_inputs_are_checked_before_the_pipeline_runs():
    check_loss_inputs(CrossEntropyLoss(), batch_fields=[])
    check_loss_inputs(VanillaPolicyGradientLoss(), batch_fields=["advantages", "old_logprobs"])
    with pytest.raises(ValueError) as error:
        check_loss_inputs(VanillaPolicyGradientLoss(), batch_fields=["old_logprobs"])
    assert str(error.value) == ("VanillaPolicyGradientLoss needs the batch fields "
                                "['advantages']; the batch has ['old_logprobs']")

    class NoNames:
        def __call__(self, logprobs, micro_batch):
            raise AssertionError("not called")

    with pytest.raises(ValueError) as error:
        check_loss_inputs(NoNames(), batch_fields=[])
    assert str(error.value) == ("loss function NoNames must declare metric_names as a tuple of "
                                "str, got None")

    class Clash(CrossEntropyLoss):
        metric_names = ("loss",)

    with pytest.raises(ValueError) as error:
        check_loss_inputs(Clash(), batch_fields=[])
    assert str(error.value) == "Clash.metric_names may not use the reserved names ['loss']"
