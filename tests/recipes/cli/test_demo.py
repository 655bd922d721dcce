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
