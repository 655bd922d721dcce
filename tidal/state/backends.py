"""Residency backends: how a storage's device memory is released and restored.

The store decides *what* moves and *when* (admission, host slots, the copy schedule, recovery);
a backend decides how the device memory under a storage goes away after its bytes reached the
host, and how it comes back before they return. Protocol::

    class Backend:
        def reserve(self, nbytes: Sequence[int]) -> None: ...  # about to restore these (a hint)
        def restore(self, storage, nbytes: int) -> None: ...     # give the storage its memory back
        def release(self, storage) -> None: ...                   # take its memory away
        def settle(self) -> None: ...                             # after a release: where the memory goes

:class:`ResizeBackend` (the default, no native code) resizes the storage itself, as FSDP does:
tensors, views and optimizer keys stay valid, but a restored storage may get another device
address. An address-stable backend (issue 15: CUDA virtual memory at the same addresses) plugs
in here.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from tidal.device import DeviceOps

__all__ = ["ResidencyBackend", "ResizeBackend"]

_LARGE = 1 << 20  # the caching allocator serves larger requests from its large pool
_MIN_RESERVE = 16 << 20


class ResidencyBackend(Protocol):
    def reserve(self, nbytes: Sequence[int]) -> None: ...

    def restore(self, storage: torch.UntypedStorage, nbytes: int) -> None: ...

    def release(self, storage: torch.UntypedStorage) -> None: ...

    def settle(self) -> None: ...


class ResizeBackend:
    """``storage.resize_(0)`` to release, ``resize_(nbytes)`` to restore, through torch's
    caching allocator.

    Args:
        ops: the device.
        coalesce: before restoring a run of large storages, make the allocator hold one free
            block that fits them all (:meth:`reserve`), so their ``resize_`` calls split it
            instead of each paying a ``cudaMalloc`` (which costs enough host time to starve the
            copy queue), and the next release returns few allocator segments instead of
            hundreds. Only on an accelerator.
        release_to_driver: after releasing, hand the freed blocks back to the driver
            (:meth:`settle`), so another process (an inference engine) can use them.
    """

    def __init__(self, ops: DeviceOps, *, coalesce: bool = True, release_to_driver: bool = True) -> None:
        self.ops = ops
        self.coalesce = coalesce and ops.is_accelerator
        self.release_to_driver = release_to_driver

    def reserve(self, nbytes: Sequence[int]) -> None:
        if not self.coalesce:
            return
        # The allocator rounds large requests to 512 bytes; smaller ones come from 2 MiB
        # small-pool segments that this block cannot serve.
        large = sum(-(-n // 512) * 512 for n in nbytes if n > _LARGE)
        if large < _MIN_RESERVE:
            return
        try:
            # Allocated and freed on the current stream, whose pool the storages' resize_
            # calls draw from.
            block = torch.empty(large, dtype=torch.uint8, device=self.ops.device)
            del block
        except torch.OutOfMemoryError:
            pass  # fragmented: those storages fall back to one allocation each

    def restore(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        storage.resize_(nbytes)

    def release(self, storage: torch.UntypedStorage) -> None:
        storage.resize_(0)

    def settle(self) -> None:
        if self.release_to_driver:
            # Other processes (an inference engine) only see what the driver sees.
            self.ops.release_to_driver()
