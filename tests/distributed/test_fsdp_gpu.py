"""FSDP2 sharded roles on 2 GPUs (NCCL, one process per GPU): the CPU tests' equivalences on
the device, and the driver-level memory a sharded role gives back when it is offloaded."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn as nn

import tidal
from tests.distributed.multiproc import run_distributed
from tests.distributed.test_fsdp import (
    Net,
    _equivalence_worker,
    _gathered_worker,
    _hooks_off_worker,
    _lent_worker,
    _roundtrip_worker,
    local,
)
from tidal.device import DeviceOps
from tidal.distributed import local_state_bytes, shard_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]

MiB = 1 << 20


def big_role(rank: int, *, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A stage-3 role of about 1.1 GiB per rank (params, grads, Adam moments): vocab 65536 x
    hidden 1024 embedding and head (128 MiB shards each, above one 64 MiB staging bucket), two
    blocks. One step taken and the grads of another backward kept, so all of it exists."""
    torch.manual_seed(seed)
    net = Net(vocab=65536, hidden=1024, layers=2).to(f"cuda:{rank}")
    shard_model(net, zero_stage=3, layers=net.blocks)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    for step in range(2):
        g = torch.Generator().manual_seed(10 * step + rank)
        ids = torch.randint(0, 65536, (2, 65), generator=g).to(f"cuda:{rank}")
        logits = net(ids[:, :-1])
        nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)).backward()
        del logits
        if step == 0:
            opt.step()
            opt.zero_grad()
    return net, opt


def _free() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def _driver_free_worker(rank: int, world_size: int) -> None:
    # Warm what stays for the life of the process before the baseline, as an inference engine
    # sharing the GPU would see it: NCCL's buffers, cuBLAS workspaces and the kernels CUDA loads
    # lazily (measured on 2 H200s: a baseline taken before any FSDP2 step was 326 MiB short of
    # the free memory after the offload). The same role is built, trained and dropped once.
    warm = big_role(rank)
    del warm
    gc.collect()  # FSDP2's hooks hold the module in reference cycles
    # As the timeshare releases: cuBLAS workspaces dropped first, so no segment stays pinned.
    DeviceOps(f"cuda:{rank}").release_to_driver()
    baseline = _free()

    net, opt = big_role(rank)
    ts = tidal.Timeshare(f"cuda:{rank}")
    ts.add_role("actor", model=net, optimizer=opt, optimizer_residency="role")
    role = ts.role_bytes("actor")
    assert role > 1000 * MiB, role
    assert local_state_bytes(net) < 0.6 * sum(p.numel() * 4 for p in net.parameters())  # shards only
    torch.cuda.empty_cache()
    assert baseline - _free() >= role - 64 * MiB, "the role must really be on the GPU before the offload"
    for cycle in range(3):
        rec = ts.offload("actor")
        gap = baseline - _free()
        assert gap <= 256 * MiB, f"rank {rank} cycle {cycle}: {gap / MiB:.0f} MiB not back with the driver"
        assert rec.unreleased_bytes <= 256 * MiB
        ts.load("actor")
    # Still trains after the cycles.
    ids = torch.randint(0, 65536, (2, 33), device=f"cuda:{rank}")
    with ts.use("actor"):
        logits = net(ids[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(local(p)).all() for p in net.parameters())
    ts.close()


def test_sharded_role_offload_reload_bit_exact_every_stage_gpu():
    run_distributed(_roundtrip_worker, "cuda", backend="nccl")


def test_stage3_training_with_timeshare_identical_to_without_gpu():
    run_distributed(_equivalence_worker, "cuda", backend="nccl")


def test_driver_free_memory_after_offloading_a_sharded_role_gpu():
    run_distributed(_driver_free_worker, backend="nccl")


def test_gathered_generates_what_per_unit_gathers_do_on_two_gpus():
    """tidal.distributed.gathered over NCCL: the same tokens, one all-gather per unit."""
    pytest.importorskip("transformers")
    run_distributed(_gathered_worker, "cuda", backend="nccl")


def test_fsdp2_hooks_come_off_while_gathered_on_two_gpus():
    """hooks_off_while_gathered over NCCL: no FSDP2 hook in the gathered generation, the same
    tokens, the hooks back in their order after."""
    pytest.importorskip("transformers")
    run_distributed(_hooks_off_worker, "cuda", backend="nccl")


def test_the_policy_lends_its_shards_while_gathered_on_two_gpus():
    """Timeshare.lending with gathered() over NCCL: each unit's shards go to the host as it is
    gathered (the device holds the full copy in their place, by the allocator's count), the
    same tokens, the shards back bit for bit after, under an exception too."""
    pytest.importorskip("transformers")
    run_distributed(_lent_worker, "cuda", backend="nccl")
