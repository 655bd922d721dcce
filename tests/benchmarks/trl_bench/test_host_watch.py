"""trl_bench.host_watch: the host memory of each variant's process, watched (what tells a variant
killed by the host's out-of-memory killer from one that crashed)."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "benchmarks"))

host_watch = pytest.importorskip("trl_bench.host_watch")

MiB = 1 << 20


def test_the_watch_sees_a_childs_resident_memory_and_its_exit_status():
    code = "import time; x = bytearray(300 << 20); time.sleep(1.0)"
    rc, host = host_watch.run_watching_host_memory([sys.executable, "-c", code], dict(os.environ), interval_s=0.1)
    assert rc == 0
    assert host["host_peak_rss_bytes"] >= 290 * MiB, host
    assert host["host_total_bytes"] > 0 and 0 < host["host_min_available_bytes"] <= host["host_total_bytes"]


def test_the_watch_says_when_the_peak_came_and_keeps_a_timeline():
    # 100 MiB at first, 400 MiB from 1.2 s on: the peak is the second, and the timeline has both.
    code = "import time; a = bytearray(100 << 20); time.sleep(1.2); b = bytearray(300 << 20); time.sleep(0.8)"
    rc, host = host_watch.run_watching_host_memory(
        [sys.executable, "-c", code], dict(os.environ), interval_s=0.05, timeline_every_s=0.2
    )
    assert rc == 0
    assert host["host_peak_rss_at_s"] >= 1.0, host["host_peak_rss_at_s"]
    times = [t for t, _, _ in host["host_rss_timeline"]]
    assert times == sorted(times) and all(b - a >= 0.2 - 1e-9 for a, b in zip(times, times[1:]))
    # Before the peak, a reading of the first allocation alone; at least one of both together.
    before = [rss for t, rss, _ in host["host_rss_timeline"] if t < host["host_peak_rss_at_s"]]
    assert before and min(before) < 300 * MiB
    assert max(rss for _, rss, _ in host["host_rss_timeline"]) >= 350 * MiB
    assert all(avail is None or avail > 0 for _, _, avail in host["host_rss_timeline"])


def test_a_child_of_a_child_counts_and_a_kill_shows_as_its_signal():
    code = (
        "import os, signal, subprocess, sys, time; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; x = bytearray(200 << 20); time.sleep(1.5)']); "
        "time.sleep(1.0); os.kill(os.getpid(), signal.SIGKILL)"
    )
    rc, host = host_watch.run_watching_host_memory([sys.executable, "-c", code], dict(os.environ), interval_s=0.1)
    assert rc == -signal.SIGKILL
    assert host["host_peak_rss_bytes"] >= 190 * MiB, host


def test_a_run_below_the_host_floor_is_stopped_whole_and_says_so(tmp_path):
    """A run that takes the host's available memory below the floor (here: 1 GiB more, the
    floor 300 MiB below what is available) is killed with its descendants (a grandchild that
    holds nothing included), long before its own end."""
    from tidal.device import host_memory

    floor = host_memory().available_bytes - 300 * MiB
    pid_file = tmp_path / "grandchild"
    code = (
        "import subprocess, sys, time; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        f"open({str(pid_file)!r}, 'w').write(str(p.pid)); "
        "x = bytearray(1 << 30); time.sleep(60)"  # touched: resident
    )
    t0 = time.perf_counter()
    rc, host = host_watch.run_watching_host_memory(
        [sys.executable, "-c", code], dict(os.environ), interval_s=0.1, floor_bytes=floor
    )
    assert time.perf_counter() - t0 < 30
    assert rc == -signal.SIGKILL
    stopped = host["host_stopped"]
    assert stopped["floor_bytes"] == floor and stopped["available_bytes"] < floor
    assert stopped["tree_rss_bytes"] >= 250 * MiB  # read as it crossed, mid-allocation
    grandchild = int(pid_file.read_text())  # written before the allocation that crossed the floor
    for _ in range(50):
        if _state(grandchild) in ("Z", "gone"):
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the grandchild {grandchild} is still running")


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_without_a_floor_nothing_is_stopped():
    rc, host = host_watch.run_watching_host_memory([sys.executable, "-c", "pass"], dict(os.environ), interval_s=0.1)
    assert rc == 0 and "host_stopped" not in host
