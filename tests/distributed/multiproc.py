"""Run a test body on 2 CPU processes joined by a gloo process group."""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, world_size: int, store_file: str, fn, args: tuple) -> None:
    torch.set_num_threads(1)  # 2 processes on 2 cores: no oversubscription
    # A file rendezvous: no TCP port to pick, so no race with other jobs on the machine.
    dist.init_process_group("gloo", rank=rank, world_size=world_size, init_method=f"file://{store_file}")
    try:
        fn(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_distributed(fn, *args, world_size: int = 2) -> None:
    """Call ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes; an assertion
    failing in any of them fails the caller with that process's traceback."""
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_entry, args=(world_size, os.path.join(d, "store"), fn, args), nprocs=world_size, join=True)
