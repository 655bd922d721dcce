"""What the parts of the timeshare below it use of a :class:`~tidal.Timeshare`, as protocols:
the optimizer-residency strategies and the streamed step (:class:`TimeshareCore`), the
rules for threads (:class:`ThreadedTimeshare`) and a role's lending (:class:`LendingTimeshare`). They name the timeshare's members they read,
so those modules do not import the timeshare that imports them."""

from __future__ import annotations

import threading
from typing import Any, Protocol, Sequence

import torch

from tidal.state.result import MoveResult
from tidal.state.store import OffloadStore
from tidal.timeshare.config import TimeshareConfig
from tidal.timeshare.role import Role
from tidal.timeshare.telemetry import TransitionRecord

__all__ = ["EvictionChooser", "GuardedMoves", "LendingTimeshare", "ThreadedTimeshare", "TimeshareCore"]


class TimeshareCore(Protocol):
    """The members of a timeshare that :mod:`tidal.timeshare.residency` and
    :mod:`tidal.timeshare.stream` use: its settings, device and store, its records, and the
    optimizer state's moves."""

    config: TimeshareConfig
    device: torch.device
    store: OffloadStore

    def record_move(
        self, kind: str, roles_out: tuple[str, ...], role_in: str | None, move: MoveResult, note: str = ""
    ) -> TransitionRecord: ...

    def resident_keys(self, *, exclude: Sequence[Role] = ()) -> set[int]: ...

    def _start_clock(self) -> None: ...

    def offload_optimizer_state(
        self, name: str, *, grads: bool = False, kind: str = "optim-out"
    ) -> TransitionRecord | None: ...

    def reload_optimizer_state(
        self, name: str, *, grads: bool = False, kind: str = "optim-in"
    ) -> TransitionRecord | None: ...


class EvictionChooser(Protocol):
    """A timeshare's eviction choice as :class:`ThreadedTimeshare` uses it (what
    :class:`tidal.timeshare.evict.EvictionChoice` gives): the resident roles bringing ``role`` in
    moves out."""

    def choose(
        self,
        role: Role,
        *,
        ignore_use: bool = False,
        room_source: Any = None,
        keep_free_bytes: int | None = None,
    ) -> list[Role]: ...


class ThreadedTimeshare(Protocol):
    """The timeshare's internals that :mod:`tidal.timeshare.threads` reads and waits on: its
    lock and the condition on it, its roles, the ``use()`` calls waiting for room (thread id ->
    (role, roles it would move out, threads it waits on, ticket, the bytes it keeps free)), and its
    checks."""

    _lock: threading.RLock
    _idle: threading.Condition
    _roles: dict[str, Role]
    _waiting: dict[int, tuple[str, set[str], dict[int, int], int, int | None]]
    evictions: EvictionChooser

    def _check_open(self) -> None: ...


class GuardedMoves(Protocol):
    """A timeshare's transitions as :class:`LendingTimeshare` uses them (what
    :class:`tidal.timeshare.transition.TransitionRunner` gives): a store move that, interrupted,
    brings the roles' flags back in line with the store before the exception goes on."""

    def guarded(
        self, move: Any, *, touches_model: bool, recovering: bool = False, settled_by_caller: bool = False
    ) -> Any: ...


class LendingTimeshare(Protocol):
    """What :class:`tidal.timeshare.lending.Lending` uses of its timeshare: the lock and store,
    the storages lent now, its transitions (the guarded move that settles the roles' flags if it
    is interrupted), and the records."""

    _lock: threading.RLock
    store: OffloadStore
    lent_keys: set[int]
    transitions: GuardedMoves

    def _check_open(self) -> None: ...

    def _start_clock(self) -> None: ...

    def record_move(
        self, kind: str, roles_out: tuple[str, ...], role_in: str | None, move: MoveResult, note: str = ""
    ) -> TransitionRecord: ...
