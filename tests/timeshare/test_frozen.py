"""Frozen roles: once a frozen role's state has gone out, its host copy stays valid, so later
offloads release device memory without copying; a write to it is caught (verify) or handled
(load_state_dict), and results never change."""

from __future__ import annotations

import pytest
import torch

import tidal
from tests.helpers import TinyLM, lm_loss, make_trained


def _ts(verify="off"):
    return tidal.Timeshare("cpu", config=tidal.TimeshareConfig(transfer=tidal.TransferConfig(verify=verify)))


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_frozen_role_is_copied_out_once_then_only_reloaded():
    policy, opt = make_trained()
    torch.manual_seed(1)
    ref = TinyLM()
    want = {k: v.clone() for k, v in ref.state_dict().items()}
    ts = _ts()
    ts.add_role("policy", model=policy, optimizer=opt)
    ts.add_role("reference", model=ref, frozen=True)
    ref_bytes = ts.role_bytes("reference")
    ts.offload("reference")
    first = ts.records[-1]
    assert first.bytes_out == ref_bytes and first.bytes_skipped == 0  # the first time it is copied
    ids = torch.randint(0, 64, (4, 9))
    for _ in range(3):
        with ts.use("reference"):
            with torch.no_grad():
                ref(ids)
        with ts.use("policy"):  # the reference goes out: nothing of it is copied
            lm_loss(policy, ids).backward()
            opt.step()
            opt.zero_grad()
        rec = [r for r in ts.records if "reference" in r.roles_out][-1]
        assert rec.bytes_skipped == ref_bytes and rec.bytes_out < ref_bytes
        assert "without a copy" in rec.note
    ts.load("reference")
    assert all(torch.equal(v, want[k]) for k, v in ref.state_dict().items())  # bit-exact after skipped offloads
    ts.close()


def test_a_write_to_a_frozen_role_is_caught_with_verify_and_nothing_moves():
    torch.manual_seed(1)
    ref = TinyLM()
    ts = _ts(verify="full")
    ts.add_role("reference", model=ref, frozen=True)
    ts.offload("reference")
    ts.load("reference")
    with torch.no_grad():
        ref.embed.weight.add_(1.0)  # the declaration was wrong
    changed = ref.embed.weight.detach().clone()
    with pytest.raises(ValueError, match="declared frozen were written"):
        ts.offload("reference")
    assert ts.is_resident("reference") and torch.equal(ref.embed.weight.detach(), changed)
    ts.close()


def test_load_state_dict_into_a_resident_frozen_role_is_copied_out_again():
    torch.manual_seed(1)
    ref = TinyLM()
    torch.manual_seed(2)
    other = TinyLM()
    ts = _ts()
    ts.add_role("reference", model=ref, frozen=True)
    ts.offload("reference")
    ts.load("reference")
    ref.load_state_dict(other.state_dict())  # a legitimate write: seen by the load hook
    ts.offload("reference")
    assert ts.records[-1].bytes_skipped == 0 and ts.records[-1].bytes_out == ts.role_bytes("reference")
    ts.load("reference")
    assert _same(ref, other)
    ts.close()


def test_a_frozen_role_with_an_optimizer_is_refused():
    policy, opt = make_trained()
    with pytest.raises(ValueError, match="frozen=True"):
        _ts().add_role("policy", model=policy, optimizer=opt, frozen=True)


def test_fault_at_every_point_of_a_frozen_roles_skipped_offload_loses_nothing():
    """The switch that sends a frozen (already copied once) reference out without a copy and
    brings the actor in: an exception at each point leaves everything restorable."""
    from tests.faults import SmallLM, assert_consistent, same, small_trained, snapshot, sweep, tensors_of

    def make():
        model, opt = small_trained()
        torch.manual_seed(5)
        ref = SmallLM()
        ts = tidal.Timeshare("cpu")
        ts.add_role("actor", model=model, optimizer=opt)
        ts.add_role("reference", model=ref, frozen=True)
        ts.load("reference")  # the actor out (copied), the reference in...
        ts.load("actor")  # ...and out again: its host copy is valid from now on
        ts.load("reference")
        state = {"ts": ts, "modules": [model, ref], "opts": [opt]}
        state["before"] = snapshot(state["modules"], state["opts"], ts.store)
        return state

    def check(state, fired):
        ts, modules, opts = state["ts"], state["modules"], state["opts"]
        assert_consistent(ts, modules, opts)
        assert same(state["before"], snapshot(modules, opts, ts.store)), f"values changed (fault at {fired})"
        ts.load("actor")
        ts.load("reference")
        ts.close()
        now = {n: t.detach().to("cpu", copy=True) for n, t in tensors_of(modules, opts)}
        assert same(state["before"], now), f"state not restored bit-exact (fault at {fired})"

    points = sweep(make, lambda s: s["ts"].load("actor"), check)
    assert "offload_skipped" in points, points  # the skipped offload was swept
