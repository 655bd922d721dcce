"""A timeshare role whose model lives in a region tag (``add_role(region=...)``): offload copies
it out and unmaps its memory in place, reload maps it back at the same addresses; foreign and
strict access see it as moved out although its storages keep their size. CPU, through the fake
VMM driver."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.faults import sweep
from tests.transfer.fakes import FakeAccelOps
from tests.vmm.fakes import FakeDriver
from tidal import Timeshare, TimeshareConfig
from tidal.state.foreign import moved_out
from tidal.state.strict import StrictAccessError, strict_access
from tidal.transfer import TransferContext
from tidal.vmm import Region

G = 4096


def _in_region(model: nn.Module, tag, drv) -> None:
    """Move every parameter's bytes into memory allocated in ``tag`` (as if built inside it)."""
    with torch.no_grad():
        for p in model.parameters():
            n = p.numel() * p.element_size()
            view = drv.view(tag.alloc(n), n).view(p.dtype).view(p.shape)
            view.copy_(p)
            p.data = view


def _setup(guard: bool = True, **cfg):
    drv = FakeDriver(total_bytes=256 << 20, granularity=G)
    ctx = TransferContext(FakeAccelOps())
    region = Region("r", driver=drv, context=ctx, guard_released=guard, reserve_bytes=1 << 20)
    tag = region.tag("policy", policy="discard")
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 32))
    _in_region(a, tag, drv)
    b = nn.Linear(48, 48)  # an ordinary role beside it
    ts = Timeshare("cpu", context=ctx, config=TimeshareConfig(min_offload_bytes=0, **cfg))
    ts.add_role("a", model=a, region=tag)
    ts.add_role("b", model=b)
    return ts, region, tag, drv, a, b


def test_region_role_keeps_addresses_and_bytes_and_gives_memory_back():
    ts, region, tag, drv, a, b = _setup()
    ref = {k: v.clone() for k, v in a.state_dict().items()}
    ptrs = [p.data_ptr() for p in a.parameters()]
    b_ref = {k: v.clone() for k, v in b.state_dict().items()}
    with ts.use("b"):
        assert not tag.resident and region.mapped_bytes() == 0  # unmapped in place
        assert all(moved_out(p) and p.untyped_storage().nbytes() > 0 for p in a.parameters())
        sd = a.state_dict()  # foreign access: the host copies, not the scratch behind the addresses
        assert all(torch.equal(sd[k], ref[k]) for k in ref)
        with pytest.raises(StrictAccessError, match="role 'a'"), strict_access(ts):
            a[0].weight.sum()
    with ts.use("a"):
        assert tag.resident and [p.data_ptr() for p in a.parameters()] == ptrs
        assert all(torch.equal(v, ref[k]) for k, v in a.state_dict().items())
        assert not any(moved_out(p) for p in a.parameters())
        with torch.no_grad():
            a[0].weight.add_(1.0)  # training changes it
        changed = a[0].weight.clone()
    with ts.use("b"):
        pass
    with ts.use("a"):
        assert torch.equal(a[0].weight, changed) and [p.data_ptr() for p in a.parameters()] == ptrs
    assert all(torch.equal(v, b_ref[k]) for k, v in b.state_dict().items())


def test_other_memory_in_the_tag_is_kept_and_the_tag_still_goes():
    """A module's plain tensor attribute (not a parameter or buffer, e.g. a rotary cache) in the
    role's tag: the region copies it, so the tag's memory still goes back to the driver."""
    ts, region, tag, drv, a, b = _setup(guard=False)
    stray = tag.alloc(G)
    drv.write(stray, bytes(range(256)) * (G // 256))
    with ts.use("b"):
        assert region.mapped_bytes() == 0 and drv.physical_bytes() == 0
    with ts.use("a"):
        assert drv.read(stray, G) == bytes(range(256)) * (G // 256)


def test_load_state_dict_into_an_offloaded_region_role():
    ts, region, tag, drv, a, b = _setup()
    new = {k: torch.full_like(v, 0.5) for k, v in a.state_dict().items()}
    with ts.use("b"):
        a.load_state_dict(new)  # written into the host copies
    with ts.use("a"):
        assert all(torch.equal(v, new[k]) for k, v in a.state_dict().items())


def test_region_role_misuse():
    drv = FakeDriver(total_bytes=64 << 20, granularity=G)
    ctx = TransferContext(FakeAccelOps())
    region = Region("r", driver=drv, context=ctx, reserve_bytes=1 << 20)
    ts = Timeshare("cpu", context=ctx, config=TimeshareConfig(min_offload_bytes=0))
    with pytest.raises(ValueError, match="policy='discard'"):
        ts.add_role("x", model=nn.Linear(4, 4), region=region.tag("w"))  # a backup tag
    with pytest.raises(ValueError, match="none of its storages lies in region"):
        ts.add_role("x", model=nn.Linear(4, 4), region=region.tag("kv", policy="discard"))
    with pytest.raises(TypeError, match="RegionTag"):
        ts.add_role("x", model=nn.Linear(4, 4), region=region)
    assert ts.roles == []  # nothing registered by a refusal


def test_faults_in_region_role_switches_lose_nothing():
    def make():
        ts, region, tag, drv, a, b = _setup()
        ref = {k: v.clone() for k, v in a.state_dict().items()}
        return ts, a, ref, [p.data_ptr() for p in a.parameters()]

    def act(state):
        ts = state[0]
        with ts.use("b"):
            pass
        with ts.use("a"):
            pass

    def check(state, fired):
        ts, a, ref, ptrs = state
        with ts.use("a"):
            assert [p.data_ptr() for p in a.parameters()] == ptrs, fired
            assert all(torch.equal(v, ref[k]) for k, v in a.state_dict().items()), fired
        with ts.use("b"):
            pass
        with ts.use("a"):
            assert all(torch.equal(v, ref[k]) for k, v in a.state_dict().items()), fired

    assert len(sweep(make, act, check)) >= 6


def test_a_region_role_handed_over_in_chunks_comes_back_exact():
    """An offload in hand-over chunks settles after every chunk; a region tag must not be
    unmapped then while some of its storages are still to be copied out (the copies would read
    the scratch behind the released addresses and the host copies would be garbage)."""
    from tidal.transfer import TransferConfig

    small = TransferConfig(bucket_bytes=2048, small_tensor_bytes=512)  # several copies, several chunks
    ts, region, tag, drv, a, b = _setup(handover_chunk_bytes=4096, transfer=small)
    ref = {k: v.clone() for k, v in a.state_dict().items()}
    ptrs = [p.data_ptr() for p in a.parameters()]
    ts.load("a")
    reports = []
    ts.offload_all(on_released=lambda returned, total: reports.append((returned, total)))
    assert len(reports) >= 3 and not tag.resident and region.mapped_bytes() == 0
    assert reports[-1][0] > 0  # the tag's memory went back, at the end
    ts.load("a")
    assert [p.data_ptr() for p in a.parameters()] == ptrs
    assert all(torch.equal(v, ref[k]) for k, v in a.state_dict().items())
