"""Issue 12, item 9: the CLI's bad input gets a clear error (what, why, what to do) before any
work starts, and a finished run never loses what it measured."""

from __future__ import annotations

import json

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
