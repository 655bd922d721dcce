"""bench_trl.py's paired comparison (``--paired``): each tidal process against the TRL process
just before it, the median ratio and a distribution-free 95% interval for it; and the merge of
a multi-process variant's ranks."""

from __future__ import annotations

import json
import math
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

bench_trl = pytest.importorskip("bench_trl")


def test_the_interval_for_the_median_holds_95_percent_and_needs_six_values():
    assert bench_trl.median_ci95([1.0, 2.0, 3.0, 4.0, 5.0]) is None  # 2 / 32 > 5%: no interval
    assert bench_trl.median_ci95([6.0, 1.0, 5.0, 2.0, 4.0, 3.0]) == (1.0, 6.0)  # 1 - 2/64 = 96.9%
    lo, hi = bench_trl.median_ci95([float(i) for i in range(1, 21)])
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
    got = bench_trl._paired(results)["stream"]
    assert got["n"] == 6
    assert got["ratios"] == [(11.0 + i) / (10.0 + i) for i in range(6)]
    assert got["ratio_ci95"] == (min(got["ratios"]), max(got["ratios"]))
    assert got["generate_ratio_median"] == pytest.approx(1.1)


def test_a_multi_process_variant_is_its_slowest_rank_and_highest_peak(tmp_path):
    out = str(tmp_path / "v.json")
    for r, (step, peak) in enumerate([(10.0, 5), (11.0, 7)]):
        with open(f"{out}.rank{r}", "w") as f:
            json.dump(
                {
                    "variant": "x",
                    "rank": r,
                    "error": None,
                    "step_s": step,
                    "step_min_s": step - 1,
                    "peak_bytes": peak,
                    "exposed_s_per_step": 0.1 * r,
                    "host_held_bytes": 3,
                },
                f,
            )
    merged = bench_trl._merged_ranks(out, 2)
    assert merged["step_s"] == 11.0 and merged["peak_bytes"] == 7 and merged["nproc"] == 2
    assert [x["step_s"] for x in merged["ranks"]] == [10.0, 11.0]
    assert bench_trl._merged_ranks(str(tmp_path / "none.json"), 2) is None  # no rank wrote one
    # Rank 0 killed by the launcher after rank 1 ran out of memory: the variant says why.
    one = str(tmp_path / "one.json")
    with open(f"{one}.rank1", "w") as f:
        json.dump({"variant": "y", "rank": 1, "error": "out of memory: CUDA out of memory."}, f)
    merged = bench_trl._merged_ranks(one, 2, "y")
    assert merged["variant"] == "y" and merged["error"].startswith("out of memory")


def test_the_floor_is_compute_plus_the_state_beyond_the_room_beside_the_gradients_at_the_line_rate():
    gb = 10**9
    r = {
        "phase_s": {"generate": 6.0, "reference": 1.0, "loss_forward": 1.0, "backward": 2.0},
        "exposed_s_per_step": 1.0,  # the compute stream waited on copies: not compute
        "workload": {
            "weights_bytes": 30 * gb,
            "grads_bytes": 30 * gb,
            "optimizer_state_bytes": 59 * gb,
            "device_total_bytes": 85 * gb,
        },
    }
    line = {"h2d_gbps": 50.0}
    got = bench_trl._floor(r, line)
    # 59 GB of state, 25 GB of room beside the weights and gradients: 34 GB cross at 50 GB/s.
    assert got["beyond_room_bytes"] == 34 * gb
    assert got["compute_s"] == pytest.approx(9.0)
    assert got["floor_s"] == pytest.approx(9.0 + 34 / 50)
    r["workload"]["optimizer_state_bytes"] = 20 * gb  # it all fits beside them: compute alone
    assert bench_trl._floor(r, line)["floor_s"] == pytest.approx(9.0)
    assert bench_trl._floor({**r, "workload": {}}, line) is None
    assert bench_trl._floor(r, None) is None


def test_with_several_variants_a_round_pairs_each_with_its_trl_run():
    results = []
    for i in range(3):
        results += [_row("trl", 10.0 + i), _row("a", 11.0 + i), _row("b", 12.0 + i)]
    got = bench_trl._paired(results)
    assert got["a"]["ratios"] == [(11.0 + i) / (10.0 + i) for i in range(3)]
    assert got["b"]["ratios"] == [(12.0 + i) / (10.0 + i) for i in range(3)]


def test_the_zero3_offload_anchor_launches_trls_zero3_config_with_everything_on_the_cpu():
    import argparse

    pytest.importorskip("trl")
    cmd = bench_trl._launched(
        ["python", "bench_trl.py", "--_variant", "trl"],
        argparse.Namespace(launch="zero3-offload", nproc=4, trl_loading="every-rank"),
    )
    assert cmd[cmd.index("--config_file") + 1].endswith("zero3.yaml")
    assert cmd[cmd.index("--offload_optimizer_device") + 1] == "cpu"
    assert cmd[cmd.index("--offload_param_device") + 1] == "cpu"
    assert cmd[cmd.index("--num_processes") + 1] == "4" and cmd[-2:] == ["--_variant", "trl"]
    fsdp = bench_trl._launched(
        ["python", "bench_trl.py"], argparse.Namespace(launch="fsdp2", nproc=2, trl_loading="every-rank")
    )
    assert "--offload_param_device" not in fsdp and fsdp[fsdp.index("--mixed_precision") + 1] == "no"
    # FSDP2: TRL alone's ranks each load the weights (its reference is sharded as loaded);
    # tidal's keep fsdp2.yaml's loading on rank 0 only.
    ns = argparse.Namespace(launch="fsdp2", nproc=2, trl_loading="every-rank")
    alone = bench_trl._launched(["python", "bench_trl.py", "--_variant", "trl"], ns)
    ours = bench_trl._launched(["python", "bench_trl.py", "--_variant", "stream+prefetch"], ns)
    assert alone[alone.index("--fsdp_cpu_ram_efficient_loading") + 1] == "false"
    assert "--fsdp_cpu_ram_efficient_loading" not in ours
    # --trl-loading rank0 (where every rank loading would not fit the host): as fsdp2.yaml says.
    ns.trl_loading = "rank0"
    alone = bench_trl._launched(["python", "bench_trl.py", "--_variant", "trl"], ns)
    assert "--fsdp_cpu_ram_efficient_loading" not in alone


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
    got = bench_trl._paired(results)
    assert got["A"]["ratios"] == pytest.approx([1.1] * 4) and got["B"]["ratios"] == pytest.approx([1.2] * 4)


@pytest.mark.parametrize("flag", ["--anchor-json", "--one-gpu-json"])
def test_a_missing_anchor_or_one_gpu_json_is_refused_before_any_work(flag, tmp_path, capsys):
    missing = tmp_path / "out" / "anchor.json"
    cache = tmp_path / "models"
    with pytest.raises(SystemExit) as e:
        bench_trl.main([flag, str(missing), "--model-cache", str(cache), "--steps", "1"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"{flag} {missing}: no such file" in err
    assert not cache.exists()  # no model saved, no process launched
