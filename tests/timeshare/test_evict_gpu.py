"""``TimeshareConfig(evict="as_needed")`` on a real GPU: evictions follow the driver's free
memory. With room for two of three roles (the GPU filled around them), bringing the third in
moves out exactly the least recently used one; with room for all, nothing moves; every byte
comes back exact."""

from __future__ import annotations

import pytest
import torch

import tidal
from tests.helpers import assert_same_state, snapshot_state
from tests.timeshare.test_timeshare_gpu import Blob

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

MiB = 1 << 20


def _two_of_three_fit_then_the_least_recent_goes() -> None:
    """With room for two of three roles (the GPU filled around them), bringing the third in
    moves out exactly the least recently used one; with room for all, nothing moves."""
    roles = {n: Blob(big_mib=256, n_big=4, n_small=50).cuda() for n in "abc"}
    before = {n: snapshot_state(m) for n, m in roles.items()}
    headroom = 256 * MiB
    ts = tidal.Timeshare("cuda", config=tidal.TimeshareConfig(evict="as_needed", headroom_bytes=headroom))
    for n, m in roles.items():
        ts.add_role(n, model=m)
    ts.offload_all()
    one = ts.role_bytes("a")
    torch.cuda.empty_cache()
    free = torch.cuda.mem_get_info()[0]
    # Leave room for two roles, the headroom and the staging (two buckets in, one out), not a third.
    keep = 2 * one + headroom + ts.store.staging_bytes(3) + one // 2
    filler = torch.empty(free - keep, dtype=torch.uint8, device="cuda")
    try:
        with ts.use("a"):
            pass
        with ts.use("b"):
            pass
        assert sorted(ts.resident_roles) == ["a", "b"]  # the device had room: nothing moved out
        with ts.use("c"):
            assert sorted(ts.resident_roles) == ["b", "c"]  # a, least recently used, and only a
        moves = [(r.kind, r.roles_out, r.role_in) for r in ts.records[1:]]
        assert moves == [("reload", (), "a"), ("reload", (), "b"), ("switch", ("a",), "c")]
        ts.offload_all()
    finally:
        del filler
        torch.cuda.empty_cache()
    with ts.use("a"), ts.use("b"), ts.use("c"):
        assert sorted(ts.resident_roles) == ["a", "b", "c"]  # room for all now
    for n, m in roles.items():
        assert_same_state(before[n], snapshot_state(m))
    ts.close()


def test_evict_as_needed_follows_the_drivers_free_memory():
    _two_of_three_fit_then_the_least_recent_goes()


def test_evict_as_needed_does_not_count_a_released_regions_pool_as_room():
    """The GPU suite's order found this: after the rollout-graph tests, a region's pool held
    15.5 GiB reserved and free (its segments released: no memory behind them), counted as
    room by the allocator's reserved-minus-allocated; the eviction then moved nothing out and
    the third role's load ran out of memory."""
    from tidal.vmm import Region

    region = Region("rollout")
    with region.allocate("kv"):
        cache = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    del cache  # the pool keeps the segment, free
    region.release()
    ops = tidal.device.DeviceOps("cuda")
    pool_free = ops.private_free_bytes()
    assert pool_free >= 2 << 30, pool_free
    assert ops.reserved_bytes() - ops.allocated_bytes() >= pool_free  # the allocator counts it
    assert ops.cached_free_bytes() == ops.reserved_bytes() - ops.allocated_bytes() - pool_free
    try:
        _two_of_three_fit_then_the_least_recent_goes()
    finally:
        region.close()
