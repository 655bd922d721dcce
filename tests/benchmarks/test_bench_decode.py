"""bench_decode.py on the CPU: every state runs its reps with the same tokens decoded."""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

pytest.importorskip("transformers")
bench_decode = pytest.importorskip("bench_decode")


def test_each_state_decodes_every_token_and_is_set_against_the_untouched_policy(tmp_path, capsys):
    out = tmp_path / "decode.json"
    args = ["--preset", "tiny", "--batch", "2", "--new-tokens", "4", "--reps", "2", "--json", str(out)]
    assert bench_decode.main(args) == 0
    got = json.loads(out.read_text())
    assert list(got["states"]) == ["untouched", "registered", "reloaded", "reloaded+prefetch", "closed"]
    for state, s in got["states"].items():
        assert len(s["rep_median_gaps_s"]) == 2 and all(g > 0 for g in s["rep_median_gaps_s"]), state
    assert got["states"]["untouched"]["gap_x_untouched"] == 1.0
    assert "x untouched" in capsys.readouterr().out


def test_bad_counts_are_refused():
    with pytest.raises(SystemExit):
        bench_decode.main(["--preset", "tiny", "--reps", "0"])
