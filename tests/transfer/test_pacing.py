"""The pacing of device-to-host copies (tidal.transfer.pacing) on the fake accelerator: which
pieces a copy is cut into, that they take turns on two streams each behind the one before,
that every byte arrives, and what is left unpaced. Its effect on a real copy engine is measured
in tests/transfer/test_pacing_gpu.py."""

from __future__ import annotations

import pytest
import torch

from tests.transfer.fakes import FakeAccelOps
from tidal.device import DeviceOps
from tidal.transfer import CopyItem, HostArena, TransferConfig, TransferContext, TransferEngine
from tidal.transfer.pacing import CopyPacer


def _engine(ops, **cfg) -> TransferEngine:
    return TransferEngine(ops, HostArena(ops, alignment_bytes=64), TransferConfig(**cfg))


def _items(arena: HostArena, sizes: list[int], seed: int = 0) -> list[CopyItem]:
    g = torch.Generator().manual_seed(seed)
    slots = arena.reserve(sizes)
    return [
        CopyItem(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).untyped_storage(), s, n)
        for s, n in zip(slots, sizes)
    ]


def _pacing_log(ops: FakeAccelOps, pacer: CopyPacer) -> list[tuple]:
    """The records and event waits on the copy stream and the pacer's second stream, the
    streams named "copy" and "second" and the event ids renumbered 1, 2, ... in order of first
    appearance."""
    names = {pacer.stream.name: "copy", pacer.second.name: "second"}
    ids: dict[int, int] = {}
    out = []
    for e in ops.log:
        if e[0] in ("record", "wait_event") and e[1] in names:
            out.append((e[0], names[e[1]], ids.setdefault(e[2], len(ids) + 1)))
    return out


def _on_second(here: int, piece: int) -> list[tuple]:
    """A piece on the second stream: the copy stream's position is recorded, the second stream
    waits for it (so for the piece before, queued there), then the piece and its event."""
    return [("record", "copy", here), ("wait_event", "second", here), ("record", "second", piece)]


def _copied(eng: TransferEngine, items: list[CopyItem]) -> bool:
    return all(torch.equal(eng.arena.view(it.slot), _bytes(it)) for it in items)


def _bytes(it: CopyItem) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(it.storage, 0, (it.nbytes,), (1,))


def test_a_copy_goes_in_pieces_taking_turns_each_behind_the_one_before():
    ops = FakeAccelOps()
    eng = _engine(ops, bucket_bytes=4096, small_tensor_bytes=0, paced_piece_bytes=1000)
    items = _items(eng.arena, [2500])
    (seg,) = eng.plan(items)
    eng.begin_out()
    eng.copy_out(seg)
    # Three pieces (1000, 1000, 500): the first on the copy stream at once (nothing before it),
    # the second on the second stream behind it, the third on the copy stream behind the
    # second; then the segment's own event.
    assert _pacing_log(ops, eng.pacer) == [
        ("record", "copy", 1),
        *_on_second(2, 3),
        ("wait_event", "copy", 3),
        ("record", "copy", 4),
        ("record", "copy", 5),
    ]
    assert eng.pacer.pieces == 3
    assert _copied(eng, items)


