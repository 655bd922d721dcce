"""skip_unchanged roles: an offload copies only the storages whose bytes changed since their host
copy was made (a device digest decides). Every write path below must make the next offload copy:
if the check were removed (always skip), the reload would bring the stale host bytes back and
these tests would fail."""

from __future__ import annotations

import ctypes

import pytest
import torch
from torch import nn

from tests.faults import sweep
from tests.transfer.fakes import FakeAccelOps
from tidal import Timeshare, TimeshareConfig
from tidal.transfer import TransferContext


def _setup(skip: bool = True):
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64))
    other = nn.Linear(32, 32)
    ts = Timeshare("cpu", context=TransferContext(FakeAccelOps()), config=TimeshareConfig(min_offload_bytes=0))
    ts.add_role("ref", model=ref, skip_unchanged=skip)
    ts.add_role("other", model=other)
    return ts, ref


def _role_bytes(m: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in list(m.parameters()) + list(m.buffers()))


def _cycle(ts):
    """ref out (other in), then ref back; returns the offload's record."""
    with ts.use("other"):
        rec = [r for r in ts.records if "ref" in r.roles_out][-1]
    with ts.use("ref"):
        pass
    return rec


def test_unchanged_role_is_released_without_a_copy():
    ts, ref = _setup()
    values = {k: v.clone() for k, v in ref.state_dict().items()}
    first = _cycle(ts)
    assert first.bytes_skipped == 0  # no host copy yet
    for _ in range(3):
        rec = _cycle(ts)
        assert rec.bytes_skipped == _role_bytes(ref) and rec.move.bytes_out == 0
    assert all(torch.equal(v, values[k]) for k, v in ref.state_dict().items())


def test_without_the_option_every_offload_copies():
    ts, ref = _setup(skip=False)
    _cycle(ts)
    rec = _cycle(ts)
    assert rec.bytes_skipped == 0 and rec.move.bytes_out == _role_bytes(ref)


def _write_inplace(ref):
    with torch.no_grad():
        ref[0].weight.add_(1.0)


def _write_data(ref):
    ref[0].weight.data[0, 0] = 123.0  # through .data: the parameter's version counter does not move


def _write_copy(ref):
    with torch.no_grad():
        ref[1].bias.copy_(torch.full_like(ref[1].bias, 7.0))


def _write_raw(ref):
    ctypes.memset(ref[0].bias.data_ptr() + 12, 0x41, 4)  # through a raw pointer: torch sees nothing


def _write_optimizer(ref):
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref(torch.randn(4, 64)).sum().backward()
    opt.step()
    ref.zero_grad(set_to_none=True)


@pytest.mark.parametrize("write", [_write_inplace, _write_data, _write_copy, _write_raw, _write_optimizer])
def test_every_write_path_makes_the_next_offload_copy(write):
    ts, ref = _setup()
    _cycle(ts)
    _cycle(ts)  # host copies exist and match
    with ts.use("ref"):
        write(ref)
        after = {k: v.clone() for k, v in ref.state_dict().items()}
    rec = _cycle(ts)
    assert rec.move.bytes_out > 0, "a written storage must be copied out again"
    with ts.use("ref"):
        assert all(torch.equal(v, after[k]) for k, v in ref.state_dict().items())
    assert _cycle(ts).bytes_skipped == _role_bytes(ref)  # and unchanged again after


def test_state_loaded_into_the_offloaded_role_comes_back_and_is_copied_later():
    ts, ref = _setup()
    _cycle(ts)
    _cycle(ts)
    new = {k: torch.full_like(v, 0.25) for k, v in ref.state_dict().items()}
    with ts.use("other"):
        ref.load_state_dict(new)  # into the host copies
    with ts.use("ref"):
        assert all(torch.equal(v, new[k]) for k, v in ref.state_dict().items())
    _cycle(ts)
    with ts.use("ref"):
        assert all(torch.equal(v, new[k]) for k, v in ref.state_dict().items())


def test_faults_in_a_checked_offload_lose_nothing():
    def make():
        ts, ref = _setup()
        _cycle(ts)
        with ts.use("ref"):
            _write_data(ref)  # half the cycles below find a change
            want = {k: v.clone() for k, v in ref.state_dict().items()}
        return ts, ref, want

    def act(state):
        _cycle(state[0])

    def check(state, fired):
        ts, ref, want = state
        for _ in range(2):
            with ts.use("ref"):
                assert all(torch.equal(v, want[k]) for k, v in ref.state_dict().items()), fired
            with ts.use("other"):
                pass

    assert len(sweep(make, act, check)) >= 6
