"""Issue 28: every Python block in the README and in docs/*.md runs as written on a CPU.

Each block runs alone, in a fresh interpreter, in an empty folder (what it writes lands there).
A block that needs a GPU or an extra starts with a marker line, ``# needs: cuda`` or
``# needs: trl`` (names separated by commas: ``cuda``, or modules that must import), is
skipped without it, and runs with ``-m slow``; the blocks that need only torch and tidal run
with the default command. The README's own shape is checked too: under 15,000 characters, a
quickstart of at most 12 lines, every docs page linked.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
_NEEDS = re.compile(r"^# needs: (.+)$")


def _blocks():
    """Every block, as a pytest param; those with a ``# needs:`` line (an extra or a GPU: a
    trainer run, a model built by transformers) run with the ``slow`` set, the others (torch
    and tidal only) with the default test command."""
    for page in PAGES:
        text = page.read_text()
        for m in _FENCE.finditer(text):
            line = text.count("\n", 0, m.start()) + 2  # the block's first line, 1-based
            marks = [pytest.mark.slow] if _NEEDS.match(m.group(1).split("\n", 1)[0]) else []
            yield pytest.param(m.group(1), id=f"{page.relative_to(ROOT)}:{line}", marks=marks)


def _missing(code: str) -> list[str]:
    first = code.splitlines()[0] if code.strip() else ""
    m = _NEEDS.match(first)
    if not m:
        return []
    missing = []
    for need in (n.strip() for n in m.group(1).split(",")):
        if need in ("cuda", "gpu"):
            if not torch.cuda.is_available():
                missing.append("a CUDA device")
        elif importlib.util.find_spec(need) is None:
            missing.append(f"the {need} package")
    return missing


@pytest.mark.parametrize("code", list(_blocks()))
def test_python_block_runs_as_written(code, tmp_path):
    missing = _missing(code)
    if missing:
        pytest.skip(f"the block says it needs {', '.join(missing)}")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env["PYTHONWARNINGS"] = "ignore::FutureWarning"  # transformers' deprecations are not the block's
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, f"the block failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"


def test_every_block_is_found_and_markers_name_known_needs():
    blocks = [p.values[0] for p in _blocks()]
    assert len(blocks) >= 8, "the README and the docs pages hold runnable examples"
    for code in blocks:
        m = _NEEDS.match(code.splitlines()[0])
        if m:
            for need in (n.strip() for n in m.group(1).split(",")):
                assert need in ("cuda", "gpu") or re.fullmatch(r"[a-z_][a-z0-9_]*", need), need
        assert "\n...\n" not in code and not code.rstrip().endswith("..."), "no elided code in a block"


def test_readme_is_short_and_its_first_screen_has_what_a_newcomer_needs():
    text = (ROOT / "README.md").read_text()
    assert len(text) < 15_000
    blocks = _FENCE.findall(text)
    assert len(blocks) == 1, "one Python block: the quickstart"
    assert len(blocks[0].strip("\n").splitlines()) <= 12
    assert not _NEEDS.match(blocks[0].splitlines()[0]), "the quickstart runs on a CPU without extras"
    for heading in ("## Measured", "## Two commands", "## Quickstart"):
        assert heading in text, heading
    # The two commands first, then a few figures a newcomer can read, then the quickstart.
    assert text.index("## Two commands") < text.index("## Measured") < text.index("## Quickstart")
    measured = text[text.index("## Measured") : text.index("## Quickstart")]
    figures = re.split(r"^- ", measured.split("\n\n![")[0], flags=re.M)[1:]
    assert 3 <= len(figures) <= 7, "three to seven figures, the rest linked"
    for figure in figures:  # a plain sentence or two each: the commits and the method in docs/measurements.md
        assert len(figure.strip().splitlines()) <= 3, figure
        assert not re.search(r"\b[0-9a-f]{7}\b", figure), f"a commit in the README's figures: {figure}"
    assert "(docs/measurements.md)" in measured
    assert "python -m pytest -q -m slow" in text and "python -m pytest -q\n" in text
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert f"(docs/{page.name})" in text, f"docs/{page.name} is not linked from the README"
