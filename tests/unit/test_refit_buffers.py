"""Packing into persistent buffers and unpacking views: bitwise round trips, headers, checksums."""

import pytest
import torch

from mcore_refit.bench.synthetic import SyntheticWeightSource, tiny_mixed_specs
from mcore_refit.refit import TensorDigester, TensorSpec, build_plan, mismatched_names
from mcore_refit.refit.buffers import (
    HEADER_WORDS,
    BufferHeader,
    BufferSlots,
    BufferStatus,
    HeaderWord,
)
from mcore_refit.refit.checksum import buffer_checksum
from mcore_refit.refit.source import SourceReader
from tests.tensors import bits

CPU = torch.device("cpu")



def mixed_named_tensors():
    """fp32/bf16/fp16/int64, 0-dim, empty, non-contiguous (transposed and strided)."""
    g = torch.Generator().manual_seed(0)
    return [
        ("w32", torch.randn(7, 5, generator=g)),
        ("w16_t", torch.randn(6, 9, generator=g).half().t()),
        ("scalar", torch.tensor(3.25, dtype=torch.bfloat16)),
        ("ids", torch.randint(-2**62, 2**62, (11,), generator=g, dtype=torch.int64)),
        ("strided", torch.randn(4, 20, generator=g).bfloat16()[:, ::3]),
        ("empty", torch.zeros(0, 3)),
        ("nan_bits", torch.tensor([float("nan"), -0.0, float("inf")], dtype=torch.bfloat16)),
        ("big", torch.randn(300, generator=g)),  # 1200 bytes: larger than a 1024-byte buffer
    ]


@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("num_slots", [1, 2, 3])
@pytest.mark.parametrize("buffer_bytes", [1024, 4096])
def test_pack_unpack_round_trip_is_bitwise(num_slots, buffer_bytes, batched):
    named = mixed_named_tensors()
    specs = [TensorSpec.of(n, t) for n, t in named]
    plan = build_plan(specs, slot_bytes=buffer_bytes, num_slots=num_slots)
    slots = BufferSlots.allocate(plan, CPU)
    assert [s.numel() for s in slots.slots] == [plan.slot_capacity(i)
                                                for i in range(plan.num_held_slots)]
    storages = [s.data_ptr() for s in slots.slots]
    reader = SourceReader(plan, iter(named))
    received = {}
    for buffer in plan.buffers:
        slots.pack_from(buffer.index, reader, batched=batched)
        # Views are zero-copy: they live inside the buffer's slot.
        slot = slots.slot_of(buffer.index)
        for spec, view in slots.entries(buffer.index):
            if view.numel():
                assert slot.data_ptr() <= view.data_ptr() < slot.data_ptr() + slot.numel()
            received[spec.name] = view.clone()  # the slot is reused by later buffers
    assert [s.data_ptr() for s in slots.slots] == storages  # nothing reallocated
    assert reader.extra() is None
    assert list(received) == [n for n, _ in named]
    for name, tensor in named:
        assert received[name].shape == tensor.shape and received[name].dtype == tensor.dtype
        assert torch.equal(bits(received[name]), bits(tensor)), name
    if buffer_bytes == 1024:
        big = next(b for b in plan.buffers if plan.names[b.first_tensor] == "big")
        assert big.oversized and big.num_tensors == 1


def test_source_reader_rejects_drift_from_the_plan():
    named = mixed_named_tensors()
    plan = build_plan([TensorSpec.of(n, t) for n, t in named], slot_bytes=4096, num_slots=2)
    slots = BufferSlots.allocate(plan, CPU)
    wrong_name = [("other", named[0][1])] + named[1:]
    with pytest.raises(ValueError, match=r"yielded 'other' \(7, 5\) torch.float32 at position "
                                         r"0, the refit plan expects 'w32' \(7, 5\)"):
        slots.pack_from(0, SourceReader(plan, iter(wrong_name)), batched=False)
    wrong_dtype = [("w32", named[0][1].double())] + named[1:]
    with pytest.raises(ValueError, match="torch.float64 at position 0"):
        slots.pack_from(0, SourceReader(plan, iter(wrong_dtype)), batched=True)
    with pytest.raises(ValueError,
                       match="the weight source ended before .*position 2 of the refit plan"):
        slots.pack_from(0, SourceReader(plan, iter(named[:2])), batched=False)
    reader = SourceReader(plan, iter(named + [("surplus", torch.zeros(1))]))
    for buffer in plan.buffers:
        slots.pack_from(buffer.index, reader, batched=True)
    assert reader.extra() == "surplus"


