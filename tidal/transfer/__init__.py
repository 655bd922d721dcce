"""Moving bytes: an exact-size pinned host arena and a two-stream, bucketed copy engine."""

from tidal.transfer.arena import HostArena, HostSlot
from tidal.transfer.engine import CopyItem, Segment, TransferConfig, TransferEngine, byte_view

__all__ = ["CopyItem", "HostArena", "HostSlot", "Segment", "TransferConfig", "TransferEngine", "byte_view"]
