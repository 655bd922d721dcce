"""Issue 12, item 9: the CLI's bad input gets a clear error (what, why, what to do) before any
work starts, and a finished run never loses what it measured."""

from __future__ import annotations

import json
import os

import pytest

import tidal
import tidal_recipes.cli.bench
import tidal_recipes.cli.demo
import tidal.plan
from tidal_recipes.cli.main import EXIT_OUTPUT, EXIT_USAGE, main


def _no_work(*args, **kwargs):
    raise AssertionError("the work started although an argument was bad")


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"tidal {tidal.__version__}"


@pytest.mark.parametrize("flag", ["--results", "--json"])
def test_bench_output_paths_are_checked_before_the_run(tmp_path, capsys, monkeypatch, flag):
    monkeypatch.setattr(tidal_recipes.cli.bench, "run_bench", _no_work)
    for bad, why in [
        (tmp_path, "is a folder"),
        (tmp_path / "missing" / "x.md", "does not exist"),
        (tmp_path / "file.txt" / "x.md", "does not exist"),
    ]:
        (tmp_path / "file.txt").write_text("a file, not a folder")
        assert main(["bench", "--device", "cpu", "--preset", "nano", flag, str(bad)]) == EXIT_USAGE
        err = capsys.readouterr().err
        assert f"tidal bench: error: {flag} {bad}" in err and why in err and "Nothing was run" in err, err


