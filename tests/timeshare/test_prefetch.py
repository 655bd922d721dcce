"""Prefetch (issue 16, item 2): the next role's H2D queued behind the current phase, the
current role's bytes written back ahead of its offload, and the switch that follows claiming
both. On the CPU the copies are synchronous, so these tests cover the bookkeeping: values
bit-exact, what each record says moved, foreign access while a prefetch is pending, what
cancels one, the waits the claim makes (through the fake accelerator's stream log), refusals,
and faults at every point. The race itself (a claim that does not wait) is the GPU test's."""

from __future__ import annotations

import ctypes

import pytest
import torch
from torch import nn

from tests.faults import SmallLM, assert_consistent, same, snapshot, sweep, tensors_of
from tests.transfer.fakes import FakeAccelOps
from tidal import Timeshare, TimeshareConfig, TransferConfig
from tidal.errors import StateCorruptionError
from tidal.state.backends import holds_memory
from tidal.transfer import TransferContext
from tests.helpers import held_bytes, is_out


def _nbytes(m: nn.Module) -> int:
    return sum(held_bytes(t) for t in list(m.parameters()) + list(m.buffers()))


def _setup(*, fake: bool = False, **cfg):
    torch.manual_seed(0)
    actor = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 8))
    ref = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 8))
    ctx = TransferContext(FakeAccelOps()) if fake else None
    ts = Timeshare("cpu", context=ctx, config=TimeshareConfig(min_offload_bytes=0, **cfg))
    opt = torch.optim.AdamW(actor.parameters(), lr=1e-2)
    ts.add_role("actor", model=actor, optimizer=opt)
    ts.add_role("ref", model=ref, frozen=True)
    return ts, actor, ref, opt


def _values(m: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in m.state_dict().items()}


def _equal(m: nn.Module, want: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(v, want[k]) for k, v in m.state_dict().items())


def test_prefetched_role_comes_in_without_a_copy_and_bit_exact():
    ts, actor, ref, _ = _setup()
    want = _values(ref)
    with ts.use("actor"):
        pass  # ref goes out (its first offload copies)
    with ts.use("actor"):
        rec = ts.prefetch("ref")
        assert rec.kind == "prefetch" and rec.role_in == "ref" and rec.queued
        assert rec.bytes_in == _nbytes(ref)
        # The host's time inside the call that queued the copies is a part of the verb's
        # (on the CPU that call does the copies, so it is not zero).
        assert 0.0 < rec.move.queue_seconds <= rec.move.seconds
        assert not ts.is_resident("ref")  # not before use() claims it
        assert all(not holds_memory(p.untyped_storage()) for p in ref.parameters())
    with ts.use("ref"):
        switch = ts.records[-1]
        assert switch.kind == "switch" and switch.bytes_in == 0
        assert switch.bytes_prefetched == _nbytes(ref)
        assert _equal(ref, want)
        ref(torch.randn(2, 64))  # the module runs
    assert_consistent(ts, [actor, ref], [])


def test_bytes_to_load_leaves_out_what_a_prefetch_brought_in_ahead():
    """What making a role resident would still copy in: all of its state while out, the rest
    once a prefetch brought part of it in, nothing once all of it arrived or it is resident."""
    ts, actor, ref, _ = _setup()
    with ts.use("actor"):
        pass  # ref goes out
    assert ts.bytes_to_load("actor") == 0  # resident
    whole = ts.role_bytes("ref")
    assert whole > 0 and ts.bytes_to_load("ref") == whole
    with ts.use("actor"):
        part = ts.prefetch("ref", limit_bytes=whole - 1).bytes_in  # not the last storage
        assert 0 < part < whole
        assert ts.bytes_to_load("ref") == whole - part
        ts.prefetch("ref")  # the rest
        assert ts.bytes_to_load("ref") == 0 and not ts.is_resident("ref")
    with pytest.raises(ValueError, match="unknown role 'critic'"):
        ts.bytes_to_load("critic")


def test_training_with_prefetch_is_bit_identical_to_without():
    def run(prefetch: bool):
        ts, actor, ref, opt = _setup()
        torch.manual_seed(1)
        losses = []
        for _ in range(4):
            x = torch.randn(8, 64)
            with ts.use("ref"):
                if prefetch:
                    ts.prefetch("actor")
                with torch.no_grad():
                    target = ref(x)
            with ts.use("actor"):
                if prefetch:
                    ts.prefetch("ref")
                loss = (actor(x) - target).pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
        ts.close()
        return losses, [p.detach().clone() for p in actor.parameters()], ts

    base, w_base, _ = run(False)
    got, w_got, ts = run(True)
    assert base == got
    assert all(torch.equal(a, b) for a, b in zip(w_base, w_got))
    kinds = [r.kind for r in ts.records]
    assert "prefetch" in kinds
    assert any(r.bytes_prefetched > 0 for r in ts.records)


