"""Refit plan layout: order, alignment, buffer boundaries, oversized tensors, fingerprint."""

import json

import pytest
import torch

from mcore_refit.bench.synthetic import synthetic_specs
from mcore_refit.refit import TensorSpec, build_plan, plan_from_json
from mcore_refit.refit.plan import HEADER_BYTES


def spec(name, shape, dtype=torch.float32):
    return TensorSpec(name, tuple(shape), dtype)


def test_layout_packs_in_order_with_aligned_offsets():
    specs = [spec("a", (3,)), spec("b", (5,), torch.bfloat16), spec("c", ()),
             spec("d", (0, 7)), spec("e", (10,), torch.int64)]
    plan = build_plan(specs, slot_bytes=1024, num_slots=2, alignment_bytes=64)
    assert plan.payload_offset == 64  # the 64-byte header rounded up to the alignment
    assert [t.spec.name for t in plan.tensors] == ["a", "b", "c", "d", "e"]
    assert [t.offset_bytes for t in plan.tensors] == [64, 128, 192, 256, 256]
    assert [t.buffer_index for t in plan.tensors] == [0] * 5
    (only,) = plan.buffers
    assert (only.first_tensor, only.stop_tensor, only.slot, only.oversized) == (0, 5, 0, False)
    assert only.wire_bytes == 384  # e ends at 256 + 80 = 336, rounded up to 64
    assert plan.payload_bytes == 12 + 10 + 4 + 0 + 80


def test_buffers_split_at_capacity_and_slots_round_robin():
    # 256-byte payload room per 512-byte buffer (256 header after alignment); 200-byte tensors.
    specs = [spec(f"t{i}", (50,)) for i in range(5)]
    plan = build_plan(specs, slot_bytes=512, num_slots=2, alignment_bytes=256)
    assert [b.num_tensors for b in plan.buffers] == [1, 1, 1, 1, 1]
    assert [b.slot for b in plan.buffers] == [0, 1, 0, 1, 0]
    assert all(b.wire_bytes <= 512 for b in plan.buffers)
    plan3 = build_plan(specs, slot_bytes=1024, num_slots=3, alignment_bytes=256)
    assert [b.num_tensors for b in plan3.buffers] == [3, 2]  # offsets 256, 512, 768
    assert [b.slot for b in plan3.buffers] == [0, 1]


def test_oversized_tensor_travels_alone_in_the_extra_slot():
    specs = [spec("small0", (8,)), spec("huge", (1000,)), spec("small1", (8,)),
             spec("huge2", (600,)), spec("small2", (8,))]
    plan = build_plan(specs, slot_bytes=1024, num_slots=2, alignment_bytes=256)
    layout = [(b.first_tensor, b.stop_tensor, b.slot, b.oversized) for b in plan.buffers]
    assert layout == [(0, 1, 0, False), (1, 2, 2, True), (2, 3, 1, False), (3, 4, 2, True),
                      (4, 5, 0, False)]
    assert plan.buffers[1].wire_bytes == 256 + 4000 + 96  # header + tensor, aligned up
    assert plan.oversized_slot_bytes == 4352
    assert plan.num_held_slots == 3
    assert [plan.slot_capacity(s) for s in range(3)] == [1024, 1024, 4352]
    assert plan.held_bytes == 2 * 1024 + 4352
    assert plan.largest_tensor_bytes == 4000


def test_a_slot_per_buffer_only_when_no_slot_serves_two_buffers_of_a_refit():
    specs = [spec(f"t{i}", (50,)) for i in range(5)]  # one 200-byte tensor per 512-byte buffer
    assert not build_plan(specs, slot_bytes=512, num_slots=2, alignment_bytes=256).slot_per_buffer
    assert build_plan(specs, slot_bytes=512, num_slots=5, alignment_bytes=256).slot_per_buffer
    # Sources fill their own slots: 3 buffers from rank 0 and 2 from rank 1 need 5 on receivers.
    two_sources = build_plan(specs, slot_bytes=512, num_slots=3, alignment_bytes=256,
                             sources=[0, 0, 0, 1, 1])
    assert not two_sources.slot_per_buffer
    # Oversized buffers share the one extra slot.
    big = [spec("small", (8,)), spec("huge", (1000,)), spec("huge2", (600,))]
    assert build_plan(big[:2], slot_bytes=1024, num_slots=1, alignment_bytes=256).slot_per_buffer
    assert not build_plan(big, slot_bytes=1024, num_slots=4, alignment_bytes=256).slot_per_buffer


def test_no_oversized_slot_when_everything_fits():
    plan = build_plan([spec("a", (4,))], slot_bytes=1024, num_slots=3)
    assert plan.num_held_slots == 3 and plan.oversized_slot_bytes == 0


def test_real_model_shapes():
    dense = build_plan(synthetic_specs("dense_8b"), slot_bytes=1 << 30, num_slots=2)
    assert dense.num_tensors == 291
    assert dense.payload_bytes == 16_060_522_496
    assert dense.num_held_slots == 2  # the 1.05 GB embedding still fits in 1 GiB
    moe = build_plan(synthetic_specs("moe_30b_a3b"), slot_bytes=1 << 30, num_slots=2)
    assert moe.num_tensors == 18_867
    assert round(moe.payload_bytes / 1e9, 1) == 61.1
    for plan in (dense, moe):
        for t in plan.tensors:
            buffer = plan.buffers[t.buffer_index]
            assert t.offset_bytes % 256 == 0
            assert t.offset_bytes + t.spec.num_bytes <= buffer.wire_bytes <= plan.slot_bytes