def test_demo_out_folder_is_checked_before_the_run(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(tidal_recipes.cli.demo, "run_demo", _no_work)
    a_file = tmp_path / "taken"
    a_file.write_text("x")
    for bad, why in [(a_file, "is not a folder"), (a_file / "sub", "is a file")]:
        assert main(["demo", "--device", "cpu", "--out", str(bad)]) == EXIT_USAGE
        err = capsys.readouterr().err
        assert f"tidal demo: error: --out {bad}" in err and why in err, err


def test_plan_json_path_is_checked_before_the_plan(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(tidal.plan, "build_plan", _no_work)
    assert main(["plan", "--preset", "qwen2-0.5b", "--json", str(tmp_path / "no" / "plan.json")]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "--json" in err and "does not exist" in err and "Nothing was run" in err


@pytest.mark.parametrize(
    "content,expect",
    [
        (
            {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 100},
            "has no 'num_attention_heads', 'intermediate_size': the planner needs",
        ),
        ('{"model_type": "qwen2", ', "is not valid JSON (Expecting property name enclosed in double quotes at line 1"),
        ([1, 2], "expected a JSON object"),
        ({"model_type": "gpt2", "n_layer": 2}, "model_type 'gpt2' is not supported"),
    ],
)
def test_plan_config_errors_name_the_file_and_what_is_wrong(tmp_path, capsys, content, expect):
    path = tmp_path / "config.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    assert main(["plan", "--config", str(path)]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("tidal plan: error: ") and expect in err, err
    assert str(path) in err, "the message names the file"


def test_plan_accepts_a_model_folder_and_explains_one_without_config(tmp_path, capsys):
    folder = tmp_path / "Qwen2-tiny"
    folder.mkdir()
    assert main(["plan", "--config", str(folder)]) == EXIT_USAGE
    assert "is a folder without a config.json" in capsys.readouterr().err
    cfg = {
        "model_type": "qwen2",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 100,
    }
    (folder / "config.json").write_text(json.dumps(cfg))
    assert main(["plan", "--config", str(folder), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["plan"]["config"]["shape"]["layers"] == 2


def test_a_demo_output_that_cannot_be_written_loses_nothing_else(tmp_path, capsys):
    """The run finishes; the table is printed; the PNG is written though demo.jsonl cannot
    be; the exit code says an output is missing."""
    pytest.importorskip("transformers")
    pytest.importorskip("matplotlib")
    out = tmp_path / "demo"
    (out / "demo.jsonl").mkdir(parents=True)  # a folder where the file should go
    code = main(
        ["demo", "--device", "cpu", "--preset", "nano", "--steps", "1", "--baseline-steps", "0", "--out", str(out)]
    )
    text = capsys.readouterr().out
    assert code == EXIT_OUTPUT
    assert "rollout" in text and "train" in text, "the table was printed"
    assert f"could not write {out / 'demo.jsonl'}" in text
    assert (out / "timeline.png").is_file()


def test_a_vllm_rollout_is_refused_before_any_work_without_vllm_or_with_a_baseline(tmp_path, capsys, monkeypatch):
    import importlib.util
    import sys

    monkeypatch.setattr(tidal_recipes.cli.demo, "build_policy", _no_work)
    out = tmp_path / "demo"
    if importlib.util.find_spec("vllm") is None:
        assert main(["demo", "--device", "cpu", "--rollout-engine", "vllm", "--out", str(out)]) == EXIT_USAGE
        assert "--rollout-engine vllm needs vLLM installed" in capsys.readouterr().err
    from tests.integrations import fake_vllm

    fake_vllm.install_module(monkeypatch)  # vLLM "installed": the settings tidal cannot run are refused
    assert "vllm" in sys.modules
    code = main(["demo", "--device", "cpu", "--rollout-engine", "vllm", "--baseline-steps", "1", "--out", str(out)])
    assert code == EXIT_USAGE
    assert "vLLM takes one engine a process: --baseline-steps 0" in capsys.readouterr().err
    assert not out.exists()


def test_rollout_graph_refused_before_any_work(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(tidal_recipes.cli.demo, "build_policy", _no_work)
    out = tmp_path / "demo"
    assert main(["demo", "--device", "cpu", "--rollout-graph", "--out", str(out)]) == EXIT_USAGE
    assert "--rollout-graph captures the decode step in a CUDA graph" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--roles local"):
        tidal_recipes.cli.demo.DemoSettings(
            preset="nano", device="cuda", steps=1, rollout_graph=True, roles="processes"
        )


def test_prefetch_with_remote_roles_refused_before_any_work(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(tidal_recipes.cli.demo, "build_policy", _no_work)
    out = tmp_path / "demo"
    assert main(["demo", "--device", "cpu", "--prefetch", "--roles", "processes", "--out", str(out)]) == EXIT_USAGE
    assert "--prefetch brings the next role in within this process" in capsys.readouterr().err


def test_async_transitions_with_remote_roles_refused_before_any_work(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(tidal_recipes.cli.demo, "build_policy", _no_work)
    out = tmp_path / "demo"
    assert (
        main(["demo", "--device", "cpu", "--async-transitions", "--roles", "processes", "--out", str(out)])
        == EXIT_USAGE
    )
    assert "--async-transitions keeps freed memory in this process" in capsys.readouterr().err


@pytest.mark.slow
def test_demo_says_which_options_its_optimizer_ignores(tmp_path, capsys):
    pytest.importorskip("transformers")
    out = str(tmp_path / "demo")
    args = ["demo", "--device", "cpu", "--steps", "1", "--baseline-steps", "0", "--out", out]
    assert main([*args, "--optimizer", "adamw", "--grad-accumulation", "host", "--optim-state-dtype", "bf16"]) == 0
    err = capsys.readouterr().err
    assert "--grad-accumulation host is ignored with optimizer adamw" in err
    assert "--optim-state-dtype bf16 is ignored with optimizer adamw" in err
    assert main([*args, "--optimizer", "cpu_adam", "--optimizer-residency", "role"]) == 0
    assert "--optimizer-residency role is ignored with optimizer cpu_adam" in capsys.readouterr().err
    assert main([*args, "--optimizer", "cpu_adam", "--grad-accumulation", "host"]) == 0
    assert "ignored" not in capsys.readouterr().err


# ---- issue 28: every bad input gets one line, exit code 2, before any work or folder -------
def _one_line_error(capsys, command: str) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"tidal {command}: error: "), err
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize(
    "argv,expect",
    [
        (["--gpu-mem-gib", "inf"], "argument --gpu-mem-gib: expected a finite number, got inf"),
        (["--gpu-mem-gib", "80", "--host-mem-gib", "inf"], "argument --host-mem-gib: expected a finite number"),
        (["--gpu-mem-gib", "1e308"], "argument --gpu-mem-gib: expected a number <= 1,048,576 (1 MiB to 1 PiB"),
        (["--gpu-mem-gib", "nan"], "argument --gpu-mem-gib: expected a finite number, got nan"),
        (["--d2h-gbps", "0"], "argument --d2h-gbps: expected a number > 0"),
        (["--bidir-gbps", "inf"], "argument --bidir-gbps: expected a finite number"),
        (["--context-mib", "99999999999999"], "argument --context-mib: expected an integer <= 65,536 (64 GiB"),
        (["--context-mib", "100000000"], "argument --context-mib: expected an integer <= 65,536"),
        (["--gpu-mem-gib", "1e-300"], "argument --gpu-mem-gib: expected a number >= 0.001 (1 MiB to 1 PiB"),
        (["--gpu-mem-gib", "1e-9"], "argument --gpu-mem-gib: expected a number >= 0.001"),
        (["--host-mem-gib", "1e-300"], "argument --host-mem-gib: expected a number >= 0.001"),
        (["--d2h-gbps", "1e-300"], "argument --d2h-gbps: expected a number >= 0.001 (1 MB/s to 1 PB/s"),
        (["--bogus"], "unrecognized arguments: --bogus (`tidal plan --help` lists the options)"),
        (["--launch", "ddp", "--zero-stage", "3"], "--launch ddp is ZeRO stage 0, but --zero-stage 3 was given too"),
        (["--gpus", "33"], "--gpus 33 is more than the 32 sequences of a step (--prompts 8 x --group 4)"),
        (["--prompts", "99999999999999999999"], "PiB on one GPU (rollout), more than any machine has"),
        (["--gen-len", "99999999999999999999"], "more than any machine has; lower --prompts, --group"),
        (["--lora-rank", "99999999999"], "LoRA rank 99999999999 is more than 256, the narrowest side"),
        (["--vllm-kv-cache-gib", "4"], "--vllm-kv-cache-gib size the vLLM engine: add --rollout-engine vllm"),
        (["--rollout-engine", "vllm", "--no-timeshare"], "TRL's engine alone, whose KV cache is"),
        (["--rollout-engine", "vllm", "--gpus", "2"], "rollout_engine='vllm' is planned on one GPU"),
        (["--rollout-engine", "vllm", "--vllm-max-model-len", "100"], "vllm_max_model_len=100 is below a sequence"),
        (["--rollout-engine", "vllm", "--vllm-gpu-memory-utilization", "1.5"], "expected a number <= 1"),
    ],
)
def test_plan_numbers_that_make_no_sense_are_refused(capsys, monkeypatch, argv, expect):
    monkeypatch.setattr(tidal.plan, "recommend", _no_work)
    assert main(["plan", *argv]) == EXIT_USAGE
    assert expect in _one_line_error(capsys, "plan")


def test_plan_clamps_a_micro_batch_larger_than_the_step(capsys):
    assert main(["plan", "--micro-batch", "99999999999999999999"]) == 0
    out, err = capsys.readouterr()
    assert "note: --micro-batch 99,999,999,999,999,999,999 is more than the 32 sequences" in err
    assert "32 sequences of 128+256 tokens, 1 micro-batch(es) of 32" in out
    lines = out.splitlines()
    rule = next(ln for ln in lines if ln.startswith("-----"))
    rows = [ln for ln in lines if ln.startswith(("resident state", "transient", "peak allocated"))]
    assert len(rows) == 4 and all(len(ln) == len(rule) for ln in rows), "the table's columns stay apart"


_QWEN = {
    "model_type": "qwen2",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 100,
}


@pytest.mark.parametrize(
    "change,expect",
    [
        ({"num_attention_heads": 0}, "num_attention_heads must be a whole number between 1 and"),
        ({"hidden_size": "1e999"}, "hidden_size must be a whole number between 1 and 2,147,483,648, got inf"),
        ({"num_hidden_layers": 2.5}, "num_hidden_layers must be a whole number"),
        ({"vocab_size": True}, "vocab_size must be a whole number"),
        ({"num_attention_heads": 128}, "leaves heads of width 0"),
    ],
)
def test_plan_config_with_sizes_that_make_no_sense(tmp_path, capsys, change, expect):
    text = json.dumps({**_QWEN, **{k: v for k, v in change.items() if v != "1e999"}})
    if "1e999" in change.values():  # JSON's way of writing infinity for Python's reader
        key = next(k for k, v in change.items() if v == "1e999")
        text = text.replace(f'"{key}": {_QWEN[key]}', f'"{key}": 1e999')
    path = tmp_path / "config.json"
    path.write_text(text)
    assert main(["plan", "--config", str(path)]) == EXIT_USAGE
    line = _one_line_error(capsys, "plan")
    assert expect in line and str(path) in line


@pytest.mark.parametrize(
    "content,expect",
    [
        ([1, 2], "has no line_rate with d2h_gbps, h2d_gbps and bidir_gbps"),
        ({"line_rate": {"d2h_gbps": 0, "h2d_gbps": 10, "bidir_gbps": 20}}, "d2h_gbps must be a finite number"),
        ({"line_rate": {"d2h_gbps": 10, "h2d_gbps": "x", "bidir_gbps": 20}}, "unusable line rate"),
        ("{not json", "is not a JSON file"),
        ({"ranks": [{"shared": {"d2h": 30.0}}]}, "has no line_rate with d2h_gbps, h2d_gbps and bidir_gbps"),
    ],
)
def test_plan_bench_json_that_makes_no_sense(tmp_path, capsys, monkeypatch, content, expect):
    monkeypatch.setattr(tidal.plan, "build_plan", _no_work)
    path = tmp_path / "bench.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    assert main(["plan", "--bench-json", str(path)]) == EXIT_USAGE
    assert expect in _one_line_error(capsys, "plan")


def test_plan_bench_json_that_is_not_there_is_one_line_naming_it(tmp_path, capsys, monkeypatch):
    """It had printed a bare '[Errno 2] No such file or directory'."""
    monkeypatch.setattr(tidal.plan, "build_plan", _no_work)
    missing = tmp_path / "nowhere.json"
    assert main(["plan", "--bench-json", str(missing)]) == EXIT_USAGE
    err = _one_line_error(capsys, "plan")
    assert f"{missing} cannot be read (No such file or directory); pass the file `tidal bench --json PATH` wrote" in err


_DEMO_BAD = [
    (["--lr", "-1"], "argument --lr: expected a number > 0, got -1"),
    (["--lr", "inf"], "argument --lr: expected a finite number"),
    (["--kl-coef", "-1"], "argument --kl-coef: expected a number >= 0, got -1"),
    (["--group", "1"], "--group 1: GRPO scores each sample against the others of its group"),
    (["--device", "cuda:99999999999999999999"], "torch numbers devices 0-127"),
    (["--device", "cuda:128"], "torch numbers devices 0-127"),
    (["--digits", "99999999999"], "PiB of memory (16 prompts x 8 samples of 200000000000 tokens"),
    (["--prompts", "99999999999"], "PiB of memory (99999999999 prompts x 8 samples"),
    (["--lora-rank", "99999999999"], "--lora-rank 99999999999 is more than 64, the narrowest side"),
    (["--seed", "99999999999999999999"], "argument --seed: expected an integer <= 9,223,372,036,854,775,807"),
    (["--headroom-mib", "99999999999999"], "argument --headroom-mib: expected an integer <= 1,073,741,824"),
    (["--task", "add", "--digits", "3"], "task 'add' needs an even num_digits"),
    (["--roles", "processes", "--lora-rank", "4"], "LoRA (--lora-rank) runs with --roles local"),
    (["--steps", "99999999999999999999"], "argument --steps: expected an integer <= 1,000,000 (a million steps)"),
    (["--bogus"], "unrecognized arguments: --bogus (`tidal demo --help` lists the options)"),
]


@pytest.mark.parametrize("argv,expect", _DEMO_BAD, ids=[" ".join(a) for a, _ in _DEMO_BAD])
def test_demo_numbers_that_make_no_sense_are_refused_before_any_folder(tmp_path, capsys, monkeypatch, argv, expect):
    monkeypatch.setattr(tidal_recipes.cli.demo, "build_policy", _no_work)
    out = tmp_path / "demo"
    device = [] if any(a.startswith("--device") for a in argv) else ["--device", "cpu"]
    assert main(["demo", *device, *argv, "--out", str(out)]) == EXIT_USAGE
    assert expect in _one_line_error(capsys, "demo")
    assert not out.exists(), "no folder is made for a run that is refused"


def test_demo_out_where_nothing_can_be_created(capsys, monkeypatch):
    """/proc takes no new names, whatever the permission bits say (root passes os.access)."""
    if not os.path.isdir("/proc/self"):
        pytest.skip("needs Linux's /proc")
    monkeypatch.setattr(tidal_recipes.cli.demo, "build_policy", _no_work)
    assert main(["demo", "--device", "cpu", "--steps", "1", "--out", "/proc/x"]) == EXIT_USAGE
    assert "--out /proc/x: cannot create anything in /proc" in _one_line_error(capsys, "demo")


@pytest.mark.parametrize(
    "out,expect",
    [
        ("/nonexistent-tidal/deep/dir", "the folder /nonexistent-tidal/deep does not exist; create it first"),
        ("", "--out : an empty path; give a folder"),
    ],
)
def test_demo_out_in_a_missing_folder_or_empty_is_refused_before_any_folder(capsys, monkeypatch, out, expect):
    """A typo in --out never builds a tree of folders at the root, and an empty --out is not
    the current folder: the folder named is made, not its parents."""
    monkeypatch.setattr(tidal_recipes.cli.demo, "build_policy", _no_work)
    assert main(["demo", "--device", "cpu", "--steps", "1", "--out", out]) == EXIT_USAGE
    assert expect in _one_line_error(capsys, "demo")
    assert not os.path.exists("/nonexistent-tidal")


def test_demo_clamps_a_micro_batch_larger_than_the_step(capsys, monkeypatch):
    seen = {}

    def record(settings, **kwargs):
        seen["settings"] = settings
        return {}

    monkeypatch.setattr(tidal_recipes.cli.demo, "run_demo", record)
    assert main(["demo", "--device", "cpu", "--prompts", "4", "--group", "2", "--micro-batch", "1000"]) == 0
    assert "note: --micro-batch 1,000 is more than the 8 sequences of a step (4 prompts x 2); using 8" in (
        capsys.readouterr().err
    )
    assert seen["settings"].micro_batch == 8


@pytest.mark.parametrize(
    "argv,expect",
    [
        (["--device", "cuda:99999999999999999999"], "torch numbers devices 0-127"),
        (["--line-mib", "99999999999"], "argument --line-mib: expected an integer <= 1,073,741,824"),
        (["--line-mib", "0"], "argument --line-mib: expected an integer >= 1"),
        (["--warm-iters", "1000000000"], "argument --warm-iters: expected an integer <= 10,000"),
        (["--device", "cpu", "--line-mib", "4096"], "the line-rate test holds 16.00 GiB of host buffers"),
    ],
)
def test_bench_sizes_that_make_no_sense_are_refused(capsys, monkeypatch, argv, expect):
    import tidal.memory  # noqa: PLC0415

    fake = tidal.memory.HostMemory(total_bytes=2 << 30, available_bytes=1 << 30, cgroup_limit_bytes=None)
    monkeypatch.setattr(tidal.memory, "host_memory", lambda: fake)
    monkeypatch.setattr(tidal_recipes.cli.bench, "run_bench", _no_work)
    assert main(["bench", *argv]) == EXIT_USAGE
    assert expect in _one_line_error(capsys, "bench")