def test_write_back_makes_the_next_offload_copy_nothing_when_unchanged():
    ts, actor, ref, opt = _setup()
    size = _nbytes(actor)
    with ts.use("ref"):
        pass
    with ts.use("actor"):
        want = _values(actor)
        rec = ts.prefetch("ref")
        assert rec.bytes_out == size and rec.roles_out == ("actor",)
    with ts.use("ref"):
        switch = ts.records[-1]
        assert switch.bytes_out == 0 and switch.bytes_skipped == size
    with ts.use("actor"):
        assert _equal(actor, want)


def _write_inplace(m):
    with torch.no_grad():
        m[0].weight.add_(1.0)


def _write_data(m):
    m[0].weight.data[0, 0] = 123.0  # no version-counter bump


def _write_raw(m):
    ctypes.memset(m[2].bias.data_ptr(), 0x41, 4)  # torch sees nothing


def _write_step(m):
    m(torch.randn(4, 64)).sum().backward()
    torch.optim.SGD(m.parameters(), lr=0.1).step()
    m.zero_grad(set_to_none=True)


@pytest.mark.parametrize("write", [_write_inplace, _write_data, _write_raw, _write_step])
def test_a_write_after_the_write_back_is_copied_by_the_switch(write):
    # If the switch trusted the written-back host copy without checking, the reload below
    # would bring the bytes from before the write back.
    ts, actor, ref, _ = _setup()
    with ts.use("ref"):
        pass
    with ts.use("actor"):
        ts.prefetch("ref")
        write(actor)
        want = _values(actor)
    with ts.use("ref"):
        assert ts.records[-1].bytes_out > 0
    with ts.use("actor"):
        assert _equal(actor, want)


def test_state_dict_of_a_prefetched_role_reads_its_host_copies():
    ts, actor, ref, _ = _setup()
    want = _values(ref)
    with ts.use("actor"):
        ts.prefetch("ref")
        sd = ref.state_dict()
        assert all(v.device.type == "cpu" for v in sd.values())
        assert all(torch.equal(v, want[k]) for k, v in sd.items())
        with pytest.raises(RuntimeError, match="offloaded"):
            ref(torch.randn(2, 64))  # still out: the guard refuses a forward
    with ts.use("ref"):
        assert _equal(ref, want)


def test_state_loaded_into_a_prefetched_role_is_what_comes_in():
    # The prefetch had already copied the old bytes in; the load writes the host copies, so
    # the storages it reached must come in again (else the old bytes would be used).
    ts, actor, ref, _ = _setup()
    new = {k: torch.full_like(v, 0.5) for k, v in ref.state_dict().items()}
    with ts.use("actor"):
        ts.prefetch("ref")
        ref.load_state_dict(new)
    with ts.use("ref"):
        assert _equal(ref, new)
        assert ts.records[-1].bytes_in > 0  # the loaded storages were copied in again


def test_another_transition_gives_the_prefetched_memory_back():
    ts, actor, ref, _ = _setup()
    want = _values(ref)
    ts.add_role("third", model=nn.Linear(16, 16))
    with ts.use("actor"):
        ts.prefetch("ref")
    assert ts.store.prefetched_bytes == _nbytes(ref)
    with ts.use("third"):  # not the prefetched role: its memory goes back first
        assert ts.store.prefetched_bytes == 0
        assert all(is_out(p) for p in ref.parameters())
    assert_consistent(ts, [actor, ref], [])
    with ts.use("ref"):
        assert _equal(ref, want)


def test_limit_and_free_memory_bound_what_comes_in_ahead():
    ts, actor, ref, _ = _setup()
    want = _values(ref)
    first = ref[0].weight.untyped_storage().nbytes()
    with ts.use("actor"):
        rec = ts.prefetch("ref", limit_bytes=first)
        assert rec.bytes_in == first  # in the order the module lists them, up to the limit
        assert ts.prefetch("ref") is None or ts.store.prefetched_bytes == _nbytes(ref)
    with ts.use("ref"):
        assert _equal(ref, want)
    ts2, _, ref2, _ = _setup(fake=True)
    ts2.offload("ref")
    ts2.context.ops.free_bytes = 0  # nothing free: nothing comes in ahead
    assert ts2.prefetch("ref", write_back=False) is None
    ts2.context.ops.free_bytes = 1 << 40
    assert ts2.prefetch("ref", write_back=False, leave_free_bytes=(1 << 40)) is None


def test_a_budget_bounds_the_prefetch_next_to_the_resident_roles():
    ts, actor, ref, _ = _setup(budget_bytes=0)
    budget = _nbytes(actor) + held_bytes(ref[0].weight)
    ts, actor, ref, _ = _setup(budget_bytes=budget)
    ts.load("actor")
    assert not ts.is_resident("ref")
    rec = ts.prefetch("ref")
    assert rec.bytes_in <= budget - _nbytes(actor)


