"""The GPU pass's test ledger (benchmarks/pytest_ledger.py): its tally and its exit status,
which is how `benchmarks/gpu.sh tests` learns that a test failed in a shard it ran aside."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

import pytest_ledger  # noqa: E402


def _ledger(tmp_path, lines: list[str]) -> str:
    path = tmp_path / "ledger"
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def test_a_failed_test_makes_the_tally_exit_1_and_is_listed(tmp_path, capsys):
    path = _ledger(tmp_path, ["t.py::a\tpassed\t", "t.py::b\tfailed\t", "t.py::c\tskipped\tneeds 2 GPUs"])
    assert pytest_ledger.main([path]) == 1
    out = capsys.readouterr().out
    assert "3 tests reached an outcome" in out
    assert "FAILED t.py::b" in out and "SKIPPED t.py::c - needs 2 GPUs" in out


def test_an_error_counts_as_a_failure_and_a_clean_ledger_exits_0(tmp_path):
    assert pytest_ledger.main([_ledger(tmp_path, ["t.py::a\tpassed\t", "t.py::b\terror\tsetup"])]) == 1
    assert pytest_ledger.main([_ledger(tmp_path, ["t.py::a\tpassed\t", "t.py::b\tskipped\tno GPU"])]) == 0


def test_a_later_pass_of_a_failed_test_clears_it(tmp_path):
    # The ledger keeps the latest outcome: a failure run again alone (a new line) and passed.
    assert pytest_ledger.main([_ledger(tmp_path, ["t.py::a\tfailed\t", "t.py::a\tpassed\t"])]) == 0


def test_usage_error_exits_2(capsys):
    assert pytest_ledger.main([]) == 2
    assert "usage" in capsys.readouterr().err
