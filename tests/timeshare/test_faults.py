"""Issue 12: an exception (KeyboardInterrupt, or an error such as a CUDA fault surfacing at an
event wait) at any point of a transition loses nothing.

Each test sweeps every instrumented point of one operation (tests/faults.py) and checks, after
each injected fault: every storage is resident or tracked (never freed and forgotten), the
roles' flags agree with where their tensors are, the values read through the host copies are
unchanged, and the next transition and ``close()`` bring back bit-exact state.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import tidal
from tests.faults import SmallLM, assert_consistent, same, small_loss, small_trained, snapshot, sweep, tensors_of


def _timeshare(residency: str, *, start: str):
    model, opt = small_trained()
    torch.manual_seed(5)
    ref = SmallLM()
    ts = tidal.Timeshare("cpu")
    ts.add_role("actor", model=model, optimizer=opt, optimizer_residency=residency)
    ts.add_role("reference", model=ref)
    if start == "actor_out":
        ts.offload("actor")
    elif start == "reference_in":
        ts.load("reference")
    elif start == "reference_out":
        ts.offload("reference")
    state = {"ts": ts, "modules": [model, ref], "opts": [opt], "model": model, "opt": opt}
    state["before"] = snapshot(state["modules"], state["opts"], ts.store)
    return state


def _check_movement(state, fired):
    ts, modules, opts = state["ts"], state["modules"], state["opts"]
    assert_consistent(ts, modules, opts)
    # Read through the host copies where offloaded: a transition moves bytes, never changes them.
    assert same(state["before"], snapshot(modules, opts, ts.store)), f"values changed (fault at {fired})"
    ts.load("actor")  # the next transition works
    assert_consistent(ts, modules, opts)
    ts.load("reference")
    ts.close()  # and close() brings every storage back
    now = {n: t.detach().to("cpu", copy=True) for n, t in tensors_of(modules, opts)}
    assert same(state["before"], now), f"state not restored bit-exact (fault at {fired})"


MOVES = {
    "offload": ("actor_in", lambda s: s["ts"].offload("actor")),
    "reload": ("actor_out", lambda s: s["ts"].load("actor")),
    "switch": ("actor_in", lambda s: s["ts"].load("reference")),
    "switch_back": ("reference_in", lambda s: s["ts"].load("actor")),
    "use_block": ("actor_in", lambda s: _use(s["ts"], "reference")),
    "offload_all": ("actor_in", lambda s: s["ts"].offload_all()),
    "offload_all_handing_over": ("actor_in", lambda s: _hand_over(s["ts"])),
    # keep_free_bytes: the reference comes in beside the actor (issue 26's kept policy),
    # directly, or claimed from a prefetch that wrote nothing back
    "load_beside": ("reference_out", lambda s: _load_beside(s["ts"])),
    "prefetch_then_use_beside": ("reference_out", lambda s: _prefetch_then_use_beside(s["ts"])),
    # a phase out of memory beside a kept role (issue 26): the others go, a prefetch given back
    "evict_others": ("reference_out", lambda s: _evict_others_beside(s["ts"])),
}


def _load_beside(ts):
    ts.load("reference", keep_free_bytes=0)
    assert ts.is_resident("actor") and ts.is_resident("reference")


def _prefetch_then_use_beside(ts):
    ts.prefetch("reference", keep_free_bytes=0)
    with ts.use("reference", keep_free_bytes=0):
        assert ts.is_resident("actor")


def _evict_others_beside(ts):
    ts.load("reference", keep_free_bytes=0)
    with ts.use("actor", keep_free_bytes=0):
        assert ts.evict_others("actor") > 0
        assert ts.resident_roles == ["actor"]


def _hand_over(ts):
    """An offload giving memory back in small chunks, as a lease's overlapped hand-over does."""
    ts.config = dataclasses.replace(ts.config, handover_chunk_bytes=64)
    ts.offload_all(on_released=lambda returned, total: None)


def _use(ts, name):
    with ts.use(name):
        pass


@pytest.mark.parametrize("residency", ["role", "step"])
@pytest.mark.parametrize("move", sorted(MOVES))
@pytest.mark.slow
def test_fault_at_every_point_of_a_transition_loses_nothing(move, residency):
    start, act = MOVES[move]
    points = sweep(lambda: _timeshare(residency, start=start), act, _check_movement)
    assert len(points) >= 8, points  # every storage's copy, track and free, at least


def _stepping(residency: str):
    state = _timeshare(residency, start="actor_in")
    with state["ts"].use("actor"):  # optimizer state goes to the host (step/stream residency)
        pass
    state["before"] = snapshot(state["modules"], state["opts"], state["ts"].store)
    return state


