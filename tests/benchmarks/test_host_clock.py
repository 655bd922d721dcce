"""benchmarks/host_clock.py: what the host gave a step (the main thread's CPU time, context
switches, the machine's stolen time)."""

from __future__ import annotations

import os
import sys
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

host_clock = pytest.importorskip("host_clock")


def test_a_busy_step_has_its_thread_on_a_core_and_a_sleeping_one_does_not():
    clock = host_clock.HostClock()
    clock.start()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 0.3:  # the thread computes: it has a core all along
        pass
    busy = clock.stop()
    clock.start()
    time.sleep(0.3)  # the thread waits: no CPU time
    idle = clock.stop()
    assert busy["wall_s"] >= 0.3 and idle["wall_s"] >= 0.3
    assert busy["thread_cpu_s"] > 0.5 * busy["wall_s"]
    assert idle["thread_cpu_s"] < 0.1 * idle["wall_s"]
    assert idle["voluntary_switches"] >= 1  # the sleep gave the core up
    assert busy["cpus"] >= 1
    if os.path.exists("/proc/stat"):
        assert 0.0 <= busy["machine_steal_share"] <= 1.0


def test_the_collectors_passes_and_time_are_counted_and_close_stops_watching():
    import gc

    clock = host_clock.HostClock()
    clock.start()
    for _ in range(1000):  # cyclic garbage
        a = []
        a.append(a)
    gc.collect()  # one full pass at least
    got = clock.stop()
    assert got["gc_passes"][2] >= 1 and got["gc_s"] > 0.0
    assert got["gc_tracked_objects"] > 0
    clock.close()
    assert clock._on_gc not in gc.callbacks
    clock.start()
    gc.collect()
    assert clock.stop()["gc_passes"] == [0, 0, 0]  # no longer watching