def test_unbatched_packing_honours_the_source_contract():
    """A source may overwrite a yielded tensor once the next item is requested."""
    scratch = torch.zeros(16)

    def reusing_source():
        for i in range(6):
            scratch.fill_(float(i))  # legal: the previous tensor is no longer valid
            yield f"t{i}", scratch

    plan = build_plan([TensorSpec(f"t{i}", (16,), torch.float32) for i in range(6)],
                      slot_bytes=4096, num_slots=1)
    assert plan.num_buffers == 1
    slots = BufferSlots.allocate(plan, CPU)
    slots.pack_from(0, SourceReader(plan, reusing_source()), batched=False)
    assert [float(v[0]) for v in slots.tensor_views(0)] == [0, 1, 2, 3, 4, 5]
    slots.pack_from(0, SourceReader(plan, reusing_source()), batched=True)  # contract broken
    assert [float(v[0]) for v in slots.tensor_views(0)] == [5] * 6


def test_pack_detaches_from_autograd():
    weight = torch.nn.Parameter(torch.randn(4, 4))
    plan = build_plan([TensorSpec.of("w", weight)], slot_bytes=1024, num_slots=1)
    slots = BufferSlots.allocate(plan, CPU)
    slots.pack(0, [weight])
    assert not slots.slots[0].requires_grad and slots.tensor_views(0)[0].grad_fn is None
    assert torch.equal(slots.tensor_views(0)[0], weight.detach())


def test_header_round_trip_and_rejections():
    plan = build_plan(tiny_mixed_specs(), slot_bytes=2048, num_slots=2)
    header = BufferHeader(refit_index=7, buffer_index=1, status=BufferStatus.OK,
                          wire_bytes=plan.buffers[1].wire_bytes,
                          fingerprint_word=plan.fingerprint_words[0], checksum=-5)
    words = header.to_words()
    assert len(words) == HEADER_WORDS
    again = BufferHeader.from_words(words)
    assert again == header
    again.check_expected(plan=plan, refit_index=7, buffer_index=1)
    with pytest.raises(ValueError, match=r"= \(7, 1, .*expected \(8, 1,"):
        again.check_expected(plan=plan, refit_index=8, buffer_index=1)
    with pytest.raises(ValueError, match="no valid magic word"):
        BufferHeader.from_words([0] * HEADER_WORDS)
    bad_status = list(words)
    bad_status[HeaderWord.STATUS] = 9
    with pytest.raises(ValueError, match="unknown status 9"):
        BufferHeader.from_words(bad_status)
    no_checksum = BufferHeader(refit_index=0, buffer_index=0, status=BufferStatus.ABORTED,
                               wire_bytes=0, fingerprint_word=0)
    assert BufferHeader.from_words(no_checksum.to_words()).checksum is None


def test_buffer_checksum_is_exact_and_sensitive():
    source = SyntheticWeightSource(tiny_mixed_specs(), device=CPU, seed=3)
    plan = build_plan(source.weight_specs(), slot_bytes=1 << 16, num_slots=1)
    slots = BufferSlots.allocate(plan, CPU)
    slots.pack(0, [t for _, t in source.iter_weights()])
    out = torch.zeros((), dtype=torch.int64)
    buffer_checksum(slots.payload_words(0), out=out)
    words = slots.payload_words(0)
    expected = sum(int(w) for w in words.tolist()) % 2**64
    assert int(out) % 2**64 == expected  # wrap-around int64 sum, no float rounding
    words.view(torch.uint8)[5] ^= 1  # one flipped bit
    flipped = torch.zeros((), dtype=torch.int64)
    buffer_checksum(words, out=flipped)
    assert int(flipped) != int(out)


