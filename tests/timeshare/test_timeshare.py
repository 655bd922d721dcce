"""Timeshare on device="cpu": the same code path as on a GPU, with synchronous copies."""

from __future__ import annotations

import dataclasses


import pytest
import torch
import torch.nn as nn

import tidal
from tests.helpers import TinyLM, assert_same_state, held_bytes, lm_loss, make_trained, snapshot_state


def _nbytes(t: torch.Tensor) -> int:
    return held_bytes(t)  # 0 once tidal released the storage (it keeps its size while guarded)


def _all_state_tensors(model, opt):
    ts = list(model.parameters()) + list(model.buffers())
    ts += [p.grad for p in model.parameters() if p.grad is not None]
    ts += [v for st in opt.state.values() for k, v in st.items() if k != "step"]
    return ts


@pytest.mark.parametrize("residency", ["role", "step", "stream"])
def test_round_trip_is_bit_exact_and_keeps_identity(residency):
    model, opt = make_trained()
    ref = TinyLM()
    before = snapshot_state(model, opt)
    tensors = _all_state_tensors(model, opt)
    ids = [id(t) for t in tensors]
    state_keys = [id(p) for p in opt.state]
    with tidal.Timeshare("cpu") as ts:
        ts.add_role("actor", model=model, optimizer=opt, optimizer_residency=residency)
        ts.add_role("reference", model=ref)
        with ts.use("reference"):
            assert all(_nbytes(t) == 0 for t in tensors), "offloaded storages must be freed"
            assert _nbytes(ref.embed.weight) > 0
        with ts.use("actor"):
            assert _nbytes(ref.embed.weight) == 0
            if residency == "role":
                assert_same_state(before, snapshot_state(model, opt))
        assert ts.records[0].kind == "offload" and ts.records[1].kind == "switch"
    # close() brought everything back, step-residency optimizer state included
    assert_same_state(before, snapshot_state(model, opt))
    assert [id(t) for t in _all_state_tensors(model, opt)] == ids
    assert [id(p) for p in opt.state] == state_keys
    assert model.head.weight is model.embed.weight


def test_offload_frees_every_storage_and_reports_bytes():
    model, opt = make_trained()
    with tidal.Timeshare("cpu") as ts:
        ts.add_role("actor", model=model, optimizer=opt, optimizer_residency="role")
        total = ts.role_bytes("actor")
        unique = {t.untyped_storage()._cdata: t for t in _all_state_tensors(model, opt)}
        assert total == sum(_nbytes(t) for t in unique.values())
        rec = ts.offload("actor")
        assert rec.bytes_out == total and rec.bytes_in == 0
        assert all(_nbytes(t) == 0 for t in unique.values())
        assert ts.store.offloaded_bytes == total
        rec = ts.load("actor")
        assert rec.bytes_in == total
        assert "actor" in ts.report() and "offload" in ts.report()


def test_shared_storage_is_counted_once():
    model, opt = make_trained()
    stored = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in _all_state_tensors(model, opt)}
    with tidal.Timeshare("cpu") as ts:
        ts.add_role("actor", model=model, optimizer=opt, optimizer_residency="role")
        # Tied weights, view-of-buffer and grads: every storage counted once, Adam's step excluded.
        assert ts.role_bytes("actor") == sum(stored.values())


def test_training_with_switches_matches_training_without_tidal():
    def train(use_tidal: bool, residency: str, steps: int = 6) -> list[float]:
        torch.manual_seed(1)
        actor, ref = TinyLM(), TinyLM()
        opt = torch.optim.AdamW(actor.parameters(), lr=1e-2, weight_decay=0.1)
        ts = tidal.Timeshare("cpu") if use_tidal else None
        if ts:
            ts.add_role("actor", model=actor, optimizer=opt, optimizer_residency=residency)
            ts.add_role("reference", model=ref)
        losses = []
        gen = torch.Generator().manual_seed(2)
        for _ in range(steps):
            ids = torch.randint(0, 64, (4, 9), generator=gen)
            ctx = ts.use("reference") if ts else torch.no_grad()
            with ctx, torch.no_grad():
                ref_logits = ref(ids[:, :-1])
            ctx = ts.use("actor") if ts else torch.enable_grad()
            with ctx:
                loss = lm_loss(actor, ids) + 1e-3 * ref_logits.float().pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=False)
            losses.append(loss.item())
        if ts:
            ts.close()
        return losses

    plain = train(False, "role")
    assert train(True, "role") == plain
    assert train(True, "step") == plain


def test_thousand_cycles_bit_exact_without_growth():
    model, opt = make_trained()
    before = snapshot_state(model, opt)
    with tidal.Timeshare("cpu") as ts:
        ts.add_role("actor", model=model, optimizer=opt, optimizer_residency="role")
        ts.offload("actor")
        ts.load("actor")
        host, chunks = ts.store.host_reserved_bytes, ts.store.arena.num_chunks
        for _ in range(1000):
            ts.offload("actor")
            ts.load("actor")
        assert ts.store.host_reserved_bytes == host and ts.store.arena.num_chunks == chunks
        assert_same_state(before, snapshot_state(model, opt))
        assert len(ts.records) == 2002


