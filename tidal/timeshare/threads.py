"""A timeshare used from several threads (a data loader, a logging callback, a second
trainer thread).

Every verb of :class:`~tidal.Timeshare` that reads or changes where state is runs under one
re-entrant lock (:func:`serialised`), so two transitions never interleave and a role's flags
always agree with its storages. The lock is the store's (:func:`tidal.state.foreign.lock_of`),
so ``state_dict()`` / ``load_state_dict()`` from another thread wait for a transition instead
of reading the store half-way through it.

``use()`` also knows which threads are inside a role's blocks: a ``use()`` whose switch would
move out a role that another thread is using waits until that thread's blocks of it end
(:func:`wait_for_room`), instead of pulling its state from under it. Waiting that can never end
(two threads each waiting for the other's role) raises at once. Costs one lock acquisition per
verb; nothing per op.
"""

from __future__ import annotations

import functools
import itertools
import threading
import time
from typing import Any, Callable, TypeVar

from tidal.timeshare.core import ThreadedTimeshare

from tidal.timeshare.role import Role

__all__ = ["serialised", "wait_for_room"]

F = TypeVar("F", bound=Callable[..., Any])
_TICKETS = itertools.count()  # the order in which use() calls began to wait


def serialised(method: F) -> F:
    """Run a timeshare method under the timeshare's lock."""

    @functools.wraps(method)
    def run(self: ThreadedTimeshare, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)

    return run  # type: ignore[return-value]


def _blockers(ts: ThreadedTimeshare, role: Role, me: int, keep_free_bytes: int | None) -> set[int]:
    """The other threads whose use() blocks stand in the way of loading ``role`` now: the load
    would have to move out a role they are using (or, with a budget, cannot fit beside it).
    Empty when the load can go ahead, or fails for another reason (it then raises itself)."""
    try:
        ts.evictions.choose(role, keep_free_bytes=keep_free_bytes)
        return set()
    except RuntimeError:  # refused: a role in use would have to go out
        return {t for r in ts._roles.values() if r is not role and r.resident for t in r.users if t != me}


def _waits_on(ts: ThreadedTimeshare, t: int) -> set[int]:
    """The threads a waiting thread ``t`` waits on now: those whose blocks stand in the way of
    its load, and the earlier waiters it yields to (read from the current state, not from when
    it began to wait)."""
    role, _, yields, _, keep = ts._waiting[t]
    try:
        blockers = _blockers(ts, ts._roles[role], t, keep)
    except ValueError:  # it cannot fit at all: its own load raises when it looks again
        blockers = set()
    # A thread it yielded to counts only in the same wait (its ticket then): one that has
    # since returned and waits again, later in line, is not waited on (that stale yield once
    # made two threads each seem to wait for the other).
    return blockers | {w for w, ticket in yields.items() if w in ts._waiting and ts._waiting[w][3] == ticket}


def _reaches(ts: ThreadedTimeshare, start: set[int], target: int) -> bool:
    seen, todo = set(), list(start)
    while todo:
        t = todo.pop()
        if t == target:
            return True
        if t not in seen:
            seen.add(t)
            if t in ts._waiting:
                todo.extend(_waits_on(ts, t))
    return False


def wait_for_room(
    ts: ThreadedTimeshare, role: Role, me: int, timeout: float | None, keep_free_bytes: int | None = None
) -> None:
    """Called with the lock held, before ``use(role)`` loads it: wait until no role that the
    load would move out is in use by another thread, and (first come, first served) until no
    thread that waited earlier needs ``role`` moved out. Without the second rule a thread that
    re-enters its role in a loop would starve the others for ever.

    Raises ``TimeoutError`` after ``timeout`` seconds (None: no limit), ``RuntimeError`` if the
    threads waited for are themselves waiting for this one (the wait could never end), or if
    the timeshare is closed meanwhile."""
    deadline = None if timeout is None else time.monotonic() + timeout
    waits: dict[int, tuple[str, set[str], dict[int, int], int, int | None]] = ts._waiting
    try:
        while True:
            ts._check_open()
            busy = _blockers(ts, role, me, keep_free_bytes)
            yields: dict[int, int] = {}  # thread -> the ticket of the wait it is yielded to in
            if not busy and me not in role.users:
                # Let those who began to wait earlier for this role to go out have their turn
                # (earlier only: two threads never yield to each other).
                mine = waits[me][3] if me in waits else None
                yields = {
                    t: ticket
                    for t, (_, needs, _, ticket, _) in waits.items()
                    if t != me and role.name in needs and (mine is None or ticket < mine)
                }
                busy = set(yields)
            if not busy:
                return
            if _reaches(ts, busy, me):
                names = sorted(r.name for r in ts._roles.values() if r.users - {me})
                raise RuntimeError(
                    f"use({role.name!r}) in thread {threading.current_thread().name!r} would wait for roles in "
                    f"use in other threads ({', '.join(map(repr, names))}), which wait for this thread's roles: "
                    f"the wait could never end. Exit one of the use() blocks first, or raise "
                    f"TimeshareConfig.budget_bytes so both roles can stay resident"
                )
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                names = sorted(r.name for r in ts._roles.values() if r.users - {me})
                raise TimeoutError(
                    f"use({role.name!r}) waited {timeout} s for other threads to leave their use() blocks of "
                    f"{', '.join(map(repr, names))}, which loading {role.name!r} would move out"
                )
            # What its load must move out, read again each time it looks: a role that was
            # resident when it began to wait (so needed nothing out) may have gone out since,
            # and then needs the others' roles out; a stale "nothing" let a thread re-entering
            # its own role in a loop take every turn (2 turns to 42,000 in 2 s on a CPU).
            needs = {r.name for r in ts.evictions.choose(role, ignore_use=True, keep_free_bytes=keep_free_bytes)}
            ticket = waits[me][3] if me in waits else next(_TICKETS)
            waits[me] = (role.name, needs, yields, ticket, keep_free_bytes)
            ts._idle.wait(left)
    finally:
        if waits.pop(me, None) is not None:
            ts._idle.notify_all()  # those who yielded to this thread look again
