"""The cross-process GPU lease on CPU: the state machine with a fake clock, then the TCP
arbiter with threads and forked processes (FIFO hand-over, release before grant, expiry of a
SIGKILLed holder, no two holders under stress). The Ray arbiter is tested in
test_placement.py, which has a cluster up."""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import signal
import threading
import time

import pytest

from tidal.distributed.lease import (
    GPULease,
    LeaseConfig,
    LeaseError,
    LeaseExpiredError,
    LeaseServer,
    LeaseTable,
    LeaseTimeoutError,
    LeaseUsageError,
)

_fork = multiprocessing.get_context("fork")  # children inherit the imports: no 3 s torch import each


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def server():
    with LeaseServer(ttl_s=1.0) as s:
        yield s


# ---- the state machine ------------------------------------------------------------------------
def test_table_fifo_and_previous_release():
    table = LeaseTable(ttl_s=5.0, clock=FakeClock())
    a = table.request(holder="a", role="train")
    b = table.request(holder="b", role="rollout")
    c = table.request(holder="c", role="reference")
    assert a["state"] == "granted" and a["previous"] is None
    assert (b["state"], b["position"]) == ("waiting", 0)
    assert (c["state"], c["position"]) == ("waiting", 1)
    table.release(ticket=a["ticket"], confirmation={"driver_free_bytes": 123})
    st = table.status(ticket=b["ticket"])
    assert st["state"] == "granted"
    assert st["previous"]["holder"] == "a" and st["previous"]["how"] == "released"
    assert st["previous"]["confirmation"] == {"driver_free_bytes": 123}
    assert table.status(ticket=c["ticket"])["position"] == 0


def test_table_expiry_of_holder_and_waiter():
    clock = FakeClock()
    table = LeaseTable(ttl_s=2.0, clock=clock)
    a = table.request(holder="a", role="train")["ticket"]
    b = table.request(holder="b", role="rollout")["ticket"]
    c = table.request(holder="c", role="reference")["ticket"]
    clock.now = 1.5
    table.touch(ticket=a)  # holder heartbeats; b keeps itself alive; c goes silent
    table.touch(ticket=b)
    clock.now = 3.0  # c not heard from since t=0: dropped, a still holds
    assert table.status(ticket=a)["state"] == "granted"
    table.touch(ticket=b)
    assert table.status(ticket=c)["state"] == "expired"
    clock.now = 3.6  # a silent since 1.5: expired, b granted
    table.sweep()
    st = table.status(ticket=b)
    assert st["state"] == "granted" and st["previous"]["how"] == "expired"
    with pytest.raises(LeaseExpiredError, match="too late"):
        table.release(ticket=a)
    with pytest.raises(LeaseExpiredError, match="no heartbeat"):
        table.touch(ticket=a)


def test_table_misuse_is_an_error():
    table = LeaseTable(ttl_s=5.0, clock=FakeClock())
    a = table.request(holder="a", role="train")["ticket"]
    b = table.request(holder="b", role="rollout")["ticket"]
    with pytest.raises(LeaseUsageError, match="double acquire: holder 'a' holds"):
        table.request(holder="a", role="reference")
    with pytest.raises(LeaseUsageError, match="double acquire: holder 'b' is already waiting"):
        table.request(holder="b", role="reference")
    with pytest.raises(LeaseUsageError, match="release without holding"):
        table.release(ticket=b)
    with pytest.raises(LeaseUsageError, match="unknown ticket 99"):
        table.release(ticket=99)
    with pytest.raises(ValueError, match="ttl_s must be > 0"):
        LeaseTable(ttl_s=0)
    table.cancel(ticket=b)
    table.release(ticket=a)
    assert table.snapshot()["holder"] is None and table.snapshot()["waiting"] == []


# ---- the TCP arbiter, threads -----------------------------------------------------------------
def _wait_until(pred, timeout_s: float = 5.0) -> None:
    end = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < end, "condition not reached in time"
        time.sleep(0.005)


def test_fifo_handover_and_release_before_grant(server):
    log: list[str] = []
    lock = threading.Lock()

    def note(s: str):
        with lock:
            log.append(s)

    first = GPULease(server.address, holder="first")
    grant0 = first.acquire("train", release_fn=lambda: (note("release train"), {"freed": 1})[1])
    order: list[str] = []
    grants = {}

    def waiter(name: str):
        with GPULease(server.address, holder=name) as lease:
            with lease.hold(
                role=name, acquire_fn=lambda: note(f"acquire {name}"), release_fn=lambda: note(f"release {name}")
            ) as grant:
                order.append(name)
                grants[name] = grant
                time.sleep(0.02)

    threads = []
    for i, name in enumerate(["w0", "w1", "w2", "w3"]):
        t = threading.Thread(target=waiter, args=(name,))
        t.start()
        threads.append(t)
        # each waiter is queued before the next starts, so arrival order is known
        _wait_until(lambda: len(first.snapshot()["waiting"]) == i + 1)
    assert grant0.previous is None
    assert first.release() == {"freed": 1}
    for t in threads:
        t.join(10)
    assert order == ["w0", "w1", "w2", "w3"]
    assert grants["w0"].previous["confirmation"] == {"freed": 1}
    assert grants["w1"].previous["holder"] == "w0" and grants["w1"].previous["how"] == "released"
    # every release ran before the next holder's acquire_fn
    assert log == ["release train"] + [f"{v} w{i}" for i in range(4) for v in ("acquire", "release")]
    first.close()


