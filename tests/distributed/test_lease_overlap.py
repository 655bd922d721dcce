"""Issue 16, item 3: overlapped hand-overs through the lease. The holder reports memory given
back chunk by chunk (``progress``); the waiter at the head of the queue that asked for
``overlap`` loads into it before its grant; the grant itself still waits for the release."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import tidal
from tests.distributed.test_lease import FakeClock, _wait_until
from tidal.distributed.lease import (
    GPULease,
    LeaseServer,
    LeaseTable,
    LeaseUsageError,
    timeshare_callbacks,
)


@pytest.fixture
def server():
    with LeaseServer(ttl_s=2.0) as s:
        yield s


# ---- the state machine ------------------------------------------------------------------------
def test_table_an_early_head_of_queue_loads_on_the_holders_credit_and_is_granted_at_release():
    clock = FakeClock()
    table = LeaseTable(ttl_s=5.0, clock=clock)
    a = table.request(holder="a", role="train")["ticket"]
    b = table.request(holder="b", role="rollout", early=True)["ticket"]
    c = table.request(holder="c", role="reference", early=True)["ticket"]
    assert table.status(ticket=b)["state"] == "waiting"  # the holder has not started releasing
    st = table.progress(ticket=a, returned_bytes=100, total_bytes=400)
    assert st["state"] == "granted"
    sb = table.status(ticket=b)
    assert sb["state"] == "loading" and sb["credit"] == {"returned_bytes": 100, "total_bytes": 400}
    assert table.status(ticket=c)["state"] == "waiting"  # only the head of the queue loads early
    table.progress(ticket=a, returned_bytes=300, total_bytes=400)
    assert table.status(ticket=b)["credit"]["returned_bytes"] == 300
    clock.now = 4.0
    table.progress(ticket=a, returned_bytes=400, total_bytes=400)  # a heartbeat too
    table.touch(ticket=b)
    table.touch(ticket=c)
    clock.now = 8.0
    assert table.status(ticket=a)["state"] == "granted"  # not expired: its progress was heard at 4.0
    table.touch(ticket=b)
    table.touch(ticket=c)
    table.release(ticket=a, confirmation={"bytes_out": 400})
    sb = table.status(ticket=b)
    assert sb["state"] == "granted" and sb["previous"]["confirmation"] == {"bytes_out": 400}
    assert "credit" not in sb
    assert table.status(ticket=c)["state"] == "waiting"  # b has not started releasing
    events = [h["event"] for h in table.history]
    assert events.count("releasing") == 1


def test_table_a_waiter_that_did_not_ask_to_overlap_waits_for_the_release():
    table = LeaseTable(ttl_s=5.0, clock=FakeClock())
    a = table.request(holder="a", role="train")["ticket"]
    b = table.request(holder="b", role="rollout")["ticket"]
    table.progress(ticket=a, returned_bytes=100, total_bytes=400)
    assert table.status(ticket=b)["state"] == "waiting"
    table.release(ticket=a)
    assert table.status(ticket=b)["state"] == "granted"


def test_table_progress_misuse_is_an_error():
    table = LeaseTable(ttl_s=5.0, clock=FakeClock())
    a = table.request(holder="a", role="train")["ticket"]
    b = table.request(holder="b", role="rollout", early=True)["ticket"]
    with pytest.raises(LeaseUsageError, match="progress without holding"):
        table.progress(ticket=b, returned_bytes=1, total_bytes=2)
    for bad in (-1, 1.5, "3", True):
        with pytest.raises(LeaseUsageError, match="returned_bytes must be an int"):
            table.progress(ticket=a, returned_bytes=bad, total_bytes=2)
    assert table.status(ticket=b)["state"] == "waiting"  # nothing was recorded


def test_table_a_loader_that_withdraws_lets_the_next_early_waiter_load():
    table = LeaseTable(ttl_s=5.0, clock=FakeClock())
    a = table.request(holder="a", role="train")["ticket"]
    b = table.request(holder="b", role="rollout", early=True)["ticket"]
    c = table.request(holder="c", role="reference", early=True)["ticket"]
    table.progress(ticket=a, returned_bytes=10, total_bytes=40)
    assert table.status(ticket=b)["state"] == "loading"
    table.cancel(ticket=b)
    assert table.status(ticket=c)["state"] == "loading"


# ---- the client, over TCP ----------------------------------------------------------------------
def test_an_overlapped_acquire_loads_while_the_holder_releases_and_returns_after_its_release(server):
    steps = 4
    seen: list[tuple[int, int]] = []  # (credit returned, chunk the holder was at) per room wait
    at_chunk = [0]
    loaded_early = threading.Event()
    times: dict[str, float] = {}

    def release_fn():
        for k in range(1, steps + 1):
            at_chunk[0] = k
            holder.report_released(100 * k, 100 * steps)
            if k == 1:
                assert loaded_early.wait(10), "the waiter did not load on the first chunk"
        times["released"] = time.monotonic()
        return {"bytes_out": 100 * steps}

    holder = GPULease(server.address, holder="holder")
    holder.acquire("train", release_fn=release_fn)
    waiter = GPULease(server.address, holder="waiter")
    out: dict = {}

    def acquire_fn():
        room = waiter.room_source
        assert room is not None and room.pending_bytes() == 300  # 100 of 400 came with the first report
        loaded_early.set()
        while room.wait():
            seen.append((100 * steps - room.pending_bytes(), at_chunk[0]))
        assert room.pending_bytes() == 0

    def take():
        grant = waiter.acquire("rollout", acquire_fn=acquire_fn, overlap=True)
        times["granted"] = time.monotonic()
        out["grant"] = grant
        assert waiter.room_source is None

    t = threading.Thread(target=take)
    t.start()
    _wait_until(lambda: len(holder.snapshot()["waiting"]) == 1)
    assert holder.release() == {"bytes_out": 400}
    t.join(10)
    assert not t.is_alive()
    assert out["grant"].previous["confirmation"] == {"bytes_out": 400} and out["grant"].overlapped
    assert times["granted"] >= times["released"]
    assert loaded_early.is_set()
    assert [h["event"] for h in holder.snapshot()["history"]].count("releasing") == 1
    waiter.close()
    holder.close()


def test_report_released_outside_a_release_is_an_error(server):
    lease = GPULease(server.address, holder="h")
    with pytest.raises(LeaseUsageError, match="outside a release"):
        lease.report_released(1, 2)
    with lease.hold(role="train"):
        with pytest.raises(LeaseUsageError, match="outside a release"):
            lease.report_released(1, 2)
    lease.close()


def _role(seed: int, width: int = 64, layers: int = 4):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    return model, opt


def test_timeshare_callbacks_with_the_lease_hand_over_in_chunks_and_lose_nothing(server):
    """Two timeshares (CPU), each role taking turns through the lease with overlapped
    hand-overs: the holder's release reports every chunk, and every byte comes back."""
    cfg = tidal.TimeshareConfig(handover_chunk_bytes=16 << 10, min_offload_bytes=1)
    roles = {}
    for name, seed in (("A", 1), ("B", 2)):
        model, opt = _role(seed)
        ts = tidal.Timeshare("cpu", config=cfg)
        ts.add_role(name, model=model, optimizer=opt, optimizer_residency="role")
        state = [t.detach().clone() for t in model.parameters()]
        state += [v.clone() for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
        ts.offload(name)  # read before: a moved-out tensor's bytes are not there to read
        roles[name] = (ts, model, opt, state)
    leases = {n: GPULease(server.address, holder=n) for n in roles}
    reports: dict[str, list] = {n: [] for n in roles}
    grants: list = []
    # Not left to the machine's speed: a holder with a waiter queued keeps its first chunk's
    # report pending until the waiter has started loading (so every such hand-over overlaps).
    loading = {n: threading.Event() for n in roles}
    releasing = {n: False for n in roles}  # the next report is a release's first

    def reporting(n: str, report):
        def wrapped(r, t):
            reports[n].append((r, t))
            out = report(r, t)
            if releasing[n]:
                releasing[n] = False
                other = "B" if n == "A" else "A"
                if leases[n].snapshot()["waiting"]:
                    assert loading[other].wait(10), "the waiter did not start loading on the first chunk"
                loading[other].clear()
            return out

        return wrapped

    for n in roles:
        leases[n].report_released = reporting(n, leases[n].report_released)

    def turns(n: str, k: int):
        ts, model, opt, state = roles[n]
        cb = timeshare_callbacks(ts, n, lease=leases[n])
        assert cb["overlap"] is True
        load = cb["acquire_fn"]

        def acquire_fn():
            if leases[n].room_source is not None:  # loading before the grant
                loading[n].set()
            return load()

        cb["acquire_fn"] = acquire_fn
        for _ in range(k):
            with leases[n].hold(role=n, **cb) as grant:
                grants.append(grant)
                got = [t.detach().clone() for t in model.parameters()]
                got += [v.clone() for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
                assert all(torch.equal(a, b) for a, b in zip(state, got))
                # the other role has queued (if it has turns left) before this one releases
                deadline = time.monotonic() + 2
                while not leases[n].snapshot()["waiting"] and time.monotonic() < deadline:
                    time.sleep(0.005)
                releasing[n] = True

    threads = [threading.Thread(target=turns, args=(n, 3)) for n in roles]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(grants) == 6
    assert sum(g.overlapped for g in grants) == 5, [g.overlapped for g in grants]  # all but the first grant
    for n in roles:
        assert len(reports[n]) >= 3 * 4, reports[n]  # ~70 KiB of state in 16 KiB chunks, 3 turns
        totals = {t for _, t in reports[n]}
        assert len(totals) == 1 and totals.pop() >= roles[n][0].role_bytes(n)
        assert not roles[n][0].is_resident(n)
        leases[n].close()
        roles[n][0].close()


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_a_failed_early_load_raises_the_callers_error_and_loses_nothing(server, error):
    """The load fails after it started early (the previous holder still releasing): what came
    in goes back out, the request is withdrawn, and the caller sees its own error, not one from
    the unload's hand-over report (there is nobody to hand over to); the next holder then gets
    the turn from the previous one."""
    holder = GPULease(server.address, holder="holder")
    proceed = threading.Event()

    def holder_release():
        holder.report_released(1, 2)
        proceed.wait(10)

    holder.acquire("train", release_fn=holder_release)
    model, opt = _role(1)
    ts = tidal.Timeshare("cpu", config=tidal.TimeshareConfig(handover_chunk_bytes=16 << 10))
    ts.add_role("B", model=model, optimizer=opt, optimizer_residency="role")
    before = [p.detach().clone() for p in model.parameters()]
    ts.offload("B")
    lease = GPULease(server.address, holder="B")
    cb = timeshare_callbacks(ts, "B", lease=lease)
    load = cb["acquire_fn"]

    def acquire_fn():
        load()
        raise error("the caller's failure after the load")

    errors: list[BaseException] = []

    def take():
        try:
            lease.acquire("B", **{**cb, "acquire_fn": acquire_fn})
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=take)
    t.start()
    _wait_until(lambda: len(holder.snapshot()["waiting"]) == 1)
    rel = threading.Thread(target=holder.release)
    rel.start()
    t.join(10)
    assert len(errors) == 1 and isinstance(errors[0], error), errors
    assert "the caller's failure" in str(errors[0])
    assert not ts.is_resident("B") and holder.snapshot()["waiting"] == []
    proceed.set()
    rel.join(10)
    ts.load("B")
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    third = GPULease(server.address, holder="third")
    with third.hold(role="reference") as grant:
        assert grant.previous["holder"] == "holder"
    for c in (third, lease, holder):
        c.close()
    ts.close()


def test_a_ctrl_c_in_a_long_poll_leaves_the_connection_usable(server):
    """Interrupted while the arbiter holds its answer (a wait for memory), the client must not
    read that late answer as the reply to its next call."""
    import signal

    holder = GPULease(server.address, holder="holder")
    proceed = threading.Event()
    holder.acquire("train", release_fn=lambda: (holder.report_released(1, 100), proceed.wait(10)))
    waiter = GPULease(server.address, holder="waiter")

    def later():
        _wait_until(lambda: len(holder.snapshot()["waiting"]) == 1)
        holder.release()

    t = threading.Thread(target=later, daemon=True)
    t.start()

    def interrupt(*_):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        with pytest.raises(KeyboardInterrupt):
            waiter.acquire("rollout", acquire_fn=lambda: waiter.room_source.wait(), overlap=True)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    proceed.set()
    t.join(10)
    time.sleep(1.1)  # past the arbiter's long-poll answer (ttl_s / 2)
    assert set(waiter.snapshot()) >= {"holder", "waiting", "history"}
    with waiter.hold(role="rollout") as grant:
        assert grant.previous["holder"] == "holder"
    waiter.close()
    holder.close()
