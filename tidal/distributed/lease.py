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
stuck, and it is confined to one host's filesystem. The module layout follows the parts: the
state machine (:class:`LeaseTable`, :mod:`tidal.distributed.lease_core`) is pure Python and
transport-free; two thin transports serve it (:mod:`tidal.distributed.lease_server`):
:class:`LeaseServer`, a threaded TCP server speaking JSON lines (no Ray needed: tests,
``multiprocessing``, plain launchers), and a Ray actor (:func:`start_lease_actor`) for Ray
clusters; this module is the client (:class:`GPULease`) and the glue to a
:class:`~tidal.Timeshare` (:func:`timeshare_callbacks`). The TCP server has no
authentication: bind it to loopback (the default) or a trusted network only.

Blocking waits are served by the arbiter (a wait returns on grant or after at most
``ttl_s / 2``), so a hand-over costs one message round trip, not a polling interval.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import threading
import time
from typing import Any, Callable, Iterator

from tidal.memory import snapshot
from tidal.state.handover import NOTHING_COMING, RoomSource
from tidal.distributed.lease_core import (
    LeaseError,
    LeaseExpiredError,
    LeaseTable,
    LeaseTimeoutError,
    LeaseUsageError,
    _check,
)
from tidal.distributed.lease_server import (
    LeaseServer,
    _RayBackend,
    _TCPBackend,
    start_lease_actor,
)