def test_recreated_grads_do_not_grow_host_memory():
    model, opt = make_trained()
    ids = torch.randint(0, 64, (4, 9))
    with tidal.Timeshare("cpu") as ts:
        ts.add_role("actor", model=model, optimizer=opt, optimizer_residency="role")
        sizes = []
        for _ in range(20):
            with ts.use("actor"):
                opt.zero_grad(set_to_none=True)  # grads die and come back as new storages
                lm_loss(model, ids).backward()
                opt.step()
            ts.offload("actor")
            sizes.append(ts.store.host_reserved_bytes)
        assert len(set(sizes[2:])) == 1, sizes


def test_grad_policies():
    for policy in ("keep", "drop", "offload"):
        model, opt = make_trained()
        grad = model.blocks[0][1].weight.grad
        with tidal.Timeshare("cpu") as ts:
            ts.add_role("actor", model=model, optimizer=opt, grads=policy)
            ts.offload("actor")
            if policy == "keep":
                assert model.blocks[0][1].weight.grad is grad and _nbytes(grad) > 0
            elif policy == "drop":
                assert model.blocks[0][1].weight.grad is None
            else:
                assert model.blocks[0][1].weight.grad is grad and _nbytes(grad) == 0
            ts.load("actor")
            if policy != "drop":
                assert _nbytes(grad) > 0


def test_step_residency_keeps_optimizer_state_on_host_outside_step():
    model, opt = make_trained()
    exp_avg = opt.state[model.blocks[0][1].weight]["exp_avg"]
    ids = torch.randint(0, 64, (4, 9))
    with tidal.Timeshare("cpu") as ts:
        ts.add_role("actor", model=model, optimizer=opt)  # default residency: step
        with ts.use("actor"):
            assert _nbytes(exp_avg) > 0  # registered while resident: stays until the first step
            lm_loss(model, ids).backward()
            opt.step()
            assert _nbytes(exp_avg) == 0, "on the host after the step"
            assert _nbytes(model.embed.weight) > 0
            seen = []
            # Registered after tidal's pre-hook, so it runs after the state came back.
            h = opt.register_step_pre_hook(lambda *a: seen.append(_nbytes(exp_avg)))
            lm_loss(model, ids).backward()
            opt.step()
            h.remove()
            assert seen == [exp_avg.numel() * exp_avg.element_size()], "resident during the step"
            assert _nbytes(exp_avg) == 0, "and back on the host after it"
        kinds = [r.kind for r in ts.records]
        assert kinds == ["optim-out", "optim-in", "optim-out"]


def test_budget_keeps_roles_resident_and_evicts_least_recently_used():
    a, b, c = TinyLM(), TinyLM(), TinyLM()
    probe = tidal.Timeshare("cpu")
    probe.add_role("x", model=TinyLM())
    one = probe.role_bytes("x")
    probe.close()
    with tidal.Timeshare("cpu", config=tidal.TimeshareConfig(budget_bytes=2 * one)) as ts:
        for name, m in (("a", a), ("b", b), ("c", c)):
            ts.add_role(name, model=m)
        ts.offload_all()
        with ts.use("a"):
            pass
        with ts.use("b"):
            pass
        assert sorted(ts.resident_roles) == ["a", "b"]
        with ts.use("c"):
            assert sorted(ts.resident_roles) == ["b", "c"]  # a was least recently used
        with pytest.raises(ValueError, match="budget_bytes"):
            big = nn.Linear(1024, 1024)
            ts.add_role("big", model=big)
            ts.load("big")


@pytest.mark.parametrize("residency", ["step", "stream"])
def test_optimizer_state_kept_on_the_host_does_not_count_against_the_budget(residency):
    """A budget with room for an actor's weights and a reference beside it: the actor's Adam
    moments, on the host between steps, must not push the actor out when the reference comes
    in (they were counted as resident and did)."""
    model, opt = make_trained()
    ref = TinyLM()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    budget = weights + sum(p.numel() * p.element_size() for p in ref.parameters()) + 1024
    with tidal.Timeshare("cpu", config=tidal.TimeshareConfig(budget_bytes=budget)) as ts:
        ts.add_role("actor", model=model, optimizer=opt, optimizer_residency=residency)
        ts.add_role("reference", model=ref)
        opt.zero_grad(set_to_none=True)
        ts.offload_all()
        ts.load("actor")  # its weights; the moments stay on the host, where the residency keeps them
        assert not ts.role("actor").optim_unsettled
        assert ts.role_bytes("actor") > budget - weights  # with its moments it would not fit
        before = len(ts.records)
        with ts.use("reference"):
            assert sorted(ts.resident_roles) == ["actor", "reference"]
        assert [(r.kind, r.roles_out, r.role_in) for r in ts.records[before:]] == [("reload", (), "reference")]


