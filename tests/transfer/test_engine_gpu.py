"""A bucket's way in on a real GPU: its copy lands in one of two staging buffers and is scattered
on the scatter stream while the next copy runs. Each race test queues a GPU sleep on one stream
so that the work a wait orders comes late: a missing wait fails every run (and the test shows it
does, by dropping the wait through the sync policy)."""

from __future__ import annotations

import pytest
import torch

from tests.policies import SkipWaits
from tidal.device import DeviceOps, use_sync_policy
from tidal.transfer import CopyItem, HostArena, TransferConfig, TransferEngine

pytestmark = pytest.mark.gpu

KiB, MiB = 1 << 10, 1 << 20
SLEEP_CYCLES = int(4e8)  # ~0.2 s of queued GPU time: longer than any copy here
PER_BUCKET = 16  # storages of 64 KiB in a bucket of 1 MiB


def _setup(n_buckets: int):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    ops = DeviceOps("cuda")
    eng = TransferEngine(ops, HostArena(ops), TransferConfig(bucket_bytes=1 * MiB, small_tensor_bytes=256 * KiB))
    n = n_buckets * PER_BUCKET
    sizes = [64 * KiB - 512] * n  # slots aligned to 512 bytes: each bucket holds PER_BUCKET
    slots = eng.arena.reserve(sizes)
    tensors = [torch.empty(s, dtype=torch.uint8, device="cuda") for s in sizes]
    items = [CopyItem(t.untyped_storage(), slot, s) for t, slot, s in zip(tensors, slots, sizes)]
    segs = eng.plan(items)
    assert len(segs) == n_buckets and all(sg.bucketed and len(sg.items) == PER_BUCKET for sg in segs)
    return ops, eng, tensors, segs


def _fill_by_bucket(tensors, value_of):
    with torch.no_grad():
        for i, t in enumerate(tensors):
            t.fill_(value_of(i // PER_BUCKET))


def _round(eng, segs) -> None:
    """Copy every bucket out to its host slots and wait for it."""
    eng.begin_out()
    for ev in [eng.copy_out(sg) for sg in segs]:
        eng.wait("test", ev)
    eng.release_staging()


def _copy_in_behind_a_sleep(ops, eng, segs, stream, skip: frozenset) -> None:
    """Every bucket copied back in, ``stream`` first held up by a sleep, the waits in ``skip``
    dropped (and checked to have been reached); returns once all of it has run."""
    with use_sync_policy(SkipWaits(skip)) as policy:
        eng.begin_in()
        with ops.on_stream(stream):
            torch.cuda._sleep(SLEEP_CYCLES)
        last = None
        for sg in segs:
            last = eng.copy_in(sg)
        eng.publish(last)
    assert set(policy.skipped) == skip
    torch.cuda.synchronize()
    eng.release_staging()


def test_race_a_bucket_is_scattered_only_after_its_copy_has_landed():
    """The H2D copy of a bucket waits behind a sleep on the H2D stream; its scatter must not
    read the staging buffer before: it would find the previous transfer's bytes there."""

    def run(skip: frozenset) -> bool:
        ops, eng, tensors, segs = _setup(2)
        # A first transfer leaves 1s in the incoming staging blocks (the H2D stream's pool hands
        # the same blocks back to the next transfer).
        _fill_by_bucket(tensors, lambda b: 1)
        _round(eng, segs)
        eng.begin_in()
        for sg in segs:
            eng.copy_in(sg)
        torch.cuda.synchronize()
        eng.release_staging()
        # The host gets 2s, the device is cleared, and the copy in waits for a sleep.
        _fill_by_bucket(tensors, lambda b: 2)
        _round(eng, segs)
        _fill_by_bucket(tensors, lambda b: 0)
        _copy_in_behind_a_sleep(ops, eng, segs, eng.h2d_stream, skip)
        return all(bool((t == 2).all()) for t in tensors)

    assert run(frozenset())
    assert not run(frozenset({"scatter_after_h2d"})), "the race test must detect a scatter ahead of its copy"


def test_race_a_staging_buffer_takes_its_next_bucket_only_after_its_last_scatter():
    """The scatters wait behind a sleep on the scatter stream; the third bucket's copy, into
    the first bucket's buffer, must not overwrite it before the first bucket was scattered."""

    def run(skip: frozenset) -> bool:
        ops, eng, tensors, segs = _setup(3)
        _fill_by_bucket(tensors, lambda b: 10 + b)  # each bucket its own value
        _round(eng, segs)
        _fill_by_bucket(tensors, lambda b: 0)
        _copy_in_behind_a_sleep(ops, eng, segs, eng.scatter_stream, skip)
        return all(bool((t == 10 + i // PER_BUCKET).all()) for i, t in enumerate(tensors))

    assert run(frozenset())
    assert not run(frozenset({"staging_in_after_scatter"})), (
        "the race test must detect a staging buffer reused too early"
    )
