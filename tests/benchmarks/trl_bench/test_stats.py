"""trl_bench.stats: the distribution-free 95% interval for a median, each tidal run paired with
the TRL run of its round (``--paired``), a variant's steps pooled over its processes."""

from __future__ import annotations

import math
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "benchmarks"))

stats = pytest.importorskip("trl_bench.stats")


def test_the_interval_for_the_median_holds_95_percent_and_needs_six_values():
    assert stats.median_ci95([1.0, 2.0, 3.0, 4.0, 5.0]) is None  # 2 / 32 > 5%: no interval
    assert stats.median_ci95([6.0, 1.0, 5.0, 2.0, 4.0, 3.0]) == (1.0, 6.0)  # 1 - 2/64 = 96.9%
    lo, hi = stats.median_ci95([float(i) for i in range(1, 21)])
    assert (lo, hi) == (6.0, 15.0)
    # Its coverage: the chance the median lies outside is the two binomial tails, <= 5%.
    tail = sum(math.comb(20, i) for i in range(6)) / 2**20
    assert 2 * tail <= 0.05 < 2 * (tail + math.comb(20, 6) / 2**20)


def _row(variant, step, generate=None, error=None):
    r = {"variant": variant, "step_s": step, "error": error}
    if generate is not None:
        r["phase_s"] = {"generate": generate}
    return r


def test_each_tidal_process_is_paired_with_the_trl_process_before_it():
    results = []
    for i in range(6):
        results += [_row("trl", 10.0 + i, 5.0), _row("stream", 11.0 + i, 5.5)]
    results.append(_row("stream", 99.0))  # no TRL process before it: not paired
    results += [_row("trl", 10.0, error="out of memory"), _row("stream", 12.0, 6.0)]  # its TRL failed
    got = stats.paired(results)["stream"]
    assert got["n"] == 6
    assert got["ratios"] == [(11.0 + i) / (10.0 + i) for i in range(6)]
    assert got["ratio_ci95"] == (min(got["ratios"]), max(got["ratios"]))
    assert got["generate_ratio_median"] == pytest.approx(1.1)


def test_with_several_variants_a_round_pairs_each_with_its_trl_run():
    results = []
    for i in range(3):
        results += [_row("trl", 10.0 + i), _row("a", 11.0 + i), _row("b", 12.0 + i)]
    got = stats.paired(results)
    assert got["a"]["ratios"] == [(11.0 + i) / (10.0 + i) for i in range(3)]
    assert got["b"]["ratios"] == [(12.0 + i) / (10.0 + i) for i in range(3)]


def test_rounds_run_in_turn_reversed_and_each_run_pairs_with_its_rounds_trl_run():
    """trl A B, then B A trl: each variant runs as often after its TRL run as before it, so a
    host whose speed drifts through the call favours neither side; every run pairs with the TRL
    run of its own round."""
    order = ["trl", "A", "B", "B", "A", "trl", "trl", "A", "B", "B", "A", "trl"]
    steps = {0: 10.0, 5: 20.0, 6: 30.0, 11: 40.0}  # the TRL runs: the host slows down
    results = [_row(v, steps.get(i, 0.0)) for i, v in enumerate(order)]
    for i, v in enumerate(order):
        if v != "trl":
            base = steps[{0: 0, 1: 5, 2: 6, 3: 11}[i // 3]]  # its round's TRL run
            results[i]["step_s"] = base * (1.1 if v == "A" else 1.2)
    got = stats.paired(results)
    assert got["A"]["ratios"] == pytest.approx([1.1] * 4) and got["B"]["ratios"] == pytest.approx([1.2] * 4)


def test_paired_generation_over_the_host_probe_takes_the_hosts_drift_out():
    def row(variant, gen, probe):
        return {
            "variant": variant,
            "step_s": gen + 1.0,
            "error": None,
            "phase_s": {"generate": gen},
            "token_gap_s": {"probe": probe},
        }

    # The host slows down run by run; tidal's generation is 1.01x TRL's at the same host speed.
    results = []
    for i in range(6):
        speed = 1.0 + 0.2 * i
        results += [row("trl", 10.0 * speed, 1e-5 * speed), row("stream", 10.1 * speed * 1.1, 1e-5 * speed * 1.1)]
    got = stats.paired(results)["stream"]
    assert got["generate_ratio_median"] == pytest.approx(1.111, abs=1e-3)  # the drift in the raw ratio
    assert got["generate_per_probe_ratio_median"] == pytest.approx(1.01)
    assert got["generate_per_probe_ratio_ci95"] == pytest.approx((1.01, 1.01))
