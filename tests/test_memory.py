"""tidal.memory.host_memory: the machine's RAM bounded by a memory cgroup's limit (v2 or v1),
read from files (fakes of /proc/meminfo and /sys/fs/cgroup here)."""

import pytest

from tidal.memory import host_memory

GiB = 1 << 30


def _meminfo(tmp_path, total_gib: int, available_gib: int):
    p = tmp_path / "meminfo"
    p.write_text(
        f"MemTotal:       {total_gib * GiB // 1024} kB\nMemFree: 1 kB\nMemAvailable:   {available_gib * GiB // 1024} kB\n"
    )
    return str(p)


def test_without_a_cgroup_limit_the_kernel_totals_count(tmp_path):
    cg = tmp_path / "cg"
    (cg / "memory").mkdir(parents=True)
    (cg / "memory" / "memory.limit_in_bytes").write_text(str(2**63 - 4096))  # v1: no limit
    (cg / "memory" / "memory.usage_in_bytes").write_text(str(3 * GiB))
    h = host_memory(meminfo=_meminfo(tmp_path, 128, 100), cgroup_root=str(cg))
    assert (h.total_bytes, h.available_bytes, h.cgroup_limit_bytes) == (128 * GiB, 100 * GiB, None)
    assert host_memory(meminfo=_meminfo(tmp_path, 64, 60), cgroup_root=str(tmp_path / "none")).total_bytes == 64 * GiB


def test_a_cgroup_v2_limit_bounds_total_and_available(tmp_path):
    cg = tmp_path / "cg"
    cg.mkdir()
    (cg / "memory.max").write_text(str(32 * GiB))
    (cg / "memory.current").write_text(str(30 * GiB))
    h = host_memory(meminfo=_meminfo(tmp_path, 128, 100), cgroup_root=str(cg))
    assert (h.total_bytes, h.available_bytes, h.cgroup_limit_bytes) == (32 * GiB, 2 * GiB, 32 * GiB)
    (cg / "memory.max").write_text("max")  # v2 without a limit
    assert host_memory(meminfo=_meminfo(tmp_path, 128, 100), cgroup_root=str(cg)).available_bytes == 100 * GiB


def test_a_cgroup_v1_limit_bounds_them_too(tmp_path):
    cg = tmp_path / "cg"
    (cg / "memory").mkdir(parents=True)
    (cg / "memory" / "memory.limit_in_bytes").write_text(str(16 * GiB))
    (cg / "memory" / "memory.usage_in_bytes").write_text(str(4 * GiB))
    h = host_memory(meminfo=_meminfo(tmp_path, 128, 100), cgroup_root=str(cg))
    assert (h.total_bytes, h.available_bytes) == (16 * GiB, 12 * GiB)


_PEAK_PROBE = """
import json, torch
from tidal.memory import host_peak_rss_bytes, host_rss_bytes, reset_host_peak_rss

def anon():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))

out = {"reset": reset_host_peak_rss(), "anon_before": anon()}
buf = torch.ones(256 << 20, dtype=torch.uint8)  # 256 MiB, every page written
out.update(rss_alive=host_rss_bytes(), anon_alive=anon())
del buf
out["grown"] = host_peak_rss_bytes()
out["reset_again"] = reset_host_peak_rss()
out["after_reset"] = host_peak_rss_bytes()
print(json.dumps(out))
"""


def test_host_peak_rss_resets_and_counts_what_was_touched():
    """The peak covers a buffer touched and freed after the reset, and a new reset drops it.

    Measured in a fresh process: in the test run's own process, other threads (and memory that
    earlier tests freed) move the resident set while the buffer lives (seen in CI: a 256 MiB
    buffer that grew the anonymous resident set by 0). Under a memory limit the kernel may also
    drop file-backed pages (torch's libraries) to make room for the buffer, so the peak is
    checked against the resident set seen while the buffer lived, and the buffer against
    anonymous memory."""
    import json
    import subprocess
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("per-phase peaks need /proc/self/clear_refs (Linux)")
    run = subprocess.run([sys.executable, "-c", _PEAK_PROBE], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    m = json.loads(run.stdout.strip().splitlines()[-1])
    assert m["reset"] and m["reset_again"]
    assert m["anon_alive"] - m["anon_before"] >= 200 << 20  # the buffer really was resident
    assert m["grown"] >= m["rss_alive"] - (32 << 20)  # and the peak saw it after it was gone
    assert m["after_reset"] < m["grown"] - (160 << 20)  # the reset dropped it
