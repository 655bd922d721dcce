import dataclasses

import pytest
import torch

from tests.policies import SkipWaits
from tests.transfer.fakes import FakeAccelOps, align_up
from tidal.device import DeviceOps, use_sync_policy
from tidal.transfer import CopyItem, HostArena, Segment, TransferConfig, TransferEngine, byte_view

KiB = 1024


# ---- TransferConfig --------------------------------------------------------------------------
def test_config_defaults_are_valid():
    cfg = TransferConfig()
    assert cfg.bucket_bytes > 0 and 0 <= cfg.small_tensor_bytes <= cfg.bucket_bytes and cfg.pin_host


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(bucket_bytes=0), "bucket_bytes must be > 0"),
        (dict(bucket_bytes=-1, small_tensor_bytes=0), "bucket_bytes must be > 0"),
        (dict(small_tensor_bytes=-1), "small_tensor_bytes must be >= 0"),
        (dict(bucket_bytes=1024, small_tensor_bytes=1025), "must not exceed bucket_bytes"),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TransferConfig(**kwargs)


def test_config_edge_values_and_immutability():
    TransferConfig(bucket_bytes=1, small_tensor_bytes=0)
    TransferConfig(bucket_bytes=4096, small_tensor_bytes=4096)
    cfg = TransferConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.bucket_bytes = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        TransferConfig(1024)  # type: ignore[misc]  (keyword-only)


# ---- byte_view -------------------------------------------------------------------------------
def test_byte_view_is_the_whole_storage_without_copy():
    base = torch.arange(12, dtype=torch.float32)
    t = base.view(3, 4).t()[1:]  # non-contiguous view with an offset
    bv = byte_view(t.untyped_storage())
    assert bv.dtype == torch.uint8 and bv.numel() == 48
    assert bv.data_ptr() == base.data_ptr()
    bv.view(torch.float32)[5] = -1.0
    assert base[5].item() == -1.0


# ---- plan ------------------------------------------------------------------------------------
def _items(arena, sizes):
    """One CopyItem per size, with its own storage; slots reserved in one batch."""
    slots = arena.reserve(sizes)
    return [CopyItem(torch.empty(n, dtype=torch.uint8).untyped_storage(), s, n) for s, n in zip(slots, sizes)]


def _engine(ops, **cfg):
    arena = HostArena(ops, alignment_bytes=cfg.pop("alignment", 512))
    return TransferEngine(ops, arena, TransferConfig(**cfg))


def _check_cover(segments, items):
    flat = [it for seg in segments for it in seg.items]
    assert len(flat) == len(items) and all(a is b for a, b in zip(flat, items))


def test_plan_on_cpu_gives_every_item_its_own_segment():
    eng = _engine(DeviceOps("cpu"), bucket_bytes=64 * KiB, small_tensor_bytes=16 * KiB)
    items = _items(eng.arena, [10, 20, 30, 100 * KiB, 1])
    segs = eng.plan(items)
    assert len(segs) == 5
    assert not any(s.bucketed for s in segs)
    _check_cover(segs, items)
    for seg, it in zip(segs, items):
        assert (seg.chunk, seg.start, seg.end) == (it.slot.chunk, it.slot.offset, it.slot.offset + it.nbytes)
        assert seg.nbytes == it.nbytes


def test_plan_buckets_adjacent_small_items_on_an_accelerator():
    eng = _engine(FakeAccelOps(), bucket_bytes=64 * KiB, small_tensor_bytes=16 * KiB)
    sizes = [100, 1, 511, 512, 513, 2000]
    items = _items(eng.arena, sizes)
    (seg,) = eng.plan(items)
    assert seg.bucketed
    _check_cover([seg], items)
    assert seg.start == 0 and seg.end == items[-1].slot.offset + 2000
    assert seg.nbytes == sum(sizes)


def test_plan_respects_bucket_bytes():
    # 1000-byte items sit 1024 apart: two fit in 2048 (0..2024), a third does not.
    eng = _engine(FakeAccelOps(), bucket_bytes=2048, small_tensor_bytes=1024, alignment=1024)
    items = _items(eng.arena, [1000] * 5)
    segs = eng.plan(items)
    assert [len(s.items) for s in segs] == [2, 2, 1]
    assert all(s.bucketed for s in segs)
    assert all(s.end - s.start <= 2048 for s in segs)
    _check_cover(segs, items)


