"""Choosing what to evict. :func:`choose_evictions` is the decision itself, pure and free of any
device: from what each resident role holds (storage keys and their bytes), when each was used,
which are in use, and the room the device has, which roles bringing one in moves out.
:class:`EvictionChoice`, the collaborator of :class:`~tidal.Timeshare` that reads those figures
off its roles, its store and the driver, and raises where the room cannot be made."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

from tidal.device import DeviceOps
from tidal.units import format_bytes
from tidal.state.collect import StateEntry
from tidal.state.handover import RoomSource
from tidal.state.store import OffloadStore
from tidal.timeshare.config import TimeshareConfig
from tidal.timeshare.role import Role

__all__ = ["EvictionChoice", "Eviction", "Resident", "check_keep_free_bytes", "choose_evictions"]


def check_keep_free_bytes(keep_free_bytes: int | None) -> None:
    """Refuse a ``keep_free_bytes`` that is not None or an int >= 0 (before any work)."""
    if keep_free_bytes is None:
        return
    if isinstance(keep_free_bytes, bool) or not isinstance(keep_free_bytes, int):
        raise TypeError(f"keep_free_bytes must be an int (bytes) or None, got {type(keep_free_bytes).__name__}")
    if keep_free_bytes < 0:
        raise ValueError(f"keep_free_bytes must be >= 0 or None, got {keep_free_bytes}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Resident:
    """A resident role beside the one coming in, as :func:`choose_evictions` sees it: its device
    storages (``entries``: storage key -> bytes; roles that share a module share keys), of them
    those already out on the host (``out``: a resident role's optimizer state may be), whether
    it is in use, and when it was last used (larger: more recently)."""

    name: str
    entries: Mapping[int, int]
    out: frozenset[int] = frozenset()
    in_use: bool = False
    last_used: int = 0


@dataclasses.dataclass(frozen=True)
class Eviction:
    """What :func:`choose_evictions` decided: the roles to move out (``evict``, in that order),
    the roles in use among those that stay (``busy``), whether the room asked for is still
    short with every role that may go out gone (``short``: the move itself raises, naming the
    bytes) and whether what stays is over the budget (``over_budget``)."""

    evict: list[str]
    busy: list[str]
    short: bool
    over_budget: bool


def choose_evictions(
    incoming: Mapping[int, int],
    others: Sequence[Resident],
    *,
    coming_bytes: int,
    free_bytes: int,
    bucket_bytes: int,
    budget_bytes: int | None,
    as_needed: bool,
    room_asked: bool,
    ignore_use: bool = False,
) -> Eviction:
    """The residents of ``others`` that bringing in a role with device storages ``incoming``
    (key -> bytes) moves out. Pure: reads nothing but its arguments.

    ``coming_bytes``: of ``incoming``, what must still be copied in. ``free_bytes``: what an
    allocation can get now, less the headroom or the bytes asked to stay free (memory a move
    gives back first, such as a cancelled prefetch, counted in). ``bucket_bytes``: one staging
    bucket (0 off an accelerator): two for the copies in, one for those out if anything goes
    out. ``budget_bytes``: what every resident storage together may hold (None: no budget).
    ``as_needed``: move out only what the room takes (else, without a budget, every role goes:
    the caller's case). ``room_asked``: room is made (something comes in, or bytes are asked to
    stay free). ``ignore_use``: as if no role were in use.

    Roles go least recently used first. A role whose storages are all shared with a role that
    stays frees nothing alone: it goes with the roles that share them, where that frees
    something, and stays otherwise. Memory cost: none."""
    staying = sorted(others, key=lambda r: r.last_used)

    def resident_bytes(roles: Sequence[Resident]) -> int:
        keys = dict(incoming)
        for r in roles:
            keys.update(r.entries)
        return sum(keys.values())

    def freed_by_evicting(roles: Sequence[Resident]) -> int:
        """Device bytes moving out with everything resident but ``roles`` and the incoming."""
        keep = set(incoming).union(*(r.entries for r in roles))
        gone = {
            k: n for r in others if r not in roles for k, n in r.entries.items() if k not in keep and k not in r.out
        }
        return sum(gone.values())

    def short(roles: Sequence[Resident]) -> bool:
        over_budget = budget_bytes is not None and resident_bytes(roles) > budget_bytes
        if over_budget or not as_needed or not room_asked:
            return over_budget
        staging = bucket_bytes * (2 * int(bool(coming_bytes)) + int(len(roles) < len(others)))
        return coming_bytes > free_bytes - staging + freed_by_evicting(roles)

    def gains(rest: Sequence[Resident]) -> bool:
        return resident_bytes(rest) < resident_bytes(staying) or freed_by_evicting(rest) > freed_by_evicting(staying)

    evictable = lambda r: not r.in_use or ignore_use  # noqa: E731
    evict: list[str] = []
    changed = True
    while changed and short(staying):
        changed = False
        for r in [x for x in staying if evictable(x)]:  # least recently used first
            if not short(staying):
                break
            rest = [x for x in staying if x is not r]
            if not gains(rest):
                # It frees nothing alone (its storages are shared): with the evictable roles
                # sharing them, it may (a policy's rollout and training roles).
                group = {r.name} | {x.name for x in staying if evictable(x) and set(x.entries) & set(r.entries)}
                rest = [x for x in staying if x.name not in group]
                if not gains(rest):
                    continue  # evicting it frees nothing
            evict += [x.name for x in staying if x not in rest]
            staying, changed = rest, True
    return Eviction(
        evict=evict,
        busy=[r.name for r in staying if r.in_use],
        short=short(staying),
        over_budget=budget_bytes is not None and resident_bytes(staying) > budget_bytes,
    )


class EvictionChoice:
    """Which roles a transition moves out: the figures :func:`choose_evictions` decides from,
    read off the roles, the store and the driver.

    Args:
        ops: the device, for its free memory.
        store: the timeshare's store (what is out, what a prefetch holds, its staging).
        config: the timeshare's budget, eviction rule and headroom.
        roles: the timeshare's roles by name (the live mapping).
        device_entries: ``device_entries(role)``: what the role holds on the device while resident.
        check_evictable: ``check_evictable(role, reason=...)``: raises for a role in use.

    The caller holds the timeshare's lock.
    """

    def __init__(
        self,
        *,
        ops: DeviceOps,
        store: OffloadStore,
        config: TimeshareConfig,
        roles: Mapping[str, Role],
        device_entries: Callable[[Role], dict[int, StateEntry]],
        check_evictable: Callable[..., None],
    ) -> None:
        self.ops, self.store, self.config, self.roles = ops, store, config, roles
        self._device_entries, self._check_evictable = device_entries, check_evictable

    def _free_bytes(self) -> int:
        """Device bytes an allocation of this process can get now: the driver's free memory
        and what the caching allocator holds unused."""
        return self.ops.driver_free_bytes()[0] + self.ops.cached_free_bytes()

    def to_load(self, role: Role, incoming: dict, prefetched: set[int]) -> int:
        """What making ``role`` resident must still copy in, of its device entries
        ``incoming``: those that are out, but those a prefetch has allocated already
        (``prefetched``; the driver's reading counts them as used). A resident role brings
        nothing in (load() only makes room next to it)."""
        if role.resident:
            return 0
        return sum(e.nbytes for k, e in incoming.items() if self.store.is_offloaded(k) and k not in prefetched)

    def choose(
        self,
        role: Role,
        *,
        ignore_use: bool = False,
        room_source: RoomSource | None = None,
        keep_free_bytes: int | None = None,
    ) -> list[Role]:
        """The resident roles that bringing ``role`` in moves out. ``ignore_use``: as if no
        role were in use (what ``prefetch`` writes back ahead of the switch); no error then.
        ``room_source``: memory another process is still handing over counts as free.
        ``keep_free_bytes``: this transition evicts as needed to leave that many bytes free
        beside ``role`` (the config's ``evict`` and ``headroom_bytes`` set aside), also when
        nothing of ``role`` must come in."""
        others = [r for r in self.roles.values() if r.resident and r is not role]
        budget = self.config.budget_bytes
        as_needed = self.config.evict == "as_needed" or keep_free_bytes is not None
        headroom = self.config.headroom_bytes if keep_free_bytes is None else keep_free_bytes
        if budget is None and not as_needed:
            for r in others:
                if not ignore_use:
                    self._check_evictable(r, reason=f"use({role.name!r})")
            return others
        if budget is None and role.resident and self._free_bytes() >= headroom:
            # Nothing comes in and the room is there already: nothing goes (what the walk
            # below finds, without walking every role's tensors; a turn that moves nothing
            # costs the host a free-memory reading).
            return []
        incoming = self._device_entries(role)
        incoming_bytes = sum(e.nbytes for e in incoming.values())
        if budget is not None and incoming_bytes > budget:
            raise ValueError(
                f"role {role.name!r} holds {format_bytes(incoming_bytes)} of state, more than "
                f"budget_bytes={budget} ({format_bytes(budget)}); raise the budget or shrink the role"
            )
        residents = []
        for r in others:
            entries = self._device_entries(r)
            residents.append(
                Resident(
                    name=r.name,
                    entries={k: e.nbytes for k, e in entries.items()},
                    out=frozenset(k for k in entries if self.store.is_offloaded(k)),
                    in_use=r.in_use,
                    last_used=r.last_used,
                )
            )
        prefetched = self.store.prefetched_keys()
        coming = self.to_load(role, incoming, prefetched)
        # Room is made for what comes in; with keep_free_bytes, for the free bytes asked too.
        room_asked = bool(coming) or keep_free_bytes is not None
        free = 0
        if as_needed and room_asked:
            free = self._free_bytes() - headroom
            # Another role's prefetch is cancelled before the move: its memory counts as free.
            free += sum(e.nbytes for e in self.store.offloaded_entries(sorted(prefetched - set(incoming))))
            if room_source is not None:
                free += room_source.pending_bytes()  # the load waits for it
        choice = choose_evictions(
            {k: e.nbytes for k, e in incoming.items()},
            residents,
            coming_bytes=coming,
            free_bytes=free,
            bucket_bytes=self.store.staging_bytes(1),
            budget_bytes=budget,
            as_needed=as_needed,
            room_asked=room_asked,
            ignore_use=ignore_use,
        )
        if choice.over_budget and not ignore_use:
            raise RuntimeError(
                f"role {role.name!r} does not fit in budget_bytes={budget} next to the roles in "
                f"use {choice.busy}; exit their use() blocks first or raise the budget"
            )
        if as_needed and choice.busy and choice.short and not ignore_use:
            raise RuntimeError(
                f"role {role.name!r} ({format_bytes(coming)} to load) does not fit in the device's free memory "
                f"({format_bytes(max(0, free))} after leaving {format_bytes(headroom)} free) next to the "
                f"roles in use {choice.busy}; exit their use() blocks first or lower headroom_bytes (keep_free_bytes)"
            )
        # Short with every evictable role out: the move itself raises, naming the bytes.
        by_name = {r.name: r for r in others}
        return [by_name[n] for n in choice.evict]
