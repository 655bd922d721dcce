"""tidal's top level: a small face, loaded on first use; importing tidal (or its planner)
imports no torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

import tidal


def test_importing_tidal_and_its_planner_imports_no_torch():
    code = (
        "import sys, tidal, tidal.plan\n"
        "tidal.plan.preset('qwen2-7b')\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:5]\n"
        "print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_the_face_is_small_and_every_name_resolves():
    assert 10 <= len(tidal.__all__) <= 14 and sorted(tidal.__all__) == sorted(tidal._FACE)
    for name in tidal.__all__ + sorted(tidal._ALSO):
        assert getattr(tidal, name) is not None, name
    assert tidal.Timeshare.__module__ == "tidal.timeshare.timeshare"
    assert tidal.timeshare.Timeshare is tidal.Timeshare  # a sub-package, as after its import
    with pytest.raises(AttributeError, match="no attribute 'Timeshares'"):
        tidal.Timeshares
