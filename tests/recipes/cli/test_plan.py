"""``tidal plan``: argparse wiring, the printed report, JSON, usage errors."""

import argparse
import json

import pytest

from tidal_recipes.cli.plan import add_parser


def _run(argv, capsys):
    parser = argparse.ArgumentParser(prog="tidal")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plan", *argv])
    code = args.run(args)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_report_has_table_recommendation_and_assumptions(capsys):
    code, out, _ = _run(
        [
            "--preset",
            "qwen2-7b",
            "--gpu-mem-gib",
            "79",
            "--prompts",
            "32",
            "--group",
            "8",
            "--gen-len",
            "1024",
            "--micro-batch",
            "8",
        ],
        capsys,
    )
    assert code == 0
    for text in (
        "rollout",
        "reference",
        "train",
        "optimizer_step",
        "peak allocated, timeshare",
        "peak allocated, all resident",
        "transitions per step",
        "recommendation for 1 GPU(s)",
        "Enable:",
        "assumptions:",
        "CUDA context",
    ):
        assert text in out, text


def test_json_output_and_flags(capsys, tmp_path):
    code, out, _ = _run(
        [
            "--preset",
            "qwen2-0.5b",
            "--grad-ckpt",
            "--optimizer",
            "cpu_adam",
            "--lora-rank",
            "8",
            "--gpus",
            "2",
            "--zero-stage",
            "2",
            "--gpu-mem-gib",
            "24",
            "--json",
        ],
        capsys,
    )
    assert code == 0
    data = json.loads(out)
    cfg = data["plan"]["config"]
    assert (cfg["grad_ckpt"], cfg["optimizer"], cfg["lora_rank"], cfg["dp"], cfg["zero_stage"]) == (
        True,
        "cpu_adam",
        8,
        2,
        2,
    )
    assert data["recommendation"]["fits"] is True
    assert data["plan"]["peak_bytes"] == max(p["peak_bytes"] for p in data["plan"]["phases"].values())
    path = tmp_path / "plan.json"
    code, out, _ = _run(["--preset", "qwen2-0.5b", "--json", str(path)], capsys)
    assert code == 0 and json.loads(path.read_text())["recommendation"] is None


def test_config_json_and_bench_bandwidth(capsys, tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        hidden_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        intermediate_size=1024,
        vocab_size=32000,
    )
    cfg.to_json_file(str(tmp_path / "config.json"))
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"line_rate": {"d2h_gbps": 11.0, "h2d_gbps": 11.0, "bidir_gbps": 20.0}}))
    code, out, _ = _run(["--config", str(tmp_path / "config.json"), "--bench-json", str(bench)], capsys)
    assert code == 0 and "llama" in out and "D2H 11 GB/s" in out


def test_a_shared_copies_json_plans_each_rank_at_the_rate_the_slowest_got_with_all_copying(capsys, tmp_path):
    """Several GPUs of one host share its memory and PCIe fabric: ``bench_shared_copies.py``'s
    file gives the plan the rates its slowest rank got with every rank copying at once, a
    note saying so; a one-GPU rate planning several GPUs gets a note that it is too high."""
    shared = tmp_path / "shared.json"
    ranks = [
        {"rank": 0, "shared": {"d2h": 31.0, "h2d": 40.0, "both": 42.0}},
        {"rank": 1, "shared": {"d2h": 30.0, "h2d": 41.0, "both": 43.0}},
    ]
    shared.write_text(json.dumps({"world": 2, "ranks": ranks}))
    flags = ["--preset", "qwen2-0.5b", "--gpus", "2", "--launch", "ddp", "--prompts", "4", "--group", "4"]
    code, out, err = _run([*flags, "--bench-json", str(shared)], capsys)
    assert code == 0 and "D2H 30 GB/s and H2D 40 GB/s" in out and "at most 42 GB/s" in out, out
    assert "the slowest of 2 ranks got with every rank copying at once" in err
    one = tmp_path / "one.json"
    one.write_text(json.dumps({"line_rate": {"d2h_gbps": 55.0, "h2d_gbps": 55.0, "bidir_gbps": 90.0}}))
    code, out, err = _run([*flags, "--bench-json", str(one)], capsys)
    assert code == 0 and "D2H 55 GB/s" in out and "holds one GPU's line rate; 2 ranks" in err
    code, out, err = _run(["--preset", "qwen2-0.5b", "--bench-json", str(one)], capsys)
    assert code == 0 and "note" not in err  # one GPU planned: its own rate


def test_usage_errors(capsys, tmp_path):
    code, _, err = _run(["--config", str(tmp_path / "missing.json")], capsys)
    assert code == 2 and "neither a preset" in err
    with pytest.raises(SystemExit):
        _run(["--preset", "gpt-9"], capsys)


