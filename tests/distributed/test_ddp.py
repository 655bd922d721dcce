"""DDP's gradient buckets freed between steps (tidal.distributed.GradientBuckets), on a CPU
mesh (gloo, 2 processes): the same training as DDP alone, bit for bit, with the buckets' memory
gone while the gradients are None."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tidal import guard
from tidal.distributed import GradientBuckets
from tidal.state.backends import counted_nbytes
from tests.distributed.multiproc import run_distributed
from tests.distributed.test_fsdp import Net, batch, loss_of


def _train(
    rank: int,
    *,
    buckets: bool,
    find_unused: bool,
    steps: int = 4,
    accumulation: int = 1,
    device: str = "cpu",
    hidden: int = 32,
    memory: list | None = None,
):
    """``steps`` AdamW steps of a DDP-wrapped Net (bucket cap small enough for several
    buckets, one of them a single large parameter); returns the final weights and what the
    buckets did. ``memory``: on a GPU, the allocated bytes before and after each release."""
    torch.manual_seed(0)
    net = Net(hidden=hidden).to(device)
    ids_device = {"device_ids": [torch.device(device).index]} if device != "cpu" else {}
    ddp = DDP(
        net,
        bucket_cap_mb=0.01 if device == "cpu" else 25,
        find_unused_parameters=find_unused,
        gradient_as_bucket_view=buckets,
        **ids_device,
    )
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    seen: list[tuple[int, int, bool]] = []
    gb = None
    if buckets:
        gb = GradientBuckets(ddp)
        gb.watch(opt)
    for step in range(steps):
        if gb is not None:
            before = torch.cuda.memory_allocated(device) if memory is not None else 0
            freed = gb.release()
            if memory is not None:
                memory.append((before, torch.cuda.memory_allocated(device), freed))
            seen.append((freed, gb.noted_bytes, gb.released))
            if gb.released:
                # Every noted buffer holds no memory and refuses reads with tidal's message.
                for t in gb:
                    assert counted_nbytes(t.untyped_storage()) == 0
                    if guard.available():
                        with pytest.raises(RuntimeError, match="DistributedDataParallel's gradient buckets"):
                            t.sum()
        for micro in range(accumulation):
            ids = batch(step * accumulation + micro, rank, device)
            ctx = ddp.no_sync() if micro < accumulation - 1 else _null()
            with ctx:
                loss_of(ddp, ids).backward()
        if gb is not None:
            assert not gb.released  # the forward with grad gave them memory back
        opt.step()
        opt.zero_grad(set_to_none=True)
    weights = {n: p.detach().clone() for n, p in net.named_parameters()}
    if gb is not None:
        assert len(list(gb)) > 2  # several buckets (the embedding's and head's alone in theirs)
        assert ddp._has_rebuilt_buckets == (not find_unused)  # the case the test names happened
        gb.close()
    return weights, seen


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _same_as_ddp_alone(rank: int, world: int, find_unused: bool, accumulation: int) -> None:
    want, _ = _train(rank, buckets=False, find_unused=find_unused, accumulation=accumulation)
    got, seen = _train(rank, buckets=True, find_unused=find_unused, accumulation=accumulation)
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want), [k for k in want if not torch.equal(want[k], got[k])]
    params = sum(p.numel() * p.element_size() for p in Net(hidden=32).parameters())
    # Step 0: nothing noted yet (the first step's buckets are noted at its optimizer step).
    assert seen[0] == (0, 0, False)
    if find_unused:
        # No rebuild: from step 1 every bucket (the whole gradient's bytes) is freed each step.
        assert all(freed == params and noted == params and released for freed, noted, released in seen[1:]), seen
    else:
        # The rebuild at step 1's forward drops the first buckets (released at step 1's start),
        # the new ones are noted at its optimizer step and freed from step 2 on.
        assert seen[1] == (params, params, True), seen
        assert all(freed == params and released for freed, _, released in seen[2:]), seen


@pytest.mark.parametrize("find_unused", [True, False], ids=["find_unused", "rebuilt"])
@pytest.mark.parametrize("accumulation", [1, 2])
def test_freed_buckets_train_bit_identically_to_ddp_alone(find_unused, accumulation):
    run_distributed(_same_as_ddp_alone, find_unused, accumulation)


def _refusals(rank: int, world: int) -> None:
    with pytest.raises(TypeError, match="needs a DistributedDataParallel"):
        GradientBuckets(nn.Linear(2, 2))
    ddp = DDP(nn.Linear(4, 4))
    with pytest.raises(ValueError, match="gradient_as_bucket_view=True"):
        GradientBuckets(ddp)


def test_a_wrapper_without_bucket_views_or_no_wrapper_is_refused():
    run_distributed(_refusals)


def _interrupted(rank: int, world: int) -> None:
    """A KeyboardInterrupt (or any exception) at every buffer of a release and of a restore:
    the next restore gives every buffer its memory back, and training goes on as DDP alone's."""
    from tidal import guard as guard_mod

    want, _ = _train(rank, buckets=False, find_unused=True, steps=3)
    for where in ("release", "restore"):
        for k in range(4):
            torch.manual_seed(0)
            net = Net(hidden=32)
            ddp = DDP(net, bucket_cap_mb=0.01, find_unused_parameters=True, gradient_as_bucket_view=True)
            opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
            gb = GradientBuckets(ddp)
            gb.watch(opt)
            real = {"release": guard_mod.release, "unseal": guard_mod.unseal}
            for step in range(3):
                if step == 1:
                    calls = [0]
                    name = "release" if where == "release" else "unseal"

                    def failing(*a, _name=name, _real=real[name], **kw):
                        calls[0] += 1
                        if calls[0] == k + 1:
                            raise KeyboardInterrupt(f"injected at {where} #{k}")
                        return _real(*a, **kw)

                    setattr(guard_mod, name, failing)
                    try:
                        try:
                            gb.release()
                            gb.restore()
                        except KeyboardInterrupt:
                            pass
                    finally:
                        setattr(guard_mod, name, real[name])
                    gb.restore()  # what the next forward's hook does, whatever was left
                    assert all(counted_nbytes(t.untyped_storage()) > 0 for t in gb)
                else:
                    gb.release()
                loss_of(ddp, batch(step, rank)).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            got = {n: p.detach() for n, p in net.named_parameters()}
            assert all(torch.equal(want[n], got[n]) for n in want), (where, k)
            gb.close()


def test_an_interrupted_release_or_restore_leaves_every_bucket_restorable():
    run_distributed(_interrupted)