def test_the_turns_run_across_copies_and_buckets_and_the_copy_stream_waits_for_the_last():
    # Two direct copies and a bucket: the turns go on from one copy to the next, and a copy
    # whose last piece ran on the second stream has the copy stream wait for it before the
    # engine's segment event (which must mark every byte done).
    ops = FakeAccelOps()
    eng = _engine(ops, bucket_bytes=4096, small_tensor_bytes=1024, paced_piece_bytes=1500)
    items = _items(eng.arena, [2000, 300, 400, 1600], seed=1)
    segs = eng.plan(items)
    assert [s.bucketed for s in segs] == [False, True, False]
    eng.begin_out()
    for seg in segs:
        eng.copy_out(seg)
    assert _pacing_log(ops, eng.pacer) == [
        ("record", "copy", 1),  # 2000 bytes: 1500 on the copy stream, 500 on the second
        *_on_second(2, 3),
        ("wait_event", "copy", 3),  # the copy stream after the last piece
        ("record", "copy", 4),  # segment 1 done
        ("wait_event", "copy", 3),  # the bucket (700 bytes staged): one piece, behind the last
        ("record", "copy", 5),
        ("record", "copy", 6),  # segment 2 done
        *_on_second(7, 8),  # 1600 bytes: 1500 on the second stream, 100 on the copy stream
        ("wait_event", "copy", 8),
        ("record", "copy", 9),
        ("record", "copy", 10),
    ]
    assert eng.pacer.pieces == 5
    assert _copied(eng, items)


def test_write_backs_queued_directly_are_paced_and_uploads_are_not():
    ops = FakeAccelOps()
    eng = _engine(ops, paced_piece_bytes=1024)
    items = _items(eng.arena, [3000, 1024], seed=2)
    eng.begin_out()
    eng.queue_direct(items, to_device=False)
    assert eng.pacer.pieces == 3 + 1
    assert _copied(eng, items)
    before = eng.pacer.pieces
    for it in items:
        _bytes(it).zero_()
    eng.begin_in()
    eng.queue_direct(items, to_device=True)
    assert eng.pacer.pieces == before  # host-to-device copies hold no device-to-host read back
    assert _copied(eng, items)


def test_engines_of_one_context_share_one_chain():
    ops = FakeAccelOps()
    ctx = TransferContext(ops)
    a, b = ctx.engine(TransferConfig(paced_piece_bytes=512)), ctx.engine(TransferConfig(paced_piece_bytes=512))
    assert a.pacer is b.pacer is ctx.d2h_pacer
    ia, ib = _items(a.arena, [600]), _items(b.arena, [600], seed=3)
    for eng, items in ((a, ia), (b, ib)):
        eng.begin_out()
        eng.queue_direct(items, to_device=False)
    log = _pacing_log(ops, ctx.d2h_pacer)
    # a's two pieces, its queue event (4), then b's two pieces going on with the turns: its first
    # on the copy stream behind a's last (3), its second on the second stream.
    assert log == [
        ("record", "copy", 1),
        *_on_second(2, 3),
        ("wait_event", "copy", 3),
        ("record", "copy", 4),
        ("wait_event", "copy", 3),
        ("record", "copy", 5),
        *_on_second(6, 7),
        ("wait_event", "copy", 7),
        ("record", "copy", 8),
    ]


def test_zero_piece_bytes_queues_each_copy_whole():
    ops = FakeAccelOps()
    eng = _engine(ops, small_tensor_bytes=0, paced_piece_bytes=0)
    items = _items(eng.arena, [5000])
    eng.begin_out()
    eng.copy_out(eng.plan(items)[0])
    assert eng.pacer.pieces == 0
    assert _pacing_log(ops, eng.pacer) == [("record", "copy", 1)]
    assert _copied(eng, items)


def test_on_cpu_there_is_no_pacer():
    eng = _engine(DeviceOps("cpu"), paced_piece_bytes=16)
    assert eng.pacer is None
    items = _items(eng.arena, [100])
    eng.copy_out(eng.plan(items)[0])
    assert _copied(eng, items)


def test_misuse_is_refused():
    with pytest.raises(ValueError, match="paced_piece_bytes must be >= 0"):
        TransferConfig(paced_piece_bytes=-1)
    ops = FakeAccelOps()
    with pytest.raises(ValueError, match="pass the copy stream"):
        CopyPacer(ops, None)
    other = CopyPacer(ops, ops.new_stream())
    with pytest.raises(ValueError, match="another stream"):
        TransferEngine(ops, HostArena(ops), streams=(ops.new_stream(), ops.new_stream()), pacer=other)