def _params_and_moments(state, snap):
    """Per parameter: its value and optimizer state, as one tuple of tensors."""
    names = [n for n, _ in tensors_of(state["modules"][:1], [])]
    opt_names = [n for n, _ in tensors_of([], state["opts"])]
    per_param: dict[str, list[str]] = {}
    params = [n for n in names if not n.endswith(".grad") and ".buf." not in n]
    order = {id(p): i for i, p in enumerate(state["opt"].state)}
    for n, p in zip(params, state["model"].parameters()):
        i = order.get(id(p))
        per_param[n] = [n] + [o for o in opt_names if i is not None and o.startswith(f"o0.{i}.")]
    return per_param


@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("residency", ["step", "stream"])
@pytest.mark.slow
def test_fault_at_every_point_of_an_optimizer_step_leaves_no_torn_parameter(residency, prefetch):
    """A step with its state brought in (step) or streamed chunk by chunk (stream), with or
    without its state prefetched ahead (``prefetch_optimizer``, faults in it swept too): after
    a fault, each parameter with its optimizer state is entirely as before the step or
    entirely as after it; the bookkeeping is consistent; and (stream) step() again completes
    the step exactly."""
    clean: dict = {}
    ids = torch.randint(0, 16, (2, 6), generator=torch.Generator().manual_seed(2))

    def make():
        state = _stepping(residency)
        with state["ts"].use("actor"):
            small_loss(state["model"], ids).backward()
        return state

    def act(state):
        with state["ts"].use("actor"):
            if prefetch:
                assert state["ts"].prefetch_optimizer("actor") is not None
            state["opt"].step()

    def check(state, fired):
        ts, modules, opts = state["ts"], state["modules"], state["opts"]
        assert_consistent(ts, modules, opts)
        now = snapshot(modules, opts, ts.store)
        if fired is None:
            clean["after"] = now
            return
        before, after = state["before"], clean["after"]
        for param, keys in _params_and_moments(state, now).items():
            assert same(now, before, keys) or same(now, after, keys), f"{param} torn by a fault at {fired}"
        if residency == "stream" and any(p.grad is not None for p in state["model"].parameters()):
            if not same(now, after, [k for k in now if not k.endswith(".grad")]):
                with ts.use("actor"):
                    state["opt"].step()  # completes the interrupted step
                done = snapshot(modules, opts, ts.store)
                keys = [k for k in done if not k.endswith(".grad")]
                assert same(done, after, keys), f"step() again did not complete the step (fault at {fired})"
        ts.close()

    points = sweep(make, act, check)
    assert len(points) >= 4, points


@pytest.mark.parametrize("grads", [False, True])
@pytest.mark.slow
def test_fault_at_every_point_of_offload_optimizer_for_a_role(grads):
    def make():
        return _timeshare("role", start="actor_in")

    def act(state):
        with tidal.offload_optimizer(state["opt"], grads=grads):
            pass

    points = sweep(make, act, _check_movement)
    assert len(points) >= 4, points


@pytest.mark.parametrize("grads", [False, True])
@pytest.mark.slow
def test_fault_at_every_point_of_a_standalone_offload_optimizer(grads):
    """offload_optimizer on an optimizer of no timeshare: after a fault anywhere (the offload,
    the block, the reload), state_dict() reads the right values wherever they are, and the
    next step() equals the step of a run without the fault."""
    ids = torch.randint(0, 16, (2, 6), generator=torch.Generator().manual_seed(4))
    clean: dict = {}

    def make():
        model, opt = small_trained()
        return {"model": model, "opt": opt, "modules": [model], "opts": [opt]}

    def act(s):
        with tidal.offload_optimizer(s["opt"], grads=grads):
            pass

    def check(s, fired):
        model, opt = s["model"], s["opt"]
        sd = opt.state_dict()  # right wherever the state is (host copies if stranded)
        values = {f"{i}.{k}": v.clone() for i, st in sd["state"].items() for k, v in st.items()}
        opt.step()  # brings stranded state (and grads) back first
        small_loss(model, ids).backward()
        opt.step()
        after = {n: t.detach().clone() for n, t in tensors_of([model], [opt])}
        if fired is None:
            clean["values"], clean["after"] = values, after
            return
        assert same(values, clean["values"]), f"state_dict() wrong after a fault at {fired}"
        assert same(after, clean["after"]), f"training diverged after a fault at {fired}"

    points = sweep(make, act, check)
    assert len(points) >= 4, points
