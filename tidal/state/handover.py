"""The two ends of a hand-over of device memory between holders that cannot see each other's
allocations (two processes taking turns on one GPU).

The giver offloads in chunks and, after each, reports how many bytes it has given back to the
driver so far (a :data:`ReleaseProgress` callback). The taker loads against a
:class:`RoomSource`: when its next storages do not fit in what the driver has free, it waits
for the giver's next chunk instead of failing, so its H2D copies run while the giver's D2H
copies still do. :func:`tidal.distributed.timeshare_callbacks` joins the two ends through a
lease; the store (:meth:`tidal.state.OffloadStore.switch`) only sees these seams.
"""

from __future__ import annotations

from typing import Callable, Protocol

__all__ = ["NOTHING_COMING", "ReleaseProgress", "RoomSource"]

#: ``progress(returned_bytes, total_bytes)``: after each chunk of an offload, the bytes this
#: process has given back to the driver so far, and the bytes the whole offload frees.
ReleaseProgress = Callable[[int, int], None]


class RoomSource(Protocol):
    """Where a load waits for memory another holder is still giving back."""

    def pending_bytes(self) -> int:
        """Bytes still to come (the giver's announced total less what it has given back);
        0 once nothing more will come. Read before the load starts, to refuse a load that
        cannot fit even then."""
        ...

    def wait(self) -> bool:
        """Block until more memory was given back, or the giver has finished. Returns False,
        without blocking, once nothing more will come."""
        ...


class _NothingComing:
    """A room source for a load that hands memory over but has nobody to wait for (the
    lease was granted outright): loads as usual, in hand-over-sized runs."""

    def pending_bytes(self) -> int:
        return 0

    def wait(self) -> bool:
        return False


NOTHING_COMING: RoomSource = _NothingComing()
