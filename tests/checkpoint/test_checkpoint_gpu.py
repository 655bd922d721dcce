"""Checkpoints of FSDP2 stage-3 roles on 2 GPUs (NCCL, one process per GPU): exact resume
through a timeshare, and the device memory a save takes beyond the state itself."""

from __future__ import annotations

import pytest
import torch

import tidal
from tests.checkpoint.test_distributed import _resume_worker
from tests.distributed.multiproc import run_distributed
from tests.distributed.test_fsdp import local, state_tensors
from tests.distributed.test_fsdp_gpu import big_role
from tidal.checkpoint import TrainState, load, save

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]

MiB = 1 << 20
BUCKET = 64 * MiB  # one staging bucket (TransferConfig.bucket_bytes)


def _peak_extra(fn) -> int:
    """Device bytes allocated at the peak of ``fn()`` beyond what was allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def _save_memory_worker(rank: int, world_size: int, directory: str) -> None:
    net, opt = big_role(rank)
    opt.zero_grad()  # checkpoints hold params and optimizer state, not grads
    ts = tidal.Timeshare(f"cuda:{rank}")
    ts.add_role("actor", model=net, optimizer=opt, optimizer_residency="role")
    state = TrainState(net, opt, timeshare=ts)
    largest = max(local(t).numel() * local(t).element_size() for t in state_tensors(net, opt).values())
    assert largest > BUCKET, "the role needs a tensor larger than the bound for the test to mean anything"

    resident = _peak_extra(lambda: save(directory, state, step=1))
    assert resident <= BUCKET, f"rank {rank}: a save of the resident role took {resident / MiB:.1f} MiB extra"

    ts.offload("actor")
    offloaded = _peak_extra(lambda: save(directory, state, step=2))
    assert not ts.is_resident("actor"), "saving brought the role back"
    assert offloaded <= 1 * MiB, f"rank {rank}: a save of the offloaded role took {offloaded / MiB:.1f} MiB"

    # Both load back into the live tensors bit for bit: the resident one on the device, the
    # offloaded one into its host copies.
    ts.load("actor")
    expected = {k: v.clone() for k, v in state_tensors(net, opt).items()}
    with torch.no_grad():
        for k, t in state_tensors(net, opt).items():
            if not k.endswith(".step"):
                t.zero_()
    loaded = _peak_extra(lambda: load(f"{directory}/step-1", state))
    assert loaded <= BUCKET, f"rank {rank}: loading took {loaded / MiB:.1f} MiB extra"
    for k, t in state_tensors(net, opt).items():
        assert torch.equal(t, expected[k]), f"rank {rank}: {k} after loading the resident save"
    ts.offload("actor")
    load(f"{directory}/step-2", state)
    ts.load("actor")
    for k, t in state_tensors(net, opt).items():
        assert torch.equal(t, expected[k]), f"rank {rank}: {k} after loading the offloaded save"
    print(
        f"rank {rank}: save peak extra resident {resident / MiB:.2f} MiB, offloaded {offloaded / MiB:.2f} MiB; "
        f"load {loaded / MiB:.2f} MiB; largest shard {largest / MiB:.0f} MiB",
        flush=True,
    )
    ts.close()


def test_stage3_save_load_continue_identical_with_timeshare_gpu(tmp_path):
    run_distributed(_resume_worker, str(tmp_path), "cuda", backend="nccl")


def test_save_peak_extra_gpu_memory_at_most_one_bucket_resident_and_about_zero_offloaded(tmp_path):
    run_distributed(_save_memory_worker, str(tmp_path), backend="nccl")
