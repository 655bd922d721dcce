"""Storages a role in use lends to the host for a block: :class:`Lending`, what
:meth:`tidal.Timeshare.lending` yields."""

from __future__ import annotations

from typing import Iterable

import torch

from tidal.state.collect import StateEntry, storage_key
from tidal.timeshare.core import LendingTimeshare

__all__ = ["Lending"]


def local_storage_key(t: torch.Tensor) -> int:
    """The key of the storage that holds ``t``'s memory on this rank."""
    return storage_key(_local(t).untyped_storage())


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (what holds its memory on this rank), else ``t``."""
    inner = getattr(t, "_local_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else t


class Lending:
    """The parameters of a role in use whose device memory is lent to the block (see
    :meth:`tidal.Timeshare.lending`). ``entries``: the role's parameter storages the timeshare
    moves, on the device when the block began, by key; ``own``: the keys of all its
    parameters' storages then (those too small to move stay where they are)."""

    def __init__(self, ts: LendingTimeshare, name: str, entries: dict[int, StateEntry], own: set[int]) -> None:
        self._ts = ts
        self._name = name
        self._entries = entries
        self._own = own
        self._lent: dict[int, StateEntry] = {}

    @property
    def lent_bytes(self) -> int:
        """Device bytes lent so far (what came free beside the block)."""
        return sum(e.nbytes for e in self._lent.values())

    def out(self, tensors: Iterable[torch.Tensor]) -> None:
        """Move the storages of ``tensors`` (parameters of the role, as they were when the block
        began; a DTensor's local shard) to the host and free their device memory. Blocks until
        the copies are done; storages already lent are skipped. Raises ``ValueError`` before
        moving anything if a tensor is not one of the role's parameters."""
        keys = []
        for t in tensors:
            key = local_storage_key(t)
            if key not in self._own:
                raise ValueError(
                    f"lending({self._name!r}).out(): a tensor of shape {tuple(t.shape)} is not one of the role's "
                    f"parameters as they were when the block began; lend only those"
                )
            if key in self._entries:  # else too small for the timeshare to move, or already out
                keys.append(key)
        ts = self._ts
        with ts._lock:
            ts._check_open()
            going = [self._entries[k] for k in dict.fromkeys(keys) if k not in self._lent]
            if not going:
                return
            ts._start_clock()
            # Each storage counts as lent once its copy has completed (the store tracks it), so
            # the block's end brings back exactly what left, whatever stopped this move.
            ts.lent_keys.update(e.key for e in going)
            try:
                move = ts.transitions.guarded(lambda: ts.store.offload(going), touches_model=True)
            finally:
                self._lent.update((e.key, e) for e in going if ts.store.is_offloaded(e.key))
                ts.lent_keys.difference_update(e.key for e in going if e.key not in self._lent)
            ts.record_move("offload", (self._name,), None, move, note="lent to a block")

    def back(self) -> None:
        """Bring every lent storage back onto the device (the block's end). Raises what the
        store raises (``InsufficientMemoryError`` before moving anything where they do not fit:
        the block must have freed what it took in their place); the timeshare then stays
        marked interrupted and its next verb brings the role back in or out whole."""
        ts = self._ts
        with ts._lock:
            back = [e for e in self._lent.values() if ts.store.is_offloaded(e.key)]
            try:
                if back:
                    ts._start_clock()
                    move = ts.transitions.guarded(
                        lambda: ts.store.reload(back, what=f"role {self._name!r}'s lent parameters"),
                        touches_model=True,
                    )
                    ts.record_move("reload", (), self._name, move, note="lent storages back")
            finally:
                ts.lent_keys.difference_update(self._lent)
                self._lent.clear()