def test_trainer_flags(capsys):
    code, out, _ = _run(
        [
            "--preset",
            "qwen2-0.5b",
            "--optimizer",
            "cpu_adam",
            "--logprob-span",
            "completion",
            "--completion-logits",
            "--action-vocab",
            "10",
            "--sampling",
            "own",
            "--cpu-adam-inflight-mib",
            "256",
            "--step-in-train",
            "--json",
        ],
        capsys,
    )
    assert code == 0
    cfg = json.loads(out)["plan"]["config"]
    assert (
        cfg["completion_logits"],
        cfg["action_vocab"],
        cfg["sampling"],
        cfg["cpu_adam_inflight_bytes"],
        cfg["step_in_train"],
    ) == (True, 10, "own", 256 << 20, True)
    code, _, err = _run(["--preset", "qwen2-0.5b", "--completion-logits"], capsys)
    assert code == 2 and "logprob_span" in err


def test_host_memory_is_itemised_and_checked(capsys, monkeypatch):
    base = ["--preset", "qwen2-7b", "--optimizer", "cpu_adam", "--grad-ckpt", "--gpu-mem-gib", "79.2"]
    args = [*base, "--cpu-adam-grad-accumulation", "host"]
    code, out, _ = _run([*args, "--host-mem-gib", "1000"], capsys)
    assert code == 0
    assert "CPU Adam moments (fp32 exp_avg, exp_avg_sq): 56.74 GiB" in out
    assert "CPU Adam gradient staging (trainable dtype): 14.19 GiB" in out
    # 10% kept back; every role fits the GPU at once, so the timeshare's host copies go (-28.38 GiB)
    assert "Host memory: 127.67 GiB pinned of 900.00 GiB usable." in out and "No timeshare needed" in out
    # Summed on the device (the default): no staging on the host.
    code, out, _ = _run([*base, "--host-mem-gib", "1000"], capsys)
    assert code == 0 and "gradient staging" not in out
    assert "Host memory: 113.48 GiB pinned of 900.00 GiB usable." in out
    # Without --host-mem-gib on the GPU host (a GPU of that memory here), its available memory (a
    # cgroup's limit included) is used; elsewhere the host is not checked, and the output asks for it.
    import tidal.memory  # noqa: PLC0415
    from tidal_recipes.cli import plan as plan_cli  # noqa: PLC0415

    fake = tidal.memory.HostMemory(total_bytes=64 << 30, available_bytes=60 << 30, cgroup_limit_bytes=64 << 30)
    monkeypatch.setattr(tidal.memory, "host_memory", lambda: fake)
    monkeypatch.setattr(plan_cli, "_is_the_gpu_host", lambda nbytes: nbytes == int(79.2 * 2**30))
    code, out, _ = _run(args, capsys)
    assert code == 0 and "of 54.00 GiB usable" in out and "156.04 GiB" in out
    assert "this machine's available memory, 60.00 GiB: it has a GPU of 79.2 GiB" in out
    elsewhere = [a if a != "79.2" else "80" for a in args]  # a GPU this machine does not have
    code, out, _ = _run(elsewhere, capsys)
    assert code == 0 and "54.00 GiB usable" not in out and "not checked: no host memory given" in out
    assert "this machine has no GPU of 80 GiB" in out and "--host-mem-gib" in out
    monkeypatch.undo()
    import torch  # noqa: PLC0415

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not plan_cli._is_the_gpu_host(int(79.2 * 2**30))  # no GPU here: not the GPU host
    data = json.loads(_run([*args, "--host-mem-gib", "100", "--json"], capsys)[1])
    assert data["plan"]["host"]["CPU Adam fp32 gradients"] == 4 * 7615616512
    assert data["recommendation"]["host_usable_bytes"] == 90 << 30 and data["host_memory_from"] == "--host-mem-gib"


def test_launch_names_the_zero_stage_of_ddp_and_fsdp2(capsys):
    """--launch ddp plans every GPU holding the whole state (ZeRO 0), fsdp2 full sharding (ZeRO 3):
    the same plans as the stages named directly."""
    from tidal_recipes.cli.main import main

    base = ["plan", "--preset", "qwen2.5-14b", "--gpus", "2", "--prompts", "8", "--group", "4"]
    outs = {}
    for extra in (["--launch", "ddp"], ["--zero-stage", "0"], ["--launch", "fsdp2"], ["--zero-stage", "3"]):
        assert main(base + extra) == 0
        outs[" ".join(extra)] = capsys.readouterr().out
    assert outs["--launch ddp"] == outs["--zero-stage 0"] and "ZeRO 0 x dp 2" in outs["--launch ddp"]
    assert outs["--launch fsdp2"] == outs["--zero-stage 3"] and "ZeRO 3 x dp 2" in outs["--launch fsdp2"]


