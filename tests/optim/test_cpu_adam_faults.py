"""Issue 12: CPUAdam under an exception at every point of step(), step_in_backward() and the
drain: each parameter is stepped entirely or not at all (weights, fp32 master, moments, step
count agree), and step() again completes an interrupted step exactly."""

from __future__ import annotations

import pytest
import torch

import tidal
from tests.faults import SmallLM, small_loss, sweep


def _state(model, opt) -> dict[str, torch.Tensor]:
    out = {}
    for n, p in model.named_parameters():
        out[n] = p.detach().clone()
        for k, v in opt.state[p].items():
            out[f"{n}.{k}"] = v.clone()
    return out


def _per_param(model) -> dict[str, list[str]]:
    return {
        n: [n] + [f"{n}.{k}" for k in ("step", "master", "exp_avg", "exp_avg_sq")] for n, _ in model.named_parameters()
    }


def _same(a, b, keys) -> bool:
    return all(torch.equal(a[k], b[k]) for k in keys)


def _make(in_backward: bool, state_dtype: torch.dtype = torch.float32):
    torch.manual_seed(0)
    model = SmallLM()
    opt = tidal.CPUAdam(model.parameters(), lr=1e-2, state_dtype=state_dtype)
    ids = torch.randint(0, 16, (2, 6), generator=torch.Generator().manual_seed(1))
    small_loss(model, ids).backward()
    opt.step()
    if not in_backward:
        small_loss(model, ids).backward()  # gradients on the host, waiting for step()
    return {"model": model, "opt": opt, "ids": ids, "before": _state(model, opt)}


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_backward", [False, True])
def test_fault_at_every_point_of_a_cpu_adam_step_tears_no_parameter(in_backward, state_dtype, monkeypatch):
    # bf16 moments update slice by slice: 64-element slices make the larger parameters span
    # several, so a fault can land between two slices of one parameter.
    monkeypatch.setattr(tidal.optim.cpu_adam, "_SLICE_ELEMS", 64)
    clean: dict = {}

    def act(s):
        if in_backward:
            with s["opt"].step_in_backward():
                small_loss(s["model"], s["ids"]).backward()
        s["backward_done"] = True  # every gradient reached the optimizer
        s["opt"].step()

    def check(s, fired):
        model, opt = s["model"], s["opt"]
        now = _state(model, opt)
        if fired is None:
            clean["after"] = now
            return
        before, after = s["before"], clean["after"]
        for name, keys in _per_param(model).items():
            assert _same(now, before, keys) or _same(now, after, keys), f"{name} torn by a fault at {fired}"
            # The weights always match the master the next update starts from.
            p = dict(model.named_parameters())[name]
            assert torch.equal(p.detach().float(), opt.state[p]["master"].to(p.dtype).float()), name
        if s.get("backward_done") and not _same(now, after, now.keys()):
            # A fault in step() (not in a backward it cut short): the gradients were kept, so
            # step() again completes exactly that step.
            opt.step()
            assert _same(_state(model, opt), after, now.keys()), f"step() again did not complete it ({fired})"
        opt.zero_grad()
        small_loss(model, s["ids"]).backward()  # and the optimizer works on
        opt.step()

    points = sweep(lambda: _make(in_backward, state_dtype), act, check)
    assert len(points) >= 4, points
    if state_dtype == torch.bfloat16:
        assert "cpu_adam_slice" in points
