import gc

import pytest
import torch

from tidal.device import DeviceOps
from tidal.transfer import HostArena, HostSlot
from tests.transfer.fakes import FakeAccelOps, align_up


@pytest.fixture
def arena():
    a = HostArena(DeviceOps("cpu"), alignment_bytes=512)
    yield a
    a.close()


# ---- sizing and layout -----------------------------------------------------------------------
def test_batch_is_exactly_sized_contiguous_and_in_order(arena):
    sizes = [1, 512, 513, 0, 1000, 4096, 7]
    slots = arena.reserve(sizes)
    assert [s.nbytes for s in slots] == sizes
    assert arena.num_chunks == 1
    assert {s.chunk for s in slots} == {0}
    assert arena.reserved_bytes == sum(align_up(n, 512) for n in sizes)
    assert arena.used_bytes == sum(sizes)
    offset = 0
    for s, n in zip(slots, sizes):
        assert s.offset == offset
        offset += align_up(n, 512)
    assert offset == arena.reserved_bytes


@pytest.mark.parametrize("alignment", [1, 2, 64, 512, 4096])
def test_offsets_are_aligned_and_reserved_is_exact(alignment):
    a = HostArena(DeviceOps("cpu"), alignment_bytes=alignment)
    assert a.alignment_bytes == alignment
    sizes = [3, 100, 1, 4097, 65]
    slots = a.reserve(sizes)
    assert all(s.offset % alignment == 0 for s in slots)
    assert a.reserved_bytes == sum(align_up(n, alignment) for n in sizes)
    a.close()


def test_second_batch_gets_its_own_exact_chunk(arena):
    arena.reserve([100, 200])
    slots = arena.reserve([300, 1024])
    assert arena.num_chunks == 2
    assert [s.chunk for s in slots] == [1, 1]
    assert [s.offset for s in slots] == [0, 512]
    assert arena.reserved_bytes == 1024 + 512 + 1024


def test_views_have_the_right_size_and_do_not_overlap(arena):
    sizes = [1, 511, 512, 513, 3000, 17]
    slots = arena.reserve(sizes) + arena.reserve([64, 9000])
    views = [arena.view(s) for s in slots]
    for v, s in zip(views, slots):
        assert v.dtype == torch.uint8 and v.dim() == 1 and v.numel() == s.nbytes
        assert v.device.type == "cpu" and v.is_contiguous()
    ranges = sorted((v.data_ptr(), v.data_ptr() + v.numel()) for v in views)
    for (_, end), (start, _) in zip(ranges, ranges[1:]):
        assert end <= start
    # Write a distinct pattern to every view, then read them all back: no view clobbers another.
    for i, v in enumerate(views):
        v.fill_(i + 1)
    for i, v in enumerate(views):
        assert bool((v == i + 1).all())


def test_span_covers_a_run_of_slots(arena):
    slots = arena.reserve([100, 100, 100])
    for i, s in enumerate(slots):
        arena.view(s).fill_(i + 10)
    span = arena.span(0, slots[0].offset, slots[2].offset + slots[2].nbytes)
    assert span.numel() == 2 * 512 + 100
    assert bool((span[:100] == 10).all())
    assert bool((span[512:612] == 11).all())
    assert bool((span[1024:] == 12).all())
    assert span.data_ptr() == arena.view(slots[0]).data_ptr()


# ---- reuse -----------------------------------------------------------------------------------
def test_released_slot_is_reused_first(arena):
    a, b, c = arena.reserve([1024, 2048, 1024])
    reserved = arena.reserved_bytes
    arena.release(b)
    assert arena.used_bytes == 2048
    (d,) = arena.reserve([2000])
    assert (d.chunk, d.offset, d.nbytes) == (b.chunk, b.offset, 2000)
    assert arena.reserved_bytes == reserved and arena.num_chunks == 1


