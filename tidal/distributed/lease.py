"""A cross-process GPU lease: roles living in different processes take turns on one GPU.

The in-process :class:`~tidal.Timeshare` switches roles that share one address space. When
the roles are separate processes (Ray actors, an inference engine beside a trainer), the
turn-taking needs an arbiter they all reach. This module is that arbiter and its client::

    lease = GPULease("127.0.0.1:7000")                       # or GPULease(ray_actor_handle)
    with lease.hold(role="rollout", acquire_fn=ts.load_all, release_fn=offload_and_confirm):
        generate(...)                                        # only this holder is resident

Contract:

- **One holder at a time, FIFO.** Requests are served in arrival order; a waiter never
  overtakes an earlier one, so no role starves.
- **Hand-over after confirmed release.** Leaving a turn runs the holder's ``release_fn``
  (offload its state, empty the cache, read the driver's free memory) *in the holder's
  process*, and only then tells the arbiter; the arbiter grants the next waiter on that
  message, never before. What ``release_fn`` returns (e.g. ``{"driver_free_bytes": n}``) is
  passed to the next holder as ``grant.previous["confirmation"]``.
- **No deadlock on a crash.** While holding, a background thread heartbeats every
  ``ttl_s / 4``; a holder (or waiter) not heard from for ``ttl_s`` loses its place and the
  next waiter proceeds (``grant.previous["how"] == "expired"``). A killed process frees its
  GPU memory with it, so the next holder finds the room. A holder that was expired while still
  alive gets :class:`LeaseExpiredError` when it leaves its turn.
- **Misuse is an error**, not a hang: nested or double acquire by one holder, a release
  without holding (:class:`LeaseUsageError`, a ``ValueError``).

Why a small server and not file locks: ``flock`` gives crash safety for free but neither FIFO
order, nor a place to carry the release confirmation, nor expiry of a holder that is alive but
stuck, and it is confined to one host's filesystem. The state machine (:class:`LeaseTable`) is
pure Python and transport-free; two thin transports serve it: :class:`LeaseServer`, a
threaded TCP server speaking JSON lines (no Ray needed: tests, ``multiprocessing``, plain
launchers), and a Ray actor (:func:`start_lease_actor`) for Ray clusters. The TCP server has
no authentication: bind it to loopback (the default) or a trusted network only.

Blocking waits are served by the arbiter (a wait returns on grant or after at most
``ttl_s / 2``), so a hand-over costs one message round trip, not a polling interval.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import socket
import socketserver
import threading
import time
from typing import Any, Callable, Iterator

__all__ = [
    "GPULease", "LeaseConfig", "LeaseError", "LeaseExpiredError", "LeaseGrant", "LeaseServer",
    "LeaseTable", "LeaseTimeoutError", "LeaseUsageError", "start_lease_actor", "timeshare_callbacks",
]


class LeaseError(RuntimeError):
    """The lease could not be used (server unreachable, release callback failed)."""


class LeaseUsageError(LeaseError, ValueError):
    """The lease was used wrongly: double acquire, release without holding, unknown ticket."""


class LeaseExpiredError(LeaseError):
    """This holder lost its turn: no heartbeat reached the arbiter for ``ttl_s``."""


class LeaseTimeoutError(LeaseError, TimeoutError):
    """``acquire_timeout_s`` passed before the turn came; the request was withdrawn."""


_ERRORS = {c.__name__: c for c in (LeaseError, LeaseUsageError, LeaseExpiredError, LeaseTimeoutError)}


@dataclasses.dataclass
class _Ticket:
    ticket: int
    holder: str
    role: str
    deadline: float
    requested_at: float
    granted_at: float | None = None


class LeaseTable:
    """The arbiter's state, without transport. Not thread-safe: a server serialises calls.

    Every method sweeps first (expires silent holders and waiters, grants the head of the
    queue when the lease is free), so expiry needs no timer thread: any call, including a
    waiter's periodic wait, moves the lease on. ``clock`` is injectable for tests.
    """

    def __init__(self, *, ttl_s: float, clock: Callable[[], float] = time.monotonic,
                 history_len: int = 1024) -> None:
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.ttl_s = float(ttl_s)
        self._clock = clock
        self._next_ticket = 1
        self._holder: _Ticket | None = None
        self._queue: collections.deque[_Ticket] = collections.deque()
        self._by_holder: dict[str, _Ticket] = {}
        self._expired: dict[int, str] = {}  # ticket -> why, so late callers get a clear answer
        self._previous: dict | None = None  # how the last turn ended, handed to the next holder
        self.history: collections.deque[dict] = collections.deque(maxlen=history_len)

    # ---- operations (each returns a JSON-able dict) -------------------------------------------
    def request(self, *, holder: str, role: str) -> dict:
        self.sweep()
        if not holder or not role:
            raise LeaseUsageError(f"holder and role must be non-empty strings, got {holder!r}, {role!r}")
        other = self._by_holder.get(holder)
        if other is not None:
            doing = "holds" if other is self._holder else "is already waiting for"
            raise LeaseUsageError(
                f"double acquire: holder {holder!r} {doing} the lease (ticket {other.ticket}, role "
                f"{other.role!r}) and asked again for role {role!r}. A holder takes one turn at a "
                f"time: release the first before asking again (or give each process its own holder name)")
        now = self._clock()
        t = _Ticket(self._next_ticket, holder, role, now + self.ttl_s, now)
        self._next_ticket += 1
        self._queue.append(t)
        self._by_holder[holder] = t
        self.sweep()
        return self.status(ticket=t.ticket)

    def status(self, *, ticket: int) -> dict:
        t = self._find(ticket)
        if t is None:
            return {"state": "expired", "ticket": ticket, "why": self._expired[ticket]}
        out = {"state": "granted" if t is self._holder else "waiting", "ticket": ticket,
               "ttl_s": self.ttl_s, "holder": self._describe(self._holder)}
        if t is self._holder:
            out["previous"] = self._previous
            out["waited_s"] = t.granted_at - t.requested_at
        else:
            out["position"] = self._queue.index(t)
        return out

    def touch(self, *, ticket: int) -> dict:
        """Heartbeat (holder) or keep-alive (waiter): push the deadline ``ttl_s`` ahead."""
        self.sweep()
        t = self._find(ticket)
        if t is None:
            raise LeaseExpiredError(f"ticket {ticket} {self._expired[ticket]}")
        t.deadline = self._clock() + self.ttl_s
        return self.status(ticket=ticket)

    def release(self, *, ticket: int, confirmation: Any = None) -> dict:
        self.sweep()
        t = self._find(ticket)
        if t is None:
            raise LeaseExpiredError(
                f"ticket {ticket} {self._expired[ticket]}; the release came too late: another "
                f"holder may have used the GPU meanwhile")
        if t is not self._holder:
            raise LeaseUsageError(
                f"release without holding: ticket {ticket} (holder {t.holder!r}, role {t.role!r}) "
                f"is waiting at position {self._queue.index(t)}; withdraw a request with cancel")
        self._end_turn(t, "released", confirmation)
        self.sweep()
        return {"state": "released", "ticket": ticket}

    def cancel(self, *, ticket: int) -> dict:
        """Withdraw a request. A ticket granted meanwhile is released (nothing was loaded)."""
        self.sweep()
        t = self._find(ticket)
        if t is None:
            return {"state": "expired", "ticket": ticket}
        if t is self._holder:
            self._end_turn(t, "cancelled", None)
        else:
            self._queue.remove(t)
            del self._by_holder[t.holder]
            self.history.append({"event": "cancel", "ticket": ticket, "holder": t.holder, "role": t.role})
        self.sweep()
        return {"state": "cancelled", "ticket": ticket}

    def snapshot(self) -> dict:
        self.sweep()
        return {"ttl_s": self.ttl_s, "holder": self._describe(self._holder),
                "waiting": [self._describe(t) for t in self._queue], "history": list(self.history)}

    # ---- bookkeeping --------------------------------------------------------------------------
    def sweep(self) -> None:
        now = self._clock()
        h = self._holder
        if h is not None and h.deadline < now:
            self._expire(h, f"expired: holder {h.holder!r} (role {h.role!r}) sent no heartbeat "
                            f"for ttl_s={self.ttl_s} s while holding", now)
            self._end_turn(h, "expired", None)
        for t in [t for t in self._queue if t.deadline < now]:
            self._queue.remove(t)
            self._expire(t, f"expired: waiter {t.holder!r} (role {t.role!r}) was not heard from "
                            f"for ttl_s={self.ttl_s} s while waiting", now)
        if self._holder is None and self._queue:
            t = self._queue.popleft()
            t.granted_at = now
            t.deadline = now + self.ttl_s
            self._holder = t
            self.history.append({"event": "grant", "ticket": t.ticket, "holder": t.holder,
                                 "role": t.role, "time": now})

    def next_deadline(self) -> float | None:
        """The earliest time a sweep could change something (for servers' wait timeouts)."""
        ds = [t.deadline for t in self._queue] + ([self._holder.deadline] if self._holder else [])
        return min(ds) if ds else None

    def _find(self, ticket: int) -> _Ticket | None:
        if self._holder is not None and self._holder.ticket == ticket:
            return self._holder
        for t in self._queue:
            if t.ticket == ticket:
                return t
        if ticket in self._expired:
            return None
        raise LeaseUsageError(f"unknown ticket {ticket}: it was never issued by this lease or its "
                              f"turn already ended (release without holding?)")

    def _expire(self, t: _Ticket, why: str, now: float) -> None:
        self._by_holder.pop(t.holder, None)
        self._expired[t.ticket] = why
        if len(self._expired) > 4096:  # bounded: forget the oldest expiries
            del self._expired[next(iter(self._expired))]
        self.history.append({"event": "expire", "ticket": t.ticket, "holder": t.holder,
                             "role": t.role, "time": now})

    def _end_turn(self, t: _Ticket, how: str, confirmation: Any) -> None:
        now = self._clock()
        self._holder = None
        self._by_holder.pop(t.holder, None)
        self._previous = {"ticket": t.ticket, "holder": t.holder, "role": t.role, "how": how,
                          "held_s": now - (t.granted_at or now), "confirmation": confirmation}
        self.history.append({"event": how, "ticket": t.ticket, "holder": t.holder, "role": t.role,
                             "time": now, "confirmation": confirmation})

    @staticmethod
    def _describe(t: _Ticket | None) -> dict | None:
        return None if t is None else {"ticket": t.ticket, "holder": t.holder, "role": t.role}


_OPS = ("request", "status", "touch", "release", "cancel", "snapshot")


def _dispatch(table: LeaseTable, op: str, kwargs: dict) -> dict:
    if op not in _OPS:
        raise LeaseUsageError(f"unknown lease operation {op!r}; expected one of {_OPS}")
    return getattr(table, op)(**kwargs)


def _reply(fn: Callable[[], dict]) -> dict:
    try:
        return {"ok": True, **fn()}
    except LeaseError as e:
        return {"ok": False, "error": type(e).__name__, "message": str(e)}
    except (TypeError, ValueError) as e:  # malformed request from a client
        return {"ok": False, "error": "LeaseUsageError", "message": f"bad request: {e}"}


# ---- transport 1: TCP, JSON lines -------------------------------------------------------------
class _Handler(socketserver.StreamRequestHandler):
    def setup(self) -> None:
        super().setup()
        self.server.connections.add(self.connection)  # type: ignore[attr-defined]

    def finish(self) -> None:
        self.server.connections.discard(self.connection)  # type: ignore[attr-defined]
        super().finish()

    def handle(self) -> None:
        server: LeaseServer = self.server.lease_server  # type: ignore[attr-defined]
        for line in self.rfile:
            try:
                msg = json.loads(line)
                op, kwargs = msg["op"], msg.get("kwargs", {})
            except (ValueError, KeyError, TypeError) as e:
                out = {"ok": False, "error": "LeaseUsageError", "message": f"bad request: {e}"}
            else:
                out = server._serve(op, kwargs)
            try:
                self.wfile.write(json.dumps(out).encode() + b"\n")
                self.wfile.flush()
            except OSError:  # the client went away (killed, or closed mid-wait)
                return


class _TCPServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


class LeaseServer:
    """The arbiter over TCP (one thread per client connection), run in any process.

    ``LeaseServer(ttl_s=10).start()`` serves on ``address`` (``"host:port"``; port 0 picks a
    free one) from a daemon thread until :meth:`close`.
    """

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0, ttl_s: float = 10.0) -> None:
        self.table = LeaseTable(ttl_s=ttl_s)
        self._cond = threading.Condition()
        self._server = _TCPServer((host, port), _Handler)
        self._server.lease_server = self  # type: ignore[attr-defined]
        self._server.connections = set()  # type: ignore[attr-defined]
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        host, port = self._server.server_address[:2]
        return f"{host}:{port}"

    def start(self) -> "LeaseServer":
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="tidal-lease-server", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop serving and drop every client connection (their next call raises LeaseError)."""
        self._server.shutdown()
        self._server.server_close()
        for conn in list(self._server.connections):  # type: ignore[attr-defined]
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def __enter__(self) -> "LeaseServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def _serve(self, op: str, kwargs: dict) -> dict:
        with self._cond:
            if op != "wait":
                out = _reply(lambda: _dispatch(self.table, op, kwargs))
                self._cond.notify_all()
                return out
            return _reply(lambda: self._wait(**kwargs))

    def _wait(self, *, ticket: int, timeout_s: float) -> dict:
        # Called with the condition held. Capped at ttl/2 so a blocked waiter never outlives
        # its own keep-alive; every wake sweeps, which is what expires a silent holder.
        end = time.monotonic() + min(float(timeout_s), self.table.ttl_s / 2)
        st = self.table.touch(ticket=ticket)
        while st["state"] == "waiting" and (left := end - time.monotonic()) > 0:
            nd = self.table.next_deadline()
            self._cond.wait(left if nd is None else max(0.0, min(left, nd - time.monotonic()) + 1e-3))
            self.table.sweep()
            st = self.table.status(ticket=ticket)
        self._cond.notify_all()  # a sweep may have granted someone else
        return st


class _TCPBackend:
    def __init__(self, address: str, *, connect_timeout_s: float) -> None:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"lease address must be 'host:port', got {address!r}")
        self.address = address
        try:
            self._sock = socket.create_connection((host, int(port)), timeout=connect_timeout_s)
        except OSError as e:
            raise LeaseError(f"cannot reach the lease server at {address}: {e}. Start one with "
                             f"LeaseServer(...).start() and pass its address") from e
        self._sock.settimeout(None)
        self._file = self._sock.makefile("rwb")
        self._lock = threading.Lock()

    def call(self, op: str, **kwargs) -> dict:
        with self._lock:  # one request in flight per connection (heartbeat thread vs caller)
            try:
                self._file.write(json.dumps({"op": op, "kwargs": kwargs}).encode() + b"\n")
                self._file.flush()
                line = self._file.readline()
            except OSError as e:
                raise LeaseError(f"lease server at {self.address} failed during {op!r}: {e}") from e
        if not line:
            raise LeaseError(f"lease server at {self.address} closed the connection during {op!r}")
        return json.loads(line)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._file.close()
            self._sock.close()


# ---- transport 2: a Ray actor ---------------------------------------------------------------
_ACTOR_CLASS = None


def _lease_actor_class():
    global _ACTOR_CLASS
    if _ACTOR_CLASS is None:
        import asyncio  # noqa: PLC0415

        import ray  # noqa: PLC0415  (optional dependency: tidal[ray])

        class GPULeaseActor:
            """The arbiter as an async Ray actor: one event loop serialises the table."""

            def __init__(self, ttl_s: float) -> None:
                self.table = LeaseTable(ttl_s=ttl_s)
                self._cond: asyncio.Condition | None = None

            async def call(self, op: str, kwargs: dict) -> dict:
                if self._cond is None:
                    self._cond = asyncio.Condition()
                async with self._cond:
                    if op == "wait":
                        out = await self._wait(**kwargs)
                    else:
                        out = _reply(lambda: _dispatch(self.table, op, kwargs))
                    self._cond.notify_all()
                    return out

            async def _wait(self, *, ticket: int, timeout_s: float) -> dict:
                end = time.monotonic() + min(float(timeout_s), self.table.ttl_s / 2)
                st = _reply(lambda: self.table.touch(ticket=ticket))
                while st.get("state") == "waiting" and (left := end - time.monotonic()) > 0:
                    nd = self.table.next_deadline()
                    wait_s = left if nd is None else max(0.0, min(left, nd - time.monotonic()) + 1e-3)
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._cond.wait(), wait_s)
                    st = _reply(lambda: (self.table.sweep(), self.table.status(ticket=ticket))[1])
                return st

        _ACTOR_CLASS = ray.remote(num_cpus=0, max_concurrency=1000)(GPULeaseActor)
    return _ACTOR_CLASS


def start_lease_actor(name: str, *, ttl_s: float = 10.0, namespace: str | None = None, **options):
    """Start, or get if it lives, the arbiter of one GPU as a named Ray actor (it lives as long
    as the job that started it). Every process sharing the GPU passes the same ``name`` (e.g.
    ``Placement.lease_name(role, index)``) and wraps the handle in :class:`GPULease`. Extra
    ``options`` go to ``.options()`` (e.g. a scheduling strategy to keep it on the GPU's node)."""
    cls = _lease_actor_class()
    return cls.options(name=name, namespace=namespace, get_if_exists=True, **options).remote(ttl_s)


class _RayBackend:
    def __init__(self, actor) -> None:
        self.actor = actor
        self.address = f"ray actor {actor}"

    def call(self, op: str, **kwargs) -> dict:
        import ray  # noqa: PLC0415

        try:
            return ray.get(self.actor.call.remote(op, kwargs))
        except ray.exceptions.RayActorError as e:
            raise LeaseError(f"the lease actor died during {op!r}: {e}") from e

    def close(self) -> None:
        pass


# ---- client ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class LeaseConfig:
    """
    Attributes:
        acquire_timeout_s: give up waiting after this long (:class:`LeaseTimeoutError`; the
            request is withdrawn). ``None``: wait for the turn however long the queue is.
        heartbeat_interval_s: how often a holder tells the arbiter it lives. ``None``: a
            quarter of the arbiter's ``ttl_s`` (so three heartbeats may be lost before expiry).
        connect_timeout_s: for reaching a TCP arbiter.
    """

    acquire_timeout_s: float | None = None
    heartbeat_interval_s: float | None = None
    connect_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        for name in ("acquire_timeout_s", "heartbeat_interval_s"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"{name} must be > 0 or None, got {v}")
        if not self.connect_timeout_s > 0:
            raise ValueError(f"connect_timeout_s must be > 0, got {self.connect_timeout_s}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LeaseGrant:
    """A turn: who holds it, how long the wait took, and how the previous turn ended
    (``previous["how"]`` is ``"released"``, ``"expired"`` or ``"cancelled"``;
    ``previous["confirmation"]`` is what the previous holder's ``release_fn`` returned)."""

    holder: str
    role: str
    ticket: int
    waited_s: float
    ttl_s: float
    previous: dict | None


class _Heartbeat(threading.Thread):
    def __init__(self, backend, ticket: int, interval_s: float) -> None:
        super().__init__(name=f"tidal-lease-heartbeat-{ticket}", daemon=True)
        self._backend, self._ticket, self._interval_s = backend, ticket, interval_s
        self._stop_event = threading.Event()
        self.error: LeaseError | None = None

    def run(self) -> None:
        while not self._stop_event.wait(self._interval_s):
            try:
                _check(self._backend.call("touch", ticket=self._ticket))
            except LeaseError as e:  # expired or arbiter gone: report at release, stop beating
                self.error = e
                return

    def stop(self) -> None:
        self._stop_event.set()
        self.join()


def _check(out: dict) -> dict:
    if not out.get("ok", False):
        raise _ERRORS.get(out.get("error"), LeaseError)(out.get("message", repr(out)))
    return out


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=repr))