def test_the_claim_waits_on_the_device_not_the_host():
    ts, actor, ref, _ = _setup(fake=True)
    ops = ts.context.ops
    with ts.use("actor"):
        ts.prefetch("ref", write_back=False)
        # The copy events are on the copy streams (the compute stream's are timing marks).
        queued = [e for e in ops.log if e[0] == "record" and e[1] != "compute"]
    assert queued, "the prefetch recorded no copy event"
    last = queued[-1][2]
    start = len(ops.log)
    with ts.use("ref"):
        claim = ops.log[start:]
    assert ("wait_event", "compute", last) in claim, "the compute stream must wait for the prefetched copies"
    assert ("sync", last) not in claim, "claiming a prefetch must not block the host"


def test_refusals():
    ts, actor, ref, _ = _setup()
    with pytest.raises(ValueError, match="unknown role"):
        ts.prefetch("nope")
    with pytest.raises(ValueError, match="leave_free_bytes"):
        ts.prefetch("ref", leave_free_bytes=-1)
    with pytest.raises(ValueError, match="limit_bytes"):
        ts.prefetch("ref", limit_bytes=-1)
    assert ts.prefetch("actor") is None  # resident already
    x = torch.randn(4, 64, requires_grad=True)
    y = actor(x)

    def hook(g):
        ts.prefetch("ref")
        return g

    y.register_hook(hook)
    with pytest.raises(RuntimeError, match="backward"):
        y.sum().backward()
    ts.close()
    with pytest.raises(RuntimeError, match="closed"):
        ts.prefetch("ref")


def test_close_claims_a_pending_prefetch():
    ts, actor, ref, _ = _setup()
    want = _values(ref)
    with ts.use("actor"):
        ts.prefetch("ref")
    ts.close()
    assert _equal(ref, want) and all(holds_memory(p.untyped_storage()) for p in ref.parameters())


# ---- faults at every point ----------------------------------------------------------------------
def _faulty(config: TimeshareConfig | None = None, context: TransferContext | None = None):
    """An actor (trained one step) and a reference on a timeshare, the actor in (shared with
    test_no_wait.py's sweep)."""
    torch.manual_seed(3)
    actor, ref = SmallLM(), SmallLM()
    opt = torch.optim.AdamW(actor.parameters(), lr=1e-2)
    actor(torch.tensor([[1, 2, 3]])).float().sum().backward()
    opt.step()
    ts = Timeshare("cpu", config=config, context=context)
    ts.add_role("actor", model=actor, optimizer=opt)
    ts.add_role("ref", model=ref)
    ts.load("actor")
    state = {"ts": ts, "modules": [actor, ref], "opts": [opt]}
    state["before"] = snapshot(state["modules"], state["opts"], ts.store)
    return state


def _check(state, fired):
    ts, modules, opts = state["ts"], state["modules"], state["opts"]
    assert_consistent(ts, modules, opts)
    for name in ("ref", "actor", "ref"):
        with ts.use(name):
            pass
        assert_consistent(ts, modules, opts)
    ts.close()
    now = {n: t.detach().to("cpu", copy=True) for n, t in tensors_of(modules, opts)}
    assert same(state["before"], now), f"state not restored bit-exact (fault at {fired})"


def _prefetch_then_use(state):
    ts = state["ts"]
    ts.prefetch("ref")
    with ts.use("ref"):
        pass


def _prefetch_then_other(state):
    ts = state["ts"]
    ts.prefetch("ref")
    ts.offload("actor")  # cancels the prefetch


@pytest.mark.parametrize("act", [_prefetch_then_use, _prefetch_then_other])
def test_fault_at_every_point_of_a_prefetch_and_what_follows_loses_nothing(act):
    points = sweep(_faulty, act, _check)
    assert {"prefetch_allocated", "prefetch_claimed" if act is _prefetch_then_use else "prefetch_cancelled"} <= set(
        points
    )


def test_verify_checks_the_bytes_a_prefetch_brought_in():
    """With verify on, the claim compares the arrived bytes with the digest taken at offload: a
    corrupted host copy is refused and its storage stays out (its bytes never used)."""
    ts, actor, ref, _ = _setup(transfer=TransferConfig(verify="full"))
    want = _values(ref)
    with ts.use("actor"):
        ts.prefetch("ref")
    with ts.use("ref"):
        assert _equal(ref, want)  # clean bytes pass the check
    with ts.use("actor"):
        weight = ref[0].weight.untyped_storage()
        ts.store.arena.view(ts.store._slots[weight._cdata][0])[0] ^= 0xFF  # the host copy goes bad
        ts.prefetch("ref")
    with pytest.raises(StateCorruptionError, match="0.weight"):
        ts.load("ref")
    assert not holds_memory(weight) and ts.store.is_offloaded(weight._cdata)
