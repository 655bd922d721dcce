"""Issue 12: activation offload under an exception at every point of a step (forward with its
offloads, backward with its reloads), on the fake accelerator (streams, buckets, staging):
the parameters are untouched, the offloader takes the next step, and that step's gradients
are bit-exact."""

from __future__ import annotations

import torch

from tests.activations.models import MixedLM, assert_bitwise_equal, grads_of
from tests.faults import sweep
from tests.transfer.fakes import FakeAccelOps
from tidal.transfer import TransferContext
from tidal.activations import ActivationOffloadConfig, ActivationOffloader

CFG = ActivationOffloadConfig(min_offload_bytes=256)


def _ids() -> torch.Tensor:
    return torch.randint(0, 96, (3, 12), generator=torch.Generator().manual_seed(7))


def _step(model, off, ids):
    torch.manual_seed(123)  # dropout masks
    if off is None:
        loss = model(ids)
    else:
        with off:
            loss = model(ids)
    loss.backward()


def _reference():
    torch.manual_seed(0)
    model = MixedLM(pairs=1)
    _step(model, None, _ids())
    return grads_of(model)


def test_fault_at_every_point_of_an_offloaded_step_loses_nothing():
    want = _reference()

    def make():
        torch.manual_seed(0)
        model = MixedLM(pairs=1)
        ops = FakeAccelOps()
        off = ActivationOffloader(model, layers=model.blocks, config=CFG, context=TransferContext(ops))
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        return {"model": model, "off": off, "params": params}

    def act(s):
        _step(s["model"], s["off"], _ids())

    def check(s, fired):
        model, off = s["model"], s["off"]
        for n, p in model.named_parameters():
            assert torch.equal(p.detach(), s["params"][n]), f"{n} changed (fault at {fired})"
        model.zero_grad(set_to_none=True)
        _step(model, off, _ids())  # the offloader takes the next step
        assert_bitwise_equal(grads_of(model), want)
        assert off._mover.arena.used_bytes == 0, "host slots of the failed step were not given back"

    points = sweep(make, act, check)
    assert len(points) >= 10, points