def _as_needed(free_bytes: int, **cfg):
    """A timeshare evicting as needed, on a fake accelerator whose free memory the test sets."""
    from tests.transfer.fakes import FakeAccelOps
    from tidal.transfer.context import TransferContext

    ops = FakeAccelOps(free_bytes=free_bytes)
    # Staging buckets far smaller than a role, as they are beside a GPU role.
    transfer = tidal.TransferConfig(bucket_bytes=4 << 10, small_tensor_bytes=1 << 10)
    config = tidal.TimeshareConfig(evict="as_needed", transfer=transfer, **cfg)
    return tidal.Timeshare("cpu", context=TransferContext(ops), config=config), ops


def test_evict_as_needed_keeps_roles_while_the_device_has_room_and_then_the_least_recent():
    models = {n: TinyLM() for n in "abc"}
    before = {n: {k: v.clone() for k, v in m.state_dict().items()} for n, m in models.items()}
    ts, ops = _as_needed(1 << 40)
    for n, m in models.items():
        ts.add_role(n, model=m)
    ts.offload_all()
    one = ts.role_bytes("a")
    staging = ts.store.staging_bytes(3)  # two buckets in, one out
    with ts.use("a"):
        pass
    with ts.use("b"):
        pass
    assert sorted(ts.resident_roles) == ["a", "b"]  # room for both: nothing moved out
    ops.free_bytes = one // 2 + staging  # half a role free: c needs one of them out
    with ts.use("c"):
        assert sorted(ts.resident_roles) == ["b", "c"]  # a, least recently used, and only a
    ops.free_bytes = staging  # nothing free: b must go for a, c is in use
    with ts.use("c"):
        with pytest.raises(RuntimeError, match="in use"):
            ts.offload("c")
    with ts.use("a"):
        assert sorted(ts.resident_roles) == ["a", "c"]
    moves = [(r.kind, r.roles_out, r.role_in) for r in ts.records]
    assert moves[1:] == [("reload", (), "a"), ("reload", (), "b"), ("switch", ("a",), "c"), ("switch", ("b",), "a")]
    ops.free_bytes = 1 << 40
    ts.close()
    for n, m in models.items():
        assert all(torch.equal(v, before[n][k]) for k, v in m.state_dict().items()), n


def test_evict_as_needed_leaves_the_headroom_free_and_still_obeys_a_budget():
    a, b = TinyLM(), TinyLM()
    ts, ops = _as_needed(1 << 40, headroom_bytes=1 << 20)
    ts.add_role("a", model=a)
    ts.add_role("b", model=b)
    ts.offload_all()
    one = ts.role_bytes("a")
    staging = ts.store.staging_bytes(1)  # a bucket in
    with ts.use("a"):
        pass
    ops.free_bytes = one + staging + (1 << 20) - 1  # one byte short of the headroom beside b
    with ts.use("b"):
        assert ts.resident_roles == ["b"]
    ops.free_bytes = 1 << 40
    with ts.use("a"):
        assert sorted(ts.resident_roles) == ["a", "b"]
    ts.close()
    capped, _ = _as_needed(1 << 40, budget_bytes=int(1.5 * one))
    capped.add_role("a", model=TinyLM())
    capped.add_role("b", model=TinyLM())
    capped.offload_all()
    with capped.use("a"):
        pass
    with capped.use("b"):
        assert capped.resident_roles == ["b"]  # the device has room, the budget has not
    capped.close()
    with pytest.raises(ValueError, match="evict must be"):
        tidal.TimeshareConfig(evict="lru")


@pytest.mark.parametrize("evict", ["others", "as_needed"])
def test_roles_sharing_every_storage_are_evicted_together(evict):
    """Two roles on one module (a policy's rollout and training roles) free nothing one at a
    time: making room for a third moves both out, under a budget or as memory needs."""
    shared = nn.Linear(256, 256)
    one = sum(p.numel() * p.element_size() for p in shared.parameters())
    ts, ops = _as_needed(1 << 40, budget_bytes=one + 100 if evict == "others" else None)
    ts.config = dataclasses.replace(ts.config, evict=evict)
    ts.add_role("rollout", model=shared)
    ts.add_role("train", model=shared)
    ts.add_role("reference", model=nn.Linear(256, 256))
    ts.offload_all()
    with ts.use("rollout"):
        pass
    with ts.use("train"):
        pass
    ops.free_bytes = ts.store.staging_bytes(2) + one // 2  # the reference fits once the shared weights go
    with ts.use("reference"):
        assert ts.resident_roles == ["reference"]
    ops.free_bytes = 1 << 40
    ts.close()


