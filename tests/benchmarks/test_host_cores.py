"""benchmarks/bench_host_cores.py: each core's speed at Python and its memory's distance, and
whether the cores keep their order from round to round."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")
sys.path.insert(0, BENCH)

bench_host_cores = pytest.importorskip("bench_host_cores")


def test_spearman_of_the_same_order_is_one_and_of_the_reverse_minus_one():
    a = [0.3, 0.1, 0.2, 0.5]
    assert bench_host_cores.spearman(a, [3.0, 1.0, 2.0, 5.0]) == pytest.approx(1.0)
    assert bench_host_cores.spearman(a, [-3.0, -1.0, -2.0, -5.0]) == pytest.approx(-1.0)


def test_spearman_gives_ties_their_mean_rank():
    # ranks of [1, 1, 2]: 0.5, 0.5, 2; of [1, 2, 3]: 0, 1, 2 -> covariance 1.5, variances 1.5 and 2
    assert bench_host_cores.spearman([1.0, 1.0, 2.0], [1.0, 2.0, 3.0]) == pytest.approx(1.5 / (1.5 * 2) ** 0.5)


def test_spearman_refuses_unequal_lists_and_has_no_value_for_too_few_or_constant():
    with pytest.raises(ValueError, match="equally long"):
        bench_host_cores.spearman([1.0, 2.0, 3.0], [1.0, 2.0])
    assert bench_host_cores.spearman([1.0, 2.0], [2.0, 1.0]) is None
    assert bench_host_cores.spearman([1.0, 1.0, 1.0], [1.0, 2.0, 3.0]) is None


def test_a_small_sweep_times_every_core_in_every_round(tmp_path):
    out = tmp_path / "cores.json"
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(BENCH, "bench_host_cores.py"),
            "--rounds",
            "2",
            "--calls",
            "200",
            "--chase-steps",
            "2000",
            "--list-len",
            "5000",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    cpus = data["cpus"]
    assert cpus == sorted(os.sched_getaffinity(0))
    assert len(data["rounds"]) == 2
    for row in data["rounds"]:
        for key in ("calls", "calls_cpu_share"):
            assert sorted(int(c) for c in row[key]) == cpus
            assert all(v > 0 for v in row[key].values())
        chases = [k for k in row if k.startswith("chase_built_on_")]
        assert sorted(chases) == sorted({f"chase_built_on_{cpus[0]}", f"chase_built_on_{cpus[-1]}"})
    assert data["summary"]["calls"]["slowest_over_fastest"] >= 1.0
    assert "slowest/fastest" in proc.stdout


def test_one_round_is_refused():
    proc = subprocess.run(
        [sys.executable, os.path.join(BENCH, "bench_host_cores.py"), "--rounds", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "--rounds must be >= 2" in proc.stderr