def test_plan_random_sizes_keep_every_bucket_within_limits():
    gen = torch.Generator().manual_seed(1)
    eng = _engine(FakeAccelOps(), bucket_bytes=32 * KiB, small_tensor_bytes=8 * KiB)
    sizes = [int(x) for x in torch.randint(1, 12 * KiB, (300,), generator=gen)]
    items = _items(eng.arena, sizes)
    segs = eng.plan(items)
    _check_cover(segs, items)
    for s in segs:
        if s.bucketed:
            assert s.end - s.start <= 32 * KiB
            assert all(it.nbytes < 8 * KiB for it in s.items)
            # Consecutive slots touch (only the previous slot's own padding between them).
            for a, b in zip(s.items, s.items[1:]):
                assert b.slot.offset == a.slot.offset + align_up(a.nbytes, 512)
        else:
            assert len(s.items) == 1
    assert len(segs) < len(items)  # something was bucketed


def test_large_items_get_their_own_segment_and_break_runs():
    eng = _engine(FakeAccelOps(), bucket_bytes=64 * KiB, small_tensor_bytes=8 * KiB)
    sizes = [100, 100, 8 * KiB, 100, 100, 50 * KiB]
    items = _items(eng.arena, sizes)
    segs = eng.plan(items)
    assert [(s.bucketed, len(s.items)) for s in segs] == [(True, 2), (False, 1), (True, 2), (False, 1)]
    assert segs[1].items[0].nbytes == 8 * KiB  # == small_tensor_bytes counts as large
    _check_cover(segs, items)


def test_small_tensor_bytes_zero_disables_bucketing():
    eng = _engine(FakeAccelOps(), bucket_bytes=64 * KiB, small_tensor_bytes=0)
    items = _items(eng.arena, [10, 10, 10])
    assert [s.bucketed for s in eng.plan(items)] == [False, False, False]


def test_plan_does_not_bucket_across_chunks_or_backwards():
    eng = _engine(FakeAccelOps(), bucket_bytes=64 * KiB, small_tensor_bytes=8 * KiB)
    a = _items(eng.arena, [100, 100])
    b = _items(eng.arena, [100, 100])
    segs = eng.plan(a + b)
    assert [len(s.items) for s in segs] == [2, 2]
    assert [s.chunk for s in segs] == [0, 1]
    segs = eng.plan([a[1], a[0]])
    assert [len(s.items) for s in segs] == [1, 1]


def test_plan_never_spans_a_slot_that_is_not_in_the_transfer():
    """Regression: the bucket's host copy writes every byte of [start, end), so a slot
    belonging to some other storage must never lie inside it."""
    eng = _engine(FakeAccelOps(), bucket_bytes=64 * KiB, small_tensor_bytes=8 * KiB)
    a, b, c = _items(eng.arena, [100, 100, 100])
    segs = eng.plan([a, c])
    assert [len(s.items) for s in segs] == [1, 1]


def test_segment_nbytes():
    arena = HostArena(DeviceOps("cpu"))
    items = _items(arena, [3, 5, 7])
    assert Segment(items, True, 0, 0, 1031).nbytes == 15


# ---- copies ----------------------------------------------------------------------------------
def _tensors():
    gen = torch.Generator().manual_seed(2)
    return [
        torch.randn(37, generator=gen),
        torch.randint(-(2**40), 2**40, (5, 3), generator=gen),
        torch.randn(4, 4, generator=gen).to(torch.bfloat16),
        torch.rand(9, generator=gen) > 0.5,
        torch.randn(20_000, generator=gen),  # large on the engines below
        torch.randn(3, generator=gen, dtype=torch.float64),
    ]


def _round_trip(eng):
    tensors = _tensors()
    clones = [t.clone() for t in tensors]
    storages = [t.untyped_storage() for t in tensors]
    slots = eng.arena.reserve([s.nbytes() for s in storages])
    items = [CopyItem(s, slot, s.nbytes()) for s, slot in zip(storages, slots)]
    segs = eng.plan(items)
    eng.begin_out()
    events = [eng.copy_out(seg) for seg in segs]
    for ev in events:
        eng.wait("test", ev)
    for t in tensors:
        t.untyped_storage().resize_(0)
    # The host holds the bytes.
    for c, slot in zip(clones, slots):
        assert torch.equal(eng.arena.view(slot), byte_view(c.untyped_storage()))
    for it in items:
        it.storage.resize_(it.nbytes)
    eng.begin_in()
    last = None
    for seg in segs:
        last = eng.copy_in(seg)
    eng.publish(last)
    eng.wait("test", last)
    eng.release_staging()
    for t, c in zip(tensors, clones):
        assert torch.equal(t, c)
    total = sum(it.nbytes for it in items)
    assert eng.bytes_out == total and eng.bytes_in == total
    return segs


