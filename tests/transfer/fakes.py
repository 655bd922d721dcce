"""A CPU stand-in for an accelerator, so CI can exercise the accelerator-only paths.

``FakeAccelOps`` says ``is_accelerator = True`` (so the engine buckets small storages and the
store reserves staging room) but keeps every byte in host memory and never touches CUDA.
Streams and events are recording fakes: every ``wait_stream``, ``wait_event``, ``record`` and
``synchronize`` lands in ``ops.log``, so tests can check that waits happen, and in what order
relative to storage frees. Copies are synchronous, so an event is "done" when recorded.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from tidal.device import DeviceOps, sync_policy


class FakeStream:
    def __init__(self, name: str, log: list) -> None:
        self.name = name
        self.log = log

    def wait_stream(self, other: "FakeStream") -> None:
        self.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event: "FakeEvent") -> None:
        self.log.append(("wait_event", self.name, event.id))

    def synchronize(self) -> None:
        self.log.append(("stream_sync", self.name))

    def __repr__(self) -> str:
        return f"FakeStream({self.name})"


class FakeEvent:
    _next_id = 0

    def __init__(self, log: list) -> None:
        FakeEvent._next_id += 1
        self.id = FakeEvent._next_id
        self.log = log
        self.stream: FakeStream | None = None

    def record(self, stream: FakeStream) -> None:
        self.stream = stream
        self.log.append(("record", stream.name, self.id))

    def synchronize(self) -> None:
        self.log.append(("sync", self.id))

    def query(self) -> bool:
        return True  # copies are synchronous: done once recorded

    def elapsed_time(self, other: "FakeEvent") -> float:
        return 0.0  # nothing waits on a synchronous copy


class FakeAccelOps(DeviceOps):
    """An "accelerator" whose memory is host memory. ``free_bytes`` is what
    :meth:`driver_free_bytes` reports (tests lower it to provoke the room check)."""

    def __init__(self, free_bytes: int = 1 << 40) -> None:
        super().__init__("cpu")
        self.is_accelerator = True
        self.free_bytes = free_bytes
        self.log: list = []
        self.compute = FakeStream("compute", self.log)
        self._streams = 0
        self.host_buffers: list[tuple[int, bool]] = []  # (nbytes, pin) per new_host_buffer
        self.freed_host_buffers: list[tuple[int, bool]] = []

    def new_stream(self) -> FakeStream:
        self._streams += 1
        return FakeStream(f"side{self._streams}", self.log)

    def current_stream(self) -> FakeStream:
        return self.compute

    @contextlib.contextmanager
    def on_stream(self, stream) -> Iterator[None]:
        assert stream is not None, "the engine should run copies on a side stream"
        self.log.append(("enter", stream.name))
        try:
            yield
        finally:
            self.log.append(("exit", stream.name))

    def new_event(self, *, timing: bool = False) -> FakeEvent:
        return FakeEvent(self.log)

    def synchronize(self) -> None:
        self.log.append(("device_sync",))

    def hold_until(self, name: str, tensor: torch.Tensor, stream: FakeStream) -> None:
        # No allocator to tell: logged, and seen by the sync policy as a point (fault sweeps).
        self.log.append(("hold", stream.name, tensor.untyped_storage()._cdata))
        sync_policy().point(name)

    def driver_free_bytes(self) -> tuple[int, int]:
        return self.free_bytes, 1 << 41

    def allocated_bytes(self) -> int:
        return 0

    def reserved_bytes(self) -> int:
        return 0

    def empty_cache(self) -> None:
        self.log.append(("empty_cache",))

    def new_host_buffer(self, nbytes: int, *, pin: bool) -> torch.Tensor:
        self.host_buffers.append((nbytes, pin))
        return torch.empty(nbytes, dtype=torch.uint8)

    def free_host_buffer(self, buf: torch.Tensor, *, pinned: bool) -> None:
        self.freed_host_buffers.append((buf.numel(), pinned))


def align_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` reinterpreted as integers of the same width, so NaN payloads, signed zeros and
    infinities compare bit for bit with ``torch.equal``."""
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    if t.dtype.is_complex:
        t = torch.view_as_real(t)
    if t.dtype.is_floating_point:
        return t.view(_INT_OF_SIZE[t.element_size()])
    return t


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, what
    assert torch.equal(bits(a), bits(b)), f"bits differ: {what}"
