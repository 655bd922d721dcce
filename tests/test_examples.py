"""Issue 28: the example scripts run on a CPU in seconds, as a newcomer would run them (with
the ``slow`` set: each trains a model in a fresh interpreter)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent


def _run(script: str, *args: str, cwd: Path, launcher: tuple[str, ...] = ()) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    if launcher:
        env["OMP_NUM_THREADS"] = "1"  # one process per core
    proc = subprocess.run(
        [sys.executable, *launcher, str(ROOT / "examples" / script), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc.stdout


def test_trl_example(tmp_path):
    pytest.importorskip("trl")
    out = _run("trl_grpo.py", "--steps", "2", "--out", str(tmp_path / "trl"), cwd=tmp_path)
    assert "tidal timeshare on" in out and "switch" in out, out[-2000:]
    assert (tmp_path / "trl" / "tiny-model" / "config.json").is_file()


def test_trl_example_under_torchrun(tmp_path):
    """As docs/trl.md says: the same script, two processes (DDP over gloo on a CPU)."""
    pytest.importorskip("trl")
    # Each rank's stdout to a file of its own (two ranks' output into one pipe may interleave).
    logs = tmp_path / "logs"
    torchrun = ("-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2")
    torchrun += ("--log-dir", str(logs), "--redirects", "1")
    _run("trl_grpo.py", "--steps", "2", "--out", str(tmp_path / "trl"), cwd=tmp_path, launcher=torchrun)
    outs = sorted(logs.rglob("stdout.log"))
    assert len(outs) == 2, outs
    for path in outs:  # one report per rank
        out = path.read_text()
        assert "tidal timeshare on" in out and "switch" in out, out[-2000:]


def test_hf_trainer_example_learns(tmp_path):
    pytest.importorskip("transformers")
    out = _run("hf_trainer.py", "--steps", "20", "--out", str(tmp_path / "trainer"), cwd=tmp_path)
    line = next(ln for ln in out.splitlines() if ln.startswith("loss "))
    first, last = (float(x) for x in line.split()[1:4:2])
    assert last < 0.7 * first, line  # counting is learnt within 20 steps
    assert "tidal/act_offloaded_gb" in out and "tidal/optimizer_step_s" in out


@pytest.mark.parametrize("script", ["trl_grpo.py", "hf_trainer.py"])
def test_an_example_refuses_an_out_folder_it_cannot_write_before_any_work(script, tmp_path):
    if not os.path.isdir("/proc/self"):
        pytest.skip("needs Linux's /proc")
    pytest.importorskip("trl" if script.startswith("trl") else "transformers")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), "--out", "/proc/x"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"{script}: error: --out /proc/x: cannot create anything in /proc" in proc.stderr
    assert "Traceback" not in proc.stderr