def test_round_trip_on_cpu():
    eng = _engine(DeviceOps("cpu"), bucket_bytes=64 * KiB, small_tensor_bytes=16 * KiB)
    segs = _round_trip(eng)
    assert len(segs) == 6 and eng.copy_out(segs[0]) is None  # no events on CPU


def test_round_trip_with_buckets_on_an_accelerator():
    ops = FakeAccelOps()
    eng = _engine(ops, bucket_bytes=64 * KiB, small_tensor_bytes=16 * KiB)
    segs = _round_trip(eng)
    assert [(s.bucketed, len(s.items)) for s in segs] == [(True, 4), (False, 1), (True, 1)]
    assert not eng.holds_staging()  # released


def test_bucketed_copy_out_leaves_other_slots_alone():
    """Regression: a slot offloaded earlier between two slots of a later transfer keeps its bytes."""
    ops = FakeAccelOps()
    eng = _engine(ops, bucket_bytes=64 * KiB, small_tensor_bytes=16 * KiB)
    a, b, c = (torch.full((100,), float(i)) for i in (1, 2, 3))
    slots = eng.arena.reserve([400, 400, 400])
    items = [CopyItem(t.untyped_storage(), s, 400) for t, s in zip((a, b, c), slots)]
    for seg in eng.plan([items[1]]):
        eng.copy_out(seg)
    for seg in eng.plan([items[0], items[2]]):
        eng.copy_out(seg)
    for t, slot in zip((a, b, c), slots):
        assert torch.equal(eng.arena.view(slot).view(torch.float32), t)


def test_staging_is_one_buffer_out_and_two_in_turn_of_at_least_bucket_bytes():
    ops = FakeAccelOps()
    eng = _engine(ops, bucket_bytes=4 * KiB, small_tensor_bytes=1 * KiB)
    items = _items(eng.arena, [100] * 30)
    segs = eng.plan(items)
    assert len(segs) > 2 and all(s.bucketed and len(s.items) > 1 for s in segs)
    eng.copy_out(segs[0])
    staging = eng._staging_out
    assert staging is not None and staging.numel() == 4 * KiB
    for seg in segs[1:]:
        eng.copy_out(seg)
    assert eng._staging_out is staging  # reused, not reallocated
    assert eng._staging_in == [None, None]
    for seg in segs:
        eng.copy_in(seg)
    first, second = eng._staging_in
    assert (
        first is not None
        and second is not None
        and first is not second
        and staging is not first
        and staging is not second
    )
    assert first.numel() == second.numel() == 4 * KiB
    for seg in segs:  # a second transfer's buckets take the same two buffers in turn
        eng.copy_in(seg)
    assert eng._staging_in[0] is first and eng._staging_in[1] is second
    eng.release_staging()
    assert not eng.holds_staging()


def test_a_staging_buffer_is_as_large_as_its_buckets_need_up_to_bucket_bytes():
    """A transfer of a few small storages holds a buffer the size of their bucket (rounded up
    to a power of two), not a full bucket; a larger bucket later grows it, never past
    bucket_bytes, and the bytes still arrive."""
    ops = FakeAccelOps()
    eng = _engine(ops, bucket_bytes=64 * KiB, small_tensor_bytes=16 * KiB)
    tensors = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in [300] * 3 + [3000] * 40]
    clones = [t.clone() for t in tensors]
    slots = eng.arena.reserve([t.numel() for t in tensors])
    items = [CopyItem(t.untyped_storage(), slot, t.numel()) for t, slot in zip(tensors, slots)]
    (small,) = eng.plan(items[:3])  # one bucket of 900 bytes (and alignment)
    assert small.bucketed and len(small.items) == 3
    eng.copy_out(small)
    eng.copy_in(small)
    need = 1 << (small.end - small.start - 1).bit_length()
    assert eng._staging_out.numel() == eng._staging_in[0].numel() == need < 64 * KiB
    eng.release_staging()
    segs = eng.plan(items)
    assert max(s.end - s.start for s in segs) > 32 * KiB
    for seg in segs:
        eng.copy_out(seg)
    assert eng._staging_out.numel() == 64 * KiB
    for t in tensors:
        t.zero_()
    for seg in segs:
        eng.copy_in(seg)
    assert max(b.numel() for b in eng._staging_in) == 64 * KiB
    eng.release_staging()
    for t, c in zip(tensors, clones):
        assert torch.equal(t, c)


