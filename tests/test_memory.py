"""tidal.memory.host_memory: the machine's RAM bounded by a memory cgroup's limit (v2 or v1),
read from files (fakes of /proc/meminfo and /sys/fs/cgroup here)."""

import pytest
import torch

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


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/self/status")


def test_host_peak_rss_resets_and_counts_what_was_touched():
    """The peak covers a buffer touched and freed after the reset, and a new reset drops it."""
    import gc
    import sys

    from tidal.memory import host_peak_rss_bytes, host_rss_bytes, reset_host_peak_rss

    if not sys.platform.startswith("linux"):
        pytest.skip("per-phase peaks need /proc/self/clear_refs (Linux)")
    # Earlier tests leave cyclic garbage; were the collector to free it between the
    # reset and the buffer, the resident set would shrink first and the peak grow less.
    # Under a memory limit the kernel may also drop file-backed pages (torch's own
    # libraries) to make room for the buffer, so the peak is checked against the
    # resident set seen while the buffer lived, and the buffer against anonymous memory.
    gc.collect()
    gc.disable()
    try:
        assert reset_host_peak_rss()
        anon_before = _status_bytes("RssAnon")
        buf = torch.ones(256 << 20, dtype=torch.uint8)  # 256 MiB, every page written
        rss_alive = host_rss_bytes()
        anon_alive = _status_bytes("RssAnon")
        del buf
        grown = host_peak_rss_bytes()
        assert anon_alive - anon_before >= 200 << 20  # the buffer really was resident
        assert grown >= rss_alive - (32 << 20)  # and the peak saw it after it was gone
        assert reset_host_peak_rss()
        assert host_peak_rss_bytes() < grown - (160 << 20)
    finally:
        gc.enable()
