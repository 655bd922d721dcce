"""The virtual addresses of one tag of a region, and what is mapped at them.

A tag reserves large ranges of virtual addresses and hands out pieces of them first fit, so the
allocations of a tag sit next to each other: after a release they come back as few large runs
(one physical allocation, one map call per run) rather than one per allocation.

Bookkeeping only: the driver calls are made by the region, which tells this module what it did.
"""

from __future__ import annotations

import bisect
import dataclasses
import enum

__all__ = ["Allocation", "AddressSpace", "Mapping", "MapState"]


class MapState(enum.Enum):
    MAPPED = "mapped"  # physical memory behind it; its bytes are the live ones
    FILLING = "filling"  # mapped again, its host copy still on the way in (the host copy is the live one)
    RELEASED = "released"  # no physical memory; the host copy (backup) or nothing (discard) is the live one


@dataclasses.dataclass(eq=False)
class Allocation:
    """One allocation handed to torch (a segment of its caching allocator)."""

    va: int
    nbytes: int
    dead: bool = False  # freed; its memory goes with its mapping at the next release, its addresses at the restore


@dataclasses.dataclass(eq=False)
class Mapping:
    """One physical allocation mapped over ``[va, va + nbytes)``: one allocation when it was
    first made; after a restore, a chunk of a run of adjacent allocations (its bounds need not
    fall on an allocation's)."""

    va: int
    nbytes: int
    handle: int | None  # None while released
    state: MapState = MapState.MAPPED

    @property
    def end(self) -> int:
        return self.va + self.nbytes


class AddressSpace:
    """Reserved ranges and their free pieces (first fit, coalesced on free)."""

    def __init__(self) -> None:
        self.ranges: list[tuple[int, int]] = []  # (va, nbytes) reserved from the driver
        self._free: list[tuple[int, int]] = []  # sorted (va, nbytes)

    def add_range(self, va: int, nbytes: int) -> None:
        self.ranges.append((va, nbytes))
        self.give_back(va, nbytes)

    def take(self, nbytes: int) -> int | None:
        """The lowest free address with ``nbytes`` after it, or None."""
        for i, (va, n) in enumerate(self._free):
            if n >= nbytes:
                if n == nbytes:
                    del self._free[i]
                else:
                    self._free[i] = (va + nbytes, n - nbytes)
                return va
        return None

    def give_back(self, va: int, nbytes: int) -> None:
        i = bisect.bisect_left(self._free, (va, 0))
        assert i == len(self._free) or va + nbytes <= self._free[i][0], "freed twice"
        assert i == 0 or self._free[i - 1][0] + self._free[i - 1][1] <= va, "freed twice"
        self._free.insert(i, (va, nbytes))
        if (
            i + 1 < len(self._free)
            and va + nbytes == self._free[i + 1][0]
            and self._same_range(va, self._free[i + 1][0])
        ):
            self._free[i] = (va, nbytes + self._free[i + 1][1])
            del self._free[i + 1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == va and self._same_range(self._free[i - 1][0], va):
            self._free[i - 1] = (self._free[i - 1][0], self._free[i - 1][1] + self._free[i][1])
            del self._free[i]

    def free_bytes(self) -> int:
        return sum(n for _, n in self._free)

    def _same_range(self, a: int, b: int) -> bool:
        # Two reservations may happen to be adjacent; a piece never spans both (each is
        # given back to the driver whole).
        return any(va <= a < va + n and va <= b < va + n for va, n in self.ranges)
