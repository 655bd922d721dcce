"""A region's bookkeeping and copies on the CPU, through the fake driver: bytes come back at
the same addresses, released memory is back with the driver, discard tags move nothing, runs
are restored with one allocation each, and no exception anywhere loses a byte."""

from __future__ import annotations

import gc
import os

import pytest
import torch

from tests.faults import sweep
from tests.transfer.fakes import FakeAccelOps
from tests.vmm.fakes import FRESH, FakeDriver
from tidal.errors import InsufficientMemoryError
from tidal.transfer import TransferContext
from tidal.vmm import Region, VmmUnavailableError

G = 4096


def make_region(
    *, total_bytes: int = 256 << 20, guard: bool = True, chunk: int = 256 << 20
) -> tuple[Region, FakeDriver]:
    drv = FakeDriver(total_bytes=total_bytes, granularity=G)
    ctx = TransferContext(FakeAccelOps())
    region = Region("r", driver=drv, context=ctx, guard_released=guard, reserve_bytes=1 << 20, map_chunk_bytes=chunk)
    return region, drv


def fill(drv: FakeDriver, va: int, n: int, seed: int) -> bytes:
    data = os.urandom(n) if seed < 0 else bytes((seed + i * 7) % 251 for i in range(n))
    drv.write(va, data)
    return data


def test_release_restore_same_addresses_and_bytes():
    region, drv = make_region(guard=False)
    t = region.tag("weights")
    vas = [t.alloc(n) for n in (3 * G, 5000, G)]  # 5000 rounds up to 2 pages
    assert vas == sorted(vas) and vas[1] == vas[0] + 3 * G and vas[2] == vas[1] + 2 * G  # first fit: one run
    data = [fill(drv, va, n, i) for i, (va, n) in enumerate(zip(vas, (3 * G, 2 * G, G)))]
    assert drv.physical_bytes() == 6 * G

    out = region.release()
    assert out.bytes_copied == 6 * G and out.bytes_mapped == 6 * G
    assert drv.physical_bytes() == 0 and not region.resident and not t.resident
    with pytest.raises(RuntimeError, match="unmapped"):
        drv.view(vas[0], G)  # the memory is really gone
    assert region.host_bytes() == 6 * G

    creates = drv.calls.count("create")
    back = region.restore()
    assert back.bytes_copied == 6 * G and region.resident
    assert drv.calls.count("create") == creates + 1  # the three allocations came back as one run
    assert len(t.mappings) == 1
    for va, n, d in zip(vas, (3 * G, 2 * G, G), data):
        assert drv.read(va, n) == d

    # A second cycle reuses the host slots (warm) and still restores every byte.
    host = region.host_bytes()
    region.release()
    assert region.host_bytes() == host and drv.physical_bytes() == 0
    region.restore()
    for va, n, d in zip(vas, (3 * G, 2 * G, G), data):
        assert drv.read(va, n) == d


def test_discard_tag_moves_no_bytes_and_comes_back_fresh():
    region, drv = make_region(guard=False)
    kv = region.tag("kv", policy="discard")
    w = region.tag("w")
    va_kv = kv.alloc(4 * G)
    va_w = w.alloc(G)
    fill(drv, va_kv, 4 * G, 1)
    dw = fill(drv, va_w, G, 2)
    out = region.release()
    assert out.bytes_copied == G and out.bytes_mapped == 5 * G  # only the backup tag copied
    assert kv.slots == {} and drv.physical_bytes() == 0
    back = region.restore()
    assert back.bytes_copied == G
    assert drv.read(va_kv, 4 * G) == bytes([FRESH]) * (4 * G)  # fresh memory, same addresses
    assert drv.read(va_w, G) == dw


