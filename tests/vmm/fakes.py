"""A CPU stand-in for the CUDA virtual-memory driver, so CI runs a region's bookkeeping and its
copies byte for byte.

Virtual addresses are real host addresses (each reserved range is a host buffer), so the
region's copies read and write them as they would device memory. Mapping fresh physical memory
fills the range with ``FRESH`` and unmapping fills it with ``GONE``: a byte the region failed to
copy back shows up as one of them. :meth:`view` of a range that is not mapped raises, as a
kernel touching it would fault. Physical memory is counted against ``total_bytes``.
"""

from __future__ import annotations

import ctypes

import torch

FRESH = 0xA5
GONE = 0x5A


class FakeDriver:
    def __init__(self, *, total_bytes: int = 64 << 20, granularity: int = 4096) -> None:
        self.granularity = granularity
        self.device_index = 0
        self.total_bytes = total_bytes
        self._ranges: dict[int, torch.Tensor] = {}  # va -> its host buffer
        self._physical: dict[int, int] = {}  # live handle -> bytes
        self._released: set[int] = set()  # handles released by the caller but still mapped
        self._mapped: dict[int, tuple[int, int]] = {}  # va -> (nbytes, handle), one per map call
        self._next_handle = 1
        self.calls: list[str] = []

    # ---- VmmDriver ---------------------------------------------------------------------------
    def reserve(self, nbytes: int) -> int:
        self.calls.append("reserve")
        raw = torch.full((nbytes + self.granularity,), GONE, dtype=torch.uint8)
        skip = -raw.data_ptr() % self.granularity  # addresses aligned as the driver's are
        buf = raw[skip : skip + nbytes]
        va = buf.data_ptr()
        self._ranges[va] = buf
        return va

    def free_range(self, va: int, nbytes: int) -> None:
        self.calls.append("free_range")
        assert not any(va <= m < va + nbytes for m in self._mapped), "freeing a range that is still mapped"
        del self._ranges[va]

    def create(self, nbytes: int) -> int:
        self.calls.append("create")
        assert nbytes % self.granularity == 0, nbytes
        if self.physical_bytes() + nbytes > self.total_bytes:
            raise torch.OutOfMemoryError(f"fake driver: {nbytes} bytes do not fit")
        h = self._next_handle
        self._next_handle += 1
        self._physical[h] = nbytes
        return h

    def release(self, handle: int) -> None:
        self.calls.append("release")
        assert handle in self._physical and handle not in self._released, "released twice"
        self._released.add(handle)
        self._collect(handle)

    def map(self, va: int, nbytes: int, handle: int, offset: int = 0) -> None:
        self.calls.append("map")
        assert handle in self._physical and handle not in self._released, "mapping a released handle"
        assert va % self.granularity == 0 and nbytes % self.granularity == 0
        assert offset == 0 and nbytes == self._physical[handle], "CUDA maps a physical allocation whole"
        for m, (n, _) in self._mapped.items():
            assert va + nbytes <= m or m + n <= va, "mapping over a mapping"
        self._buffer(va, nbytes).fill_(FRESH)
        self._mapped[va] = (nbytes, handle)

    def unmap(self, va: int, nbytes: int) -> None:
        self.calls.append("unmap")
        assert self._mapped.get(va, (None,))[0] == nbytes, "unmap must cover exactly one mapping"
        _, handle = self._mapped.pop(va)
        self._buffer(va, nbytes).fill_(GONE)
        self._collect(handle)

    def view(self, va: int, nbytes: int) -> torch.Tensor:
        if not self.is_mapped(va, nbytes):
            raise RuntimeError(f"fake driver: access to unmapped memory at {va:#x} (+{nbytes})")
        self._buffer(va, nbytes)  # inside a reserved range
        # A tensor whose storage is exactly the range, as torch's view of device memory is.
        return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(va), dtype=torch.uint8)

    def driver_free_bytes(self) -> int:
        return self.total_bytes - self.physical_bytes()

    # ---- for the tests -------------------------------------------------------------------------
    def physical_bytes(self) -> int:
        return sum(self._physical.values())

    def mapped_handles(self) -> set[int]:
        return {h for _, h in self._mapped.values()}

    def is_mapped(self, va: int, nbytes: int) -> bool:
        covered = 0
        for m, (n, _) in self._mapped.items():
            lo, hi = max(m, va), min(m + n, va + nbytes)
            covered += max(0, hi - lo)
        return covered == nbytes

    def write(self, va: int, data: bytes) -> None:
        self.view(va, len(data)).copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))

    def read(self, va: int, nbytes: int) -> bytes:
        return bytes(self.view(va, nbytes).tolist())

    # ---- internals ----------------------------------------------------------------------------
    def _collect(self, handle: int) -> None:
        if handle in self._released and handle not in self.mapped_handles():
            del self._physical[handle]
            self._released.discard(handle)

    def _buffer(self, va: int, nbytes: int) -> torch.Tensor:
        for base, buf in self._ranges.items():
            if base <= va and va + nbytes <= base + buf.numel():
                return buf[va - base : va - base + nbytes]
        raise AssertionError(f"{va:#x} is in no reserved range")
