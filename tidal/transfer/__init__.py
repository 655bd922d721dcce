"""Moving bytes: an exact-size pinned host arena, a two-stream bucketed copy engine, and the
per-device context that shares them."""

from tidal.transfer.arena import HostArena, HostSlot
from tidal.transfer.context import TransferContext
from tidal.transfer.engine import CopyItem, Segment, TransferConfig, TransferEngine, byte_view

__all__ = [
    "CopyItem",
    "HostArena",
    "HostSlot",
    "Segment",
    "TransferConfig",
    "TransferContext",
    "TransferEngine",
    "byte_view",
]
