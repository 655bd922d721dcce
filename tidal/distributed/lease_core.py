"""The lease's turn-taking state machine: one holder at a time, FIFO, release before grant,
expiry of silent holders and waiters. Pure Python, no transport, no threads: the arbiters in
:mod:`tidal.distributed.lease_server` serialise calls into one :class:`LeaseTable`; clients
use :class:`tidal.distributed.lease.GPULease`.

Errors travel between processes by name: :func:`_reply` turns a raised :class:`LeaseError`
into a JSON-able answer, :func:`_check` raises it again on the client's side.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any, Callable

__all__ = ["LeaseError", "LeaseExpiredError", "LeaseTable", "LeaseTimeoutError", "LeaseUsageError"]


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
    early: bool = False  # may load while the holder before it still releases (overlapped hand-over)
    # While this holder releases in chunks: the bytes given back so far, and in all (progress()).
    returned_bytes: int | None = None
    total_bytes: int = 0


class LeaseTable:
    """The arbiter's state, without transport. Not thread-safe: a server serialises calls.

    Every method sweeps first (expires silent holders and waiters, grants the head of the
    queue when the lease is free), so expiry needs no timer thread: any call, including a
    waiter's periodic wait, moves the lease on. ``clock`` is injectable for tests.
    """

    def __init__(self, *, ttl_s: float, clock: Callable[[], float] = time.monotonic, history_len: int = 1024) -> None:
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
    def request(self, *, holder: str, role: str, early: bool = False) -> dict:
        """Queue for the lease. ``early``: this requester can load within memory handed over
        chunk by chunk, so once it heads the queue and the holder is releasing (reporting
        :meth:`progress`), its status is ``"loading"`` with the holder's credit, before the
        grant. The grant itself still waits for the holder's release."""
        self.sweep()
        if not holder or not role:
            raise LeaseUsageError(f"holder and role must be non-empty strings, got {holder!r}, {role!r}")
        other = self._by_holder.get(holder)
        if other is not None:
            doing = "holds" if other is self._holder else "is already waiting for"
            raise LeaseUsageError(
                f"double acquire: holder {holder!r} {doing} the lease (ticket {other.ticket}, role "
                f"{other.role!r}) and asked again for role {role!r}. A holder takes one turn at a "
                f"time: release the first before asking again (or give each process its own holder name)"
            )
        now = self._clock()
        t = _Ticket(self._next_ticket, holder, role, now + self.ttl_s, now, early=bool(early))
        self._next_ticket += 1
        self._queue.append(t)
        self._by_holder[holder] = t
        self.sweep()
        return self.status(ticket=t.ticket)

    def status(self, *, ticket: int) -> dict:
        t = self._find(ticket)
        if t is None:
            return {"state": "expired", "ticket": ticket, "why": self._expired[ticket]}
        out = {
            "state": "granted" if t is self._holder else "waiting",
            "ticket": ticket,
            "ttl_s": self.ttl_s,
            "holder": self._describe(self._holder),
        }
        if t is self._holder:
            out["previous"] = self._previous
            out["waited_s"] = t.granted_at - t.requested_at
        else:
            out["position"] = self._queue.index(t)
            h = self._holder
            if out["position"] == 0 and t.early and h is not None and h.returned_bytes is not None:
                out["state"] = "loading"
                out["credit"] = {"returned_bytes": h.returned_bytes, "total_bytes": h.total_bytes}
        return out

    def progress(self, *, ticket: int, returned_bytes: int, total_bytes: int) -> dict:
        """The holder is releasing: it has given ``returned_bytes`` of ``total_bytes`` back to
        the driver so far. The early requester at the head of the queue may load within that
        (its status turns ``"loading"``). Counts as a heartbeat."""
        self.sweep()
        for name, v in (("returned_bytes", returned_bytes), ("total_bytes", total_bytes)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise LeaseUsageError(f"{name} must be an int >= 0, got {v!r}")
        t = self._find(ticket)
        if t is None:
            raise LeaseExpiredError(f"ticket {ticket} {self._expired[ticket]}")
        if t is not self._holder:
            raise LeaseUsageError(
                f"progress without holding: ticket {ticket} (holder {t.holder!r}, role {t.role!r}) is "
                f"waiting at position {self._queue.index(t)}; only the holder reports its release"
            )
        if t.returned_bytes is None:
            self.history.append(
                {"event": "releasing", "ticket": ticket, "holder": t.holder, "role": t.role, "time": self._clock()}
            )
        t.returned_bytes, t.total_bytes = max(returned_bytes, t.returned_bytes or 0), total_bytes
        t.deadline = self._clock() + self.ttl_s
        return self.status(ticket=ticket)

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
                f"holder may have used the GPU meanwhile"
            )
        if t is not self._holder:
            raise LeaseUsageError(
                f"release without holding: ticket {ticket} (holder {t.holder!r}, role {t.role!r}) "
                f"is waiting at position {self._queue.index(t)}; withdraw a request with cancel"
            )
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
        return {
            "ttl_s": self.ttl_s,
            "holder": self._describe(self._holder),
            "waiting": [self._describe(t) for t in self._queue],
            "history": list(self.history),
        }

    # ---- bookkeeping --------------------------------------------------------------------------
    def sweep(self) -> None:
        now = self._clock()
        h = self._holder
        if h is not None and h.deadline < now:
            self._expire(
                h,
                f"expired: holder {h.holder!r} (role {h.role!r}) sent no heartbeat "
                f"for ttl_s={self.ttl_s} s while holding",
                now,
            )
            self._end_turn(h, "expired", None)
        for t in [t for t in self._queue if t.deadline < now]:
            self._queue.remove(t)
            self._expire(
                t,
                f"expired: waiter {t.holder!r} (role {t.role!r}) was not heard from "
                f"for ttl_s={self.ttl_s} s while waiting",
                now,
            )
        if self._holder is None and self._queue:
            t = self._queue.popleft()
            t.granted_at = now
            t.deadline = now + self.ttl_s
            self._holder = t
            self.history.append({"event": "grant", "ticket": t.ticket, "holder": t.holder, "role": t.role, "time": now})

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
        raise LeaseUsageError(
            f"unknown ticket {ticket}: it was never issued by this lease or its "
            f"turn already ended (release without holding?)"
        )

    def _expire(self, t: _Ticket, why: str, now: float) -> None:
        self._by_holder.pop(t.holder, None)
        self._expired[t.ticket] = why
        if len(self._expired) > 4096:  # bounded: forget the oldest expiries
            del self._expired[next(iter(self._expired))]
        self.history.append({"event": "expire", "ticket": t.ticket, "holder": t.holder, "role": t.role, "time": now})

    def _end_turn(self, t: _Ticket, how: str, confirmation: Any) -> None:
        now = self._clock()
        self._holder = None
        self._by_holder.pop(t.holder, None)
        self._previous = {
            "ticket": t.ticket,
            "holder": t.holder,
            "role": t.role,
            "how": how,
            "held_s": now - (t.granted_at or now),
            "confirmation": confirmation,
        }
        self.history.append(
            {
                "event": how,
                "ticket": t.ticket,
                "holder": t.holder,
                "role": t.role,
                "time": now,
                "confirmation": confirmation,
            }
        )

    @staticmethod
    def _describe(t: _Ticket | None) -> dict | None:
        return None if t is None else {"ticket": t.ticket, "holder": t.holder, "role": t.role}


_OPS = ("request", "status", "touch", "progress", "release", "cancel", "snapshot")


def _unchanged(st: dict, seen_bytes: int | None) -> bool:
    """A wait goes on while the status is what its caller saw: still waiting, or (for a
    caller already loading, ``seen_bytes`` given) still loading with no new credit."""
    if st.get("state") == "waiting":
        return True
    return seen_bytes is not None and st.get("state") == "loading" and st["credit"]["returned_bytes"] <= seen_bytes


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


def _check(out: dict) -> dict:
    if not out.get("ok", False):
        raise _ERRORS.get(out.get("error"), LeaseError)(out.get("message", repr(out)))
    return out
