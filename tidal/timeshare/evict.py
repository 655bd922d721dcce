"""Choosing what to evict: :class:`EvictionChoice`, the part of :class:`~tidal.Timeshare` that
decides which resident roles bringing one in moves out (the budget, the headroom, roles in
use, storages shared between roles)."""

from __future__ import annotations

from tidal.units import format_bytes
from tidal.state.handover import RoomSource
from tidal.timeshare.role import Role

__all__ = ["EvictionChoice", "check_keep_free_bytes"]


def check_keep_free_bytes(keep_free_bytes: int | None) -> None:
    """Refuse a ``keep_free_bytes`` that is not None or an int >= 0 (before any work)."""
    if keep_free_bytes is None:
        return
    if isinstance(keep_free_bytes, bool) or not isinstance(keep_free_bytes, int):
        raise TypeError(f"keep_free_bytes must be an int (bytes) or None, got {type(keep_free_bytes).__name__}")
    if keep_free_bytes < 0:
        raise ValueError(f"keep_free_bytes must be >= 0 or None, got {keep_free_bytes}")


class EvictionChoice:
    """Which roles a transition moves out, a mixin of :class:`~tidal.Timeshare`."""

    def _free_bytes(self) -> int:
        """Device bytes an allocation of this process can get now: the driver's free memory
        and what the caching allocator holds unused."""
        return self.ops.driver_free_bytes()[0] + self.ops.cached_free_bytes()

    def _to_load(self, role: Role, incoming: dict, prefetched: set[int]) -> int:
        """What making ``role`` resident must still copy in, of its device entries
        ``incoming``: those that are out, but those a prefetch has allocated already
        (``prefetched``; the driver's reading counts them as used). A resident role brings
        nothing in (load() only makes room next to it)."""
        if role.resident:
            return 0
        return sum(e.nbytes for k, e in incoming.items() if self.store.is_offloaded(k) and k not in prefetched)

    def _choose_evictions(
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
        others = [r for r in self._roles.values() if r.resident and r is not role]
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
        entries = {r.name: self._device_entries(r) for r in others}
        staying = sorted(others, key=lambda r: r.last_used)

        def resident_bytes(roles: list[Role]) -> int:
            keys = {k: e.nbytes for k, e in incoming.items()}
            for r in roles:
                keys.update((k, e.nbytes) for k, e in entries[r.name].items())
            return sum(keys.values())

        prefetched = self.store.prefetched_keys()
        coming = self._to_load(role, incoming, prefetched)
        # Room is made for what comes in; with keep_free_bytes, for the free bytes asked too.
        room_asked = bool(coming) or keep_free_bytes is not None
        free = 0
        if as_needed and room_asked:
            free = self._free_bytes() - headroom
            # Another role's prefetch is cancelled before the move: its memory counts as free.
            free += sum(e.nbytes for e in self.store.offloaded_entries(sorted(prefetched - set(incoming))))
            if room_source is not None:
                free += room_source.pending_bytes()  # the load waits for it

        def freed_by_evicting(roles: list[Role]) -> int:
            """Device bytes moving out with everything resident but ``roles`` and ``role``."""
            keep = set(incoming).union(*(entries[r.name] for r in roles))
            gone = {
                k: e.nbytes
                for r in others
                if r not in roles
                for k, e in entries[r.name].items()
                if k not in keep and not self.store.is_offloaded(k)
            }
            return sum(gone.values())

        def short(roles: list[Role]) -> bool:
            over_budget = budget is not None and resident_bytes(roles) > budget
            if over_budget or not as_needed or not room_asked:
                return over_budget
            # A staging bucket for the copies in, and one for those out if anything goes out.
            staging = self.store.staging_bytes(int(bool(coming)) + int(len(roles) < len(others)))
            return coming > free - staging + freed_by_evicting(roles)

        def gains(rest: list[Role]) -> bool:
            return resident_bytes(rest) < resident_bytes(staying) or freed_by_evicting(rest) > freed_by_evicting(
                staying
            )

        evictable = lambda r: not r.in_use or ignore_use  # noqa: E731
        evict: list[Role] = []
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
                    group = {r.name} | {
                        x.name for x in staying if evictable(x) and set(entries[x.name]) & set(entries[r.name])
                    }
                    rest = [x for x in staying if x.name not in group]
                    if not gains(rest):
                        continue  # evicting it frees nothing
                evict += [x for x in staying if x not in rest]
                staying, changed = rest, True
        busy = [r.name for r in staying if r.in_use]
        if budget is not None and resident_bytes(staying) > budget and not ignore_use:
            raise RuntimeError(
                f"role {role.name!r} does not fit in budget_bytes={budget} next to the roles in "
                f"use {busy}; exit their use() blocks first or raise the budget"
            )
        if as_needed and busy and short(staying) and not ignore_use:
            raise RuntimeError(
                f"role {role.name!r} ({format_bytes(coming)} to load) does not fit in the device's free memory "
                f"({format_bytes(max(0, free))} after leaving {format_bytes(headroom)} free) next to the "
                f"roles in use {busy}; exit their use() blocks first or lower headroom_bytes (keep_free_bytes)"
            )
        # Short with every evictable role out: the move itself raises, naming the bytes.
        return evict