def test_misuse_through_the_client(server):
    lease = GPULease(server.address, holder="p")
    with pytest.raises(LeaseUsageError, match="release without holding"):
        lease.release()
    with lease.hold(role="train"):
        with pytest.raises(LeaseUsageError, match="double acquire.*turns do not nest"):
            with lease.hold(role="rollout"):
                pass
    twin = GPULease(server.address, holder="p")  # same holder name from another client
    with lease.hold(role="train"):
        with pytest.raises(LeaseUsageError, match="double acquire: holder 'p' holds"):
            twin.acquire("rollout")
    assert lease.held is None
    with pytest.raises(TypeError, match="arbiter must be"):
        GPULease(42)
    with pytest.raises(ValueError, match="acquire_timeout_s must be > 0"):
        LeaseConfig(acquire_timeout_s=0)
    lease.close()
    twin.close()


def test_acquire_timeout_withdraws_the_request(server):
    holder = GPULease(server.address, holder="holder")
    holder.acquire("train")
    impatient = GPULease(server.address, holder="impatient", config=LeaseConfig(acquire_timeout_s=0.3))
    t0 = time.monotonic()
    with pytest.raises(LeaseTimeoutError, match="within acquire_timeout_s=0.3 s.*position 0"):
        impatient.acquire("rollout")
    assert time.monotonic() - t0 < 0.3 + 1.0
    assert holder.snapshot()["waiting"] == []
    holder.release()
    with impatient.hold(role="rollout") as grant:  # usable again after the timeout
        assert grant.previous["holder"] == "holder"
    holder.close()
    impatient.close()


def test_heartbeat_keeps_a_long_turn(server):
    # ttl 1 s; a turn of 2.5 s survives on heartbeats, and the waiter gets it only afterwards
    holder = GPULease(server.address, holder="long")
    waiter = GPULease(server.address, holder="waiter")
    got = []
    with holder.hold(role="train"):
        t = threading.Thread(target=lambda: got.append(waiter.acquire("rollout")))
        t.start()
        time.sleep(2.5)
        holder.check()  # still ours
        assert not got
    t.join(5)
    assert got and got[0].previous["how"] == "released"
    waiter.release()
    holder.close()
    waiter.close()


def test_failed_callbacks():
    with LeaseServer(ttl_s=0.5) as server:
        lease = GPULease(server.address, holder="a")
        released = []
        with pytest.raises(RuntimeError, match="load failed"):
            lease.acquire(
                "train",
                acquire_fn=lambda: (_ for _ in ()).throw(RuntimeError("load failed")),
                release_fn=lambda: released.append(1),
            )
        assert released == [1] and lease.held is None  # what was loaded went back out
        assert lease.snapshot()["holder"] is None

        def broken():
            raise OSError("offload failed")

        with pytest.raises(LeaseError, match="NOT handed over") as info:
            with lease.hold(role="train", release_fn=broken):
                pass
        assert isinstance(info.value.__cause__, OSError)
        other = GPULease(server.address, holder="b")
        t0 = time.monotonic()
        with other.hold(role="rollout") as grant:  # not before the ttl: the state may be resident
            waited = time.monotonic() - t0
        assert grant.previous["how"] == "expired" and 0.3 < waited < 0.5 + 1.0
        lease.close()
        other.close()


# ---- forked processes -------------------------------------------------------------------------
def _hold_forever(address: str, ready_path: str) -> None:
    lease = GPULease(address, holder="doomed")
    lease.acquire("rollout")
    with open(ready_path, "w") as f:
        f.write("held")
    time.sleep(120)


def test_sigkilled_holder_loses_the_lease(server, tmp_path):
    ready = tmp_path / "ready"
    p = _fork.Process(target=_hold_forever, args=(server.address, str(ready)))
    p.start()
    try:
        _wait_until(ready.exists, 20)
        waiter = GPULease(server.address, holder="survivor")
        got = []
        t = threading.Thread(target=lambda: got.append(waiter.acquire("train")))
        t.start()
        _wait_until(lambda: len(waiter.snapshot()["waiting"]) == 1)
        time.sleep(1.5)  # heartbeats keep the live holder's turn past ttl_s
        assert not got
        t_kill = time.monotonic()
        os.kill(p.pid, signal.SIGKILL)
        t.join(10)
        elapsed = time.monotonic() - t_kill
        assert got, "waiter never got the lease after the holder was killed"
        assert got[0].previous["holder"] == "doomed" and got[0].previous["how"] == "expired"
        assert elapsed < 1.0 + 2.0  # ttl_s plus slack for a loaded CI box
        waiter.close()
    finally:
        p.kill()
        p.join()


