"""``tidal bench`` end to end on the CPU: the CLI runs, every figure is measured, and the
state that went through every offload/reload/switch cycle is bit-exact."""

import json

import pytest
import torch

from tidal_recipes.cli.main import main


@pytest.fixture(scope="module")
def bench_json(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    path, results = tmp / "bench.json", tmp / "RESULTS.md"
    rc = main(
        [
            "bench",
            "--device",
            "cpu",
            "--preset",
            "tiny",
            "--warm-iters",
            "2",
            "--json",
            str(path),
            "--results",
            str(results),
        ]
    )
    assert rc == 0
    return json.loads(path.read_text()), results.read_text()


@pytest.mark.slow
def test_bench_figures_are_measured(bench_json):
    r, _ = bench_json
    assert r["preset"] == "tiny" and r["env"]["device"] == "cpu"
    for key in ("d2h_gbps", "h2d_gbps", "bidir_gbps"):
        assert r["line_rate"][key] > 0
    for side in ("anchor", "tidal"):
        for key in ("offload_cold_gbps", "offload_warm_gbps", "reload_cold_gbps", "reload_warm_gbps"):
            assert r[side][key] > 0, (side, key)
    t = r["tidal"]
    assert t["bytes"] > 0 and t["bytes_out"] == t["bytes_in"] == t["bytes"]
    assert 0 < r["memory"]["host_ratio"] <= 1.05
    sw = r["switch"]
    assert sw["switch_s"] > 0 and sw["sequential_s"] > 0 and sw["ratio"] > 0
    assert sw["bytes_each_way"] == t["bytes"]


def test_bench_state_round_trips_bit_exact(bench_json):
    r, _ = bench_json
    assert r["reference_mode"] == "clone"
    assert r["bit_exact"] is True, r["mismatches"]
    assert r["bit_exact_anchor"] is True
    # (1 + warm_iters) offload/load pairs, then (1 + warm_iters) switch iterations of three
    # transitions each: the comparison covers every one of them.
    assert r["transitions"] >= 2 * 3 + 3 * 3


def test_bench_results_row(bench_json):
    _, md = bench_json
    lines = [ln for ln in md.splitlines() if ln.startswith("|")]
    assert len(lines) == 3  # header, separator, one row
    assert lines[0].count("|") == lines[2].count("|")
    assert "| tiny |" in lines[2]


def test_cli_usage_errors(capsys):
    assert main(["bench", "--device", "tpu"]) == 2
    assert main(["bench", "--preset", "nope"]) == 2
    assert main([]) == 2
    assert main(["--help"]) == 0
    if not torch.cuda.is_available():  # an absent device is a usage error, not a traceback
        assert main(["bench", "--device", "cuda"]) == 2
        assert "no cuda device" in capsys.readouterr().err
    capsys.readouterr()
