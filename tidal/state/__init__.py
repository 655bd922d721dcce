"""The state of a role: its storages, found and deduplicated, and the store that moves them."""

from tidal.state.collect import (
    StateEntry,
    collect_module_state,
    collect_optimizer_state,
    storage_key,
    unique_storage_bytes,
)
from tidal.state.result import MoveResult
from tidal.state.store import OffloadStore

__all__ = [
    "MoveResult",
    "OffloadStore",
    "StateEntry",
    "collect_module_state",
    "collect_optimizer_state",
    "storage_key",
    "unique_storage_bytes",
]
