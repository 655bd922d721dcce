"""The per-device transfer context: one pair of copy streams and one host arena shared by
every user of a device, an account of host bytes per owner, and claims instead of module
registries."""

from __future__ import annotations

import gc

import pytest
import torch

import tidal
from tests.helpers import make_trained
from tests.transfer.fakes import FakeAccelOps
from tidal.activations import ActivationOffloader
from tidal.state.store import OffloadStore
from tidal.transfer import TransferConfig, TransferContext


def test_one_context_per_device_and_private_ones_apart():
    assert TransferContext.of("cpu") is TransferContext.of(torch.device("cpu"))
    assert TransferContext("cpu") is not TransferContext.of("cpu")  # built directly: private


def test_every_user_of_a_device_queues_on_the_same_two_streams():
    ops = FakeAccelOps()
    ctx = TransferContext(ops)
    store = OffloadStore(ops, TransferConfig(), context=ctx)
    model, opt = make_trained()
    off = ActivationOffloader(model, layers=[model.embed], context=ctx)
    assert ctx.d2h_stream is not None and ctx.d2h_stream is not ctx.h2d_stream
    for engine in (store.engine, off._mover.engine):
        assert (engine.d2h_stream, engine.h2d_stream) == (ctx.d2h_stream, ctx.h2d_stream)
        assert engine.arena is ctx.arena(pin=True)


def test_host_account_names_each_owner_and_closing_frees_its_chunks():
    ctx = TransferContext("cpu")
    a = OffloadStore(ctx.ops, context=ctx, owner="A")
    b = OffloadStore(ctx.ops, context=ctx, owner="B")
    x, y = torch.randn(1000), torch.randn(3000)
    a.prepare(_entries(x))
    b.prepare(_entries(y))
    held = ctx.host_bytes()
    assert held == {"A": 4096, "B": 12288}
    assert a.host_reserved_bytes == held["A"] and b.host_reserved_bytes == held["B"]
    # A closes: its chunk goes back to the OS; B's stays.
    a.close()
    assert ctx.host_bytes() == {"B": 12288} and ctx.arena().num_chunks == 1
    b.close()
    assert ctx.arena().num_chunks == 0 and ctx.host_bytes() == {}


def test_a_live_owner_keeps_its_free_space():
    """Activation offload's chunks are free between steps; another owner must not take them
    (both would then grow the arena in turn)."""
    ctx = TransferContext("cpu")
    arena = ctx.arena()
    slots = arena.reserve([4096], owner="activations")
    arena.release(slots[0])
    store = OffloadStore(ctx.ops, context=ctx, owner="store")
    store.prepare(_entries(torch.randn(100)))
    assert ctx.host_bytes() == {"activations": 4096, "store": 512}


def test_cpu_adam_masters_outlive_the_optimizer_and_free_their_slots_after():
    ctx = TransferContext("cpu")
    model, _ = make_trained()
    opt = tidal.CPUAdam(model.parameters(), context=ctx)
    label = next(k for k in ctx.host_bytes() if k.startswith("CPUAdam"))
    sd = opt.state_dict()
    want = {k: v["master"].clone() for k, v in sd["state"].items()}
    used = ctx.arena().used_bytes
    del opt
    gc.collect()
    # The gradient and staging slots are back; the masters stay while the state dict holds them.
    masters = sum(v.numel() * 4 for v in want.values())
    assert ctx.arena().used_bytes == masters < used
    assert label not in ctx.host_bytes()  # its chunks serve anyone now
    filler = ctx.arena().reserve([used - masters], owner="next")  # reuses the free space
    assert ctx.arena().num_chunks == 2
    torch.manual_seed(3)
    for s in filler:
        ctx.arena().view(s).random_(0, 255)
    for k, v in sd["state"].items():
        assert torch.equal(v["master"], want[k]), "a master kept by a state dict was overwritten"
    del sd, v
    gc.collect()
    assert ctx.arena().used_bytes == used - masters


def test_offload_optimizer_finds_the_role_through_the_context_claim():
    ts = tidal.Timeshare("cpu")
    model, opt = make_trained()
    ts.add_role("actor", model=model, optimizer=opt)
    assert tidal.timeshare.registration.timeshare_of(opt) == (ts, "actor")
    with pytest.raises(ValueError, match="already belongs to role 'actor'"):
        tidal.Timeshare("cpu").add_role("again", optimizer=opt)
    ts.close()
    assert tidal.timeshare.registration.timeshare_of(opt) is None
    assert TransferContext.of("cpu").owner_of(opt) is None


def test_a_context_for_another_device_is_refused():
    with pytest.raises(ValueError, match="transfer context is for cpu"):
        tidal.Timeshare("cuda:0", context=TransferContext("cpu"))


def _entries(t: torch.Tensor):
    from tidal.state.collect import collect_tensors

    return collect_tensors([("t", t, "param")], torch.device("cpu"), min_offload_bytes=1)
