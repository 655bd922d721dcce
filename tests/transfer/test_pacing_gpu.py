"""Paced device-to-host copies on a real copy engine (tidal.transfer.pacing): a small read the
compute stream queues while gigabytes are written back waits for one piece, not for all of
them, the copy keeps its rate, and every byte arrives. The same write-back unpaced is the
control: its first read waits for everything queued, so the test sees the difference."""

from __future__ import annotations

import time

import pytest
import torch

from tidal.device import DeviceOps
from tidal.transfer import CopyItem, HostArena, TransferConfig, TransferEngine

MiB = 1 << 20
GiB = 1 << 30


def _write_back_with_reads(eng: TransferEngine, items: list[CopyItem], x: torch.Tensor) -> tuple[float, list[float]]:
    """Queue every item's copy to the host at once (as a write-back does), then run small
    compute-stream reads until the copies are done. Returns (copy seconds, read seconds)."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    eng.begin_out()
    start.record(eng.d2h_stream)
    done = eng.queue_direct(items, to_device=False)
    end.record(eng.d2h_stream)
    reads = []
    while True:
        t0 = time.perf_counter()
        (x * 2).sum().item()  # a token's read: a kernel, then a few bytes to the host
        reads.append(time.perf_counter() - t0)
        if done.query():
            break
    end.synchronize()
    return start.elapsed_time(end) / 1e3, reads


@pytest.mark.gpu
def test_a_paced_write_back_lets_the_compute_streams_reads_through():
    ops = DeviceOps("cuda")
    arena = HostArena(ops)
    sizes = [GiB] * 6 + [100 * MiB + 12345]  # a piece size does not divide the last
    slots = arena.reserve(sizes)
    g = torch.Generator(device="cuda").manual_seed(0)
    dev = [torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda", generator=g) for n in sizes]
    items = [CopyItem(t.untyped_storage(), s, n) for t, s, n in zip(dev, slots, sizes)]
    x = torch.ones(1024, device="cuda")
    paced = TransferEngine(ops, arena, TransferConfig(paced_piece_bytes=64 * MiB))
    whole = TransferEngine(ops, arena, TransferConfig(paced_piece_bytes=0))
    _write_back_with_reads(whole, items[-1:], x)  # warm-up: the streams, the kernels
    _write_back_with_reads(paced, items[-1:], x)

    whole_s, whole_reads = _write_back_with_reads(whole, items, x)
    for t, s in zip(dev, slots):
        arena.view(s).zero_()
    paced_s, paced_reads = _write_back_with_reads(paced, items, x)
    total = sum(sizes)
    print(
        f"\nwrite-back of {total / GiB:.2f} GiB: whole {total / whole_s / 1e9:.1f} GB/s, first read waited "
        f"{whole_reads[0] * 1e3:.1f} ms; paced (64 MiB) {total / paced_s / 1e9:.1f} GB/s, "
        f"{len(paced_reads)} reads, longest {max(paced_reads) * 1e3:.2f} ms"
    )
    # Unpaced, the first read waits for most of the copy (about 120 ms at 55 GB/s): the control.
    assert whole_reads[0] > 0.5 * whole_s, (whole_reads[0], whole_s)
    # Paced, no read waits for more than a few pieces (one is about 1.2 ms at the line rate).
    assert max(paced_reads) < 0.1 * paced_s and max(paced_reads) < 0.015, (max(paced_reads), paced_s)
    assert len(paced_reads) > 20
    assert paced_s < 1.15 * whole_s, (paced_s, whole_s)  # the copy keeps (near) its rate
    for t, s in zip(dev, slots):
        assert torch.equal(arena.view(s), t.cpu()), "a paced copy lost bytes"


SLEEP_CYCLES = int(4e8)  # about 0.2-0.3 s on an H100: far longer than the copies


@pytest.mark.gpu
@pytest.mark.parametrize("dropped", [None, "pace_piece_after_stream", "pace_stream_after_copy"])
def test_race_a_piece_on_the_second_stream_reads_after_the_copy_stream_and_is_waited_for(dropped):
    """Two pieces: the first on the copy stream, the second on the pacer's second stream. The
    second must read the source only after what the copy stream waited for (the compute that
    wrote it: ``pace_piece_after_stream``), and the copy stream's next event must come after it
    (``pace_stream_after_copy``: the engine's event says the copy is done). A GPU sleep in front
    of the write (and, for the second wait, in front of the second stream's piece) makes each
    missing wait show in every run."""
    from tests.policies import SkipWaits
    from tidal.device import SyncPolicy, use_sync_policy

    ops = DeviceOps("cuda")
    arena = HostArena(ops)
    piece = 256 * MiB
    (slot,) = arena.reserve([2 * piece])
    src = torch.zeros(2 * piece, dtype=torch.uint8, device="cuda")
    item = CopyItem(src.untyped_storage(), slot, 2 * piece)
    eng = TransferEngine(
        ops, arena, TransferConfig(paced_piece_bytes=piece)
    )  # its own pacer: first piece on the copy stream
    (seg,) = eng.plan([item])
    arena.view(slot).fill_(0xAA)
    torch.cuda.synchronize()
    policy = SkipWaits([dropped]) if dropped else SyncPolicy()
    with use_sync_policy(policy):
        torch.cuda._sleep(SLEEP_CYCLES)  # the write below lands late
        src.fill_(1)
        if dropped == "pace_stream_after_copy":
            with torch.cuda.stream(eng.pacer.second):
                torch.cuda._sleep(2 * SLEEP_CYCLES)  # the second piece runs late
        eng.begin_out()
        done = eng.copy_out(seg)
    done.synchronize()  # the engine's word that the copy has run
    got = arena.view(slot)
    whole = bool((got == 1).all())
    torch.cuda.synchronize()
    if dropped is None:
        assert whole, "a paced copy read stale bytes or was not waited for"
        assert eng.pacer.pieces == 2
    else:
        assert policy.skipped == [dropped], "the wait was never reached"
        assert not whole, f"without {dropped} the test must see the race"
