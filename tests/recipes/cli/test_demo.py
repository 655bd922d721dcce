import dataclasses
import json
import os

import pytest

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

from tidal_recipes.cli.main import main  # noqa: E402


@pytest.mark.slow
def test_demo_reward_rises_and_writes_its_files(tmp_path, capsys):
    """The README's first command on the CPU, shortened: the policy learns (mean reward of the
    last tenth of the steps well above the first tenth), the tables print, and the JSONL and
    PNG are written."""
    out = tmp_path / "demo"
    assert main(["demo", "--device", "cpu", "--steps", "100", "--baseline-steps", "1", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    for phase in ("rollout", "reference", "train"):
        assert phase in text
    assert "timeshare / all-resident" in text
    lines = [json.loads(line) for line in (out / "demo.jsonl").read_text().splitlines()]
    summary = [x for x in lines if x["type"] == "summary"][-1]
    steps = [x for x in lines if x["type"] == "step"]
    assert len(steps) == 100
    assert summary["reward_last"] > summary["reward_first"] + 0.15, summary
    assert summary["reward_first"] < 0.3  # random digits: about 1 in 10 right at the start
    # the timeshare held less role state on the device than all roles at once
    assert summary["peak_timeshare_bytes"] < summary["peak_all_resident_bytes"]
    assert {x["type"] for x in lines} >= {"sample", "phase", "mark", "step", "summary"}
    # the compute floor: the planner's matmul count over a rate measured in the run
    floor = summary["compute_floor"]
    assert floor["flops"] > 0 and floor["rate"] > 0 and floor["seconds"] == floor["flops"] / floor["rate"]
    assert "compute floor:" in text and summary["train_tokens_per_second"] > 0
    assert all(ph["host_peak_rss_bytes"] for ph in summary["phases"].values())
    png = out / "timeline.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and os.path.getsize(png) > 10_000


def test_demo_usage_errors(tmp_path, capsys):
    assert main(["demo", "--steps", "0"]) == 2
    assert main(["demo", "--device", "tpu"]) == 2
    assert (
        main(
            [
                "demo",
                "--device",
                "cpu",
                "--steps",
                "1",
                "--baseline-steps",
                "0",
                "--task",
                "add",
                "--digits",
                "3",
                "--out",
                str(tmp_path),
            ]
        )
        == 2
    )
    assert "even num_digits" in capsys.readouterr().err


def test_the_all_resident_baseline_halves_its_micro_batch_until_it_fits(tmp_path, monkeypatch):
    """Where every role resident at the run's micro-batch runs out of device memory (Qwen2-7B
    at 128 on an H100: AdamW's state beside the activations), the baseline is measured at the
    largest half that fits, and says so; where none fits, it is "OOM". Here the device's limit
    is faked: the all-resident trainer's step raises torch's out-of-memory error above a
    micro-batch of 16."""
    import torch

    from tidal_recipes.cli.demo import DemoSettings, run_demo
    from tidal_recipes.grpo import GRPOTrainer

    step = GRPOTrainer.step
    limit = [16]

    def fake_step(self):
        if self.ts is None and self.config.micro_batch > limit[0]:
            raise torch.OutOfMemoryError(f"CUDA out of memory (faked above micro-batch {limit[0]})")
        return step(self)

    monkeypatch.setattr(GRPOTrainer, "step", fake_step)
    s = DemoSettings(
        preset="nano", device="cpu", steps=2, micro_batch=64, baseline_steps=2, baseline_optimizers=("same",)
    )
    lines: list[str] = []
    summary = run_demo(dataclasses.replace(s, out_dir=str(tmp_path / "a")), log=lines.append)
    assert summary["micro_batch_all_resident_by_optimizer"] == {"adamw": 16}
    assert summary["step_all_resident_seconds_by_optimizer"]["adamw"] > 0
    text = "\n".join(lines)
    assert "at micro-batch 64 ran out of device memory" in text and "at micro-batch 32 ran out" in text
    assert "no timeshare, micro-batch 16, 2 steps" in text
    limit[0] = 0
    summary = run_demo(dataclasses.replace(s, out_dir=str(tmp_path / "b")), log=lines.append)
    assert summary["peak_all_resident_by_optimizer"] == {"adamw": "OOM"}
    assert summary["micro_batch_all_resident_by_optimizer"] == {}