def test_release_and_restore_by_tag():
    region, drv = make_region(guard=False)
    a, b = region.tag("a"), region.tag("b")
    va, vb = a.alloc(G), b.alloc(G)
    da, db = fill(drv, va, G, 3), fill(drv, vb, G, 4)
    region.release(["a"])
    assert not a.resident and b.resident and drv.physical_bytes() == G
    with pytest.raises(RuntimeError, match=r"tag\(s\) \['a'\] are released"):
        region.check_resident()
    region.check_resident(["b"])
    region.restore("a")
    assert drv.read(va, G) == da and drv.read(vb, G) == db
    with pytest.raises(ValueError, match="no tag 'c'"):
        region.release(["c"])


def test_guard_maps_released_addresses_to_scratch():
    region, drv = make_region(guard=True)
    t = region.tag()
    va = t.alloc(2 * G)
    d = fill(drv, va, 2 * G, 5)
    region.release()
    # The addresses are mapped (to scratch), so a stray access reads garbage instead of faulting;
    # only the scratch allocation is held.
    assert drv.is_mapped(va, 2 * G)
    assert drv.physical_bytes() == (64 << 20) + G and region.mapped_bytes() == 0
    region.restore()
    assert drv.read(va, 2 * G) == d and drv.physical_bytes() == (64 << 20) + 3 * G


def test_freed_allocations_go_with_the_next_release_and_their_addresses_are_reused():
    region, drv = make_region(guard=False)
    t = region.tag()
    v1, v2, v3 = (t.alloc(G) for _ in range(3))
    d1, d3 = fill(drv, v1, G, 6), fill(drv, v3, G, 7)
    t.free(v2)
    assert t.allocated_bytes == 2 * G and drv.physical_bytes() == 3 * G  # its memory goes with the release
    out = region.release()
    assert out.bytes_copied == 2 * G and drv.physical_bytes() == 0  # its bytes were not copied
    region.restore()  # v1 and v3 are no longer adjacent: two mappings, v2's addresses free again
    assert len(t.mappings) == 2 and drv.physical_bytes() == 2 * G
    assert drv.read(v1, G) == d1 and drv.read(v3, G) == d3
    v4 = t.alloc(G)
    assert v4 == v2  # the freed addresses were reused
    d4 = fill(drv, v4, G, 8)
    region.release()
    region.restore()  # v1, v4, v3 adjacent again: one mapping
    assert len(t.mappings) == 1
    assert drv.read(v1, G) == d1 and drv.read(v4, G) == d4 and drv.read(v3, G) == d3
    t.free(v4)
    t.free(v4)  # twice, or an unknown address: ignored
    t.free(12345)
    region.release()
    region.restore()
    assert drv.physical_bytes() == 2 * G and drv.read(v1, G) == d1 and drv.read(v3, G) == d3


def test_restore_maps_runs_in_chunks():
    region, drv = make_region(guard=False, chunk=4 * G)
    t = region.tag()
    vas = [t.alloc(3 * G) for _ in range(3)]  # one run of 9 pages
    data = [fill(drv, va, 3 * G, i) for i, va in enumerate(vas)]
    region.release()
    region.restore()
    assert [m.nbytes for m in t.mappings] == [4 * G, 4 * G, G]  # chunk bounds need not fall on allocations
    for va, d in zip(vas, data):
        assert drv.read(va, 3 * G) == d
    region.release()  # and released chunk by chunk
    assert drv.physical_bytes() == 0
    region.restore()
    for va, d in zip(vas, data):
        assert drv.read(va, 3 * G) == d


def test_free_while_released():
    region, drv = make_region(guard=True)
    t = region.tag()
    v1, v2 = t.alloc(G), t.alloc(G)
    d2 = fill(drv, v2, G, 8)
    region.release()
    t.free(v1)
    region.restore()  # only v2 comes back
    assert drv.read(v2, G) == d2 and t.allocated_bytes == G and t.mapped_bytes == G


