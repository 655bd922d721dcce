"""Run a test body on 2 processes joined by a process group: gloo on CPU (CI), NCCL with one
GPU per process (``backend="nccl"``, GPU tests)."""

from __future__ import annotations

import gc
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# NVLink multicast stays off (it can take a shared host's GPUs out of service); set here as
# well as on the machine, so a child started with its own environment keeps them.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _entry(rank: int, world_size: int, store_file: str, backend: str, fn, args: tuple) -> None:
    kwargs = {}
    if backend == "nccl":
        for k, v in NO_MULTICAST.items():
            os.environ[k] = v
        torch.cuda.set_device(rank)
        kwargs["device_id"] = torch.device("cuda", rank)
    else:
        torch.set_num_threads(1)  # 2 processes on 2 cores: no oversubscription
    # A file rendezvous: no TCP port to pick, so no race with other jobs on the machine.
    dist.init_process_group(backend, rank=rank, world_size=world_size, init_method=f"file://{store_file}", **kwargs)
    try:
        fn(rank, world_size, *args)
        # FSDP2's hooks keep modules (and their gloo work) in reference cycles; collected
        # before teardown, a gloo child no longer aborts at exit now and then (seen with
        # torch 2.13: ~3 in 30 runs of the export tests before, 0 in 30 after).
        gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_distributed(fn, *args, world_size: int = 2, backend: str = "gloo") -> None:
    """Call ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes; an assertion
    failing in any of them fails the caller with that process's traceback. With
    ``backend="nccl"`` rank ``r`` runs on ``cuda:r``."""
    if backend == "nccl":
        for k, v in NO_MULTICAST.items():
            os.environ[k] = v
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_entry, args=(world_size, os.path.join(d, "store"), backend, fn, args), nprocs=world_size, join=True)