def test_fingerprint_covers_names_shapes_dtypes_and_layout():
    specs = [spec("a", (4, 4)), spec("b", (8,), torch.bfloat16)]
    base = build_plan(specs, slot_bytes=1024, num_slots=2)
    assert base.fingerprint == build_plan(list(specs), slot_bytes=1024, num_slots=2).fingerprint
    variants = [
        build_plan([spec("A", (4, 4)), specs[1]], slot_bytes=1024, num_slots=2),
        build_plan([spec("a", (2, 8)), specs[1]], slot_bytes=1024, num_slots=2),
        build_plan([spec("a", (4, 4), torch.float16), specs[1]], slot_bytes=1024, num_slots=2),
        build_plan(specs[::-1], slot_bytes=1024, num_slots=2),
        build_plan(specs, slot_bytes=2048, num_slots=2),
        build_plan(specs, slot_bytes=1024, num_slots=3),
        build_plan(specs, slot_bytes=1024, num_slots=2, alignment_bytes=128),
    ]
    prints = {base.fingerprint, *(v.fingerprint for v in variants)}
    assert len(prints) == 1 + len(variants)
    assert base == build_plan(specs, slot_bytes=1024, num_slots=2)
    assert base != variants[0]


def test_json_round_trip_and_tampering():
    plan = build_plan([spec("a", (4, 4)), spec("b", (), torch.int64)], slot_bytes=1024,
                      num_slots=2)
    again = plan_from_json(plan.to_json())
    assert again == plan and again.fingerprint == plan.fingerprint
    data = json.loads(plan.to_json())
    data["specs"][0][1] = [2, 8]
    with pytest.raises(ValueError, match="does not match its content"):
        plan_from_json(json.dumps(data))
    data = json.loads(plan.to_json())
    data["version"] = 99
    with pytest.raises(ValueError, match="plan format version 99"):
        plan_from_json(json.dumps(data))
    with pytest.raises(ValueError, match="malformed refit plan"):
        plan_from_json("{}")
    data = json.loads(plan.to_json())
    data["specs"][1][2] = "os.system"
    with pytest.raises(ValueError, match="unknown dtype name 'os.system'"):
        plan_from_json(json.dumps(data))


@pytest.mark.parametrize("specs, kwargs, message", [
    ([], {}, "a refit plan needs at least one tensor; the weight source is empty"),
    ([spec("a", (1,)), spec("a", (2,))], {}, "tensor name 'a' appears twice in the weight source"),
    ([spec("a", (1,))], {"slot_bytes": 1000},
     "slot_bytes=1000 must be a multiple of alignment_bytes=256 and larger than the 64-byte "
     "header"),
    ([spec("a", (1,))], {"slot_bytes": 256},
     "slot_bytes=256 must be a multiple of alignment_bytes=256 and larger than the 64-byte "
     "header"),
    ([spec("a", (1,))], {"alignment_bytes": 100},
     "alignment_bytes must be a power of two ≥ 16, got 100"),
    ([spec("a", (1,))], {"num_slots": 0}, "num_slots must be ≥ 1, got 0"),
])
def test_invalid_plans(specs, kwargs, message):
    args = {"slot_bytes": 1024, "num_slots": 2, **kwargs}
    with pytest.raises(ValueError) as error:
        build_plan(specs, **args)
    assert str(error.value) == message


def test_header_constant_matches_the_buffer_header():
    from mcore_refit.refit.buffers import HEADER_WORDS

    assert HEADER_BYTES == HEADER_WORDS * 8


def test_sources_interleave_round_robin_and_keep_their_order():
    # Source 1's tensors first in the input; every buffer holds one source's tensors only.
    specs = [spec(f"s{i % 2}_{i}", (50,)) for i in range(8)]
    sources = [1 if name.startswith("s1") else 0 for name in (s.name for s in specs)]
    plan = build_plan(specs, slot_bytes=512, num_slots=2, alignment_bytes=256, sources=sources)
    assert [b.source for b in plan.buffers] == [0, 1, 0, 1, 0, 1, 0, 1]
    assert plan.sources == (0, 1)
    for source in (0, 1):
        own = [t.spec.name for t in plan.tensors if plan.buffers[t.buffer_index].source == source]
        assert own == [s.name for s, o in zip(specs, sources, strict=True) if o == source]
    # Slots round-robin per source on the source, over all buffers on receivers.
    assert [b.slot for b in plan.buffers] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [b.receiver_slot for b in plan.buffers] == [0, 1, 0, 1, 0, 1, 0, 1]
    assert plan.buffers_from(1) == tuple(b for b in plan.buffers if b.source == 1)
    assert plan.tensor_sources() == [plan.buffers[t.buffer_index].source for t in plan.tensors]


def test_uneven_sources_and_the_fingerprint_covers_them():
    specs = [spec(f"t{i}", (50,)) for i in range(5)]
    lopsided = build_plan(specs, slot_bytes=512, num_slots=2, alignment_bytes=256,
                          sources=[0, 0, 0, 0, 1])
    assert [b.source for b in lopsided.buffers] == [0, 1, 0, 0, 0]
    moved = build_plan(specs, slot_bytes=512, num_slots=2, alignment_bytes=256,
                       sources=[0, 0, 0, 1, 1])
    assert moved.fingerprint != lopsided.fingerprint
    again = plan_from_json(lopsided.to_json())
    assert again == lopsided and again.tensor_sources() == lopsided.tensor_sources()
    with pytest.raises(ValueError, match="2 sources for 5 tensors"):
        build_plan(specs, slot_bytes=512, num_slots=2, sources=[0, 1])