def test_prefetch_fused_adamw_and_a_streamed_step(capsys):
    """--prefetch prints each phase with what TRL's prefetching schedule keeps beside it (and
    needs --gpu-mem-gib); --fused-adamw drops the step's state-sized temporary; --optim-stream-mib
    streams the offloaded states through the step (only with --optimizer adamw_offload)."""
    base = ["--preset", "qwen2.5-14b", "--prompts", "8", "--group", "8", "--prompt-len", "8", "--micro-batch", "16"]
    code, out, err = _run([*base, "--prefetch"], capsys)
    assert code == 2 and "--prefetch" in err and "--gpu-mem-gib" in err and out == ""
    code, out, _ = _run([*base, "--gpu-mem-gib", "79.2", "--prefetch", "--json"], capsys)
    assert code == 0
    data = json.loads(out)
    kept = data["prefetch"]
    assert set(kept) == {"rollout", "reference", "train", "optimizer_step"}
    assert set(kept["rollout"]["kept"]) <= {"reference"} and set(kept["reference"]["kept"]) <= {"policy"}
    code, out, _ = _run([*base, "--json"], capsys)
    foreach = json.loads(out)["plan"]["phases"]["optimizer_step"]["transient"]
    code, out, _ = _run([*base, "--fused-adamw", "--json"], capsys)
    fused = json.loads(out)["plan"]["phases"]["optimizer_step"]["transient"]
    assert "adamw step temporary" in foreach and "adamw step temporary" not in fused
    code, out, err = _run([*base, "--optim-stream-mib", "256"], capsys)
    assert code == 2 and "adamw_offload" in err
    code, out, _ = _run([*base, "--optimizer", "adamw_offload", "--optim-stream-mib", "256", "--json"], capsys)
    whole = json.loads(_run([*base, "--optimizer", "adamw_offload", "--json"], capsys)[1])
    streamed = json.loads(out)
    step = lambda d: d["plan"]["phases"]["optimizer_step"]["resident"]["optimizer states"]  # noqa: E731
    assert step(streamed) < step(whole)


def test_fused_lm_head_gathered_rollout_and_the_host_prefetch_holds(capsys):
    """--fused-lm-head plans TRL's fused LM head (needs --logprob-span completion); --gathered-rollout
    gathers an FSDP2 policy whole for generation (a note where nothing is sharded); with --prefetch
    the host memory held counts AdamW's state only where a scoring does not keep the policy."""
    base = ["--preset", "qwen2-7b", "--prompts", "8", "--group", "8", "--prompt-len", "8", "--micro-batch", "64"]
    code, out, err = _run([*base, "--fused-lm-head"], capsys)
    assert code == 2 and "logprob_span='completion'" in err and out == ""
    code, out, _ = _run([*base, "--fused-lm-head", "--logprob-span", "completion", "--json"], capsys)
    assert code == 0
    fused = json.loads(out)["plan"]["config"]
    assert fused["lm_head"] == "fused"
    code, out, _ = _run(
        [*base, "--fused-lm-head", "--logprob-span", "completion", "--gpu-mem-gib", "79.2", "--prefetch", "--json"],
        capsys,
    )
    data = json.loads(out)
    assert "policy" in data["prefetch"]["reference"]["kept"]
    assert set(data["prefetch_host"]) == {
        "reference weights (timeshare host copy)",
        "actor weights (timeshare host copy)",
    }
    assert "optimizer states (timeshare host copy)" in data["plan"]["host"]
    code, out, _ = _run(
        [*base, "--fused-lm-head", "--logprob-span", "completion", "--gpu-mem-gib", "79.2", "--prefetch"], capsys
    )
    assert "host held per GPU 28.37 GiB" in out
    code, out, err = _run([*base, "--gathered-rollout"], capsys)
    assert code == 0 and "--gathered-rollout is ignored" in err
    code, out, err = _run([*base, "--gathered-rollout", "--gpus", "2", "--prompts", "16", "--launch", "ddp"], capsys)
    assert code == 0 and "applies only where ZeRO 3" in err
    sharded = [*base, "--gpus", "2", "--prompts", "16", "--launch", "fsdp2", "--json"]
    layers = json.loads(_run(sharded, capsys)[1])["plan"]["phases"]["rollout"]["transient"]
    code, out, err = _run([*sharded, "--gathered-rollout"], capsys)
    whole = json.loads(out)["plan"]["phases"]["rollout"]["transient"]
    assert code == 0 and "ignored" not in err
    assert "zero3 whole policy gathered" in whole and "zero3 whole policy gathered" not in layers


