"""A pytest plugin that lets one test run span several device calls, and its tally.

A lent GPU machine gives at most 10 minutes a command, less than the whole GPU suite takes.
With this plugin a run interrupted at its deadline (``timeout -s INT``) is continued by the
same command in the next call: every test that reached an outcome is appended to a ledger
file as it ends, and a later run with the same ledger deselects those tests.

    TIDAL_TESTS_LEDGER=/tmp/ledger python3 -m pytest -p pytest_ledger -m gpu tests   # benchmarks/ on sys.path
    python3 benchmarks/pytest_ledger.py /tmp/ledger    # the tally over every run of that ledger
                                                       # (exit status 1 if any test failed)

Ledger lines: ``nodeid<TAB>outcome<TAB>detail``; outcome is one of passed, failed, error,
skipped, xfailed, xpassed (detail: the skip or xfail reason). A test that reached no outcome
(the run was interrupted inside it) is not in the ledger and runs again. A failed test is not
run again either: the tally lists it. Without ``TIDAL_TESTS_LEDGER`` the plugin does nothing.
"""

from __future__ import annotations

import collections
import os
import sys

ENV = "TIDAL_TESTS_LEDGER"


def _ledger() -> str | None:
    return os.environ.get(ENV) or None


def read(path: str) -> dict[str, tuple[str, str]]:
    """nodeid -> (outcome, detail); a later line for the same test wins, except that a
    teardown error does not hide a failure."""
    out: dict[str, tuple[str, str]] = {}
    if not os.path.exists(path):
        return out
    with open(path) as f:
        for line in f:
            parts = line.rstrip("\n").split("\t")
            if len(parts) < 2:
                continue  # a line cut short by a kill
            nodeid, outcome, detail = parts[0], parts[1], parts[2] if len(parts) > 2 else ""
            if out.get(nodeid, ("",))[0] == "failed" and outcome == "error":
                continue
            out[nodeid] = (outcome, detail)
    return out


def pytest_collection_modifyitems(config, items):
    path = _ledger()
    if path is None:
        return
    done = read(path)
    if not done:
        return
    again = [i for i in items if i.nodeid in done]
    if again:
        config.hook.pytest_deselected(items=again)
        items[:] = [i for i in items if i.nodeid not in done]


def _outcome(report) -> tuple[str, str] | None:
    xfail = getattr(report, "wasxfail", None)
    if report.when == "call":
        if xfail is not None:
            return ("xfailed", xfail) if report.skipped else ("xpassed", xfail)
        if report.skipped:
            return "skipped", _reason(report)
        return ("passed", "") if report.passed else ("failed", "")
    if report.skipped:  # skipped in setup (a skip mark, a skipif, a fixture's skip)
        return ("xfailed", xfail) if xfail is not None else ("skipped", _reason(report))
    if report.failed:
        return "error", report.when
    return None


def _reason(report) -> str:
    lr = report.longrepr
    if isinstance(lr, tuple) and len(lr) == 3:
        return str(lr[2]).removeprefix("Skipped: ")
    return str(lr)


def pytest_runtest_logreport(report):
    path = _ledger()
    if path is None:
        return
    got = _outcome(report)
    if got is None:
        return
    outcome, detail = got
    with open(path, "a") as f:
        f.write(f"{report.nodeid}\t{outcome}\t{' '.join(detail.split())}\n")


def tally(path: str) -> list[str]:
    """Counts by outcome over every run of the ledger, each skip with its reason, and the
    tests that failed."""
    done = read(path)
    counts = collections.Counter(o for o, _ in done.values())
    lines = [
        f"ledger {path}: {len(done)} tests reached an outcome: "
        + (", ".join(f"{n} {o}" for o, n in counts.most_common()) or "none")
    ]
    for nodeid, (outcome, detail) in sorted(done.items()):
        if outcome not in ("passed", "xpassed"):
            lines.append(f"  {outcome.upper()} {nodeid}{' - ' + detail if detail else ''}")
    return lines


def main(argv: list[str]) -> int:
    """Print the tally; exit status 1 if a test failed or errored (the pass then failed too)."""
    if len(argv) != 1:
        print("usage: python benchmarks/pytest_ledger.py LEDGER", file=sys.stderr)
        return 2
    print("\n".join(tally(argv[0])))
    return int(any(o in ("failed", "error") for o, _ in read(argv[0]).values()))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