def _linear_roles(names: str, used: str):
    """An as-needed timeshare on a fake accelerator with a Linear role per name, all offloaded,
    then those in ``used`` brought in, in that order."""
    ts, ops = _as_needed(1 << 40)
    for n in names:
        ts.add_role(n, model=nn.Linear(256, 256))
    ts.offload_all()
    for n in used:
        with ts.use(n):
            pass
    return ts, ops


def test_evict_as_needed_counts_a_prefetched_role_once():
    """A prefetch has allocated the incoming role already (the driver counts it as used): its
    switch must not move another role out for it a second time."""
    ts, ops = _linear_roles("abc", used="ab")
    one = ts.role_bytes("c")
    ops.free_bytes = ts.store.staging_bytes(2) + one + one // 2  # room for c beside a and b
    with ts.use("b"):
        rec = ts.prefetch("c")
        assert rec.bytes_in == one
    ops.free_bytes -= rec.bytes_in  # what the driver reports once they hold memory
    with ts.use("c"):
        assert sorted(ts.resident_roles) == ["a", "b", "c"]
    ops.free_bytes = 1 << 40
    ts.close()


def test_evict_as_needed_counts_memory_still_handed_over_as_free():
    """A load through a lease's hand-over waits for the memory the previous holder is still
    giving back: no local role needs to go out for it."""
    from tidal.state.handover import RoomSource

    class Coming(RoomSource):
        def __init__(self, n):
            self.n = n

        def pending_bytes(self):
            return self.n

        def wait(self):
            if not self.n:
                return False
            ops.free_bytes += self.n  # it arrives
            self.n = 0
            return True

    ts, ops = _linear_roles("ab", used="a")
    one = ts.role_bytes("b")
    ops.free_bytes = ts.store.staging_bytes(2)  # nothing free yet: all of b's room is still coming
    ts.load("b", room_source=Coming(one))
    assert sorted(ts.resident_roles) == ["a", "b"]
    ops.free_bytes = 1 << 40
    ts.close()


def _moves(ts, since=0):
    return [(r.kind, r.roles_out, r.role_in) for r in ts.records[since:]]


def test_keep_free_bytes_keeps_the_role_before_where_there_is_room_and_only_there():
    """use(name, keep_free_bytes=N) under the default evict="others": the switch moves out only
    what it takes to have ``name`` in and N bytes free, so the role before stays where the
    device has room (and goes where it has not); the next plain use() moves the others out as
    before. No state changes on the way."""
    ts, ops = _linear_roles("ab", used="a")
    ts.config = dataclasses.replace(ts.config, evict="others")
    want = {n: {k: v.clone() for k, v in ts.role(n).modules[0].state_dict().items()} for n in "ab"}
    one, keep = ts.role_bytes("b"), 1 << 20
    staging = ts.store.staging_bytes(2)  # two buckets in; nothing goes out
    ops.free_bytes = one + staging + keep  # room for b and the bytes asked, exactly
    n = len(ts.records)
    with ts.use("b", keep_free_bytes=keep):
        assert sorted(ts.resident_roles) == ["a", "b"]
    assert _moves(ts, n) == [("reload", (), "b")]
    ops.free_bytes = 1 << 40
    with ts.use("a"):  # the config's "others": b goes, though there is room
        assert ts.resident_roles == ["a"]
    ops.free_bytes = one + staging + keep - 1  # one byte short: a must go for b
    n = len(ts.records)
    with ts.use("b", keep_free_bytes=keep):
        assert ts.resident_roles == ["b"]
    assert _moves(ts, n) == [("switch", ("a",), "b")]
    ops.free_bytes = 1 << 40
    ts.close()
    for name in "ab":
        got = ts.role(name).modules[0].state_dict()
        assert all(torch.equal(v, want[name][k]) for k, v in got.items()), name


def test_keep_free_bytes_counts_also_when_the_role_arrived_ahead():
    """A role a prefetch brought in needs no room of its own, but keep_free_bytes still asks
    for free memory beside it: where the device lacks it, the role before goes out, and only
    then. The prefetch with the same keep_free_bytes writes back nothing where the switch
    will keep everything, and the role before where it will not."""
    ts, ops = _linear_roles("ab", used="a")
    ts.config = dataclasses.replace(ts.config, evict="others")
    one, keep = ts.role_bytes("b"), 1 << 20
    ops.free_bytes = one + ts.store.staging_bytes(2) + keep  # two buckets in
    rec = ts.prefetch("b", keep_free_bytes=keep)
    assert rec.bytes_in == one and rec.bytes_out == 0 and rec.roles_out == ()  # a stays: nothing written back
    ops.free_bytes = keep  # what is free once b holds its memory
    with ts.use("b", keep_free_bytes=keep):
        assert sorted(ts.resident_roles) == ["a", "b"]
    ops.free_bytes = 1 << 40
    with ts.use("a"):
        pass
    ops.free_bytes = one + ts.store.staging_bytes(1) + keep
    rec = ts.prefetch("b", keep_free_bytes=2 * keep)  # the switch will not keep a: a is written back
    assert rec.bytes_in == one and rec.bytes_out == one and rec.roles_out == ("a",)
    ops.free_bytes = keep  # b arrived; not the 2 * keep asked beside it
    n = len(ts.records)
    with ts.use("b", keep_free_bytes=2 * keep):
        assert ts.resident_roles == ["b"]
    ((kind, out, came),) = _moves(ts, n)
    assert (kind, out, came) == ("switch", ("a",), "b") and ts.records[-1].bytes_out == 0  # written back ahead
    ops.free_bytes = 1 << 40
    ts.close()