def test_tensor_digest_is_exact_and_position_sensitive():
    digester = TensorDigester(CPU, block_words=16)
    x = torch.randn(1000, generator=torch.Generator().manual_seed(1)).bfloat16()
    assert torch.equal(digester.digest(x), digester.digest(x.clone()))
    swapped = x.clone()
    swapped[[3, 900]] = swapped[[900, 3]]  # same multiset of values, different positions
    assert not torch.equal(digester.digest(x), digester.digest(swapped))
    swapped_in_block = x.clone().view(torch.int64)
    swapped_in_block[[0, 1]] = swapped_in_block[[1, 0]]
    assert not torch.equal(digester.digest(x), digester.digest(swapped_in_block.view(x.dtype)))
    # Odd byte counts, 0-dim, empty, non-contiguous and unaligned views all digest.
    odd = torch.arange(7, dtype=torch.uint8)
    for tensor in (odd, odd[1:], torch.tensor(2.0), torch.zeros(0), x.view(10, 100).t()):
        assert torch.equal(digester.digest(tensor), digester.digest(tensor.clone()))
    table = digester.table([x, swapped])
    assert mismatched_names(["a", "b"], table, digester.table([x, x])) == ["b"]


def test_pieces_pack_from_runs_and_load_into_their_regions():
    """A tensor sent in two pieces (two TP shards), one made of runs that lie apart in its
    parameter (like the query rows of a fused QKV shard): packed without an intermediate copy,
    loaded into the right rows, checked against the plan."""
    from mcore_refit.refit import Piecewise, Region, TensorDictEngine
    from mcore_refit.refit.engines import load_into

    full = torch.arange(8 * 3, dtype=torch.float32).view(8, 3)
    fused = torch.cat([full[0:2], torch.full((1, 3), -1.0), full[2:4]])  # rows 0-1, junk, 2-3
    first = Piecewise(shape=(4, 3), dtype=torch.float32, dim=0, offsets=[0, 2],
                      runs=[fused[0:2], fused[3:5]])
    specs = [TensorSpec("w", (4, 3), torch.float32, region=Region(dim=0, start=0, full=8)),
             TensorSpec("w", (4, 3), torch.float32, region=Region(dim=0, start=4, full=8))]
    plan = build_plan(specs, slot_bytes=4096, num_slots=1)
    engine = TensorDictEngine.from_specs(specs, device=CPU)
    assert engine.get_weight("w").shape == (8, 3)
    for batched in (False, True):
        engine.get_weight("w").zero_()
        slots = BufferSlots.allocate(plan, CPU)
        slots.pack_from(0, SourceReader(plan, iter([("w", first), ("w", full[4:8])])),
                        batched=batched)
        load_into(engine, slots.entries(0))
        assert torch.equal(engine.get_weight("w"), full), batched
    with pytest.raises(ValueError, match=r"weight 'w': received a piece \(4, 2\)"):
        engine.load_weight_pieces([("w", torch.zeros(4, 2), specs[0].region)])
    with pytest.raises(ValueError, match="the pieces of 'w' cover 4 of its 8 along dim 0"):
        build_plan(specs[:1], slot_bytes=4096, num_slots=1)


def test_packed_offsets_start_every_tensor_at_the_alignment_and_views_hold_them_apart():
    from mcore_refit.refit import packed_offsets, typed_view

    layout = [((3, 5), torch.float32), ((), torch.bfloat16), ((0, 4), torch.float32),
              ((7,), torch.int64)]
    offsets, nbytes = packed_offsets(layout, alignment=64)
    # 60 bytes, 2 bytes, nothing, 56 bytes: each rounded up to 64 (the empty one takes none).
    assert (offsets, nbytes) == ([0, 64, 128, 128], 192)
    memory = torch.zeros(nbytes, dtype=torch.uint8)
    views = [typed_view(memory, offset, shape, dtype)
             for (shape, dtype), offset in zip(layout, offsets, strict=True)]
    assert [(tuple(v.shape), v.dtype) for v in views] == [(s, d) for s, d in layout]
    for value, view in enumerate(views, start=1):
        view.fill_(value)
    assert views[0].eq(1).all() and views[1].item() == 2 and views[3].eq(4).all()
