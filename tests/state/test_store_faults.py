"""Issue 12: the store's switch under an exception at every point, on the CPU path and on the
fake accelerator (buckets of small storages, staging buffers, coalesced allocations)."""

from __future__ import annotations

import pytest

from tests.faults import sweep
from tests.state.test_store import _assert_state_equal, _clone_all, _entries, _make, _tensors
from tests.transfer.fakes import FakeAccelOps
from tidal.device import DeviceOps
from tidal.state import OffloadStore
from tidal.transfer import TransferConfig
from tests.helpers import is_out

KiB = 1024


def _store(kind: str) -> OffloadStore:
    if kind == "cpu":
        return OffloadStore(DeviceOps("cpu"))
    # Small buckets: the model's storages go in several buckets and several direct copies; with
    # "paced", every device-to-host copy of more than 256 bytes goes in chained pieces.
    paced = 256 if kind == "fake-accel-paced" else 0
    return OffloadStore(
        FakeAccelOps(), TransferConfig(bucket_bytes=2 * KiB, small_tensor_bytes=512, paced_piece_bytes=paced)
    )


@pytest.mark.parametrize("kind", ["cpu", "fake-accel", "fake-accel-paced"])
@pytest.mark.parametrize("move", ["offload", "reload", "switch"])
@pytest.mark.slow
def test_fault_at_every_point_of_a_store_move_keeps_every_storage_resident_or_tracked(kind, move):
    def make():
        (ma, oa), (mb, ob) = _make(seed=1), _make(seed=2)
        ea, eb = _entries(ma, oa), _entries(mb, ob)
        state = {
            "store": _store(kind),
            "ea": ea,
            "eb": eb,
            "ta": _tensors(ma, oa),
            "tb": _tensors(mb, ob),
            "ca": _clone_all(_tensors(ma, oa)),
            "cb": _clone_all(_tensors(mb, ob)),
        }
        if move != "offload":
            state["store"].offload(eb)
        return state

    def act(s):
        if move == "offload":
            s["store"].offload(s["ea"])
        elif move == "reload":
            s["store"].reload(s["eb"])
        else:
            s["store"].switch(s["ea"], s["eb"])

    def check(s, fired):
        store = s["store"]
        for e in s["ea"] + s["eb"]:
            if is_out(e.storage):
                assert store.is_offloaded(e.key), f"{e.name}: freed and untracked (fault at {fired})"
            else:
                assert not store.is_offloaded(e.key), f"{e.name}: tracked but still on the device ({fired})"
        assert not store.engine.holds_staging(), "staging left allocated"
        assert not store.interrupted
        store.reload(s["ea"] + s["eb"])
        _assert_state_equal(s["ta"], s["ca"])
        _assert_state_equal(s["tb"], s["cb"])
        store.offload(s["ea"] + s["eb"])  # and the store works on
        store.reload(s["ea"] + s["eb"])
        _assert_state_equal(s["ta"], s["ca"])
        store.close()

    points = sweep(make, act, check)
    assert len(points) >= 10, points
    if kind == "fake-accel-paced" and move != "reload":
        assert "pace_piece_after_piece" in points and "pace_piece_after_stream" in points, points