def _stress_worker(address: str, path: str, turns: int, seed: int) -> None:
    rng = random.Random(seed)
    lease = GPULease(address, holder=f"p{os.getpid()}")
    rows = []
    for _ in range(turns):
        time.sleep(rng.uniform(0, 0.01))
        row = {}
        with lease.hold(
            role=f"r{seed}",
            acquire_fn=lambda: row.update(acquire=time.monotonic()),
            release_fn=lambda: row.update(release=time.monotonic()),
        ):
            row["enter"] = time.monotonic()
            time.sleep(rng.uniform(0, 0.01))
            row["exit"] = time.monotonic()
        rows.append(row)
    lease.close()
    with open(path, "w") as f:
        json.dump(rows, f)


def test_stress_no_two_holders(server, tmp_path):
    n, turns = 8, 6
    procs = [
        _fork.Process(target=_stress_worker, args=(server.address, str(tmp_path / f"{i}.json"), turns, i))
        for i in range(n)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    rows = [r for i in range(n) for r in json.loads((tmp_path / f"{i}.json").read_text())]
    assert len(rows) == n * turns
    rows.sort(key=lambda r: r["acquire"])
    for prev, nxt in zip(rows, rows[1:]):
        assert prev["acquire"] <= prev["enter"] <= prev["exit"] <= prev["release"]
        # the next turn (its acquire_fn included) starts only after this release_fn finished
        assert nxt["acquire"] >= prev["release"], (prev, nxt)
    history = GPULease(server.address, holder="observer").snapshot()["history"]
    assert sum(1 for e in history if e["event"] == "released") == n * turns
    assert not any(e["event"] == "expire" for e in history)


def test_timeshare_callbacks_offload_on_release(server):
    import torch

    import tidal
    from tidal.distributed.lease import timeshare_callbacks

    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    before = [p.detach().clone() for p in model.parameters()]
    ts = tidal.Timeshare(device="cpu")
    ts.add_role("train", model=model, optimizer=opt)
    ts.offload("train")
    with GPULease(server.address, holder="train") as lease, GPULease(server.address, holder="next") as nxt:
        with lease.hold(role="train", **timeshare_callbacks(ts, "train")):
            assert ts.is_resident("train")
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        assert not ts.is_resident("train")
        with nxt.hold(role="rollout") as grant:
            conf = grant.previous["confirmation"]
        assert conf["bytes_out"] >= 64 * 64 * 4 and conf["driver_free_bytes"] > 0
    with pytest.raises(ValueError, match="unknown role|no role"):
        timeshare_callbacks(ts, "nope")
    ts.close()


# ---- the TCP server against bad clients (issue 27) --------------------------------------------
def _raw(server: LeaseServer):
    import socket

    host, port = server.address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10)
    return sock, sock.makefile("rwb")


def test_close_without_start_returns_at_once():
    s = LeaseServer()
    t = threading.Thread(target=s.close, daemon=True)
    t.start()
    t.join(5)
    assert not t.is_alive(), "LeaseServer().close() without start() hung"
    s.close()  # idempotent


def test_an_over_long_request_is_refused_without_holding_it(server):
    """A 64 MiB line grew the server's memory by up to 64 MiB: now at most the limit is read,
    the request is answered with an error and the connection closed; the server goes on."""
    import tracemalloc

    sock, f = _raw(server)
    limit = server.max_request_bytes
    chunk = b"x" * (256 << 10)
    tracemalloc.start()
    try:
        sent = 0
        with pytest.raises(OSError):  # the server drops the connection once it has read the limit
            while sent < (64 << 20):
                sock.sendall(chunk)
                sent += len(chunk)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert sent < (64 << 20)
    assert peak < 4 * len(chunk) + 4 * limit, f"the server held {peak} bytes of one request"
    sock.close()
    lease = GPULease(server.address, holder="after")
    with lease.hold(role="r"):
        pass
    lease.close()


def test_an_over_long_request_gets_an_answer(server):
    sock, f = _raw(server)
    f.write(b"{" + b" " * (2 * server.max_request_bytes) + b"}\n")
    f.flush()
    reply = json.loads(f.readline())
    assert reply["ok"] is False and f"longer than {server.max_request_bytes} bytes" in reply["message"]
    assert f.readline() == b""  # closed
    sock.close()


@pytest.mark.parametrize(
    "line",
    [
        b"[" * 30000 + b"]" * 30000,  # nested deeper than the parser's recursion limit
        b'{"op": "status", "kwargs": [1, 2]}',
        b'{"op": ["status"]}',
        b"[1, 2]",
        b"42",
        b"not json",
    ],
)
def test_a_malformed_request_is_answered_and_the_connection_stays_usable(server, line):
    sock, f = _raw(server)
    f.write(line + b"\n")
    f.flush()
    reply = json.loads(f.readline())
    assert reply["ok"] is False and reply["error"] == "LeaseUsageError", reply
    f.write(json.dumps({"op": "status", "kwargs": {"ticket": 0}}).encode() + b"\n")
    f.flush()
    again = json.loads(f.readline())  # the handler thread is alive and answers
    assert "ok" in again
    sock.close()
