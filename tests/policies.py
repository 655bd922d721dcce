"""Sync policies the tests inject through tidal's one seam (``tidal.device.use_sync_policy``).

* :class:`SkipWaits` drops the named waits and records which of them were reached, so a race
  test can show it detects a missing wait (and cannot pass because the wait was never there).
* :class:`CountPoints` counts every call (waits and points) of a run, by name.
* :class:`FaultAt` raises at the k-th call: the fault-injection sweep runs a scenario once
  with :class:`CountPoints`, then once per k with :class:`FaultAt`.
"""

from __future__ import annotations

import threading
from typing import Any, Iterable

from tidal.device import SyncPolicy


class SkipWaits(SyncPolicy):
    def __init__(self, names: Iterable[str]) -> None:
        self.names = frozenset(names)
        self.skipped: list[str] = []

    def _skip(self, name: str) -> bool:
        if name in self.names:
            self.skipped.append(name)
            return True
        return False

    def wait_stream(self, name: str, consumer: Any, producer: Any) -> None:
        if not self._skip(name):
            super().wait_stream(name, consumer, producer)

    def wait_event(self, name: str, stream: Any, event: Any) -> None:
        if not self._skip(name):
            super().wait_event(name, stream, event)

    def wait_host(self, name: str, event: Any) -> None:
        if not self._skip(name):
            super().wait_host(name, event)

    def hold_until(self, name: str, tensor: Any, stream: Any) -> None:
        if not self._skip(name):
            super().hold_until(name, tensor, stream)


class CountPoints(SyncPolicy):
    """Counts calls made from the thread that created it (the copy worker threads of CPUAdam
    are counted too when ``all_threads``)."""

    def __init__(self, *, all_threads: bool = False) -> None:
        self.calls: list[str] = []
        self._thread = None if all_threads else threading.get_ident()

    def _hit(self, name: str) -> None:
        if self._thread is None or threading.get_ident() == self._thread:
            self.calls.append(name)

    def wait_stream(self, name, consumer, producer):
        self._hit(name)
        super().wait_stream(name, consumer, producer)

    def wait_event(self, name, stream, event):
        self._hit(name)
        super().wait_event(name, stream, event)

    def wait_host(self, name, event):
        self._hit(name)
        super().wait_host(name, event)

    def hold_until(self, name, tensor, stream):
        self._hit(name)
        super().hold_until(name, tensor, stream)

    def point(self, name):
        self._hit(name)


class FaultAt(CountPoints):
    """Raises ``exc`` at the ``k``-th call (0-based) made from this thread, once."""

    def __init__(self, k: int, exc: type[BaseException] = KeyboardInterrupt) -> None:
        super().__init__()
        self.k = k
        self.exc = exc
        self.fired: str | None = None

    def _hit(self, name: str) -> None:
        if threading.get_ident() != self._thread:
            return
        n = len(self.calls)
        self.calls.append(name)
        if n == self.k and self.fired is None:
            self.fired = name
            raise self.exc(f"injected at call {n} ({name})")
