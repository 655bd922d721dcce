"""bench_trl_vllm's pairing: each round's tidal run against that round's TRL + vLLM run."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

import bench_trl_vllm  # noqa: E402


def _row(variant, rnd, step):
    return {"variant": variant, "round": rnd, "summary": {"step_s": step}}


def test_each_round_is_paired_with_its_own_anchor_and_a_failed_run_is_left_out():
    rows = [_row("trl", r, 4.0 + r) for r in range(6)] + [_row("tidal", r, 1.1 * (4.0 + r)) for r in range(6)]
    rows.append(_row("tidal+kv=4", 0, None))  # ran out of memory: no step
    paired = bench_trl_vllm._paired_rounds(rows)
    assert list(paired) == ["tidal"]
    st = paired["tidal"]
    assert st["n"] == 6 and all(abs(x - 1.1) < 1e-12 for x in st["ratios"])
    assert abs(st["ratio_median"] - 1.1) < 1e-12 and st["ratio_ci95"] is not None
    few = bench_trl_vllm._paired_rounds(rows[:3] + rows[6:9])
    assert few["tidal"]["n"] == 3 and few["tidal"]["ratio_ci95"] is None  # too few rounds for an interval


def _run(variant, rnd, logs, digest, ok=True):
    return {"variant": variant, "round": rnd, "ok": ok, "trl_logs": logs, "weights_sha256": digest}


def test_each_run_is_set_against_the_first_trl_run_line_by_line_and_by_its_weights():
    logs = [{"loss": 0.5, "reward": 1.0}, {"loss": 0.25, "reward": 2.0}]
    off = [{"loss": 0.5, "reward": 1.0}, {"loss": 0.25 + 1e-3, "reward": 2.0}]
    rows = [
        _run("tidal", 0, logs, "a", ok=False),  # failed: neither anchor nor compared
        _run("trl", 0, logs, "a"),
        _run("trl", 0, off, "b"),
        _run("tidal+prefetch", 0, logs, "a"),
        _run("tidal+role", 0, logs[:1], "a"),
    ]
    got = {i["variant"]: i for i in bench_trl_vllm.identity(rows)}
    assert set(got) == {"trl", "tidal+prefetch", "tidal+role"}
    assert got["tidal+prefetch"]["logs_equal"] and got["tidal+prefetch"]["weights_equal"]
    assert got["tidal+prefetch"]["max_log_diff"] == 0
    assert not got["trl"]["logs_equal"] and not got["trl"]["weights_equal"]
    assert abs(got["trl"]["max_log_diff"] - 1e-3) < 1e-12
    assert not got["tidal+role"]["logs_equal"]  # a step short: not the same run
    assert bench_trl_vllm.identity([_run("tidal", 0, logs, "a")]) == []  # no anchor, nothing to say