class GPULease:
    """A client of one GPU's arbiter, for one holder (by default this process).

    Args:
        arbiter: ``"host:port"`` of a :class:`LeaseServer`, or a Ray actor handle from
            :func:`start_lease_actor`.
        holder: this client's identity at the arbiter (default ``"<hostname>:<pid>"``); one
            holder takes one turn at a time.
        config: timeouts and heartbeat interval.

    Use :meth:`hold` around a turn, or :meth:`acquire` / :meth:`release` where the turn
    spans calls (Ray actor methods). Not meant to be shared between threads.
    """

    def __init__(self, arbiter, *, holder: str | None = None, config: LeaseConfig | None = None) -> None:
        self.config = config or LeaseConfig()
        self.holder = holder or f"{socket.gethostname()}:{os.getpid()}"
        if isinstance(arbiter, str):
            self._backend = _TCPBackend(arbiter, connect_timeout_s=self.config.connect_timeout_s)
        elif hasattr(arbiter, "call") and hasattr(arbiter.call, "remote"):
            self._backend = _RayBackend(arbiter)
        else:
            raise TypeError(f"arbiter must be a 'host:port' string or a Ray actor handle from "
                            f"start_lease_actor(), got {type(arbiter).__name__}")
        self._lock = threading.Lock()
        self._pending: str | None = None  # role being acquired (guards double acquire)
        self._grant: LeaseGrant | None = None
        self._release_fn: Callable[[], Any] | None = None
        self._heartbeat: _Heartbeat | None = None

    @property
    def held(self) -> LeaseGrant | None:
        """The current turn, or None."""
        return self._grant

    def snapshot(self) -> dict:
        """The arbiter's view: holder, queue, recent history (grants, releases, expiries)."""
        return _check(self._backend.call("snapshot"))

    def acquire(self, role: str, *, acquire_fn: Callable[[], Any] | None = None,
                release_fn: Callable[[], Any] | None = None) -> LeaseGrant:
        """Wait for the turn (FIFO), then run ``acquire_fn`` (bring the role's state in).
        ``release_fn`` is kept for :meth:`release`."""
        with self._lock:
            busy = self._grant.role if self._grant else self._pending
            if busy is not None:
                raise LeaseUsageError(
                    f"double acquire: holder {self.holder!r} already {'holds' if self._grant else 'waits for'} "
                    f"the lease for role {busy!r} and asked for role {role!r}; turns do not nest: "
                    f"release the first turn before taking the next")
            self._pending = role
        try:
            grant = self._wait_for_turn(role)
            beat = self.config.heartbeat_interval_s or grant.ttl_s / 4
            self._heartbeat = _Heartbeat(self._backend, grant.ticket, beat)
            self._heartbeat.start()
            self._grant, self._release_fn = grant, release_fn
        finally:
            self._pending = None
        if acquire_fn is not None:
            try:
                acquire_fn()
            except BaseException:
                # Whatever was loaded goes back out before the turn passes on.
                with contextlib.suppress(LeaseError):
                    self.release()
                raise
        return grant

    def release(self) -> Any:
        """End the turn: run ``release_fn`` (offload, confirm), then tell the arbiter, which
        grants the next waiter. Returns the confirmation sent. Raises
        :class:`LeaseExpiredError` if the turn had expired meanwhile (after offloading)."""
        grant, heartbeat, release_fn = self._grant, self._heartbeat, self._release_fn
        if grant is None:
            raise LeaseUsageError(f"release without holding: holder {self.holder!r} holds no turn "
                                  f"(acquire first, or use `with lease.hold(role=...)`)")
        self._grant = self._heartbeat = self._release_fn = None
        try:
            confirmation = _jsonable(release_fn()) if release_fn is not None else None
        except BaseException as e:
            heartbeat.stop()
            raise LeaseError(
                f"release_fn of role {grant.role!r} failed, so the turn was NOT handed over (the "
                f"role's state may still be on the GPU). The arbiter stops hearing from this "
                f"holder and passes the turn on after its ttl_s, as for a crashed holder") from e
        heartbeat.stop()  # beats continued while release_fn ran (an offload may outlast ttl_s)
        try:
            _check(self._backend.call("release", ticket=grant.ticket, confirmation=confirmation))
        except LeaseExpiredError as e:
            raise LeaseExpiredError(f"{e} (heartbeat error: {heartbeat.error})") from None
        return confirmation

    @contextlib.contextmanager
    def hold(self, role: str, *, acquire_fn: Callable[[], Any] | None = None,
             release_fn: Callable[[], Any] | None = None) -> Iterator[LeaseGrant]:
        """``with lease.hold(role="rollout", ...)``: a turn for the block. ``release_fn`` runs
        when the block ends (also on an exception), before the next holder is granted."""
        grant = self.acquire(role, acquire_fn=acquire_fn, release_fn=release_fn)
        try:
            yield grant
        finally:
            self.release()

    def check(self) -> None:
        """Raise :class:`LeaseExpiredError` if the current turn was lost (call it between
        steps of a long turn)."""
        if self._heartbeat is not None and self._heartbeat.error is not None:
            raise self._heartbeat.error

    def close(self) -> None:
        """Release a held turn (running ``release_fn``) and drop the connection."""
        try:
            if self._grant is not None:
                self.release()
        finally:
            self._backend.close()

    def __enter__(self) -> "GPULease":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _wait_for_turn(self, role: str) -> LeaseGrant:
        timeout = self.config.acquire_timeout_s
        deadline = None if timeout is None else time.monotonic() + timeout
        st = _check(self._backend.call("request", holder=self.holder, role=role))
        ticket = st["ticket"]
        try:
            while st["state"] == "waiting":
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    _check(self._backend.call("cancel", ticket=ticket))
                    raise LeaseTimeoutError(
                        f"role {role!r} (holder {self.holder!r}) did not get the lease within "
                        f"acquire_timeout_s={timeout} s: {st['holder']} holds it and this request "
                        f"was at position {st['position']} of the queue; the request was withdrawn")
                st = _check(self._backend.call("wait", ticket=ticket,
                                               timeout_s=st["ttl_s"] / 2 if left is None else min(left, st["ttl_s"] / 2)))
        except KeyboardInterrupt:
            with contextlib.suppress(LeaseError):
                self._backend.call("cancel", ticket=ticket)
            raise
        if st["state"] != "granted":
            raise LeaseExpiredError(f"role {role!r} lost its place in the queue: {st.get('why', st)}")
        return LeaseGrant(holder=self.holder, role=role, ticket=ticket, waited_s=st["waited_s"],
                          ttl_s=st["ttl_s"], previous=st.get("previous"))



