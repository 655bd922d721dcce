"""benchmarks/pool_paired.py: the pairs of several bench processes (one a GPU, at once) pooled
into one median ratio and its 95% interval, each pair kept inside its own process."""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

pytest.importorskip("trl_bench.stats")
pool_paired = pytest.importorskip("pool_paired")


def _run(pairs, host_speed=1.0, gpu="H100"):
    """One process's JSON: TRL alone then tidal, each pair on a host ``host_speed`` times slower."""
    variants = []
    for trl_step, ratio in pairs:
        t = trl_step * host_speed
        variants.append({"variant": "trl", "step_s": t, "peak_bytes": 100, "phase_s": {"generate": 0.8 * t}})
        variants.append(
            {"variant": "stream", "step_s": t * ratio, "peak_bytes": 47, "phase_s": {"generate": 0.8 * t * ratio}}
        )
    return {
        "preset": "qwen2-1.5b",
        "dtype": "float32",
        "batch": 64,
        "completion": 256,
        "gpu": gpu,
        "variants": variants,
    }


def test_pairs_pool_across_processes_and_each_stays_inside_its_own():
    # Two processes on hosts 2x apart: pairing across them would read 2x; inside each, 1.02-1.04.
    fast = _run([(10.0, 1.02), (11.0, 1.03), (12.0, 1.04)])
    slow = _run([(10.0, 1.03), (11.0, 1.02), (12.0, 1.04)], host_speed=2.0)
    got = pool_paired.pool([fast, slow])["stream"]
    assert got["n"] == 6 and got["processes"] == 2
    assert sorted(got["ratios"]) == pytest.approx([1.02, 1.02, 1.03, 1.03, 1.04, 1.04])
    assert got["ratio_median"] == pytest.approx(1.03)
    assert got["ratio_ci95"] == pytest.approx((1.02, 1.04))  # n = 6: the extremes
    assert got["generate_ratio_median"] == pytest.approx(1.03)
    assert got["peak_ratio_max"] == pytest.approx(0.47)
    assert [p["n"] for p in got["per_process"]] == [3, 3]
    # Fewer than six pairs in all: no interval.
    assert pool_paired.pool([fast])["stream"]["ratio_ci95"] is None


def test_inputs_without_a_pair_or_of_different_workloads_are_refused():
    with pytest.raises(ValueError, match="no bench JSON"):
        pool_paired.pool([])
    with pytest.raises(ValueError, match="no pair"):
        pool_paired.pool([{"preset": "qwen2-1.5b", "variants": [{"variant": "trl", "step_s": 1.0}]}])
    other = {**_run([(10.0, 1.0)]), "batch": 32}
    with pytest.raises(ValueError, match="different workloads"):
        pool_paired.pool([_run([(10.0, 1.0)]), other])


def test_the_command_line_writes_the_pooled_json_and_refuses_a_missing_input(tmp_path, capsys):
    files = []
    for i in range(2):
        f = tmp_path / f"gpu{i}.json"
        f.write_text(json.dumps(_run([(10.0, 1.01), (10.0, 1.02), (10.0, 1.03)])))
        files.append(str(f))
    out = tmp_path / "pooled.json"
    assert pool_paired.main([*files, "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["processes_at_once"] == 2 and data["paired"]["stream"]["n"] == 6
    assert "median of 6 pairs" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        pool_paired.main([str(tmp_path / "gone.json"), "--json", str(out)])
    assert e.value.code == 2 and "gone.json" in capsys.readouterr().err
