"""One rank of a 2-rank job that saves a good checkpoint (step 1), then a slow one (step 2)
that the test kills with SIGKILL while it is being written.

    python -m tests.checkpoint.killed_saver <rank> <rendezvous file> <checkpoint dir>
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint.filesystem as dcp_fs
from torch.distributed.tensor import DTensor

from tests.distributed.test_fsdp import make, train_step
from tidal.checkpoint import TrainState, save

SLOW = {"on": False}
_write_item = dcp_fs._write_item


def _slow_write_item(*args, **kwargs):
    if SLOW["on"]:
        time.sleep(0.1)  # make the save last seconds, so the kill lands inside it
    return _write_item(*args, **kwargs)


def main(rank: int, store: str, directory: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"file://{store}")
    dcp_fs._write_item = _slow_write_item
    model = make(3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_step(model, opt, 0, rank)
    # Many tensors: the slow save has many items to write.
    extra = {f"blob{i}": torch.full((256,), float(i)) for i in range(60)}
    state = TrainState(model, opt, extra=extra)
    save(directory, state, step=1)
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        for k, v in st.items():
            full[f"opt:{names[id(p)]}.{k}"] = v.full_tensor() if isinstance(v, DTensor) else v
    if rank == 0:
        torch.save(full, f"{directory}/expected-step1.pt")
    dist.barrier()
    train_step(model, opt, 1, rank)
    SLOW["on"] = True
    save(directory, state, step=2)  # killed in here
    print("save of step 2 finished: the test should have killed this process", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3])
