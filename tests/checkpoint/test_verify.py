"""Checkpoints verified: every file's CRC-32 in the manifest, checked before a load reads
anything; old manifests (no checksums) still load, with a warning; and a fault-injection sweep
over every step of a save."""

from __future__ import annotations

import itertools
import json
import os
import random
import types
import warnings
import zlib

import pytest
import torch

from tests.faults import sweep
from tests.helpers import assert_same_state, lm_loss, make_trained, snapshot_state
from tidal.checkpoint import (
    CheckpointConfig,
    CheckpointError,
    TrainState,
    atomic,
    export_hf_from_checkpoint,
    load,
    load_latest,
    save,
)
from tidal.checkpoint.atomic import crc32_combine, file_checksums

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


@pytest.fixture(autouse=True)
def _one_thread():
    # Tensors this small gain nothing from intra-op threads, and on a busy 2-core machine a
    # TinyLM backward took 0.3-1.4 s with 2 of them, against 10 ms with 1.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _train_step(model, opt, seed: int) -> None:
    ids = torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(seed))
    opt.zero_grad()
    lm_loss(model, ids).backward()
    opt.step()


def _saved(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What a checkpoint holds of a snapshot: everything but the gradients."""
    return {k: v for k, v in state_dict.items() if not k.endswith(".grad")}


def _loaded(path) -> dict[str, torch.Tensor]:
    model, opt = make_trained(seed=7)  # other weights and moments, overwritten by the load
    load(path, TrainState(model, opt))
    return _saved(snapshot_state(model, opt))


def _checkpoints(tmp_path, n: int = 2, config: CheckpointConfig | None = None):
    """``n`` checkpoints step-1..step-n of a TinyLM + AdamW, a training step apart; returns the
    model, optimizer, state and what each checkpoint holds."""
    model, opt = make_trained()
    state = TrainState(model, opt)
    held = {}
    for step in range(1, n + 1):
        _train_step(model, opt, step)
        save(tmp_path, state, step=step, config=config)
        held[step] = _saved(snapshot_state(model, opt))
    return model, opt, state, held


def _flip(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def _error(fn, *args) -> str:
    with pytest.raises(CheckpointError) as info:
        fn(*args)
    return str(info.value)


# ---- the checksum itself -------------------------------------------------------------------------
def test_crc32_combine_equals_the_crc_of_the_concatenation():
    rng = random.Random(0)
    for _ in range(200):
        a, b = rng.randbytes(rng.randrange(0, 5000)), rng.randbytes(rng.randrange(0, 5000))
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


def test_files_hashed_in_pieces_on_threads_give_the_whole_file_crc(tmp_path, monkeypatch):
    monkeypatch.setattr(atomic, "_PIECE", 1000)  # many pieces per file, hashed on the thread pool
    monkeypatch.setattr(atomic, "_READ_CHUNK", 300)  # several reads per piece
    sizes = [0, 1, 999, 1000, 1001, 4096, 123_457]
    for n in sizes:
        (tmp_path / f"f{n}").write_bytes(os.urandom(n))
    got = file_checksums(tmp_path, [f"f{n}" for n in sizes])
    assert got == {f"f{n}": f"{zlib.crc32((tmp_path / f'f{n}').read_bytes()):08x}" for n in sizes}


def test_manifest_records_the_algorithm_and_each_file_crc(tmp_path):
    _checkpoints(tmp_path, n=1, config=CheckpointConfig(thread_count=2))  # two shard files
    ckpt = tmp_path / "step-1"
    manifest = json.loads((ckpt / "tidal.json").read_text())
    files = sorted(p.name for p in ckpt.iterdir() if p.name != "tidal.json")
    assert len([f for f in files if f.endswith(".distcp")]) == 2 and ".metadata" in files
    assert manifest["checksum_algorithm"] == "crc32"
    # The standard whole-file CRC-32: checkable without tidal.
    assert manifest["checksums"] == {f: f"{zlib.crc32((ckpt / f).read_bytes()):08x}" for f in files}
    assert manifest["files"] == {f: (ckpt / f).stat().st_size for f in files}


# ---- damage found before DCP reads anything ------------------------------------------------------
def test_a_byte_flipped_inside_a_shard_is_an_error_naming_the_file(tmp_path):
    model, opt, state, held = _checkpoints(tmp_path)
    shard = next((tmp_path / "step-2").glob("*.distcp"))
    # A byte in the middle of an Adam moment's bytes, in the middle of the file: DCP would load
    # it without a complaint (the size is right, the file parses), one exp_avg value changed.
    moment = held[2]["opt:blocks.0.1.weight.exp_avg"].numpy().tobytes()
    raw = shard.read_bytes()
    at = raw.find(moment)
    assert at > 0 and raw.find(moment, at + 1) == -1 and 0.2 < at / len(raw) < 0.8
    _flip(shard, at + len(moment) // 2)
    live = snapshot_state(model, opt)
    msg = _error(load_latest, tmp_path, state)
    assert f"checkpoint {tmp_path / 'step-2'} cannot be loaded" in msg
    assert "corrupted" in msg and f"file {shard.name} has crc32" in msg and ".metadata" not in msg
    assert f"previous checkpoint {tmp_path / 'step-1'} is complete" in msg
    assert_same_state(live, snapshot_state(model, opt))  # nothing was read into the live state
    assert_same_state(held[1], _loaded(tmp_path / "step-1"))  # the hint's checkpoint loads


def test_4kib_overwritten_in_one_of_several_shards_names_that_shard(tmp_path):
    _checkpoints(tmp_path, config=CheckpointConfig(thread_count=2))
    shards = sorted((tmp_path / "step-2").glob("*.distcp"))
    assert len(shards) == 2
    with open(shards[1], "r+b") as f:
        f.seek(shards[1].stat().st_size // 3)
        f.write(b"\xff" * 4096)  # the damage of the issue: exp_avg values of 3.4e38 loaded silently
    msg = _error(_loaded, tmp_path / "step-2")
    assert f"file {shards[1].name} has crc32" in msg and f"file {shards[0].name}" not in msg


def test_every_damaged_file_is_named_and_the_hint_skips_damaged_earlier_checkpoints(tmp_path):
    _, _, state, _ = _checkpoints(tmp_path, n=3)
    for step in (2, 3):
        for f in (tmp_path / f"step-{step}").iterdir():
            if f.name != "tidal.json":
                _flip(f, f.stat().st_size // 2)
    msg = _error(load_latest, tmp_path, state)
    assert "file .metadata has crc32" in msg and "__0_0.distcp has crc32" in msg
    assert f"previous checkpoint {tmp_path / 'step-1'} is complete" in msg  # step-2 is damaged too


def test_a_metadata_that_still_unpickles_but_swaps_two_layers_is_an_error(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    _, _, state, _ = _checkpoints(tmp_path)
    meta = tmp_path / "step-2" / ".metadata"
    raw = meta.read_bytes()
    # Same-shaped LayerNorms of blocks 0 and 1 swap names: a valid .metadata that would load
    # each layer's weights (and Adam moments) into the other, silently.
    swapped = raw.replace(b"blocks.0.0.", b"\x00SWAP\x00").replace(b"blocks.1.0.", b"blocks.0.0.")
    swapped = swapped.replace(b"\x00SWAP\x00", b"blocks.1.0.")
    assert swapped != raw and len(swapped) == len(raw)
    meta.write_bytes(swapped)
    FileSystemReader(str(tmp_path / "step-2")).read_metadata()  # still unpickles
    msg = _error(load_latest, tmp_path, state)
    assert "corrupted" in msg and "file .metadata has crc32" in msg and "distcp" not in msg.split(". The")[0]


def test_a_truncated_file_is_still_reported_by_its_size(tmp_path):
    _, _, state, _ = _checkpoints(tmp_path)
    shard = next((tmp_path / "step-2").glob("*.distcp"))
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 1)
    msg = _error(load_latest, tmp_path, state)
    assert f"file {shard.name} has {shard.stat().st_size} bytes" in msg and "truncated" in msg


def test_offline_export_verifies_too(tmp_path):
    _checkpoints(tmp_path)
    _flip(tmp_path / "step-2" / "__0_0.distcp", 1000)
    msg = _error(export_hf_from_checkpoint, tmp_path, tmp_path / "hf")
    assert "corrupted" in msg and "__0_0.distcp" in msg


def test_a_manifest_without_checksums_loads_with_a_warning(tmp_path):
    held = _checkpoints(tmp_path)[3]
    manifest = tmp_path / "step-2" / "tidal.json"
    m = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({k: m[k] for k in ("step", "world_size", "files")}))  # as written before
    model, opt = make_trained(seed=7)
    with pytest.warns(UserWarning, match="is not verified: its tidal.json holds no checksums"):
        assert load_latest(tmp_path, TrainState(model, opt)) == 2
    assert_same_state(held[2], _saved(snapshot_state(model, opt)))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # a checkpoint with checksums loads without one
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        assert_same_state(held[1], _loaded(tmp_path / "step-1"))


def test_a_checksum_of_an_unknown_algorithm_is_an_error(tmp_path):
    _, _, state, _ = _checkpoints(tmp_path)
    manifest = tmp_path / "step-2" / "tidal.json"
    m = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**m, "checksum_algorithm": "xxh128"}))
    assert "'xxh128' checksums" in _error(load_latest, tmp_path, state)
    m["checksums"].pop(".metadata")
    manifest.write_text(json.dumps(m))
    assert "no checksum for .metadata" in _error(load_latest, tmp_path, state)


# ---- a fault at every step of a save -------------------------------------------------------------
POINTS = [
    "checkpoint_tmp_prepared",
    "checkpoint_shards_written",
    "checkpoint_manifest_written",
    "checkpoint_synced",
    "checkpoint_renamed",
    "checkpoint_pointer_updated",
]


def test_a_fault_at_every_step_of_a_save_leaves_latest_complete(tmp_path):
    runs = itertools.count()

    def make():
        directory = tmp_path / f"run{next(runs)}"
        model, opt = make_trained()
        state = TrainState(model, opt)
        save(directory, state, step=1)
        at1 = _saved(snapshot_state(model, opt))
        _train_step(model, opt, 1)  # step 2 differs from step 1, moments included
        return types.SimpleNamespace(
            dir=directory, model=model, opt=opt, state=state, at1=at1, live=snapshot_state(model, opt)
        )

    def act(s):
        save(s.dir, s.state, step=2)

    def check(s, fired):
        # The save, failed or not, changed nothing in the live model and optimizer.
        assert_same_state(s.live, snapshot_state(s.model, s.opt))
        committed = fired is None or fired == "checkpoint_pointer_updated"
        assert (s.dir / "latest").read_text().strip() == ("step-2" if committed else "step-1"), fired
        renamed = committed or fired == "checkpoint_renamed"
        assert (s.dir / "step-2").is_dir() == renamed and (s.dir / ".tmp-2").is_dir() == (not renamed), fired
        if renamed:
            atomic.validate(s.dir / "step-2")  # complete, checksums included, even if latest is behind
        # latest loads bit-exact: weights, buffers, Adam moments and step.
        model, opt = make_trained(seed=7)
        assert load_latest(s.dir, TrainState(model, opt)) == (2 if committed else 1)
        assert_same_state(_saved(s.live) if committed else s.at1, _saved(snapshot_state(model, opt)))
        # A later save works and removes what the failed one left.
        save(s.dir, s.state, step=3)
        assert not [p for p in s.dir.iterdir() if p.name.startswith(".tmp-") or p.name == "latest.tmp"]
        assert (s.dir / "latest").read_text().strip() == "step-3"
        assert_same_state(_saved(s.live), _loaded(s.dir / "step-3"))

    assert sweep(make, act, check) == POINTS
