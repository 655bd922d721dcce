"""Copies queued by address in one driver call (tidal.transfer.batch) on a real GPU: every byte
lands, both ways, from and to an arena's pinned slots; and queueing them costs the host far
less than the copies take."""

from __future__ import annotations

import time

import pytest
import torch

from tidal.device import DeviceOps
from tidal.transfer.arena import HostArena
from tidal.transfer.batch import batch_copier
from tidal.transfer.engine import CopyItem, TransferEngine

pytestmark = pytest.mark.gpu


def test_batched_copies_move_every_byte_both_ways():
    ops = DeviceOps("cuda")
    copier = batch_copier(ops.device)
    if copier is None:
        pytest.skip("this driver has no batched copies (CUDA < 12.8): the engine copies one by one")
    arena = HostArena(ops, pin=True)
    engine = TransferEngine(ops, arena)
    g = torch.Generator(device="cuda").manual_seed(0)
    sizes = [1, 7, 512, 4096 + 3, 1 << 20, (8 << 20) + 5, 64 << 20] * 20
    tensors = [torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda", generator=g) for n in sizes]
    want = [t.cpu() for t in tensors]
    slots = arena.reserve(sizes, owner="test")
    items = [CopyItem(t.untyped_storage(), s, n) for t, s, n in zip(tensors, slots, sizes)]
    engine.begin_out()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    done = engine.queue_direct(items, to_device=False)
    queued_s = time.perf_counter() - t0
    done.synchronize()
    copied_s = time.perf_counter() - t0
    assert all(torch.equal(arena.view(s), w) for s, w in zip(slots, want)), "D2H lost bytes"
    assert queued_s < 0.25 * copied_s, f"queueing {len(items)} copies took {queued_s:.4f} s of {copied_s:.4f} s"
    for t in tensors:
        t.zero_()
    engine.begin_in()
    done = engine.queue_direct(items, to_device=True)
    torch.cuda.current_stream().wait_event(done)
    assert all(torch.equal(t.cpu(), w) for t, w in zip(tensors, want)), "H2D lost bytes"
    arena.close()
