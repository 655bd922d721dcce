"""DDP's gradient buckets freed between steps on 2 GPUs (NCCL, one process per GPU): the same
training as DDP alone, bit for bit (deterministic kernels), and the memory really goes: the
allocator's count by the buckets' bytes, the driver's once the cache is given back."""

from __future__ import annotations

import os

import pytest
import torch

from tests.distributed.multiproc import run_distributed
from tests.distributed.test_ddp import _train

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]


def _worker(rank: int, world: int) -> None:
    torch.use_deterministic_algorithms(True)  # the comparison is bit for bit: no atomics in the backward
    device = f"cuda:{rank}"
    want, _ = _train(rank, buckets=False, find_unused=False, device=device, hidden=1024)
    memory: list = []
    got, seen = _train(rank, buckets=True, find_unused=False, device=device, hidden=1024, memory=memory)
    assert all(torch.equal(want[k], got[k]) for k in want), [k for k in want if not torch.equal(want[k], got[k])]
    # From the second step on, the buckets (every gradient's bytes: 4-byte fp32) are freed at
    # each step's start: the allocator's count drops by them (rounded to its 512-byte blocks).
    params = sum(t.numel() * t.element_size() for t in want.values())
    released = [(before - after, freed) for before, after, freed in memory if freed]
    assert len(released) == 3, memory
    for dropped, freed in released:
        assert freed == params and freed <= dropped <= freed + 512 * 64, (dropped, freed)

    # The driver sees it once the cache goes back: a DDP replica's buckets after a step.
    from torch.nn.parallel import DistributedDataParallel as DDP

    from tests.distributed.test_fsdp import Net, batch, loss_of
    from tidal.distributed import GradientBuckets

    torch.manual_seed(0)
    net = Net(hidden=2048).to(device)
    ddp = DDP(net, device_ids=[rank], gradient_as_bucket_view=True)
    opt = torch.optim.AdamW(ddp.parameters())
    gb = GradientBuckets(ddp)
    gb.watch(opt)
    for step in range(2):
        loss_of(ddp, batch(step, rank, device)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free_before = torch.cuda.mem_get_info(rank)[0]
    freed = gb.release()
    torch.cuda.empty_cache()
    free_after = torch.cuda.mem_get_info(rank)[0]
    assert freed > 256 << 20, freed
    assert free_after - free_before >= 0.9 * freed, (free_after - free_before, freed)
    # And back for the next backward, which trains as before.
    loss_of(ddp, batch(2, rank, device)).backward()
    assert not gb.released and all(p.grad is not None for p in net.parameters())
    gb.close()


def test_freed_buckets_train_bit_identically_and_give_their_memory_to_the_driver():
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, set before CUDA starts
    run_distributed(_worker, backend="nccl")
