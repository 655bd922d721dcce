"""The phase clock of bench_trl.py (benchmarks/phase_clock.py): each phase's time, a phase
called inside another counted for the outer one only."""

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
from phase_clock import PhaseClock  # noqa: E402


class Trainer:
    def inner(self, model):
        time.sleep(0.02)

    def outer(self):
        time.sleep(0.03)
        self.inner("policy")  # counted inside outer, not on its own


def test_each_call_counts_once_under_its_outermost_phase():
    t = Trainer()
    clock = PhaseClock(cuda=False)
    clock.wrap(t, "inner", lambda model: f"logps:{model}")
    clock.wrap(t, "outer", "loss")
    clock.wrap(t, "outer", "again")  # wrapping twice keeps the first
    t.outer()
    t.inner("ref")
    t.inner("ref")
    got = clock.take()
    assert set(got) == {"loss", "logps:ref"}, got
    assert 0.05 <= got["loss"] < 0.2 and 0.04 <= got["logps:ref"] < 0.2, got
    assert clock.take() == {}  # taken: the next step starts empty
