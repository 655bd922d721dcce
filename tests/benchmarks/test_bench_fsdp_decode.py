"""benchmarks/bench_fsdp_decode.py: FSDP2's gathered generation against the same model whole,
in one process a rank, on a CPU with gloo."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "bench_fsdp_decode.py")


def test_it_refuses_to_run_outside_torchrun():
    pytest.importorskip("transformers")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    proc = subprocess.run(
        [sys.executable, BENCH, "--preset", "tiny"], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 2 and "run it under torchrun" in proc.stderr


@pytest.mark.slow
def test_two_ranks_time_every_state_beside_the_plain_model_with_the_same_tokens(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "decode.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", BENCH]
    cmd += ["--preset", "tiny", "--batch", "2", "--new-tokens", "6", "--reps", "2", "--per-unit", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["world"] == 2 and [r["rank"] for r in data["ranks"]] == [0, 1]
    for r in data["ranks"]:
        states = r["states"]
        assert set(states) == {"plain", "gathered", "gathered+hooks", "per-unit"}
        # Each state's reps were each beside a plain rep (the bench raises if the tokens differ).
        assert len(states["plain"]["reps"]) == 2 * 3
        for s in ("gathered", "gathered+hooks", "per-unit"):
            assert len(states[s]["reps"]) == 2 and len(states[s]["gap_ratios"]) == 2
            assert all(x > 0 for x in states[s]["wall_ratios"])
    assert "gathered" in proc.stdout and "target: gathered generation <= 1.15x" in proc.stdout
