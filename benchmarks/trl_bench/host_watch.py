"""A variant's child process run with its host memory watched: the process tree's peak
resident set, the host's lowest available memory, a timeline, and a floor below which the tree
is killed before the kernel's out-of-memory killer picks a process (what tells a variant killed
by the host from one that crashed). Linux (``/proc``)."""

from __future__ import annotations

import os
import signal
import subprocess
import time

__all__ = ["run_watching_host_memory", "tree_pids", "tree_rss_bytes"]


def tree_pids(pid: int) -> list[int]:
    """``pid`` and its descendants now (``/proc``; those that end meanwhile are skipped)."""
    pids, todo = [], [pid]
    while todo:
        p = todo.pop()
        pids.append(p)
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo += [int(c) for c in f.read().split()]
        except (OSError, ValueError):
            continue
    return pids


def tree_rss_bytes(pid: int) -> int:
    """Resident bytes of ``pid`` and its descendants (``/proc``; 0 where unreadable)."""
    total = 0
    for p in tree_pids(pid):
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
        except (OSError, ValueError):
            continue
    return total


def _kill_tree(pid: int) -> None:
    for p in reversed(tree_pids(pid)):  # the ranks first, the launcher last
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_watching_host_memory(
    cmd: list[str], env: dict, interval_s: float = 0.5, floor_bytes: int = 0, timeline_every_s: float = 5.0
) -> tuple[int, dict]:
    """Run ``cmd`` (in this process's group: a ``timeout`` around the bench ends it too) with
    ``env``; return its exit status and the host memory seen while it ran, read every
    ``interval_s``: ``host_peak_rss_bytes`` (its process tree's) and ``host_peak_rss_at_s``
    (seconds after the launch), ``host_min_available_bytes`` (``MemAvailable`` or the cgroup's
    room), ``host_total_bytes``, and ``host_rss_timeline`` (``[seconds, tree RSS, available]``
    every ``timeline_every_s``). A process killed by the kernel (exit -9) with the available
    memory near 0 ran the host out of memory. With ``floor_bytes``, the tree is killed as soon as
    the available memory falls below it, and ``host_stopped`` says when (``after_s``) and at
    what (``available_bytes``, ``floor_bytes``, ``tree_rss_bytes``)."""
    from tidal.device import host_memory

    proc = subprocess.Popen(cmd, env=env)
    peak_rss, peak_at, min_avail, total, stopped = 0, None, None, None, None
    timeline, last_kept = [], -1e9
    t0 = time.perf_counter()
    while proc.poll() is None:
        rss = tree_rss_bytes(proc.pid)
        now = time.perf_counter() - t0
        if rss > peak_rss:
            peak_rss, peak_at = rss, round(now, 1)
        try:
            mem = host_memory()
        except OSError:
            mem = None
        if now - last_kept >= timeline_every_s:  # when the memory went up: loading, a step
            timeline.append([round(now, 1), rss, mem.available_bytes if mem is not None else None])
            last_kept = now
        if mem is not None:
            total = mem.total_bytes
            min_avail = mem.available_bytes if min_avail is None else min(min_avail, mem.available_bytes)
            if floor_bytes and mem.available_bytes < floor_bytes and stopped is None:
                stopped = {
                    "after_s": round(time.perf_counter() - t0, 1),
                    "available_bytes": mem.available_bytes,
                    "floor_bytes": floor_bytes,
                    "tree_rss_bytes": rss,
                }
                print(
                    f"[bench_trl] host memory available {mem.available_bytes / 2**30:.1f} GiB of "
                    f"{total / 2**30:.1f} fell below the floor of {floor_bytes / 2**30:.1f} GiB after "
                    f"{stopped['after_s']} s (the run's processes hold {rss / 2**30:.1f} GiB): stopping it",
                    flush=True,
                )
                _kill_tree(proc.pid)
        time.sleep(interval_s)
    res = {
        "host_peak_rss_bytes": peak_rss,
        "host_peak_rss_at_s": peak_at,
        "host_min_available_bytes": min_avail,
        "host_total_bytes": total,
        "host_rss_timeline": timeline,
    }
    if stopped is not None:
        res["host_stopped"] = stopped
    return proc.returncode, res
