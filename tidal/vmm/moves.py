"""How a region's memory leaves and comes back: :class:`RegionMoves`, the part of
:class:`~tidal.vmm.Region` that copies a tag's allocations out, unmaps them (guarding the
released addresses with scratch memory), and maps and refills them at the same addresses."""

from __future__ import annotations

import bisect
import time
import warnings
from typing import Any, Sequence

import torch

from tidal.transfer.arena import HostSlot
from tidal.transfer.engine import CopyItem
from tidal.vmm.space import Mapping, MapState
from tidal.vmm.tag import SCRATCH_BYTES, RegionTag, covered, round_up

__all__ = ["RegionMoves"]


class RegionMoves:
    """Release and restore internals, a mixin of :class:`~tidal.vmm.Region` (whose ``__init__``
    sets what they read)."""

    # ---- internals: release ----------------------------------------------------------------------
    def _release_tags(
        self,
        selected: Sequence[RegionTag],
        keep: dict[str, Sequence[tuple[int, int]]],
        segments: dict[str, list[dict] | None],
    ) -> tuple[int, int]:
        """Queue the copies (backup tags, and what ``keep`` names), unmap each mapping as soon as
        the copies reading it have landed, the discard tags last. Returns (bytes copied, bytes
        unmapped)."""
        items: list[CopyItem] = []
        for t in selected:
            if t.policy == "backup" or keep.get(t.name):
                mapped = [m for m in t.mappings if m.state is MapState.MAPPED]
                ranges = (
                    t._live_ranges(segments[t.name])
                    if t.policy == "backup"
                    else sorted(r for r in keep[t.name] if covered(mapped, *r))
                )
                self._reserve_slots(t, ranges)
                items += [
                    CopyItem(self.driver.view(va, n).untyped_storage(), t.slots[(va, n)], n, (va, n))
                    for va, n in ranges
                ]
        items.sort(key=lambda it: it.tag[0])  # address order: a copy's event covers every lower address
        copy_segments = self.engine.plan(items)
        events: list[tuple[int, Any]] = []  # (highest address the copies so far read, their event)
        unmapped = 0
        try:
            if copy_segments:
                self.engine.begin_out()
                reach = 0
                for seg in copy_segments:
                    reach = max(reach, max(it.tag[0] + it.tag[1] for it in seg.items))
                    events.append((reach, self.engine.copy_out(seg)))
            reaches = [r for r, _ in events]  # non-decreasing: searched by bisection
            # Backup tags first, each mapping as soon as its copies landed; the discard tags
            # after the copies: driver calls that change page tables slow a copy in flight
            # (one H100, best warm release of 2.9 GB beside a 4 GiB KV cache: 72 ms this way,
            # 78 ms with the discard tags unmapped during the copies).
            for t in sorted(selected, key=lambda t: t.policy != "backup" and not keep.get(t.name)):
                if all(m.state is MapState.RELEASED for m in t.mappings) and (t.guard or not self.guard_released):
                    continue
                self._unguard(t)  # a partly released tag: guarded again whole below
                t.guard_run = None  # a run left open by an interrupted release
                for m in t.mappings:
                    if m.state is not MapState.RELEASED:
                        if m.state is MapState.MAPPED and events:
                            # The copies that read this mapping (all queued no later than the
                            # first one reaching past it, on one stream) must have landed.
                            self.engine.wait("region_d2h_done", events[_first_reaching(reaches, m.end)][1])
                        unmapped += m.nbytes
                        self._unmap(m)
                        self.ops.point("region_unmapped")
                    self._guard_add(t, m)
                self._guard_flush(t)
        except BaseException:
            self.engine.drain()  # no copy may still read memory that a later release unmaps
            raise
        finally:
            self.engine.release_staging()
        return sum(it.nbytes for it in items), unmapped

    def _reserve_slots(self, t: RegionTag, ranges: Sequence[tuple[int, int]]) -> None:
        """Host slots for ``ranges``: reused where a range is the one of the last release, new
        ones reserved before any copy (so a host out of memory fails before work), and those
        of mapped ranges that changed given back."""
        wanted = [r for r in ranges if r not in t.slots]
        if wanted:
            for r, slot in zip(wanted, self.arena.reserve([n for _, n in wanted], owner=self.owner)):
                t.slots[r] = slot
        keep = set(ranges)
        mapped = [m for m in t.mappings if m.state is MapState.MAPPED]
        for r in [r for r in t.slots if r not in keep and covered(mapped, *r)]:
            self.arena.release(t.slots.pop(r))

    def _unmap(self, m: Mapping) -> None:
        """Take ``m``'s physical memory away; ``m`` is then released."""
        if m.handle is None:
            m.state = MapState.RELEASED
            return
        t0 = time.perf_counter()
        self.driver.unmap(m.va, m.nbytes)
        handle, m.handle = m.handle, None
        m.state = MapState.RELEASED
        self.driver.release(handle)
        self._driver_s += time.perf_counter() - t0

    def _guard_add(self, t: RegionTag, m: Mapping) -> None:
        """Add released mapping ``m`` to the run of ``t``'s released addresses not yet guarded,
        and map the scratch over the run's whole large pieces at once (while later copies
        still run)."""
        if not self.guard_released:
            return
        run = t.guard_run
        if run is not None and run[1] == m.va and t.space._same_range(run[0], m.va):
            run[1] = m.end
        else:
            self._guard_flush(t)
            run = t.guard_run = [m.va, m.end]
        self._guard_map(t, run, final=False)

    def _guard_flush(self, t: RegionTag) -> None:
        """Guard what is left of the open run (less than one large piece: granules)."""
        run, t.guard_run = t.guard_run, None
        if run is not None and self.guard_released:
            self._guard_map(t, run, final=True)

    def _guard_map(self, t: RegionTag, run: list[int], *, final: bool) -> None:
        # The driver maps a physical allocation whole only, so the scratch is one large
        # allocation for the bulk of a run and one granule for its tail: a few map calls per
        # run, not one per granule.
        t0 = time.perf_counter()
        try:
            if self._scratch is None:
                g = self.driver.granularity
                big = round_up(SCRATCH_BYTES, g)
                first = self.driver.create(big)
                try:
                    self._scratch = (first, big, self.driver.create(g), g)
                except BaseException:
                    self.driver.release(first)
                    raise
            big_handle, big, small_handle, g = self._scratch
            while run[1] - run[0] >= big or (final and run[0] < run[1]):
                handle, n = (big_handle, big) if run[1] - run[0] >= big else (small_handle, g)
                self.driver.map(run[0], n, handle)
                t.guard.append((run[0], n))
                run[0] += n
        except (torch.OutOfMemoryError, RuntimeError) as e:
            t.guard_run = None
            self._unguard(t)
            warnings.warn(
                f"region {self.name!r}: released addresses cannot be guarded with scratch memory ({e}); they "
                f"stay unmapped, and a kernel touching them faults",
                stacklevel=4,
            )
            self.guard_released = False
        finally:
            self._driver_s += time.perf_counter() - t0

    def _unguard(self, t: RegionTag, lo: int = 0, hi: int = 1 << 64) -> None:
        """Unmap the scratch pieces of ``t`` that overlap ``[lo, hi)`` (default: all)."""
        t0 = time.perf_counter()
        i = 0
        while i < len(t.guard):
            va, n = t.guard[i]
            if va < hi and lo < va + n:
                self.driver.unmap(va, n)
                del t.guard[i]  # one at a time: an exception never leaves a piece listed twice or lost
            else:
                i += 1
        self._driver_s += time.perf_counter() - t0

    # ---- internals: restore ----------------------------------------------------------------------
    def _recut(self, t: RegionTag) -> None:
        """Re-cut the released memory of ``t`` into chunks over its live allocations: freed
        allocations dropped (their addresses back to the tag's space, its guard still over them
        until the restore ends), each run of adjacent live allocations split into mappings of
        at most ``map_chunk_bytes``."""
        if not any(m.state is MapState.RELEASED for m in t.mappings):
            return  # nothing released: no guard either (a guard only covers released memory)
        mapped = [m for m in t.mappings if m.state is not MapState.RELEASED]
        for a in [a for a in t.allocations.values() if a.dead]:
            if not any(m.va < a.va + a.nbytes and a.va < m.end for m in mapped):
                del t.allocations[a.va]
                t._starts = None
                t.space.give_back(a.va, a.nbytes)
        new: list[Mapping] = []
        for va, n in t._runs():
            pos = va
            while pos < va + n:
                if any(m.va <= pos < m.end for m in mapped):  # mapped already (a partial restore)
                    pos = next(m.end for m in mapped if m.va <= pos < m.end)
                    continue
                stop = min(va + n, pos + self.map_chunk_bytes)
                stop = min([stop] + [m.va for m in mapped if pos < m.va < stop])
                new.append(Mapping(pos, stop - pos, None, MapState.RELEASED))
                pos = stop
        t.mappings = sorted(mapped + new, key=lambda m: m.va)

    def _restore_tag(self, t: RegionTag) -> int:
        """Map each released chunk and queue the copies into it before mapping the next.
        Returns the bytes copied."""
        # The host copies cut at the mappings' bounds: a piece lands as soon as its chunk is
        # mapped, and the part of a copy over memory freed since the release is left out.
        pieces: dict[int, list[CopyItem]] = {}
        for (va, n), slot in sorted(t.slots.items()):
            for i, m in enumerate(t.mappings):
                lo, hi = max(va, m.va), min(va + n, m.end)
                if lo < hi and m.state is not MapState.MAPPED:
                    sub = HostSlot(slot.chunk, slot.offset + (lo - va), hi - lo, slot.owner)
                    pieces.setdefault(i, []).append(CopyItem(None, sub, hi - lo, (lo, hi - lo)))  # type: ignore[arg-type]
        copied = 0
        last = None
        filling: list[Mapping] = []
        try:
            for i, m in enumerate(t.mappings):
                if m.handle is None:
                    self._unguard(t, m.va, m.end)
                    t0 = time.perf_counter()
                    handle = self.driver.create(m.nbytes)
                    try:
                        self.driver.map(m.va, m.nbytes, handle)
                    except BaseException:
                        self.driver.release(handle)
                        raise
                    finally:
                        self._driver_s += time.perf_counter() - t0
                    m.handle = handle
                    m.state = MapState.FILLING if i in pieces else MapState.MAPPED
                    self.ops.point("region_mapped")
                if m.state is not MapState.FILLING:
                    continue
                filling.append(m)
                items = pieces.get(i, [])
                for it in items:
                    it.storage = self.driver.view(*it.tag).untyped_storage()
                if last is None:
                    self.engine.begin_in()
                for seg in self.engine.plan(items):
                    last = self.engine.copy_in(seg)
                copied += sum(it.nbytes for it in items)
            if last is not None:
                self.engine.publish(last)
        except BaseException:
            self.engine.drain()  # the copies stop here; the host copy stays the live one
            raise
        finally:
            self.engine.release_staging()
        for m in filling:
            m.state = MapState.MAPPED
        self._unguard(t)  # pieces left over addresses freed since the release
        # A host copy that also held memory freed since is stale now; the next release makes
        # a new one of the live ranges.
        for r in [r for r in t.slots if not covered(t.mappings, *r)]:
            self.arena.release(t.slots.pop(r))
        return copied


def _first_reaching(reaches: Sequence[int], end: int) -> int:
    """Index of the first copy event whose copies reach ``end`` or beyond (the last one if
    none); ``reaches`` is non-decreasing."""
    return min(bisect.bisect_left(reaches, end), len(reaches) - 1)
