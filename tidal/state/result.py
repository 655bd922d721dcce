"""What a move of the store did: :class:`MoveResult` (bytes each way, seconds, the driver's
free memory before and after)."""

from __future__ import annotations

import dataclasses

from tidal.units import gbps

__all__ = ["MoveResult"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoveResult:
    """What one transfer did. ``seconds`` runs from the first copy queued to the last one
    finished (host-synchronised), excluding the allocator release that follows; for a move
    that only ``queued`` its copies (a prefetch, a write-back), it is the host time spent
    queueing them, and nothing was released. ``driver_free_after`` is the driver's free memory
    read after the move, or the reading before for a move that released nothing by design (a
    prefetch, a write-back, a switch with ``release=False``)."""

    bytes_out: int
    bytes_in: int
    seconds: float
    release_seconds: float
    driver_free_before: int
    driver_free_after: int
    segments: int
    alloc_seconds: float = 0.0
    # Of ``seconds``, for a queued move: the host's time inside the call that queues the
    # copies.
    queue_seconds: float = 0.0
    # Bytes released without a D2H copy: their host copy was still valid (a frozen role).
    bytes_skipped: int = 0
    # Bytes brought in whose H2D copy a prefetch had queued already (not copied again).
    bytes_prefetched: int = 0
    # The copies were queued behind compute, not waited for (prefetch, write_back).
    queued: bool = False
    # The memory it freed was settled (handed to the driver where the backend does): False for
    # a switch told release=False, whose driver reading after is the one before.
    released: bool = True

    @property
    def bytes_moved(self) -> int:
        return self.bytes_out + self.bytes_in

    @property
    def gbps(self) -> float:
        return gbps(self.bytes_moved, self.seconds)