def test_evict_others_leaves_the_role_alone_with_those_in_use_and_gives_prefetches_back():
    """evict_others(name): what a block out of memory beside kept roles does before it runs
    again. Every other resident role not in use goes (its bytes counted), a prefetch not yet
    claimed gives its memory back (its storages stay out), a role in use stays; nothing
    changes value; with nothing beside the role it frees nothing."""
    ts, ops = _linear_roles("abc", used="abc")  # all three resident (room for all)
    want = {n: {k: v.clone() for k, v in ts.role(n).modules[0].state_dict().items()} for n in "abc"}
    one = ts.role_bytes("a")
    with ts.use("b"), ts.use("c", keep_free_bytes=0):
        assert sorted(ts.resident_roles) == ["a", "b", "c"]
        n = len(ts.records)
        assert ts.evict_others("c") == one  # a goes; b is in use and stays
        assert sorted(ts.resident_roles) == ["b", "c"] and _moves(ts, n) == [("offload", ("a",), None)]
    with ts.use("c", keep_free_bytes=0):
        ts.prefetch("a", keep_free_bytes=0)
        assert ts.store.prefetched_keys()
        assert ts.evict_others("c") == 2 * one  # b goes, a's prefetch gives its memory back
        assert ts.resident_roles == ["c"] and not ts.store.prefetched_keys() and not ts.is_resident("a")
        assert ts.evict_others("c") == 0  # nothing beside it
    with pytest.raises(ValueError, match="not resident"):
        ts.evict_others("a")
    ts.close()
    for name in "abc":
        got = ts.role(name).modules[0].state_dict()
        assert all(torch.equal(v, want[name][k]) for k, v in got.items()), name


def test_a_turn_of_a_resident_role_with_the_room_walks_no_tensors(monkeypatch):
    """use()/load() of a resident role with keep_free_bytes the device has free move nothing,
    and decide so from a free-memory reading alone: no role's tensors are walked (a 7B model's
    three no-op turns cost 33 ms of host time before, on a 2-core CPU). One byte short, the
    full choice runs and the role before goes, as before."""
    ts, ops = _linear_roles("ab", used="a")
    ts.config = dataclasses.replace(ts.config, evict="others")
    keep = 1 << 20
    ops.free_bytes = 1 << 40
    with ts.use("b", keep_free_bytes=keep):
        pass
    assert sorted(ts.resident_roles) == ["a", "b"]
    walks = []
    live = type(ts)._live
    monkeypatch.setattr(type(ts), "_live", lambda self, *a, **kw: (walks.append(1), live(self, *a, **kw))[1])
    n = len(ts.records)
    ops.free_bytes = keep  # exactly the room asked
    ts.load("b", keep_free_bytes=keep)
    with ts.use("b", keep_free_bytes=keep):
        with ts.use("b", keep_free_bytes=0):
            pass
    assert walks == [] and len(ts.records) == n and sorted(ts.resident_roles) == ["a", "b"]
    ops.free_bytes = keep - 1
    with ts.use("b", keep_free_bytes=keep):
        assert ts.resident_roles == ["b"]
    assert walks and _moves(ts, n) == [("offload", ("a",), None)]
    ops.free_bytes = 1 << 40
    ts.close()


@pytest.mark.parametrize(
    "bad, error, match",
    [
        (-1, ValueError, "keep_free_bytes must be >= 0"),
        ("1", TypeError, "keep_free_bytes must be an int"),
        (True, TypeError, "keep_free_bytes must be an int"),
    ],
)
def test_keep_free_bytes_refuses_bad_values_before_any_work(bad, error, match):
    ts, _ = _linear_roles("ab", used="a")
    n = len(ts.records)
    with pytest.raises(error, match=match):
        with ts.use("b", keep_free_bytes=bad):
            pass
    with pytest.raises(error, match=match):
        ts.load("b", keep_free_bytes=bad)
    assert ts.resident_roles == ["a"] and len(ts.records) == n and not ts.role("b").in_use
    with pytest.raises(error, match=match):
        ts.prefetch("b", keep_free_bytes=bad)
    assert not ts.store.prefetched_keys()
    ts.close()


