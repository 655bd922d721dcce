"""Transition records (tidal.timeshare.telemetry): what they say a transition cost, and that
reading them survives an interrupt at any point."""

import dataclasses

import pytest
import torch
from torch import nn

import tidal.timeshare.transition as transition
from tests.transfer.fakes import FakeAccelOps
from tidal import Timeshare, TimeshareConfig
from tidal.state.result import MoveResult
from tidal.timeshare.telemetry import TransitionRecord
from tidal.transfer import TransferContext


def _move(**kw) -> MoveResult:
    base = dict(bytes_out=8 << 20, bytes_in=0, seconds=0.1, release_seconds=0.0, driver_free_before=0)
    base.update(kw)
    return MoveResult(driver_free_after=kw.pop("driver_free_after", 0), segments=1, **base)


def test_exposed_is_the_device_gap_at_most_the_host_time_and_the_waits():
    rec = TransitionRecord.from_move(0, "switch", (), None, _move(), 0, measure_release=False, host_seconds=0.2)
    assert rec.exposed_seconds == 0.2  # no gap read (CPU): the host's time
    assert dataclasses.replace(rec, gap_seconds=0.05).exposed_seconds == 0.05  # the device had work queued
    # another thread's kernels on the same stream inside the window: capped by host + waits
    assert dataclasses.replace(rec, gap_seconds=0.9, stall_seconds=0.1).exposed_seconds == pytest.approx(0.3)


def test_a_move_told_not_to_release_reports_nothing_unreleased():
    kept = _move(released=False)
    freed = _move()
    assert TransitionRecord.from_move(0, "optim-stream", (), None, kept, 0, measure_release=True).unreleased_bytes == 0
    assert TransitionRecord.from_move(0, "switch", (), None, freed, 0, measure_release=True).unreleased_bytes == 8 << 20


def test_an_interrupt_while_a_record_is_made_leaves_later_transitions_and_figures_working(monkeypatch):
    """A KeyboardInterrupt after the store's waits were taken and before the record exists:
    the next transitions and settle_stalls() work (nothing points at a record never made)."""
    torch.manual_seed(0)
    a, b = nn.Sequential(nn.Linear(64, 64)), nn.Sequential(nn.Linear(64, 64))
    cfg = TimeshareConfig(min_offload_bytes=0, budget_bytes=20000)
    ts = Timeshare("cpu", context=TransferContext(FakeAccelOps()), config=cfg)
    ts.add_role("a", model=a)
    ts.add_role("b", model=b)
    ts.load("a")
    ts.load("b")
    real_from_move, real_take = TransitionRecord.from_move, ts.store.take_stalls
    taken: list = []

    def take():
        taken.append(real_take())
        return taken[-1]

    def interrupted(*args, **kwargs):
        if len(taken) == 1:  # the first record of the load below, its stalls taken
            taken.append("fired")
            raise KeyboardInterrupt("inside record_move")
        return real_from_move(*args, **kwargs)

    monkeypatch.setattr(ts.store, "take_stalls", take)
    monkeypatch.setattr(transition.TransitionRecord, "from_move", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ts.load("a")
    assert taken[0] and taken[1] == "fired"  # the move had made the compute stream wait
    for name in ("b", "a", "b"):
        ts.load(name)
        assert ts.is_resident(name)
    ts.settle_stalls(wait=True)
    assert ts.report()
    ts.close()


def test_the_report_names_only_the_columns_it_shows():
    """The summary has no free-memory column (report(detail=True) has): its header does not name
    one (the quickstart's report had named a 'RAM free' it did not show)."""
    import torch

    import tidal

    ts = tidal.Timeshare(device="cpu")
    ts.add_role("a", model=torch.nn.Linear(64, 64))
    ts.add_role("b", model=torch.nn.Linear(64, 64))
    with ts.use("a"):
        pass
    with ts.use("b"):
        pass
    assert "RAM free" not in ts.report().splitlines()[0]
    detail = ts.report(detail=True)
    assert "'RAM free' the host's available memory" in detail.splitlines()[0] and "RAM free before" in detail
    ts.close()
