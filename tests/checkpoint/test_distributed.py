"""Checkpoints of FSDP2 stage-3 roles on 2 processes (gloo): exact resume through a timeshare,
and a save killed with SIGKILL that leaves the previous checkpoint loadable."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import tidal
from tests.distributed.multiproc import run_distributed
from tests.distributed.test_fsdp import Net, batch, local, loss_of, make, state_tensors
from tidal.checkpoint import CheckpointError, TrainState, load, load_latest, save
from tests.helpers import is_out

ROOT = Path(__file__).resolve().parents[2]


def _train(model, ref, opt, sched, ts, steps: range, rank: int) -> list[float]:
    losses = []
    for step in steps:
        ids = batch(step, rank, ts.device)
        with ts.use("reference"):
            with torch.no_grad():
                ref_logits = ref(ids[:, :-1])
        with ts.use("actor"):
            loss = loss_of(model, ids) + 0.01 * (model(ids[:, :-1]) - ref_logits).pow(2).mean()
            loss.backward()
            opt.step()  # the optimizer state is on the host except during this call
            opt.zero_grad()
            sched.step()
        losses.append(loss.item())
    return losses


def _setup(seed_rng: int, device: str = "cpu"):
    model, ref = make(3, seed=0, dropout=0.1, device=device), make(3, seed=1, device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    ts = tidal.Timeshare(device)
    ts.add_role("actor", model=model, optimizer=opt)
    ts.add_role("reference", model=ref)
    torch.manual_seed(seed_rng)
    return model, ref, opt, sched, ts


def _resume_worker(rank: int, world_size: int, directory: str, device: str = "cpu") -> None:
    if device != "cpu":
        device = f"{device}:{rank}"
    model, ref, opt, sched, ts = _setup(100 + rank, device)
    state = TrainState(model, opt, scheduler=sched, timeshare=ts)
    _train(model, ref, opt, sched, ts, range(3), rank)
    ts.load("reference")  # the actor is offloaded: its checkpoint comes from the host copies
    assert not ts.is_resident("actor")
    save(directory, state, step=3)
    assert not ts.is_resident("actor"), "saving brought the role back to the device"
    ref_losses = _train(model, ref, opt, sched, ts, range(3, 6), rank)
    ts.load("actor")
    ts.reload_optimizer_state("actor")
    expected = {k: v.clone() for k, v in state_tensors(model, opt).items()}
    ts.close()

    model2, ref2, opt2, sched2, ts2 = _setup(999, device)  # other RNG; fresh optimizer
    state2 = TrainState(model2, opt2, scheduler=sched2, timeshare=ts2)
    ts2.offload("actor")
    with pytest.raises(ValueError, match="make the role resident"):
        load_latest(directory, state2)
    ts2.load("actor")
    # The fresh optimizer's state is created by a step and goes to the host right after it
    # (step residency): the moments load into the host copies.
    assert load_latest(directory, state2) == 3
    assert all(is_out(local(v)) for st in opt2.state.values() for k, v in st.items() if k != "step")
    got_losses = _train(model2, ref2, opt2, sched2, ts2, range(3, 6), rank)
    ts2.load("actor")
    ts2.reload_optimizer_state("actor")
    got = state_tensors(model2, opt2)
    assert got_losses == ref_losses, (got_losses, ref_losses)
    assert expected.keys() == got.keys() and any(k.endswith("exp_avg_sq") for k in got)
    for k in expected:
        assert torch.equal(expected[k], got[k]), f"rank {rank}: {k} differs after resume"

    # A mistyped directory is an error on every rank, not a fresh start.
    with pytest.raises(CheckpointError, match="does not exist"):
        load_latest(directory + "-typo", state2)
    assert load_latest(directory + "-typo", state2, allow_missing=True) is None
    # Rank 0 verifies every rank's file: a byte changed in rank 1's shard is an error on both.
    shard = Path(directory) / "step-3" / "__1_0.distcp"
    if rank == 0:
        with open(shard, "r+b") as f:
            f.seek(shard.stat().st_size // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(CheckpointError, match=r"corrupted: file __1_0\.distcp has crc32"):
        load_latest(directory, state2)
    ts2.close()


@pytest.mark.slow
def test_stage3_save_load_continue_identical_with_timeshare(tmp_path):
    run_distributed(_resume_worker, str(tmp_path))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
@pytest.mark.slow
def test_kill_9_mid_save_leaves_previous_checkpoint_loadable(tmp_path):
    ckpt = tmp_path / "ckpt"
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.checkpoint.killed_saver", str(r), str(tmp_path / "store"), str(ckpt)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r in range(2)
    ]
    try:
        deadline = time.monotonic() + 120
        tmp = ckpt / ".tmp-2"
        while not (tmp.is_dir() and any(tmp.glob("*.distcp"))):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                out = b"".join(p.stdout.read() if p.poll() is not None else b"" for p in procs)
                pytest.fail(f"the saver never reached the second save:\n{out.decode(errors='replace')[-3000:]}")
            time.sleep(0.02)
        time.sleep(0.3)  # a few items into the write
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
        for p in procs:
            p.wait(timeout=30)
    assert [p.returncode for p in procs] == [-signal.SIGKILL] * 2, "a saver finished before the kill"
    assert (ckpt / "latest").read_text().strip() == "step-1"
    assert not (ckpt / "step-2").exists() and (ckpt / ".tmp-2").is_dir()

    # The previous checkpoint loads, resharded into one process's full tensors.
    torch.manual_seed(5)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    extra = {f"blob{i}": torch.zeros(256) for i in range(60)}
    assert load_latest(ckpt, TrainState(model, opt, extra=extra)) == 1
    expected = torch.load(ckpt / "expected-step1.pt")
    got = {n: p.detach() for n, p in model.named_parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        for k, v in st.items():
            got[f"opt:{names[id(p)]}.{k}"] = v
    assert expected.keys() == got.keys() and any(k.endswith("exp_avg") for k in got)
    for k in expected:
        assert torch.equal(expected[k], got[k]), k
    assert torch.equal(extra["blob59"], torch.full((256,), 59.0))
    # The partial directory is never read as a checkpoint.
    with pytest.raises(CheckpointError, match="never committed"):
        load(ckpt / ".tmp-2", TrainState(model, opt, extra=extra))


def _interrupted_rank0_worker(rank: int, world_size: int) -> None:
    from tidal.checkpoint.atomic import on_rank0

    def commit_step():
        raise KeyboardInterrupt("Ctrl-C on rank 0 in the middle of a commit")

    with pytest.raises(KeyboardInterrupt, match="Ctrl-C on rank 0"):
        on_rank0(commit_step)  # every rank gets it: none waits in a collective for ever


@pytest.mark.slow
def test_an_interrupt_on_rank0_during_a_commit_reaches_every_rank():
    run_distributed(_interrupted_rank0_worker)


def _shared_verify_worker(rank: int, world_size: int, directory: str) -> None:
    """Each rank hashes its own share of the files before a load (not rank 0 all of them);
    a corruption found by either rank is the same error on both; an interrupt while one rank
    hashes reaches every rank, and the group still works after it."""
    from tidal.checkpoint import atomic

    model, ref, opt, sched, ts = _setup(7, "cpu")
    state = TrainState(model, opt, scheduler=sched, timeshare=ts)
    _train(model, ref, opt, sched, ts, range(2), rank)
    save(directory, state, step=2)
    step_dir = Path(directory) / "step-2"
    manifest = atomic.Manifest.from_json((step_dir / atomic.MANIFEST).read_text())
    shares = [atomic._share(manifest.file_bytes, r, world_size) for r in range(world_size)]
    assert sorted(shares[0] + shares[1]) == sorted(manifest.file_bytes) and not set(shares[0]) & set(shares[1])

    hashed: list[str] = []
    real = atomic.file_checksums

    def recording(path, names):
        names = list(names)
        hashed.extend(names)
        return real(path, names)

    atomic.file_checksums = recording
    try:
        assert load(step_dir, state) == 2
        assert sorted(hashed) == sorted(shares[rank]), (rank, hashed, shares[rank])

        # A byte flipped in a file of each rank's share in turn: both ranks raise the same error.
        for owner in range(world_size):
            victim = max(shares[owner], key=lambda n: manifest.file_bytes[n])
            if rank == 0:
                with open(step_dir / victim, "r+b") as f:
                    f.seek(manifest.file_bytes[victim] // 2)
                    byte = f.read(1)
                    f.seek(-1, os.SEEK_CUR)
                    f.write(bytes([byte[0] ^ 0x01]))
            torch.distributed.barrier()
            with pytest.raises(CheckpointError, match=f"corrupted: file {victim} has crc32"):
                load(step_dir, state)
            if rank == 0:  # undo it
                with open(step_dir / victim, "r+b") as f:
                    f.seek(manifest.file_bytes[victim] // 2)
                    f.write(byte)
            torch.distributed.barrier()

        # Ctrl-C on rank 1 while it hashes: KeyboardInterrupt on both ranks, no rank left waiting.
        def interrupted(path, names):
            raise KeyboardInterrupt("Ctrl-C on rank 1 while hashing")

        if rank == 1:
            atomic.file_checksums = interrupted
        with pytest.raises(KeyboardInterrupt, match="Ctrl-C on rank 1"):
            load(step_dir, state)
    finally:
        atomic.file_checksums = real
    torch.distributed.barrier()
    assert load(step_dir, state) == 2
    ts.close()


@pytest.mark.slow
def test_every_rank_verifies_its_share_of_the_files_before_a_load(tmp_path):
    run_distributed(_shared_verify_worker, str(tmp_path / "ckpt"))