def test_first_fit_takes_the_lowest_hole_that_fits(arena):
    slots = arena.reserve([512, 512, 4096, 512])
    arena.release(slots[0])  # hole of 512 at 0
    arena.release(slots[2])  # hole of 4096 at 1024
    (big,) = arena.reserve([2048])  # does not fit the first hole
    assert (big.chunk, big.offset) == (0, 1024)
    (small,) = arena.reserve([100])  # fits the first hole
    assert (small.chunk, small.offset) == (0, 0)
    (rest,) = arena.reserve([2048])  # the tail of the big hole
    assert (rest.chunk, rest.offset) == (0, 1024 + 2048)
    assert arena.num_chunks == 1


def test_first_fit_searches_earlier_chunks_first(arena):
    first = arena.reserve([1024])
    second = arena.reserve([1024])
    arena.release(second[0])
    arena.release(first[0])
    (s,) = arena.reserve([1024])
    assert (s.chunk, s.offset) == (0, 0)


@pytest.mark.parametrize("order", [(0, 1, 2), (0, 2, 1), (2, 1, 0), (1, 0, 2), (1, 2, 0), (2, 0, 1)])
def test_adjacent_free_ranges_merge(arena, order):
    slots = arena.reserve([512, 1000, 512, 64])  # the last one stays in use
    for i in order:
        arena.release(slots[i])
    # One merged hole of 512 + 1024 + 512 bytes at offset 0: a request of that size fits it.
    (s,) = arena.reserve([2048])
    assert (s.chunk, s.offset) == (0, 0)
    assert arena.num_chunks == 1
    assert arena._free_offsets == [[]] and arena._free_sizes == [[]]


def test_merge_with_both_neighbours_leaves_one_range(arena):
    slots = arena.reserve([512] * 5)
    arena.release(slots[1])
    arena.release(slots[3])
    assert arena._free_offsets[0] == [512, 1536]
    arena.release(slots[2])
    assert arena._free_offsets[0] == [512] and arena._free_sizes[0] == [1536]


def test_reserve_after_release_does_not_grow(arena):
    sizes = [100, 3000, 1, 64, 777]
    slots = arena.reserve(sizes)
    reserved, chunks = arena.reserved_bytes, arena.num_chunks
    for _ in range(200):
        for s in slots:
            arena.release(s)
        assert arena.used_bytes == 0
        slots = arena.reserve(sizes)
        assert arena.used_bytes == sum(sizes)
    assert (arena.reserved_bytes, arena.num_chunks) == (reserved, chunks)


def test_release_in_random_order_then_refill_does_not_grow(arena):
    gen = torch.Generator().manual_seed(0)
    sizes = [int(x) for x in torch.randint(1, 5000, (40,), generator=gen)]
    slots = arena.reserve(sizes)
    reserved = arena.reserved_bytes
    for _ in range(20):
        perm = torch.randperm(len(slots), generator=gen).tolist()
        for i in perm:
            arena.release(slots[i])
        slots = arena.reserve(sizes)
    assert arena.reserved_bytes == reserved and arena.num_chunks == 1


def test_batch_partly_served_from_free_space(arena):
    a, b = arena.reserve([512, 512])
    arena.release(a)
    s1, s2 = arena.reserve([512, 1000])
    assert (s1.chunk, s1.offset) == (0, 0)
    assert s2.chunk == 1
    assert arena.reserved_bytes == 1024 + 1024  # the new chunk holds only the missing slot


# ---- errors ----------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [0, -1, -512, 3, 100, 513])
def test_invalid_alignment_is_rejected(bad):
    with pytest.raises(ValueError, match="power of two"):
        HostArena(DeviceOps("cpu"), alignment_bytes=bad)


def test_negative_size_is_rejected_without_leaking_free_space(arena):
    a, b = arena.reserve([1024, 1024])
    arena.release(a)
    with pytest.raises(ValueError, match=">= 0"):
        arena.reserve([100, -1])
    assert arena.used_bytes == 1024
    (s,) = arena.reserve([1024])  # the hole is still there
    assert (s.chunk, s.offset) == (0, 0)
    assert arena.num_chunks == 1