def test_stream_residency_settles_after_a_step_so_the_budget_does_not_count_its_state():
    """After a streamed step the moments are all on the host: a reference loaded inside the
    actor's use() block, after step(), fits a budget for both roles' weights."""
    model, opt = make_trained()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    ref = TinyLM()
    ids = torch.randint(0, 64, (2, 9))
    budget = 3 * weights + 4096  # actor weights and grads, the reference's weights
    with tidal.Timeshare("cpu", config=tidal.TimeshareConfig(budget_bytes=budget)) as ts:
        ts.add_role("actor", model=model, optimizer=opt, optimizer_residency="stream")
        ts.add_role("reference", model=ref)
        ts.offload_all()
        with ts.use("actor"):
            lm_loss(model, ids).backward()
            opt.step()
            assert not ts.role("actor").optim_unsettled
            ts.load("reference")
            assert sorted(ts.resident_roles) == ["actor", "reference"]


# ---- misuse: a clear error and no state lost ------------------------------------------------
def test_unknown_role():
    with tidal.Timeshare("cpu") as ts:
        ts.add_role("actor", model=TinyLM())
        with pytest.raises(ValueError, match="unknown role 'critic'.*actor"):
            with ts.use("critic"):
                pass


def test_duplicate_name_and_bad_arguments():
    model, opt = make_trained()
    with tidal.Timeshare("cpu") as ts:
        ts.add_role("actor", model=model, optimizer=opt)
        with pytest.raises(ValueError, match="already exists"):
            ts.add_role("actor", model=TinyLM())
        with pytest.raises(ValueError, match="already belongs to role 'actor'"):
            ts.add_role("other", optimizer=opt)
        with pytest.raises(TypeError, match="torch.nn.modules.module.Module"):
            ts.add_role("x", model=object())
        with pytest.raises(ValueError, match="needs a model"):
            ts.add_role("x")
        with pytest.raises(ValueError, match="grads must be one of"):
            ts.add_role("x", model=TinyLM(), grads="sometimes")
        assert ts.roles == ["actor"]
    with pytest.raises(ValueError, match="budget_bytes"):
        tidal.TimeshareConfig(budget_bytes=-1)
    with pytest.raises(RuntimeError, match="closed"):
        ts.add_role("y", model=TinyLM())