def test_restore_refused_when_the_driver_is_short_then_completes():
    region, drv = make_region(total_bytes=8 * G, guard=False)
    t = region.tag()
    va = t.alloc(6 * G)
    d = fill(drv, va, 6 * G, 9)
    region.release()
    squatter = drv.create(4 * G)  # another process took memory meanwhile
    with pytest.raises(InsufficientMemoryError, match="nothing was moved"):
        region.restore()
    assert drv.physical_bytes() == 4 * G and not region.resident
    drv.release(squatter)
    region.restore()
    assert drv.read(va, 6 * G) == d


def test_allocation_while_released_is_refused():
    region, drv = make_region(guard=False)
    t = region.tag()
    t.alloc(G)
    region.release()
    with pytest.raises(RuntimeError, match="restore\\(\\) it first"):
        t.alloc(G)
    assert drv.physical_bytes() == 0


def test_misuse_gets_clear_errors():
    region, _ = make_region()
    with pytest.raises(ValueError, match="policy must be one of"):
        region.tag("x", policy="keep")
    region.tag("kv", policy="discard")
    with pytest.raises(ValueError, match="declared with policy 'discard'"):
        region.tag("kv", policy="backup")
    with pytest.raises(ValueError, match="non-empty string"):
        region.tag("")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        region.pool("kv")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_no_cuda_is_a_clear_error():
    with pytest.raises(VmmUnavailableError, match="resize backend works without one"):
        Region("r")


# ---- faults at every step of a release and of a restore --------------------------------------------
def _scenario(direction: str):
    sizes = (3 * G, 40, 2 * G, 100)  # small ones are bucketed on the (fake) accelerator

    def make():
        region, drv = make_region(guard=True, chunk=2 * G)  # restores map several chunks
        w, kv = region.tag("w"), region.tag("kv", policy="discard")
        vas = [w.alloc(n) for n in sizes]
        data = [fill(drv, va, n, i) for i, (va, n) in enumerate(zip(vas, sizes))]
        kv.alloc(G)
        gone = w.alloc(G)
        if direction == "restore":
            region.release()
            region.restore()  # chunked mappings now, then released again
            region.release()
        w.free(gone)
        return region, drv, vas, data

    def act(state):
        region = state[0]
        region.release() if direction == "release" else region.restore()

    def check(state, fired):
        region, drv, vas, data = state
        # Whatever happened, a restore completes the state, every byte in place...
        region.restore()
        assert region.resident
        for va, n, d in zip(vas, sizes, data):
            assert drv.read(va, n) == d, fired
        # ...and a full cycle after it still works and gives the memory back.
        region.release()
        assert region.mapped_bytes() == 0 and drv.physical_bytes() == (64 << 20) + G, fired
        assert all(drv.is_mapped(va, n) for va, n in zip(vas, sizes)), fired  # guarded again, whole
        region.restore()
        for va, n, d in zip(vas, sizes, data):
            assert drv.read(va, n) == d, fired

    return make, act, check


@pytest.mark.parametrize("direction", ["release", "restore"])
def test_fault_sweep(direction):
    points = sweep(*_scenario(direction))
    assert len(points) >= 4, points


def test_close_gives_everything_back_and_refuses_while_allocated():
    region, drv = make_region(guard=True)
    t = region.tag()
    va = t.alloc(2 * G)
    fill(drv, va, 2 * G, 1)
    region.release()
    region.restore()
    with pytest.raises(ValueError, match="still has allocated memory"):
        region.close()
    assert region.resident and drv.physical_bytes() > 0  # nothing freed by the refusal
    t.free(va)
    with region:
        pass  # close() on exit
    assert drv.physical_bytes() == 0 and drv._ranges == {} and region.host_bytes() == 0
    region.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        region.release()
    with pytest.raises(RuntimeError, match="closed"):
        region.tag("x")


def test_dropping_an_open_region_warns():
    region, drv = make_region(guard=False)
    region.tag().alloc(G)
    with pytest.warns(ResourceWarning, match="dropped without close"):
        del region
        gc.collect()