def test_a_failed_new_chunk_gives_back_the_free_space_it_took(arena, monkeypatch):
    """Issue 12, item 8: reserve() took free ranges for part of a batch, then the new chunk
    for the rest failed (no host memory, or pinning refused): the ranges were lost."""
    a, b = arena.reserve([1024, 1024])
    arena.release(a)

    def no_memory(nbytes, *, pin):
        raise RuntimeError("cudaHostRegister failed (simulated)")

    monkeypatch.setattr(arena._ops, "new_host_buffer", no_memory)
    with pytest.raises(RuntimeError, match="simulated"):
        arena.reserve([1024, 4096])  # the first fits the hole, the second needs a new chunk
    monkeypatch.undo()
    assert arena.used_bytes == 1024
    (s,) = arena.reserve([1024])  # the hole is still there
    assert (s.chunk, s.offset) == (0, 0)
    assert arena.num_chunks == 1


def test_slot_tensor_is_exactly_the_slot_and_outlives_the_arena():
    a = HostArena(DeviceOps("cpu"), alignment_bytes=512)
    s1, s2 = a.reserve([100, 300])
    a.view(s2).copy_(torch.arange(300, dtype=torch.uint8))
    t = a.slot_tensor(s2)
    assert t.numel() == 300 and t.untyped_storage().nbytes() == 300  # its own storage, the slot's bytes
    assert torch.equal(t, torch.arange(300, dtype=torch.uint8))
    a.close()
    gc.collect()
    assert torch.equal(t, torch.arange(300, dtype=torch.uint8)), "the chunk must stay alive while the view does"


def test_double_release_is_an_error(arena):
    a, b, c = arena.reserve([512, 512, 512])
    arena.release(a)
    with pytest.raises(ValueError, match="double release"):
        arena.release(a)
    arena.release(b)  # merges into [0, 1024)
    with pytest.raises(ValueError, match="double release"):
        arena.release(b)  # inside the merged range: the right-neighbour check alone misses it
    with pytest.raises(ValueError, match="double release"):
        arena.release(a)
    assert arena.used_bytes == 512
    (s,) = arena.reserve([1024])
    assert s.offset == 0 and arena.num_chunks == 1


def test_zero_byte_slots_release_in_any_order(arena):
    a, z, b = arena.reserve([100, 0, 100])
    assert z.offset == 512 and arena.view(z).numel() == 0
    arena.release(a)
    arena.release(b)  # [0, 1024) is one free range now, z's offset inside it
    arena.release(z)
    assert arena.used_bytes == 0
    (s,) = arena.reserve([1024])
    assert (s.chunk, s.offset) == (0, 0) and arena.num_chunks == 1


def test_close_then_reserve_is_a_clear_error():
    a = HostArena(DeviceOps("cpu"))
    a.reserve([100, 200])
    assert a.reserved_bytes > 0
    a.close()
    assert a.reserved_bytes == 0 and a.num_chunks == 0 and a.used_bytes == 0
    with pytest.raises(RuntimeError, match="closed"):
        a.reserve([10])
    a.close()  # idempotent


# ---- pinning ---------------------------------------------------------------------------------
def test_cpu_arena_never_pins():
    assert HostArena(DeviceOps("cpu"), pin=True).pinned is False
    assert HostArena(DeviceOps("cpu")).pinned is False


def test_accelerator_arena_pins_exact_chunks_and_unpins_on_close():
    ops = FakeAccelOps()
    a = HostArena(ops, alignment_bytes=256)
    assert a.pinned
    a.reserve([10, 300])
    a.reserve([1])
    assert ops.host_buffers == [(256 + 512, True), (256, True)]
    assert a.pin_seconds >= 0.0
    a.close()
    assert sorted(ops.freed_host_buffers) == [(256, True), (768, True)]
    a.close()
    assert len(ops.freed_host_buffers) == 2  # unpinned once


def test_unpin_option_and_unpin_on_garbage_collection():
    ops = FakeAccelOps()
    assert HostArena(ops, pin=False).pinned is False
    a = HostArena(ops)
    a.reserve([1000])
    del a
    gc.collect()
    assert ops.freed_host_buffers == [(1024, True)]


def test_slots_are_plain_values():
    s = HostSlot(0, 512, 10)
    assert s == HostSlot(0, 512, 10) and hash(s) == hash(HostSlot(0, 512, 10))