def timeshare_callbacks(ts, role: str) -> dict:
    """``acquire_fn`` / ``release_fn`` that make ``role`` of a :class:`~tidal.Timeshare` take
    its turns: ``lease.hold(role="rollout", **timeshare_callbacks(ts, "rollout"))``.

    The release offloads every resident role of ``ts`` (returning freed memory to the driver)
    and confirms with a driver-level reading, sent to the next holder:
    ``{"bytes_out", "driver_free_bytes", "driver_total_bytes", "allocated_bytes"}``.
    """
    from tidal.memory import snapshot  # noqa: PLC0415

    ts.role(role)  # raises for an unknown role, now rather than at the first turn
    if not ts.config.release_to_driver:
        raise ValueError("this Timeshare keeps freed memory in torch's cache "
                         "(TimeshareConfig(release_to_driver=False)): another process sharing the GPU "
                         "would never see it. Use release_to_driver=True with a cross-process lease")

    def acquire_fn() -> None:
        ts.load(role)

    def release_fn() -> dict:
        record = ts.offload_all()
        snap = snapshot(ts.ops)
        return {"bytes_out": record.bytes_out if record else 0, "driver_free_bytes": snap.driver_free_bytes,
                "driver_total_bytes": snap.driver_total_bytes, "allocated_bytes": snap.allocated_bytes}

    return {"acquire_fn": acquire_fn, "release_fn": release_fn}