__all__ = [
    "GPULease",
    "LeaseConfig",
    "LeaseError",
    "LeaseExpiredError",
    "LeaseGrant",
    "LeaseServer",
    "LeaseTable",
    "LeaseTimeoutError",
    "LeaseUsageError",
    "start_lease_actor",
    "timeshare_callbacks",
]


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
    ``previous["confirmation"]`` is what the previous holder's ``release_fn`` returned).
    ``overlapped``: ``acquire_fn`` ran while the previous holder was still releasing."""

    holder: str
    role: str
    ticket: int
    waited_s: float
    ttl_s: float
    previous: dict | None
    overlapped: bool = False


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
            raise TypeError(
                f"arbiter must be a 'host:port' string or a Ray actor handle from "
                f"start_lease_actor(), got {type(arbiter).__name__}"
            )
        self._lock = threading.Lock()
        self._pending: str | None = None  # role being acquired (guards double acquire)
        self._grant: LeaseGrant | None = None
        self._release_fn: Callable[[], Any] | None = None
        self._heartbeat: _Heartbeat | None = None
        self._releasing: LeaseGrant | None = None  # the turn whose release_fn runs now
        self._unloading = False  # release_fn runs after a failed early load: nobody to report to
        self._room: _HandedOver | None = None  # while an overlapped acquire loads early

    @property
    def room_source(self) -> "RoomSource | None":
        """While an overlapped :meth:`acquire` runs its ``acquire_fn`` before the grant (the
        previous holder still releasing): the memory that holder hands over, as a
        :class:`~tidal.state.handover.RoomSource` to load against
        (``ts.load(role, room_source=lease.room_source)``). None otherwise."""
        return self._room

    @property
    def held(self) -> LeaseGrant | None:
        """The current turn, or None."""
        return self._grant

    def snapshot(self) -> dict:
        """The arbiter's view: holder, queue, recent history (grants, releases, expiries)."""
        return _check(self._backend.call("snapshot"))

    def acquire(
        self,
        role: str,
        *,
        acquire_fn: Callable[[], Any] | None = None,
        release_fn: Callable[[], Any] | None = None,
        overlap: bool = False,
    ) -> LeaseGrant:
        """Wait for the turn (FIFO), then run ``acquire_fn`` (bring the role's state in).
        ``release_fn`` is kept for :meth:`release`.

        ``overlap``: run ``acquire_fn`` as soon as this request heads the queue and the
        holder has started releasing in chunks (:meth:`report_released`), not after its
        release; ``acquire_fn`` must then load within the memory handed over so far, waiting
        on :attr:`room_source` for more (:func:`timeshare_callbacks` with ``lease=`` does).
        Its H2D copies run while the previous holder's D2H copies still do. This returns once
        ``acquire_fn`` is done and the previous holder's release is complete, so the turn
        itself never overlaps another. Should ``acquire_fn`` fail before the grant, what it
        loaded goes back out (``release_fn``) and the request is withdrawn.
        ``config.acquire_timeout_s`` bounds the wait for the queue's head, not the loading nor
        the wait for the previous holder's release that follows it (its expiry bounds those)."""
        with self._lock:
            busy = self._grant.role if self._grant else self._pending
            if busy is not None:
                raise LeaseUsageError(
                    f"double acquire: holder {self.holder!r} already {'holds' if self._grant else 'waits for'} "
                    f"the lease for role {busy!r} and asked for role {role!r}; turns do not nest: "
                    f"release the first turn before taking the next"
                )
            self._pending = role
        try:
            st = self._wait_for_turn(role, early=overlap)
            beat = self.config.heartbeat_interval_s or st["ttl_s"] / 4
            # A loader is kept alive by the beats too: its loading may outlast ttl_s.
            self._heartbeat = _Heartbeat(self._backend, st["ticket"], beat)
            self._heartbeat.start()
        finally:
            self._pending = None
        if st["state"] == "loading":
            return self._acquire_early(role, st, acquire_fn, release_fn)
        grant = self._grant_of(role, st)
        self._grant, self._release_fn = grant, release_fn
        if acquire_fn is not None:
            try:
                acquire_fn()
            except BaseException:
                # Whatever was loaded goes back out before the turn passes on.
                with contextlib.suppress(LeaseError):
                    self.release()
                raise
        return grant

    def _acquire_early(self, role: str, st: dict, acquire_fn, release_fn) -> LeaseGrant:
        """:meth:`acquire` from ``"loading"``: load on the previous holder's credit, then wait
        for the grant (its release done)."""
        ticket = st["ticket"]
        self._room = _HandedOver(self._backend, st)
        try:
            if acquire_fn is not None:
                acquire_fn()
            st = self._room._st  # what its waits for memory last heard
            while st["state"] != "granted":
                if st["state"] not in ("waiting", "loading"):
                    raise LeaseExpiredError(f"role {role!r} lost its place in the queue: {st.get('why', st)}")
                st = _check(self._backend.call("wait", ticket=ticket, timeout_s=st["ttl_s"] / 2, seen_bytes=1 << 62))
        except BaseException:
            self._room = None
            heartbeat, self._heartbeat = self._heartbeat, None
            self._unloading = True
            try:
                if release_fn is not None:
                    release_fn()  # what acquire_fn loaded goes back out before the request is withdrawn
            finally:
                self._unloading = False
                heartbeat.stop()
                with contextlib.suppress(LeaseError):
                    self._backend.call("cancel", ticket=ticket)
            raise
        self._room = None
        grant = dataclasses.replace(self._grant_of(role, st), overlapped=True)
        self._grant, self._release_fn = grant, release_fn
        return grant

    def report_released(self, returned_bytes: int, total_bytes: int) -> None:
        """From inside ``release_fn``: ``returned_bytes`` of the ``total_bytes`` this release
        frees are back with the driver. The next waiter, if it asked for ``overlap``, starts
        loading into them. Raises :class:`LeaseUsageError` outside a ``release_fn``; does nothing
        in the ``release_fn`` that unloads a failed early load (this holder had no turn to hand
        over)."""
        if self._unloading:
            return
        grant = self._releasing
        if grant is None:
            raise LeaseUsageError(
                "report_released() outside a release: call it from the release_fn that "
                "lease.release() (or the end of lease.hold()) runs"
            )
        _check(
            self._backend.call(
                "progress", ticket=grant.ticket, returned_bytes=int(returned_bytes), total_bytes=int(total_bytes)
            )
        )

    def release(self) -> Any:
        """End the turn: run ``release_fn`` (offload, confirm), then tell the arbiter, which
        grants the next waiter. Returns the confirmation sent. Raises
        :class:`LeaseExpiredError` if the turn had expired meanwhile (after offloading)."""
        grant, heartbeat, release_fn = self._grant, self._heartbeat, self._release_fn
        if grant is None:
            raise LeaseUsageError(
                f"release without holding: holder {self.holder!r} holds no turn "
                f"(acquire first, or use `with lease.hold(role=...)`)"
            )
        self._grant = self._heartbeat = self._release_fn = None
        self._releasing = grant
        try:
            confirmation = _jsonable(release_fn()) if release_fn is not None else None
        except BaseException as e:
            self._releasing = None
            heartbeat.stop()
            raise LeaseError(
                f"release_fn of role {grant.role!r} failed, so the turn was NOT handed over (the "
                f"role's state may still be on the GPU). The arbiter stops hearing from this "
                f"holder and passes the turn on after its ttl_s, as for a crashed holder"
            ) from e
        self._releasing = None
        heartbeat.stop()  # beats continued while release_fn ran (an offload may outlast ttl_s)
        try:
            _check(self._backend.call("release", ticket=grant.ticket, confirmation=confirmation))
        except LeaseExpiredError as e:
            raise LeaseExpiredError(f"{e} (heartbeat error: {heartbeat.error})") from None
        return confirmation

    @contextlib.contextmanager
    def hold(
        self,
        role: str,
        *,
        acquire_fn: Callable[[], Any] | None = None,
        release_fn: Callable[[], Any] | None = None,
        overlap: bool = False,
    ) -> Iterator[LeaseGrant]:
        """``with lease.hold(role="rollout", ...)``: a turn for the block. ``release_fn`` runs
        when the block ends (also on an exception), before the next holder is granted.
        ``overlap``: see :meth:`acquire`."""
        grant = self.acquire(role, acquire_fn=acquire_fn, release_fn=release_fn, overlap=overlap)
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

    def _wait_for_turn(self, role: str, *, early: bool = False) -> dict:
        """Request the turn and wait until it is granted (or, ``early``, loading); returns
        the arbiter's status."""
        timeout = self.config.acquire_timeout_s
        deadline = None if timeout is None else time.monotonic() + timeout
        st = _check(self._backend.call("request", holder=self.holder, role=role, early=early))
        ticket = st["ticket"]
        try:
            while st["state"] == "waiting":
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    _check(self._backend.call("cancel", ticket=ticket))
                    raise LeaseTimeoutError(
                        f"role {role!r} (holder {self.holder!r}) did not get the lease within "
                        f"acquire_timeout_s={timeout} s: {st['holder']} holds it and this request "
                        f"was at position {st['position']} of the queue; the request was withdrawn"
                    )
                st = _check(
                    self._backend.call(
                        "wait", ticket=ticket, timeout_s=st["ttl_s"] / 2 if left is None else min(left, st["ttl_s"] / 2)
                    )
                )
        except KeyboardInterrupt:
            with contextlib.suppress(LeaseError):
                self._backend.call("cancel", ticket=ticket)
            raise
        if st["state"] not in ("granted", "loading"):
            raise LeaseExpiredError(f"role {role!r} lost its place in the queue: {st.get('why', st)}")
        return st

    def _grant_of(self, role: str, st: dict) -> LeaseGrant:
        return LeaseGrant(
            holder=self.holder,
            role=role,
            ticket=st["ticket"],
            waited_s=st["waited_s"],
            ttl_s=st["ttl_s"],
            previous=st.get("previous"),
        )


