"""trl_bench.launch: the merge of a multi-process variant's ranks, the ``accelerate launch`` command
lines, and the flags refused before any work."""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "benchmarks"))

launch = pytest.importorskip("trl_bench.launch")


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
    merged = launch.merged_ranks(out, 2)
    assert merged["step_s"] == 11.0 and merged["peak_bytes"] == 7 and merged["nproc"] == 2
    assert [x["step_s"] for x in merged["ranks"]] == [10.0, 11.0]
    assert launch.merged_ranks(str(tmp_path / "none.json"), 2) is None  # no rank wrote one
    # Rank 0 killed by the launcher after rank 1 ran out of memory: the variant says why.
    one = str(tmp_path / "one.json")
    with open(f"{one}.rank1", "w") as f:
        json.dump({"variant": "y", "rank": 1, "error": "out of memory: CUDA out of memory."}, f)
    merged = launch.merged_ranks(one, 2, "y")
    assert merged["variant"] == "y" and merged["error"].startswith("out of memory")


def test_the_zero3_offload_anchor_launches_trls_zero3_config_with_everything_on_the_cpu():
    import argparse

    pytest.importorskip("trl")
    cmd = launch.launched(
        ["python", "bench_trl.py", "--_variant", "trl"],
        argparse.Namespace(launch="zero3-offload", nproc=4, trl_loading="every-rank"),
    )
    assert cmd[cmd.index("--config_file") + 1].endswith("zero3.yaml")
    assert cmd[cmd.index("--offload_optimizer_device") + 1] == "cpu"
    assert cmd[cmd.index("--offload_param_device") + 1] == "cpu"
    assert cmd[cmd.index("--num_processes") + 1] == "4" and cmd[-2:] == ["--_variant", "trl"]
    fsdp = launch.launched(
        ["python", "bench_trl.py"], argparse.Namespace(launch="fsdp2", nproc=2, trl_loading="every-rank")
    )
    assert "--offload_param_device" not in fsdp and fsdp[fsdp.index("--mixed_precision") + 1] == "no"
    # FSDP2: TRL alone's ranks each load the weights (its reference is sharded as loaded);
    # tidal's keep fsdp2.yaml's loading on rank 0 only.
    ns = argparse.Namespace(launch="fsdp2", nproc=2, trl_loading="every-rank")
    alone = launch.launched(["python", "bench_trl.py", "--_variant", "trl"], ns)
    ours = launch.launched(["python", "bench_trl.py", "--_variant", "stream+prefetch"], ns)
    assert alone[alone.index("--fsdp_cpu_ram_efficient_loading") + 1] == "false"
    assert "--fsdp_cpu_ram_efficient_loading" not in ours
    # --trl-loading rank0 (where every rank loading would not fit the host): as fsdp2.yaml says.
    ns.trl_loading = "rank0"
    alone = launch.launched(["python", "bench_trl.py", "--_variant", "trl"], ns)
    assert "--fsdp_cpu_ram_efficient_loading" not in alone


@pytest.mark.parametrize("flag", ["--anchor-json", "--one-gpu-json"])
def test_a_missing_anchor_or_one_gpu_json_is_refused_before_any_work(flag, tmp_path, capsys):
    missing = tmp_path / "out" / "anchor.json"
    cache = tmp_path / "models"
    with pytest.raises(SystemExit) as e:
        launch.main([flag, str(missing), "--model-cache", str(cache), "--steps", "1"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"{flag} {missing}: no such file" in err
    assert not cache.exists()  # no model saved, no process launched
