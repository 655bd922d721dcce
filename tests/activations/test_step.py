"""PeakWindows: the allocator's peak per stretch of a step, through a counting fake of the
device's allocator stats."""

from __future__ import annotations

from tidal.activations.step import PeakWindows


class _Allocator:
    """allocated_bytes / peak_allocated_bytes / reset_peak, as DeviceOps has them."""

    def __init__(self, allocated: int) -> None:
        self.now = allocated
        self.peak = allocated

    def alloc(self, n: int) -> None:
        self.now += n
        self.peak = max(self.peak, self.now)

    def free(self, n: int) -> None:
        self.now -= n

    def allocated_bytes(self) -> int:
        return self.now

    def peak_allocated_bytes(self) -> int:
        return self.peak

    def reset_peak(self) -> None:
        self.peak = self.now


def test_each_stretch_gets_its_own_peak_and_the_step_keeps_the_highest():
    a = _Allocator(1000)
    w = PeakWindows(a)
    w.open(("forward", 0))
    a.alloc(300)  # saved activations
    a.alloc(500)  # a workspace, freed before the layer ends
    a.free(500)
    w.open(("forward", 1))  # opening closes the previous stretch
    a.alloc(100)
    w.close()
    a.alloc(2000)  # between stretches (a reload): in no stretch, still in the step's peak
    a.free(2000)
    w.open(("backward", 1))
    a.alloc(50)
    w.close()
    assert w.excess == {("forward", 0): 800, ("forward", 1): 100, ("backward", 1): 50}
    assert w.step_peak == 1000 + 300 + 100 + 2000


def test_a_stretch_run_twice_keeps_its_larger_peak():
    a = _Allocator(0)
    w = PeakWindows(a)
    for extra in (700, 200):  # two backward passes over a retained graph
        w.open(("backward", 0))
        a.alloc(extra)
        a.free(extra)
        w.close()
    assert w.excess[("backward", 0)] == 700
