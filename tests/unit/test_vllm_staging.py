"""RefitStaging: whole tensors assembled from a refit's buffers, outliving every slot."""

import weakref

import pytest
import torch

from mcore_refit.inference.vllm.staging import RefitStaging
from mcore_refit.refit import Region, TensorSpec, build_plan
from tests.tensors import bits

CPU = torch.device("cpu")


def _plan():
    # "w" in two row pieces from two sources (tensor parallelism), "b" whole, bf16 "e" whole.
    specs = [TensorSpec("w", (2, 3), torch.float32, region=Region(dim=0, start=0, full=4)),
             TensorSpec("w", (2, 3), torch.float32, region=Region(dim=0, start=2, full=4)),
             TensorSpec("b", (5,), torch.float32),
             TensorSpec("e", (3, 2), torch.bfloat16)]
    return build_plan(specs, slot_bytes=4096, num_slots=2, sources=[0, 1, 0, 1])


def test_vllm_staging_assembles_pieces_and_hands_out_whole_tensors_once_complete():
    staging = RefitStaging(_plan(), CPU)
    full = torch.arange(12, dtype=torch.float32).view(4, 3)
    for refit in range(2):
        staging.begin()
        assert not staging.complete
        slot = full + refit  # what a slot holds; it is overwritten after the call
        assert staging.put_pieces([("w", slot[2:], Region(dim=0, start=2, full=4))]) == []
        slot.zero_()
        whole = staging.put([("b", torch.ones(5)), ("e", torch.ones(3, 2, dtype=torch.bfloat16))])
        assert [name for name, _ in whole] == ["b", "e"] and not staging.complete
        ((name, tensor),) = staging.put_pieces([("w", (full + refit)[:2],
                                                 Region(dim=0, start=0, full=4))])
        assert name == "w" and staging.complete
        assert torch.equal(bits(tensor), bits(full + refit))  # the zeroed slot did not leak in
        assert tensor.data_ptr() == staging.tensor("w").data_ptr()


def test_vllm_staging_refuses_what_the_plan_does_not_send():
    staging = RefitStaging(_plan(), CPU)
    staging.begin()
    with pytest.raises(ValueError, match="unknown weight name 'x': the refit's staging has no"):
        staging.put([("x", torch.ones(5))])
    with pytest.raises(ValueError, match=r"weight 'b': received \(4,\) torch.float32, the "
                                         r"refit's staging holds \(5,\) torch.float32"):
        staging.put([("b", torch.ones(4))])
    with pytest.raises(ValueError, match="weight 'w': received a piece"):
        staging.put_pieces([("w", torch.ones(3, 3), Region(dim=0, start=2, full=4))])
    staging.put([("b", torch.ones(5))])
    with pytest.raises(ValueError, match="'b' arrived more often than the plan sends it"):
        staging.put([("b", torch.ones(5))])


def test_vllm_staging_refers_to_tensors_that_outlive_the_refit_and_copies_only_pieces():
    plan = _plan()
    staging = RefitStaging(plan, CPU, copied=plan.piecewise_names)
    assert plan.piecewise_names == {"w"}
    assert staging.nbytes == 64 < RefitStaging(plan, CPU).nbytes  # "w" only (48 bytes, aligned)
    b, e = torch.ones(5), torch.ones(3, 2, dtype=torch.bfloat16)
    staging.begin()
    whole = staging.refer([("b", b), ("e", e)])
    assert [(name, tensor.data_ptr()) for name, tensor in whole] == [("b", b.data_ptr()),
                                                                     ("e", e.data_ptr())]
    assert not staging.complete
    staging.put_pieces([("w", torch.ones(2, 3), Region(dim=0, start=0, full=4)),
                        ("w", torch.ones(2, 3), Region(dim=0, start=2, full=4))])
    assert staging.complete and staging.tensor("b") is b
    with pytest.raises(ValueError, match="unknown weight name 'b': the refit's staging has no"):
        staging.put([("b", b)])  # not copied here
    with pytest.raises(ValueError, match=r"weight 'e': received \(2, 3\) torch.bfloat16, the "
                                         r"refit's plan has \(3, 2\) torch.bfloat16"):
        staging.refer([("e", e.view(2, 3))])
    with pytest.raises(ValueError, match="unknown weight name 'x': the refit's plan has no"):
        staging.refer([("x", b)])
    kept = weakref.ref(b)
    del b, whole
    staging.begin()  # the next refit lets the last one's tensors go
    assert kept() is None
    with pytest.raises(ValueError, match="'e' arrived more often than the plan sends it"):
        staging.refer([("e", e), ("e", e)])
