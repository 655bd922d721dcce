"""trl_bench.probes: the trainer's per-phase log figures (``tidal/peak_gib/<phase>``,
``tidal/fragments_gib/<phase>``) read step by step, a step's moves in order, a lockstep
process's patience."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "benchmarks"))

probes = pytest.importorskip("trl_bench.probes")

GIB = 2**30


def test_each_measured_step_s_figures_in_bytes_by_phase():
    history = [
        {"step": 1, "loss": 0.1, "tidal/peak_gib/generate": 9.0, "tidal/fragments_gib/generate": 1.0},
        {"step": 2, "loss": 0.2, "tidal/peak_gib/generate": 10.5, "tidal/peak_gib/loss": 12.0},
        {"step": 2, "train_runtime": 3.0, "tidal/peak_gib/loss": 99.0},  # the run's summary line: no loss
        {"step": 3, "loss": 0.3, "tidal/peak_gib/generate": 10.0, "tidal/fragments_gib/generate": 5.5},
    ]
    peaks = probes.logged_per_step(history, "tidal/peak_gib/")
    assert peaks == [{"generate": 10.5 * GIB, "loss": 12.0 * GIB}, {"generate": 10.0 * GIB}]
    # A step without the figure is left out, not kept as an empty reading.
    assert probes.logged_per_step(history, "tidal/fragments_gib/") == [{"generate": 5.5 * GIB}]
    assert probes.logged_per_step(history, "tidal/other/") == []


def test_a_steps_moves_are_listed_in_order_with_a_streamed_steps_chunks_summed():
    import types

    def rec(kind, out, into, nin, nout, ahead=0, stall=0.0):
        move = types.SimpleNamespace(bytes_in=nin, bytes_out=nout, bytes_prefetched=ahead)
        return types.SimpleNamespace(
            kind=kind, roles_out=out, role_in=into, stall_seconds=stall, **vars(move), move=move
        )

    records = [
        rec("prefetch", ("policy",), "reference", 4e9, 7e9),
        rec("switch", (), "reference", 3e9, 0, ahead=4e9, stall=0.05),
        rec("optim-in", (), "policy", 2e9, 0),
        rec("optim-stream", ("policy",), "policy", 1e9, 1e9, stall=0.01),
        rec("optim-stream", ("policy",), "policy", 1e9, 1e9, stall=0.02),
        rec("optim-stream", ("policy",), None, 0, 1e9),
        rec("prefetch", (), "reference", 1e9, 0),
    ]
    assert probes.step_moves(records) == [
        ["prefetch", ["policy"], "reference", 4.0, 7.0, 0.0, 0.0],
        ["switch", [], "reference", 3.0, 0.0, 4.0, 0.05],
        ["optim-in", [], "policy", 2.0, 0.0, 0.0, 0.0],
        ["optim-stream", ["policy"], "policy", 2.0, 3.0, 0.0, 0.03],
        ["prefetch", [], "reference", 1.0, 0.0, 0.0, 0.0],
    ]


def test_with_turns_the_wait_lasts_two_partner_steps_wherever_another_pair_was_begun():
    """--turns: a pair of steps begins where twice a step (+15%) and 20 s fit before the
    deadline; a process then waits up to two of its partner's steps for its turn, and the
    first of a pair the partner's step at the deadline check: the wait must not run out before
    (it did, with the patience of processes starting their steps together)."""
    step = 11.0
    for left in (2 * 1.15 * step + 20.0 + x for x in (0.0, 1.0, 5.0, 30.0, 200.0)):
        now = 1000.0
        deadline = now + left
        assert not now + 1.15 * 2 * step + 20.0 > deadline  # the bench's check: not late
        assert probes.lockstep_patience(300.0, deadline, now, step, turns=True) >= 2 * step
    # Starting together, the partner is at most a moment away: the patience keeps a step's room.
    assert probes.lockstep_patience(300.0, 1100.0, 1000.0, step, turns=False) == pytest.approx(100 - 1.15 * step - 30)
    assert probes.lockstep_patience(300.0, 0.0, 1000.0, step, turns=True) == 300.0  # no deadline
    assert probes.lockstep_patience(300.0, 1005.0, 1000.0, step, turns=True) == 1.0  # at least 1 s
