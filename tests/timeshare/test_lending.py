"""Timeshare.lending: a role in use lends the device memory of parameters it will not read in
a block (an FSDP2 policy's shards while its full copy is gathered for generation); they come
back bit-exact as the block ends, under any exception, at any point of the copies."""

from __future__ import annotations

import pytest
import torch

import tidal
from tests.faults import SmallLM, assert_consistent, same, small_trained, snapshot, sweep, tensors_of
from tests.helpers import is_out
from tidal import guard


def _state():
    model, opt = small_trained()
    torch.manual_seed(5)
    ref = SmallLM()
    ts = tidal.Timeshare("cpu")
    ts.add_role("actor", model=model, optimizer=opt, optimizer_residency="step")
    ts.add_role("reference", model=ref)
    ts.offload("reference")
    state = {"ts": ts, "modules": [model, ref], "opts": [opt], "model": model}
    state["before"] = snapshot(state["modules"], state["opts"], ts.store)
    return state


def _lent(model) -> list[torch.Tensor]:
    return [model.proj.weight, model.gate]


def test_lent_parameters_leave_the_device_for_the_block_and_come_back_bit_exact():
    s = _state()
    ts, model = s["ts"], s["model"]
    with ts.use("actor"):
        with ts.lending("actor") as lend:
            lend.out(_lent(model))
            lend.out([model.proj.weight])  # already lent: skipped
            assert all(is_out(t) for t in _lent(model)) and not is_out(model.proj.bias)
            lent_bytes = lend.lent_bytes
            assert lent_bytes == sum(t.untyped_storage().nbytes() for t in _lent(model)) > 0
            assert ts.is_resident("actor")  # still the role's turn: nothing brings it in or out
            if guard.available():
                with pytest.raises(RuntimeError, match="role 'actor' is lent to host memory for a Timeshare.lending"):
                    model.proj.weight.sum()  # a foreign read gets the moved-out error, not garbage
        assert not any(is_out(t) for t in _lent(model))
        assert_consistent(ts, s["modules"], s["opts"])
    now = {n: t.detach().clone() for n, t in tensors_of(s["modules"], s["opts"]) if not is_out(t)}
    assert same(s["before"], now, keys=now.keys())
    lent = [r for r in ts.records if "lent" in r.note]
    assert [r.kind for r in lent] == ["offload", "reload"]
    assert lent[0].bytes_out == lent[1].bytes_in == lent_bytes and lend.lent_bytes == 0
    ts.close()


def test_lending_is_refused_outside_the_roles_turn_and_for_another_roles_tensor():
    s = _state()
    ts, model = s["ts"], s["model"]
    with pytest.raises(ValueError, match=r"resident and in use .*timeshare.use\('actor'\)"):
        with ts.lending("actor"):
            pass
    with ts.use("actor"):
        with ts.lending("actor") as lend:
            with pytest.raises(ValueError, match="not one of the role's parameters"):
                lend.out([model.proj.weight, s["modules"][1].proj.weight])  # the reference's: refused first
            assert not is_out(model.proj.weight)  # nothing moved
    assert not any(r.note for r in ts.records if "lent" in r.note)
    ts.close()


def test_an_exception_inside_the_block_brings_the_lent_parameters_back():
    s = _state()
    ts, model = s["ts"], s["model"]
    with ts.use("actor"):
        with pytest.raises(KeyboardInterrupt), ts.lending("actor") as lend:
            lend.out(_lent(model))
            raise KeyboardInterrupt
        assert not any(is_out(t) for t in _lent(model))
    assert_consistent(ts, s["modules"], s["opts"])
    ts.close()
    now = {n: t.detach().clone() for n, t in tensors_of(s["modules"], s["opts"])}
    assert same(s["before"], now)


def _lend_and_return(s) -> None:
    ts, model = s["ts"], s["model"]
    with ts.use("actor"):
        with ts.lending("actor") as lend:
            lend.out([model.proj.weight])
            lend.out([model.gate])


def _check(s, fired) -> None:
    ts, modules, opts = s["ts"], s["modules"], s["opts"]
    assert_consistent(ts, modules, opts)
    assert same(s["before"], snapshot(modules, opts, ts.store)), f"values changed (fault at {fired})"
    ts.load("reference")  # the next transitions work
    ts.load("actor")
    assert_consistent(ts, modules, opts)
    ts.close()
    now = {n: t.detach().to("cpu", copy=True) for n, t in tensors_of(modules, opts)}
    assert same(s["before"], now), f"state not restored bit-exact (fault at {fired})"


@pytest.mark.slow
def test_fault_at_every_point_of_a_lending_loses_nothing():
    points = sweep(_state, _lend_and_return, _check)
    assert len(points) >= 6, points