class _HandedOver:
    """The memory a releasing holder hands over, as the arbiter reports it: a
    :class:`~tidal.state.handover.RoomSource` for an early loader."""

    def __init__(self, backend, st: dict) -> None:
        self._backend, self._st = backend, st

    def _credit(self) -> tuple[int, int]:
        c = self._st.get("credit") or {}
        return c.get("returned_bytes", 0), c.get("total_bytes", 0)

    def pending_bytes(self) -> int:
        if self._st["state"] != "loading":
            return 0  # granted: the previous holder's release is complete
        returned, total = self._credit()
        return max(0, total - returned)

    def wait(self) -> bool:
        if self._st["state"] != "loading":
            return False
        seen = self._credit()[0]
        st = self._st
        while st["state"] == "loading" and st["credit"]["returned_bytes"] <= seen:
            # The arbiter answers on new credit or the grant (or after ttl_s / 2: ask again).
            st = _check(self._backend.call("wait", ticket=st["ticket"], timeout_s=st["ttl_s"] / 2, seen_bytes=seen))
        if st["state"] not in ("loading", "granted"):
            raise LeaseExpiredError(f"lost the place in the queue while loading: {st.get('why', st)}")
        self._st = st
        return True


def timeshare_callbacks(ts, role: str, *, lease: GPULease | None = None) -> dict:
    """``acquire_fn`` / ``release_fn`` that make ``role`` of a :class:`~tidal.Timeshare` take
    its turns: ``lease.hold(role="rollout", **timeshare_callbacks(ts, "rollout", lease=lease))``.

    The release offloads every resident role of ``ts`` (returning freed memory to the driver)
    and confirms with a driver-level reading, sent to the next holder:
    ``{"bytes_out", "driver_free_bytes", "driver_total_bytes", "allocated_bytes"}``.

    With ``lease``, hand-overs overlap (the dict carries ``overlap=True`` for :meth:`GPULease.hold`):
    the release gives memory back ``TimeshareConfig.handover_chunk_bytes`` at a time and
    reports each chunk to the arbiter (:meth:`GPULease.report_released`); the next holder, if
    it overlaps too, loads into that memory while the rest is still being copied out. Without
    ``lease`` a hand-over is sequential: all out, then all in.
    """
    ts.role(role)  # raises for an unknown role, now rather than at the first turn
    if not ts.config.release_to_driver:
        raise ValueError(
            "this Timeshare keeps freed memory in torch's cache "
            "(TimeshareConfig(release_to_driver=False)): another process sharing the GPU "
            "would never see it. Use release_to_driver=True with a cross-process lease"
        )

    def acquire_fn() -> None:
        # With a lease, always through a room source (NOTHING_COMING when granted outright), so
        # the role is allocated in runs its next chunked release gives back one by one.
        ts.load(role, room_source=(lease.room_source or NOTHING_COMING) if lease is not None else None)

    def release_fn() -> dict:
        record = ts.offload_all(on_released=lease.report_released if lease is not None else None)
        snap = snapshot(ts.ops)
        return {
            "bytes_out": record.bytes_out if record else 0,
            "driver_free_bytes": snap.driver_free_bytes,
            "driver_total_bytes": snap.driver_total_bytes,
            "allocated_bytes": snap.allocated_bytes,
        }

    out = {"acquire_fn": acquire_fn, "release_fn": release_fn}
    return out if lease is None else {**out, "overlap": True}
