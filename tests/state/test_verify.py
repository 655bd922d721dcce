"""Issue 12: restore verified when asked (TransferConfig(verify=...)): a corrupted host slot is
caught at reload, the corrupted tensors stay offloaded, and nothing is flagged otherwise."""

from __future__ import annotations

import pytest
import torch

import tidal
from tests.state.test_store import Model, _clone_all, _entries, _make, _tensors, _assert_state_equal
from tests.transfer.fakes import FakeAccelOps, assert_bits_equal
from tidal.device import DeviceOps
from tidal.errors import StateCorruptionError
from tidal.state import OffloadStore, storage_key
from tidal.state.digest import digest
from tidal.transfer import TransferConfig
from tests.helpers import is_out

KiB = 1024


def _store(kind: str, verify: str) -> OffloadStore:
    if kind == "cpu":
        return OffloadStore(DeviceOps("cpu"), TransferConfig(verify=verify))
    return OffloadStore(FakeAccelOps(), TransferConfig(bucket_bytes=4 * KiB, small_tensor_bytes=1 * KiB, verify=verify))


def test_verify_must_be_a_known_mode():
    with pytest.raises(ValueError, match="verify must be"):
        TransferConfig(verify="yes")


@pytest.mark.parametrize("kind", ["cpu", "fake-accel"])
@pytest.mark.parametrize("verify", ["sampled", "full"])
def test_round_trips_with_verification_pass_and_stay_bit_exact(kind, verify):
    ma, oa = _make(seed=1)
    mb, ob = _make(seed=2)
    ea, eb = _entries(ma, oa), _entries(mb, ob)
    ca, cb = _clone_all(_tensors(ma, oa)), _clone_all(_tensors(mb, ob))
    store = _store(kind, verify)
    store.offload(eb)
    for _ in range(3):
        store.switch(ea, eb)
        store.switch(eb, ea)
    store.reload(ea + eb)
    _assert_state_equal(_tensors(ma, oa), ca)
    _assert_state_equal(_tensors(mb, ob), cb)


def _corrupt(store: OffloadStore, key: int, *, whole: bool) -> None:
    slot = store._slots[key][0]
    raw = store.arena.view(slot)  # the arena's own view: not handed out, so not "exposed"
    if whole:
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8))
    else:
        raw[raw.numel() // 2] ^= 0x10  # one bit


@pytest.mark.parametrize("kind", ["cpu", "fake-accel"])
@pytest.mark.parametrize("verify,whole", [("full", False), ("full", True), ("sampled", True)])
def test_a_corrupted_host_slot_is_caught_at_reload_and_stays_offloaded(kind, verify, whole):
    model, opt = _make(seed=3)
    entries = _entries(model, opt)
    clones = _clone_all(_tensors(model, opt))
    store = _store(kind, verify)
    victim = model.l1.weight
    victim_before = victim.detach().clone()
    store.offload(entries)
    key = storage_key(victim.untyped_storage())
    _corrupt(store, key, whole=whole)
    with pytest.raises(StateCorruptionError, match=r"l1\.weight") as err:
        store.reload(entries)
    assert len(err.value.names) == 1
    # A failed reload brings nothing back: the corrupted storage (and the rest of this
    # reload) stays offloaded, so no computation can use wrong bytes.
    assert store.is_offloaded(key) and is_out(victim)
    assert all(store.is_offloaded(e.key) and is_out(e.storage) for e in entries)
    # Restoring the slot's bytes (what loading a checkpoint does) makes it load again.
    store.host_tensor(victim).copy_(victim_before)
    store.reload(entries)
    _assert_state_equal(_tensors(model, opt), clones)


def test_off_catches_nothing_and_costs_nothing():
    model, opt = _make(seed=3)
    entries = _entries(model, opt)
    store = _store("cpu", "off")
    store.offload(entries)
    _corrupt(store, storage_key(model.l1.weight.untyped_storage()), whole=False)
    store.reload(entries)  # no check: the flipped bit comes back
    assert not store._digests


def test_writes_through_handed_out_host_views_are_not_corruption():
    """load_state_dict / checkpoint loads write the host copies of an offloaded role through
    the views tidal hands out: legitimate, so the reload checks the transfer against them."""
    model, opt = _make(seed=4)
    entries = _entries(model, opt)
    store = _store("cpu", "full")
    store.offload(entries)
    store.host_tensor(model.l1.weight).fill_(0.5)
    store.reload(entries)
    assert bool((model.l1.weight == 0.5).all())


def test_timeshare_with_verification_refuses_a_corrupted_role_and_keeps_the_other():
    torch.manual_seed(0)
    a, b = Model(1), Model(2)
    cfg = tidal.TimeshareConfig(transfer=TransferConfig(verify="full"))
    ts = tidal.Timeshare("cpu", config=cfg)
    ts.add_role("a", model=a)
    ts.add_role("b", model=b)
    want_b = {k: v.clone() for k, v in b.state_dict().items()}
    ts.load("b")
    _corrupt(ts.store, storage_key(a.l1.bias.untyped_storage()), whole=False)
    with pytest.raises(StateCorruptionError, match=r"l1\.bias"):
        ts.load("a")
    assert not ts.is_resident("a")  # never resident with wrong bytes
    with pytest.raises(RuntimeError, match="role 'a' is offloaded"):
        a(torch.zeros(1, 2, dtype=torch.long))
    ts.offload("b")
    ts.load("b")
    for k, v in b.state_dict().items():
        assert_bits_equal(v, want_b[k], k)


def test_digest_is_the_same_on_any_layout_and_changes_with_any_byte():
    x = torch.randint(0, 256, (10_007,), dtype=torch.uint8)
    d = digest(x)
    assert digest(x.clone()) == d
    assert digest(torch.cat([torch.zeros(3, dtype=torch.uint8), x])[3:]) == d  # unaligned start
    for i in (0, 8, 5000, 10_006):
        y = x.clone()
        y[i] ^= 1
        assert digest(y) != d, i
    y = x.clone()
    y[0:8], y[8:16] = x[8:16].clone(), x[0:8].clone()  # two words swapped
    assert digest(y) != d
    assert digest(x[:-1]) != digest(torch.cat([x[:-1], torch.zeros(1, dtype=torch.uint8)]))
