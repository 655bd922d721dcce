"""Issue 12 on a GPU: a real SIGINT (or a SIGTERM that a handler turns into SystemExit) landing
at a random moment of a large offload or switch leaves every storage resident or tracked,
the roles' flags right, and the state restorable bit-exact (checked by digests in the child)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

pytestmark = pytest.mark.gpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("mode", ["offload", "switch"])
@pytest.mark.parametrize("delay_s,sig", [(0.05, "INT"), (0.15, "INT"), (0.3, "INT"), (0.2, "TERM")])
def test_a_real_signal_during_a_large_transition_loses_nothing(mode, delay_s, sig):
    if torch.cuda.get_device_properties(0).total_memory < 40 << 30:
        pytest.skip("needs a GPU with 40 GiB")
    args = [sys.executable, "-m", "tests.timeshare.interrupt_child", mode] + (["sigterm"] if sig == "TERM" else [])
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
    child = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = child.stdout.readline()
        while line and not line.startswith("READY"):
            line = child.stdout.readline()
        assert line.startswith("READY"), "the child did not start"
        time.sleep(delay_s)
        child.send_signal(signal.SIGINT if sig == "INT" else signal.SIGTERM)
        out, _ = child.communicate(timeout=240)
    finally:
        if child.poll() is None:
            child.kill()
    print(out)
    assert child.returncode == 0, out
    assert "INTERRUPTED" in out and "CONSISTENT" in out, out
