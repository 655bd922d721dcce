"""Transitions that do not wait for their copies on the host (``TimeshareConfig(wait_for_copies=False)``)
and optimizer state brought in ahead of its step (``Timeshare.prefetch_optimizer``), on the CPU.

The copies are synchronous here, so these tests cover the bookkeeping: values bit-exact, which
waits happen where (through the fake accelerator's stream log: a storage released behind its
copy is handed to the allocator with a hold on the D2H stream, never after a host wait on that
copy; readers of the host copies wait for it, on the device or the host), refusals, and faults
at every point. The races themselves are the GPU tests' (test_no_wait_gpu.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.faults import sweep
from tests.policies import CountPoints
from tests.timeshare.test_prefetch import _check
from tests.timeshare.test_prefetch import _faulty as _faulty_timeshare
from tests.transfer.fakes import FakeAccelOps
from tidal import Timeshare, TimeshareConfig
from tidal.device import use_sync_policy
from tidal.transfer import TransferContext


def _setup(*, fake: bool = True, **cfg):
    torch.manual_seed(0)
    actor = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 8))
    ref = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 8))
    ctx = TransferContext(FakeAccelOps()) if fake else None
    config = TimeshareConfig(min_offload_bytes=0, wait_for_copies=False, release_to_driver=False, **cfg)
    ts = Timeshare("cpu", context=ctx, config=config)
    opt = torch.optim.AdamW(actor.parameters(), lr=1e-2)
    ts.add_role("actor", model=actor, optimizer=opt)
    ts.add_role("ref", model=ref, frozen=True)
    return ts, actor, ref, opt


def _values(m: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def _equal(m: nn.Module, want: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(v, want[k]) for k, v in m.state_dict().items())


def test_a_switch_releases_what_goes_out_behind_its_copies_without_a_host_wait():
    ts, actor, ref, _ = _setup()
    ops = ts.context.ops
    want_actor, want_ref = _values(actor), _values(ref)
    with ts.use("actor"):
        pass
    start = len(ops.log)
    rec = ts.load("ref")
    log = ops.log[start:]
    d2h = ts.store.engine.d2h_stream.name
    copied_out = [e[2] for e in log if e[0] == "record" and e[1] == d2h]
    assert copied_out and rec.queued and rec.bytes_out > 0
    assert not any(e[0] == "sync" and e[1] in copied_out for e in log), "the host waited for a copy out"
    held = {e[2] for e in log if e[0] == "hold" and e[1] == d2h}
    assert held == {p.untyped_storage()._cdata for p in actor.parameters()}
    assert ts.store.departure_event is not None and ts.store.departure_event.id == copied_out[-1]
    with ts.use("actor"):
        assert _equal(actor, want_actor)
    with ts.use("ref"):
        assert _equal(ref, want_ref)
    # Each wait of the compute stream for copies was timed; read once run (0 here: the fake's
    # copies are synchronous), and the pairs are let go.
    waited = [i for i, _ in ts.log._stalls]
    assert waited and all(ts.records[i].role_in is not None for i in waited)
    ts.settle_stalls(wait=True)
    assert not ts.log._stalls and all(ts.records[i].stall_seconds == 0.0 for i in waited)


def test_readers_of_host_copies_wait_for_the_copies_out():
    ts, actor, _, _ = _setup()
    ops = ts.context.ops
    ts.load("actor")
    ts.offload("actor")
    departed = ts.store.departure_event.id
    # a reload's H2D copies queue behind the copies out (the device waits, not the host)
    start = len(ops.log)
    ts.load("actor")
    h2d = ts.store.engine.h2d_stream.name
    assert ("wait_event", h2d, departed) in ops.log[start:]
    assert ("sync", departed) not in ops.log[start:]
    # the host reading a host copy waits for them
    ts.offload("actor")
    departed = ts.store.departure_event.id
    start = len(ops.log)
    sd = actor.state_dict()
    assert ("sync", departed) in ops.log[start:] and ts.store.departure_event is None
    assert all(v.numel() for v in sd.values())


def test_prefetched_optimizer_state_is_claimed_by_the_step_and_training_is_bit_identical():
    def train(prefetch: bool, residency: str) -> tuple[dict, list]:
        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 4))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        cfg = TimeshareConfig(min_offload_bytes=0, optimizer_chunk_bytes=4096)
        ts = Timeshare("cpu", config=cfg)
        ts.add_role("policy", model=model, optimizer=opt, optimizer_residency=residency)
        recs = []
        for i in range(3):
            x = torch.randn(8, 32, generator=torch.Generator().manual_seed(i))
            with ts.use("policy"):
                loss = model(x).square().mean()
                if prefetch:
                    recs.append(ts.prefetch_optimizer("policy"))
                loss.backward()
                opt.step()
                opt.zero_grad()
        ts.close()
        return _values(model) | {f"opt{k}": v for k, v in _flat(opt).items()}, (recs, ts.records)

    for residency in ("step", "stream"):
        plain, _ = train(False, residency)
        ahead, (returned, records) = train(True, residency)
        assert plain.keys() == ahead.keys() and all(torch.equal(plain[k], ahead[k]) for k in plain)
        # none before the first step (no state yet), then all of it, claimed without a copy
        assert returned[0] is None and all(r.kind == "optim-prefetch" and r.bytes_in > 0 for r in returned[1:])
        claimed = [r for r in records if r.kind in ("optim-in", "optim-stream") and r.role_in]
        assert sum(r.bytes_prefetched for r in claimed) == sum(r.bytes_in for r in returned[1:])
        # after the first step, everything the steps used had come in ahead: no copy in at all
        first = returned[1].index
        assert sum(r.bytes_in for r in claimed if r.index > first) == 0


def _flat(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {}
    for i, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"{i}.{k}"] = v.clone()
    return out


def test_prefetch_optimizer_refusals_and_no_ops():
    ts, actor, ref, opt = _setup(fake=False)
    with pytest.raises(ValueError, match="unknown role"):
        ts.prefetch_optimizer("nope")
    with pytest.raises(ValueError, match="leave_free_bytes"):
        ts.prefetch_optimizer("actor", leave_free_bytes=-1)
    with pytest.raises(ValueError, match="limit_bytes"):
        ts.prefetch_optimizer("actor", limit_bytes=-1)
    assert ts.prefetch_optimizer("actor") is None  # no state before the first step
    assert ts.prefetch_optimizer("ref") is None  # no optimizer
    with ts.use("actor"):
        actor(torch.randn(2, 64)).sum().backward()
        opt.step()
    assert ts.prefetch_optimizer("actor", limit_bytes=0) is None  # nothing fits
    ts.offload("actor")
    assert ts.prefetch_optimizer("actor") is None  # the role is out: its step cannot run
    ts.load("actor")
    x = torch.randn(4, 64, requires_grad=True)
    y = actor(x)

    def hook(g):
        ts.prefetch_optimizer("actor")
        return g

    y.register_hook(hook)
    with pytest.raises(RuntimeError, match="backward"):
        y.sum().backward()
    ts.close()
    with pytest.raises(RuntimeError, match="closed"):
        ts.prefetch_optimizer("actor")


def test_a_transition_before_the_step_gives_prefetched_optimizer_state_back():
    ts, actor, ref, opt = _setup(fake=False)
    with ts.use("actor"):
        actor(torch.randn(2, 64)).sum().backward()
        opt.step()
        opt.zero_grad()
    want = _flat(opt)
    with ts.use("actor"):
        assert ts.prefetch_optimizer("actor").bytes_in > 0
    with ts.use("ref"):  # the prefetched memory goes back; the state stays on the host
        assert ts.store.prefetched_bytes == 0
    now = _flat(opt)
    assert all(torch.equal(now[k], want[k]) for k in want)


# ---- faults at every point ----------------------------------------------------------------------
def _faulty():
    cfg = TimeshareConfig(wait_for_copies=False, release_to_driver=False)
    return _faulty_timeshare(cfg, TransferContext(FakeAccelOps()))


def _switches(state):
    ts = state["ts"]
    ts.load("ref")
    ts.load("actor")


def test_fault_at_every_point_of_switches_without_host_waits_loses_nothing():
    points = sweep(_faulty, _switches, _check)
    assert "free_behind_d2h" in points


def test_a_fused_optimizer_steps_the_state_that_arrived_ahead_in_one_call_and_computes_the_same():
    """With ``fused=True`` (no temporaries the size of a chunk) the chunks whose state a
    prefetch brought in are stepped and sent out as one; a chunk without state yet (the first
    step) or not brought in keeps its own call. The values are those of the unmerged run."""

    def train(prefetch_limit: int | None, fused: bool) -> tuple[dict, list[int]]:
        torch.manual_seed(1)
        model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(6)])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
        cfg = TimeshareConfig(min_offload_bytes=0, optimizer_chunk_bytes=4096)
        ts = Timeshare("cpu", config=cfg)
        ts.add_role("policy", model=model, optimizer=opt, optimizer_residency="stream")
        calls: list[int] = []
        opt.register_step_pre_hook(lambda o, a, k: calls.append(sum(len(g["params"]) for g in o.param_groups)))
        per_step = []
        for i in range(3):
            x = torch.randn(8, 32, generator=torch.Generator().manual_seed(i))
            with ts.use("policy"):
                loss = model(x).square().mean()
                if prefetch_limit != 0:
                    ts.prefetch_optimizer("policy", limit_bytes=prefetch_limit)
                loss.backward()
                calls.clear()
                opt.step()
                per_step.append(len(calls) - 1)  # the chunks' calls, not the outer one
                opt.zero_grad()
        ts.close()
        return _values(model) | {f"opt{k}": v for k, v in _flat(opt).items()}, per_step

    plain, chunked = train(0, fused=True)
    ahead, merged = train(None, fused=True)
    assert plain.keys() == ahead.keys() and all(torch.equal(plain[k], ahead[k]) for k in plain)
    assert chunked[0] == merged[0] > 4  # the first step creates the state a chunk at a time
    assert all(n == chunked[0] for n in chunked) and merged[1:] == [1, 1]
    state = 6 * 2 * (32 * 32 + 32) * 4
    part, partial = train(state // 2, fused=True)  # half of it ahead: one call, then the rest chunked
    assert all(torch.equal(plain[k], part[k]) for k in plain)
    assert 1 < partial[1] < chunked[1]
    _, foreach = train(None, fused=False)  # temporaries the size of a chunk: never merged
    assert foreach == chunked


def _fused_stream_role(cfg: TimeshareConfig, ops=None):
    torch.manual_seed(1)
    layers = nn.ModuleList([nn.Linear(32, 32) for _ in range(6)])
    model = nn.Sequential(*layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    ts = Timeshare("cpu", config=cfg, **({"context": TransferContext(ops)} if ops is not None else {}))
    ts.add_role("policy", model=model, optimizer=opt, optimizer_residency="stream")
    return layers, model, opt, ts


LAYER_STATE = 2 * (32 * 32 + 32) * 4  # AdamW's two moments of one Linear(32, 32)


def test_a_merged_step_never_creates_state_for_more_than_a_chunk():
    """Parameters without state yet (no gradient before: unrouted experts, layers unfrozen
    later) keep their chunk's own step(): the merge takes only chunks whose every parameter's
    state arrived ahead."""
    cfg = TimeshareConfig(min_offload_bytes=0, optimizer_chunk_bytes=2 * LAYER_STATE)
    layers, _, opt, ts = _fused_stream_role(cfg)
    created: list[int] = []
    opt.register_step_pre_hook(
        lambda o, a, k: created.append(sum(1 for g in o.param_groups for p in g["params"] if not o.state.get(p)))
    )
    x = torch.randn(8, 32)
    for used in (range(0, 6, 2), range(6), range(6)):  # the odd layers get gradients from step 2
        with ts.use("policy"):
            h = x
            for i in used:
                h = layers[i](h)
            loss = h.square().mean()
            ts.prefetch_optimizer("policy")
            loss.backward()
            created.clear()
            opt.step()
            opt.zero_grad()
        assert max(created) <= 4, created  # a chunk: two layers, four tensors
    ts.close()


def test_after_a_merged_chunk_the_next_chunks_wait_for_its_copy_out():
    """wait_for_copies=False: a merged chunk's copy out counts by its bytes, so the chunks after
    it are not brought in while more than two chunks' bytes are still on their way out."""
    cfg = TimeshareConfig(
        min_offload_bytes=0, optimizer_chunk_bytes=LAYER_STATE, wait_for_copies=False, release_to_driver=False
    )
    _, model, opt, ts = _fused_stream_role(cfg, FakeAccelOps())
    for _ in range(2):
        with ts.use("policy"):
            loss = model(torch.randn(8, 32)).square().mean()
            ts.prefetch_optimizer("policy", limit_bytes=3 * LAYER_STATE)  # half: merged, then chunked
            loss.backward()
            with use_sync_policy(CountPoints()) as policy:
                opt.step()
            opt.zero_grad()
    calls = [c for c in policy.calls if c in ("stream_chunk_departed", "h2d_queued")]
    # the first chunk after the merged one comes in beside its copy out; the second only after it
    assert calls[:3] == ["h2d_queued", "stream_chunk_departed", "h2d_queued"], calls
    ts.close()