def test_a_staging_buffer_takes_its_next_bucket_only_after_its_last_scatter():
    """The H2D copy into a buffer waits for the scatter that last read it (two buckets back) on
    the scatter stream; the scatter waits for its own bucket's copy; the buffer's block is held
    for the scatter stream."""
    ops = FakeAccelOps()
    eng = _engine(ops, bucket_bytes=4 * KiB, small_tensor_bytes=1 * KiB)
    segs = eng.plan(_items(eng.arena, [100] * 60))
    assert len(segs) >= 3
    h2d, scatter = eng.h2d_stream.name, eng.scatter_stream.name
    ops.log.clear()
    done = [eng.copy_in(seg) for seg in segs[:3]]
    log = ops.log
    # Each scatter after its copy's event, each segment's event recorded on the scatter stream.
    copies = [e for e in log if e[0] == "record" and e[1] == h2d]
    assert [e for e in log if e[0] == "wait_event" and e[1] == scatter] == [
        ("wait_event", scatter, c[2]) for c in copies
    ]
    assert all(("record", scatter, d.id) in log for d in done)
    # The third bucket reuses the first buffer: its copy waits for the first bucket's scatter.
    assert ("wait_event", h2d, done[0].id) in log
    assert log.index(("wait_event", h2d, done[0].id)) < log.index(copies[2])
    assert ("wait_event", h2d, done[1].id) not in log  # the second buffer is not reused yet
    assert sum(1 for e in log if e[0] == "hold" and e[1] == scatter) == 2  # both blocks held for it


def test_copies_are_ordered_by_stream_waits_and_events():
    ops = FakeAccelOps()
    eng = _engine(ops, bucket_bytes=64 * KiB, small_tensor_bytes=16 * KiB)
    d2h, h2d = eng.d2h_stream.name, eng.h2d_stream.name
    assert d2h != h2d
    items = _items(eng.arena, [100, 100])
    (seg,) = eng.plan(items)
    eng.begin_out()
    ev = eng.copy_out(seg)
    eng.wait("test", ev)
    assert ops.log[0] == ("wait_stream", d2h, "compute")  # D2H waits for the producers
    assert ("enter", d2h) in ops.log and ("record", d2h, ev.id) in ops.log
    assert ops.log[-1] == ("sync", ev.id)
    ops.log.clear()
    eng.begin_in()
    ev = eng.copy_in(seg)
    eng.publish(ev)
    scatter = eng.scatter_stream.name
    assert ops.log[0] == ("wait_stream", h2d, "compute")
    # The bucket's copy on the H2D stream, its scatter after it; the event marks the scatter.
    copied = next(e for e in ops.log if e[0] == "record" and e[1] == h2d)
    assert ops.log.index(copied) < ops.log.index(("wait_event", scatter, copied[2]))
    assert ("record", scatter, ev.id) in ops.log
    assert ops.log[-1] == ("wait_event", "compute", ev.id)  # consumers wait for the data
    ops.log.clear()
    eng.publish(None)
    eng.wait("test", None)
    assert ops.log == []


def test_a_sync_policy_sees_every_wait_and_can_drop_them():
    ops = FakeAccelOps()
    eng = _engine(ops, bucket_bytes=64 * KiB, small_tensor_bytes=16 * KiB)
    (seg,) = eng.plan(_items(eng.arena, [100, 100]))
    names = ("d2h_after_compute", "free_after_d2h", "h2d_after_compute", "scatter_after_h2d", "compute_after_h2d")
    with use_sync_policy(SkipWaits(names)) as policy:
        eng.begin_out()
        eng.wait("free_after_d2h", eng.copy_out(seg))
        eng.begin_in()
        eng.publish(eng.copy_in(seg))
    assert sorted(policy.skipped) == sorted(names)  # every wait was reached, by its name
    kinds = {entry[0] for entry in ops.log}
    assert not kinds & {"wait_stream", "wait_event", "sync"}