def test_a_gathered_rollout_is_planned_as_the_trainer_gathers_whole_lending_or_per_unit(capsys):
    """The trainer gathers where the whole policy + 10% and 256 MiB is free beside the rollout's
    turn, lends the shards to the host where it is free only without them, else gathers per
    unit: 14B on 2 H100s gathers beside its shards, 32B on 4 lends them (the rollout planned
    without them, their copies out and back among the transitions), 32B on 4 GPUs of 60 GiB
    gathers per unit (planned so); on a smaller GPU the 14B gather fits but not the KV cache
    beside it (a warning)."""
    common = ["--prompt-len", "8", "--gen-len", "256", "--micro-batch", "16", "--launch", "fsdp2", "--gathered-rollout"]
    b32 = ["--preset", "qwen2.5-32b", "--gpus", "4", "--prompts", "32", "--group", "8", *common]
    code, out, err = _run([*b32, "--gpu-mem-gib", "79.2", "--json"], capsys)
    plan = json.loads(out)["plan"]
    rollout = plan["phases"]["rollout"]
    assert code == 0 and "fits only without its shards" in err and "lends them to the host" in err
    assert plan["config"]["zero3_rollout"] == "lent"
    assert "actor params" not in rollout["resident"] and "zero3 whole policy gathered" in rollout["transient"]
    shards = plan["phases"]["train"]["resident"]["actor params"]
    lent = [t for t in plan["transitions"] if t["before"] == t["after"] == "rollout"]
    assert len(lent) == 1 and lent[0]["bytes_out"] == lent[0]["bytes_in"] == shards
    code, out, err = _run([*b32, "--gpu-mem-gib", "60", "--json"], capsys)
    plan = json.loads(out)["plan"]
    assert code == 0 and "even with the policy's shards lent" in err and "gathers per unit" in err
    assert plan["config"]["zero3_rollout"] == "layers"
    assert "zero3 gathered params" in plan["phases"]["rollout"]["transient"]
    b14 = ["--preset", "qwen2.5-14b", "--gpus", "2", "--prompts", "16", "--group", "8", *common]
    code, out, err = _run([*b14, "--gpu-mem-gib", "79.2", "--prefetch"], capsys)
    assert code == 0 and "gathered-rollout" not in err and "rollout -> rollout" not in out
    code, _, err = _run([*b14, "--gpu-mem-gib", "50"], capsys)
    assert code == 0 and "warning" in err and "may run out of memory" in err and "does not fit" not in err
    code, _, err = _run(b14, capsys)  # no GPU size given: nothing to say
    assert code == 0 and "gathered-rollout" not in err


def test_a_vllm_rollout_is_planned_with_the_engine_and_what_to_type(capsys):
    """The 14B shape with TRL's vLLM engine on a whole H200: the engine's turn in the table, the
    recommendation with the engine's settings, what prefetch keeps beside the engine."""
    argv = "--preset qwen2.5-14b --prompts 8 --group 8 --prompt-len 8 --gen-len 256 --micro-batch 16 --grad-ckpt "
    argv += "--logprob-span completion --fused-lm-head --fused-adamw --rollout-engine vllm --vllm-max-model-len 320 "
    argv += "--gpu-mem-gib 139.8 --host-mem-gib 125 --prefetch"
    code, out, _ = _run(argv.split(), capsys)
    assert code == 0
    assert "Fits as configured" in out
    assert (
        'TidalConfig(vllm_kv_cache_bytes="auto", optimizer_residency="role", prefetch=True): its KV cache 3.75 GiB'
        in out
    )
    assert "Rollout: TRL's colocated vLLM engine" in out
    assert "rollout             86.44 GiB  (+ policy 27.51, + reference 27.51)" in out
    code, out, _ = _run([*argv.split(), "--json"], capsys)
    data = json.loads(out)
    assert data["plan"]["config"]["rollout_engine"] == "vllm"
    assert data["plan"]["phases"]["rollout"]["resident"]["engine weights"] == 14_770_033_664 * 2
    # TRL's engine alone takes its share of the device: the 14B shape does not fit beside it
    code, out, _ = _run([*argv.replace("--prefetch", "--no-timeshare").split()], capsys)
    assert code == 0 and "As configured it does not fit" in out and "engine kv cache 13.08" in out
    assert 'TidalConfig(vllm_kv_cache_bytes="auto", optimizer_residency="role", prefetch=True)' in out  # tidal's cache
