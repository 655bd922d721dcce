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