def test_reload_without_room_raises_and_keeps_state(monkeypatch):
    model, opt = make_trained()
    before = snapshot_state(model, opt)
    with tidal.Timeshare("cpu") as ts:
        ts.add_role("actor", model=model, optimizer=opt, optimizer_residency="role")
        ts.offload("actor")
        need = ts.role_bytes("actor")
        monkeypatch.setattr(ts.ops, "driver_free_bytes", lambda: (need // 2, 10 * need))
        with pytest.raises(tidal.InsufficientMemoryError) as err:
            ts.load("actor")
        assert err.value.needed_bytes >= need and err.value.free_bytes == need // 2
        assert f"({need} bytes)" in str(err.value) and "nothing was moved" in str(err.value)
        assert not ts.is_resident("actor") and ts.store.offloaded_bytes == need
        monkeypatch.undo()
        ts.load("actor")
        assert_same_state(before, snapshot_state(model, opt))


def test_offload_during_backward_is_refused():
    model, opt = make_trained()
    before = snapshot_state(model, opt)
    with tidal.Timeshare("cpu") as ts:
        ts.add_role("actor", model=model, optimizer=opt, optimizer_residency="role")
        errors = []

        def hook(grad):
            try:
                ts.offload("actor")
            except RuntimeError as e:
                errors.append(str(e))
            return grad

        x = torch.randn(3, requires_grad=True) * 2  # a graph that does not touch the role
        x.register_hook(hook)
        x.sum().backward()
        assert errors and "backward pass is running" in errors[0]
        assert ts.is_resident("actor")
        assert_same_state(before, snapshot_state(model, opt))


def test_offload_of_a_role_in_use_is_refused():
    model, opt = make_trained()
    with tidal.Timeshare("cpu") as ts:
        ts.add_role("actor", model=model, optimizer=opt)
        ts.add_role("reference", model=TinyLM())
        with ts.use("actor"):
            with pytest.raises(RuntimeError, match="in use"):
                ts.offload("actor")
            with pytest.raises(RuntimeError, match="in use"):
                with ts.use("reference"):  # exclusive budget: actor would have to leave
                    pass
            assert ts.is_resident("actor")
            lm_loss(model, torch.randint(0, 64, (2, 5))).backward()  # still usable


def test_using_an_offloaded_role_is_refused():
    model, opt = make_trained()
    with tidal.Timeshare("cpu") as ts:
        ts.add_role("actor", model=model, optimizer=opt)
        ts.offload("actor")
        with pytest.raises(RuntimeError, match="is offloaded"):
            model(torch.tensor([[1, 2]]))
        with pytest.raises(RuntimeError, match="offloaded"):
            opt.step()
        ts.load("actor")
        model(torch.tensor([[1, 2]]))


def test_roles_sharing_a_model_do_not_free_each_others_storage():
    shared = TinyLM()
    head = nn.Linear(32, 8)
    w = shared.blocks[0][1].weight
    before = w.detach().clone()
    with tidal.Timeshare("cpu", config=tidal.TimeshareConfig(budget_bytes=None)) as ts:
        ts.add_role("rollout", model=shared)
        ts.add_role("critic", model=[shared, head])
        assert ts.role_bytes("critic") == ts.role_bytes("rollout") + sum(_nbytes(p) for p in head.parameters())
        with ts.use("rollout"):
            # critic went out, but the storages it shares with rollout stayed
            assert _nbytes(w) > 0 and _nbytes(head.weight) == 0
        with ts.use("critic"):
            assert _nbytes(w) > 0 and _nbytes(head.weight) > 0
        ts.offload_all()
        assert _nbytes(w) == 0
        ts.load("rollout")
        assert torch.equal(w, before) and _nbytes(head.weight) == 0


def test_optimizer_state_in_lists_moves_with_the_role():
    """LBFGS keeps its history in lists of tensors: they move and come back bit-exact."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.LBFGS(model.parameters(), history_size=4, max_iter=3)
    x, y = torch.randn(32, 16), torch.randn(32, 1)

    def closure():
        opt.zero_grad()
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        return loss

    opt.step(closure)
    state = opt.state[next(iter(opt.state))]
    history = state["old_dirs"]
    assert history and all(isinstance(t, torch.Tensor) for t in history)
    before = [t.clone() for t in history]
    with tidal.Timeshare("cpu") as ts:
        ts.add_role("actor", model=model, optimizer=opt, optimizer_residency="role")
        ts.offload("actor")
        assert all(_nbytes(t) == 0 for t in history)
        ts.load("actor")
        assert all(torch.equal(a, b) for a, b in zip(before, history))
        with ts.use("actor"):
            opt.step(closure)  # keeps working


def test_unsupported_optimizer_state_is_refused_before_anything_moves():
    model, opt = make_trained()
    opt.state[model.embed.weight]["sketch"] = torch.zeros(8, 8).to_sparse()
    with tidal.Timeshare("cpu") as ts:
        with pytest.raises(TypeError, match="layout torch.sparse_coo cannot be offloaded"):
            ts.add_role("actor", model=model, optimizer=opt)
        assert ts.roles == [] and _nbytes(model.embed.weight) > 0


def test_model_on_another_device_is_refused():
    meta = nn.Linear(4, 4, device="meta")
    with tidal.Timeshare("cpu") as ts:
        with pytest.raises(ValueError, match="no state on cpu"):
            ts.add_role("actor", model=meta)


# ---- offload_optimizer ----------------------------------------------------------------------
@pytest.mark.parametrize("grads", [False, True])
def test_offload_optimizer_standalone(grads):
    model, opt = make_trained()
    before = snapshot_state(model, opt)
    exp_avg = opt.state[model.embed.weight]["exp_avg"]
    grad = model.embed.weight.grad
    with tidal.offload_optimizer(opt, grads=grads) as info:
        assert _nbytes(exp_avg) == 0
        assert (_nbytes(grad) == 0) == grads
        assert _nbytes(model.embed.weight) > 0
        with pytest.raises(RuntimeError, match="inside offload_optimizer"):
            opt.step()
        with torch.no_grad():
            model(torch.tensor([[1, 2]]))  # generation still works
    assert info.out.bytes_out > 0 and info.back.bytes_in == info.out.bytes_out
    assert_same_state(before, snapshot_state(model, opt))
    opt.step()  # usable again


def test_offload_optimizer_of_a_timeshare_role():
    model, opt = make_trained()
    before = snapshot_state(model, opt)
    exp_avg = opt.state[model.embed.weight]["exp_avg"]
    with tidal.Timeshare("cpu") as ts:
        ts.add_role("actor", model=model, optimizer=opt, optimizer_residency="role")
        with tidal.offload_optimizer(opt):
            assert _nbytes(exp_avg) == 0 and _nbytes(model.embed.weight) > 0
        assert _nbytes(exp_avg) > 0
        assert [r.kind for r in ts.records] == ["optim-ctx", "optim-ctx"]
    assert_same_state(before, snapshot_state(model, opt))


def test_import_touches_no_cuda():
    import subprocess
    import sys

    code = "import torch, tidal; assert not torch.cuda.is_initialized(), 'import tidal initialised CUDA'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_role_without_state_to_move_says_why():
    """Issue 12, item 8: a role with no tensors said "its tensors are on another device"."""
    ts = tidal.Timeshare("cpu")
    with pytest.raises(ValueError, match="no tensors at all"):
        ts.add_role("empty", model=nn.ReLU())
    with pytest.raises(
        ValueError, match=r"no state to move: its 1 tensors are empty or smaller than min_offload_bytes"
    ):
        ts.add_role("tiny", model=_one_scalar())
    ts.close()


def _one_scalar() -> nn.Module:
    m = nn.Module()
    m.p = nn.Parameter(torch.zeros(2))  # 8 bytes < min_offload_bytes
    return m


def test_unreleased_memory_is_warned_once_per_kind_and_recorded_every_time():
    """A fake accelerator whose driver never gets memory back: the first offload warns, the
    later ones of the same kind do not (a loop would repeat it every step), and every record
    still carries its unreleased bytes."""
    import warnings

    from tidal.transfer.context import TransferContext
    from tests.transfer.fakes import FakeAccelOps

    ctx = TransferContext(FakeAccelOps())
    ts = tidal.Timeshare(
        "cpu", context=ctx, config=tidal.TimeshareConfig(min_offload_bytes=0, release_tolerance_bytes=0)
    )
    model = nn.Linear(64, 64)
    ts.add_role("actor", model=model)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(3):
            ts.offload("actor")
            ts.load("actor")
    msgs = [str(w.message) for w in seen if "less than expected" in str(w.message)]
    assert len(msgs) == 1 and "(offload)" in msgs[0] and "Later offload transitions are not warned" in msgs[0]
    offloads = [r for r in ts.records if r.kind == "offload"]
    assert len(offloads) == 3 and all(r.unreleased_bytes > 0 for r in offloads)
    ts.close()


def test_a_residency_for_cpu_adam_is_ignored_with_a_warning():
    """CPUAdam's state lives on the host by design: a residency asked for it places nothing."""
    import warnings

    for residency, warned in (("stream", True), ("role", True), ("step", False)):
        model = TinyLM()
        opt = tidal.CPUAdam(model.parameters(), lr=1e-3)
        with tidal.Timeshare("cpu") as ts, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ts.add_role("actor", model=model, optimizer=opt, optimizer_residency=residency)
        mine = [w for w in caught if "optimizer_residency" in str(w.message)]
        assert len(mine) == warned, (residency, [str(w.message) for w in caught])
        if warned:
            assert f"optimizer_residency={residency!r} ignored: CPUAdam" in str(mine[0].message)
        opt.close()
    # a device optimizer beside it: the residency applies to that one, no warning
    model = TinyLM()
    with tidal.Timeshare("cpu") as ts, warnings.catch_warnings():
        warnings.simplefilter("error")
        ts.add_role("actor", model=model, optimizer=torch.optim.AdamW(model.parameters()), optimizer_residency="stream")


def test_report_sums_per_kind_and_roles_and_says_what_a_cpu_run_measured():
    """Issue 28: the default report is a summary per kind of transition and roles, in units
    that fit the bytes, saying that a CPU run's 'device' is host RAM; detail=True lists each."""
    model, opt = make_trained()
    ref = TinyLM()
    with tidal.Timeshare("cpu") as ts:
        ts.add_role("actor", model=model, optimizer=opt, optimizer_residency="role")
        ts.add_role("reference", model=ref)
        for _ in range(5):
            with ts.use("reference"):
                pass
            with ts.use("actor"):
                pass
        summary, detail = ts.report(), ts.report(detail=True)
        records = ts.records
    assert len(records) == 10  # an offload, then nine switches
    assert summary.startswith("tidal timeshare on cpu: 10 transitions. A CPU run: the 'device' is host RAM")
    assert "pinned on a GPU" not in summary and "a CPU run pins nothing" in summary
    rows = [ln.split() for ln in summary.splitlines() if ln.startswith("  switch") or ln.startswith("  offload")]
    # kind, out, in, count: both roles start resident, so the first use("reference") only
    # offloads the actor; then five switches reference -> actor and four back
    assert sorted(r[:4] for r in rows) == sorted(
        [["offload", "actor", "-", "1"], ["switch", "actor", "reference", "4"], ["switch", "reference", "actor", "5"]]
    )
    assert " 0.000" not in summary and "KiB" in summary, "small roles are shown in units that fit them"
    assert len(summary.splitlines()) < len(detail.splitlines())
    each = [ln for ln in detail.splitlines() if ln.strip()[:1].isdigit()]
    assert [int(ln.split()[0]) for ln in each] == list(range(10))
    assert "RAM free before" in detail and "free before GB" not in detail


def test_cpu_with_an_index_is_the_cpu():
    """accelerate's multi-process CPU launch (MULTI_CPU) names its device "cpu:0": a timeshare
    on it is the CPU's, sharing the CPU's transfer context."""
    ts = tidal.Timeshare("cpu:0")
    assert ts.device == torch.device("cpu") and ts.context is tidal.TransferContext.of("cpu")
    m = torch.nn.Linear(4, 4)
    ts.add_role("m", model=m)
    ts.offload("m")
    assert not ts.is_resident("m")
    ts.close()
