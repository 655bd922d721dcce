"""bench_trl.py's watch on the host memory of each variant's process (what tells a variant
killed by the host's out-of-memory killer from one that crashed)."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

bench_trl = pytest.importorskip("bench_trl")

MiB = 1 << 20


def test_the_watch_sees_a_childs_resident_memory_and_its_exit_status():
    code = "import time; x = bytearray(300 << 20); time.sleep(1.0)"
    rc, host = bench_trl._run_watching_host_memory([sys.executable, "-c", code], dict(os.environ), interval_s=0.1)
    assert rc == 0
    assert host["host_peak_rss_bytes"] >= 290 * MiB, host
    assert host["host_total_bytes"] > 0 and 0 < host["host_min_available_bytes"] <= host["host_total_bytes"]


def test_the_watch_says_when_the_peak_came_and_keeps_a_timeline():
    # 100 MiB at first, 400 MiB from 1.2 s on: the peak is the second, and the timeline has both.
    code = "import time; a = bytearray(100 << 20); time.sleep(1.2); b = bytearray(300 << 20); time.sleep(0.8)"
    rc, host = bench_trl._run_watching_host_memory(
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
    rc, host = bench_trl._run_watching_host_memory([sys.executable, "-c", code], dict(os.environ), interval_s=0.1)
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
    rc, host = bench_trl._run_watching_host_memory(
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
    rc, host = bench_trl._run_watching_host_memory([sys.executable, "-c", "pass"], dict(os.environ), interval_s=0.1)
    assert rc == 0 and "host_stopped" not in host


def test_with_several_trl_processes_each_variant_is_also_set_against_the_one_before_it(capsys):
    pytest.importorskip("trl")
    import types

    args = types.SimpleNamespace(
        preset="tiny", dtype="float32", batch=4, completion=8, results=None, json=None, picture=None, line_rate=None
    )

    def result(variant, step_s):
        return dict(variant=variant, error=None, step_s=step_s, step_min_s=step_s, peak_bytes=1 << 30)

    runs = [result("trl", 8.0), result("stream", 9.0), result("trl", 10.0), result("stream", 9.5)]
    bench_trl._report_so_far(args, runs, None)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("  stream")]
    assert "(1.12 TRL)" in lines[0] and "process before it" not in lines[0]  # its TRL is the first one
    assert "(0.90x the TRL process after it)" in lines[0]
    assert "(1.19 TRL)" in lines[1] and "(0.95x the TRL process before it)" in lines[1]
    assert "after it" not in lines[1]  # no TRL process after the last


def test_tidal_between_two_trl_processes_is_set_against_both(capsys):
    """Run h6's order, TRL, tidal, tidal, TRL: the second tidal process's neighbour is the TRL
    process after it."""
    pytest.importorskip("trl")
    import types

    args = types.SimpleNamespace(
        preset="tiny", dtype="float32", batch=4, completion=8, results=None, json=None, picture=None, line_rate=None
    )
    runs = [
        dict(variant=v, error=None, step_s=t, step_min_s=t, peak_bytes=1 << 30)
        for v, t in (("trl", 9.950), ("role+prefetch", 10.216), ("role+prefetch", 9.148), ("trl", 9.180))
    ]
    bench_trl._report_so_far(args, runs, None)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("  role")]
    assert "(1.11x the TRL process after it)" in lines[0]
    assert "(1.00x the TRL process after it)" in lines[1]


def test_a_variant_run_in_several_processes_is_also_pooled_over_all_their_steps(capsys):
    """Run i3's 7B stress steps (trl, role+prefetch, trl, role+prefetch): the median of all ten
    measured steps of each variant, and the ratio of those medians."""
    pytest.importorskip("trl")
    import types

    args = types.SimpleNamespace(
        preset="tiny", dtype="float32", batch=4, completion=8, results=None, json=None, picture=None, line_rate=None
    )
    steps = {
        "trl": [[2.635, 1.259, 1.035, 1.344, 1.293], [3.599, 1.564, 1.37, 1.487, 1.267]],
        "role+prefetch": [[2.929, 1.206, 1.296, 1.695, 1.653], [4.096, 1.26, 1.243, 1.427, 1.476]],
    }
    runs = [
        dict(variant=v, error=None, step_s=sorted(t)[2], step_min_s=min(t), peak_bytes=1 << 30, step_times_s=t)
        for i in range(2)
        for v, t in ((name, steps[name][i]) for name in steps)
    ]
    bench_trl._report_so_far(args, runs, None)
    out = capsys.readouterr().out
    assert "trl 1.357 s (2 processes, 10 steps)" in out
    assert "role+prefetch 1.452 s (2 processes, 10 steps, 1.07x TRL's)" in out
    assert bench_trl._pooled(runs[:2]) == {}  # nothing repeats: nothing pooled


def test_deepspeeds_offload_is_the_anchor_each_tidal_variant_is_set_against(capsys):
    """Run h1 (2x H100): the DeepSpeed ZeRO-3 offload variant has no timeshare and moves bytes
    the bench does not count (null): the report sets each tidal variant's step and peak against
    it, with no TRL-alone run (it runs out of memory at 7B on an H100)."""
    pytest.importorskip("trl")
    import types

    args = types.SimpleNamespace(
        preset="tiny", dtype="bfloat16", batch=4, completion=8, results=None, json=None, picture=None, line_rate=None
    )
    ds = dict(variant="ds-zero3-offload", error=None, step_s=16.0, step_min_s=15.7, peak_bytes=40 << 30)
    ds["moved_gb_per_step"] = None
    ours = dict(variant="stream+prefetch", error=None, step_s=9.6, step_min_s=9.3, peak_bytes=60 << 30)
    ours["moved_gb_per_step"] = 81.2
    bench_trl._report_so_far(args, [ds, ours], None)
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("  stream+prefetch"))
    assert "against DeepSpeed ZeRO-3 offload: step 0.60x, peak 1.50x" in line
    ds_line = next(ln for ln in out.splitlines() if ln.startswith("  ds-zero3-offload"))
    assert "bytes moved not counted" in ds_line and "against DeepSpeed" not in ds_line
