"""Checkpoints in one process: atomic layout, exact resume, clear errors, timeshare host copies."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn as nn

import tidal
from tidal.checkpoint import CheckpointConfig, CheckpointError, TrainState, load, load_latest, save
from tests.helpers import is_out

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def make(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(12, 32), nn.GELU(), nn.Dropout(0.2), nn.Linear(32, 5))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def step(model, opt, sched, i: int) -> float:
    x = torch.randn(8, 12, generator=torch.Generator().manual_seed(i))
    loss = model(x).pow(2).mean()  # dropout draws from the global RNG: restored by load
    loss.backward()
    opt.step()
    opt.zero_grad()
    sched.step()
    return loss.item()


def full_state(model, opt) -> dict[str, torch.Tensor]:
    out = {f"p:{n}": p.detach().clone() for n, p in model.named_parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        for k, v in st.items():
            out[f"opt:{names[id(p)]}.{k}"] = v.clone()
    return out


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_save_load_continue_identical_to_uninterrupted(tmp_path):
    model, opt, sched = make()
    state = TrainState(model, opt, scheduler=sched)
    losses = [step(model, opt, sched, i) for i in range(3)]
    path = save(tmp_path, state, step=3)
    assert path == tmp_path / "step-3" and (tmp_path / "latest").read_text().strip() == "step-3"
    ref_losses = [step(model, opt, sched, i) for i in range(3, 6)]
    ref = full_state(model, opt)
    ref_lr = opt.param_groups[0]["lr"]

    model2, opt2, sched2 = make(seed=1)  # other weights, fresh optimizer, other RNG
    torch.manual_seed(123)
    state2 = TrainState(model2, opt2, scheduler=sched2)
    assert load_latest(tmp_path, state2) == 3 and state2.step == 3
    assert opt2.param_groups[0]["lr"] == 0.005 and sched2.last_epoch == 3
    got_losses = [step(model2, opt2, sched2, i) for i in range(3, 6)]
    assert got_losses == ref_losses
    assert losses[0] != got_losses[0]
    assert_same(ref, full_state(model2, opt2))  # Adam moments and step included
    assert any(k.endswith("exp_avg_sq") for k in ref)
    assert opt2.param_groups[0]["lr"] == ref_lr


def test_latest_of_a_missing_directory_is_an_error_unless_allowed(tmp_path):
    model, opt, sched = make()
    state = TrainState(model, opt)
    with pytest.raises(CheckpointError, match="does not exist.*allow_missing=True") as info:
        load_latest(tmp_path / "chekpoint", state)  # a typo must not start training from scratch
    assert str(tmp_path / "chekpoint") in str(info.value)
    assert load_latest(tmp_path / "chekpoint", state, allow_missing=True) is None
    assert not (tmp_path / "chekpoint").exists()
    assert load_latest(tmp_path, state) is None  # exists, no checkpoint yet: a fresh start
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="not a directory"):
        load_latest(tmp_path / "file", state, allow_missing=True)


def _two_checkpoints(tmp_path):
    model, opt, sched = make()
    state = TrainState(model, opt, scheduler=sched)
    step(model, opt, sched, 0)
    save(tmp_path, state, step=1)
    at_one = full_state(model, opt)
    step(model, opt, sched, 1)
    save(tmp_path, state, step=2)
    return model, opt, sched, state, at_one


def _error(tmp_path, state) -> str:
    with pytest.raises(CheckpointError) as info:
        load_latest(tmp_path, state)
    assert isinstance(info.value, ValueError)
    msg = str(info.value)
    assert str(tmp_path / "step-2") in msg and "previous checkpoint" in msg and str(tmp_path / "step-1") in msg
    return msg


def test_missing_metadata_is_a_clear_error_and_previous_loads(tmp_path):
    model, opt, sched, state, at_one = _two_checkpoints(tmp_path)
    os.remove(tmp_path / "step-2" / ".metadata")
    assert ".metadata" in _error(tmp_path, state)
    fresh = TrainState(*make(seed=5)[:2])
    assert load(tmp_path / "step-1", fresh) == 1
    assert_same(at_one, full_state(fresh.model, fresh.optimizers[0]))


def test_truncated_shard_is_a_clear_error(tmp_path):
    model, opt, sched, state, _ = _two_checkpoints(tmp_path)
    shard = next((tmp_path / "step-2").glob("*.distcp"))
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size // 2)
    msg = _error(tmp_path, state)
    assert shard.name in msg and "truncated" in msg


def test_truncated_shard_without_manifest_sizes_is_caught_by_metadata_ranges(tmp_path):
    model, opt, sched, state, _ = _two_checkpoints(tmp_path)
    manifest = tmp_path / "step-2" / "tidal.json"
    shard = next((tmp_path / "step-2").glob("*.distcp"))
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 100)
    m = json.loads(manifest.read_text())
    m["files"][shard.name] = shard.stat().st_size  # a manifest that agrees with the damage
    with_sums = dict(m)
    del m["checksums"], m["checksum_algorithm"]  # as written before checksums were recorded
    manifest.write_text(json.dumps(m))
    assert "needs bytes" in _error(tmp_path, state)
    manifest.write_text(json.dumps(with_sums))  # with its checksums, the shard's content is wrong
    msg = _error(tmp_path, state)
    assert "corrupted" in msg and shard.name in msg


def test_garbage_metadata_is_a_clear_error(tmp_path):
    model, opt, sched, state, _ = _two_checkpoints(tmp_path)
    meta = tmp_path / "step-2" / ".metadata"
    meta.write_bytes(b"\x00" * meta.stat().st_size)
    assert "corrupted" in _error(tmp_path, state)


def test_uncommitted_directory_is_a_clear_error(tmp_path):
    model, opt, sched, state, _ = _two_checkpoints(tmp_path)
    os.remove(tmp_path / "step-2" / "tidal.json")
    assert "never committed" in _error(tmp_path, state)


def test_no_overwrite_stale_tmp_removed_and_retention(tmp_path):
    model, opt, sched = make()
    state = TrainState(model, opt)
    step(model, opt, sched, 0)
    save(tmp_path, state, step=1)
    with pytest.raises(ValueError, match="exists already"):
        save(tmp_path, state, step=1)
    (tmp_path / ".tmp-7").mkdir()
    (tmp_path / ".tmp-7" / "__0_0.distcp").write_bytes(b"half")
    save(tmp_path, state, step=2, config=CheckpointConfig(keep_last=2))
    save(tmp_path, state, step=3, config=CheckpointConfig(keep_last=2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-2", "step-3"]


def test_config_and_argument_errors(tmp_path):
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointConfig(keep_last=0)
    with pytest.raises(ValueError, match="thread_count"):
        CheckpointConfig(thread_count=0)
    with pytest.raises(TypeError, match="TrainState"):
        save(tmp_path, {"model": 1}, step=1)
    with pytest.raises(TypeError, match="Optimizer"):
        TrainState(nn.Linear(2, 2), "adam")
    (tmp_path / "latest").write_text("../../etc")
    with pytest.raises(CheckpointError, match="not a checkpoint name"):
        load_latest(tmp_path, TrainState(nn.Linear(2, 2)))


def test_offloaded_role_saves_from_and_loads_into_host_copies(tmp_path):
    model, opt, sched = make()
    for i in range(2):
        step(model, opt, sched, i)
    resident_dir, host_dir = tmp_path / "resident", tmp_path / "host"
    save(resident_dir, TrainState(model, opt, rng=False), step=2)
    expected = full_state(model, opt)
    with tidal.Timeshare("cpu") as ts:
        ts.add_role("actor", model=model, optimizer=opt, optimizer_residency="role")
        ts.offload("actor")
        assert all(is_out(p) for p in model.parameters())
        # Without timeshare= too: the role's state_dict() hooks hand out the host copies.
        save(tmp_path / "x", TrainState(model, opt, rng=False), step=2)
        state = TrainState(model, opt, timeshare=ts, rng=False)
        save(host_dir, state, step=2)
        assert all(is_out(p) for p in model.parameters()), "save reloaded the role"

        # Load a different state into the offloaded role: bytes land in the host copies.
        other, other_opt, other_sched = make(seed=9)
        step(other, other_opt, other_sched, 7)
        save(tmp_path / "other", TrainState(other, other_opt, rng=False), step=1)
        load(tmp_path / "other" / "step-1", state)
        assert all(is_out(p) for p in model.parameters()), "load reloaded the role"
        ts.load("actor")
        assert_same(full_state(other, other_opt), full_state(model, opt))
    # What was saved from the host equals what was saved while resident.
    a, b = make(seed=3), make(seed=4)
    load(resident_dir / "step-2", TrainState(a[0], a[1], rng=False))
    load(host_dir / "step-2", TrainState(b[0], b[1], rng=False))
    c = make(seed=5)
    load(tmp_path / "x" / "step-2", TrainState(c[0], c[1], rng=False))
    assert_same(expected, full_state(a[0], a[1]))
    assert_same(expected, full_state(b[0], b[1]))
    assert_same(expected, full_state(c[0], c[1]))
