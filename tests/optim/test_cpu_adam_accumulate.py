"""CPUAdam's gradient accumulation on the device (``accumulate()``) and without host staging
(``host_accumulation=False``): results equal AdamW / the host-accumulating path, one copy per
parameter per step, the staging memory really not reserved, misuse refused. Runs on the CPU
path and on the fake accelerator (the accelerator-only copy path, through its stream log)."""

from __future__ import annotations

import warnings

import pytest
import torch

import tidal
from tidal.transfer.context import TransferContext
from tests.optim.test_cpu_adam import _assert_matches_adamw, _assert_same_cpu_adam, _batches, _loss, _mlp, _train
from tests.transfer.fakes import FakeAccelOps

PATHS = ["cpu", "fake_accel"]


def _opt(model, path: str, **kw) -> tidal.CPUAdam:
    ctx = TransferContext(FakeAccelOps()) if path == "fake_accel" else None
    return tidal.CPUAdam(model.parameters(), lr=1e-2, weight_decay=0.1, context=ctx, **kw)


def _d2h_copies(opt: tidal.CPUAdam) -> int:
    """Events recorded on the optimizer's D2H stream: one per gradient copy (small params)."""
    return sum(1 for e in opt._ops.log if e[0] == "record" and e[1] == opt._d2h.name)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("host_accumulation", [True, False])
@pytest.mark.parametrize("in_backward", [False, True], ids=["step", "step_in_backward"])
def test_device_accumulation_matches_adamw(path, host_accumulation, in_backward):
    """4 micro-batches per step, the first 3 inside accumulate(), 3 steps: AdamW accumulating
    the same micro-batches (autograd sums them in p.grad, as here)."""
    model, ref = _mlp(), _mlp()
    opt = _opt(model, path, host_accumulation=host_accumulation)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    batches = _batches(12)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no synchronous-add warning: nothing is added on the host
        _train(model, opt, batches, accum=4, device_accum=True, in_backward=in_backward)
    _train(ref, ref_opt, batches, accum=4)
    _assert_matches_adamw(model, opt, ref, ref_opt)
    assert opt.state[model.fc1.weight]["step"].item() == 3


@pytest.mark.parametrize("path", PATHS)
def test_device_accumulation_is_bit_exact_with_summing_autograd_then_copying(path):
    """The sums autograd leaves in p.grad, sent once: bit-exact with overlap=False, which
    copies p.grad at step() (bf16 parameters, so the device-side sum is in bf16 both ways)."""
    a, b = _mlp(dtype=torch.bfloat16), _mlp(dtype=torch.bfloat16)
    opt_a = _opt(a, path, host_accumulation=False)
    opt_b = _opt(b, path, overlap=False)
    batches = _batches(8)
    _train(a, opt_a, batches, accum=4, device_accum=True)
    _train(b, opt_b, batches, accum=4, device_accum=False)
    _assert_same_cpu_adam(a, opt_a, b, opt_b)


def test_gradients_stay_on_the_device_inside_and_are_copied_once_per_step():
    """Inside accumulate() p.grad keeps the autograd sum; the backward after it sends the sum
    and frees p.grad; one D2H copy per parameter per step (four without accumulate())."""
    model = _mlp()
    opt = _opt(model, "fake_accel")
    params = [p for p in model.parameters() if p.requires_grad]
    batches = _batches(4)
    expect = _mlp()
    for k in range(4):
        _loss(expect, batches[k]).backward()
    for k in range(3):
        with opt.accumulate():
            _loss(model, batches[k]).backward()
        assert all(p.grad is not None for p in params)
    assert _d2h_copies(opt) == 0
    _loss(model, batches[3]).backward()
    assert all(p.grad is None for p in params)
    assert _d2h_copies(opt) == len(params)
    for p, e in zip(params, expect.parameters()):
        torch.testing.assert_close(opt.grad(p), e.grad, rtol=1e-6, atol=1e-7)
    opt.step()
    opt.zero_grad()
    before = _d2h_copies(opt)
    for k in range(4):
        _loss(model, batches[k]).backward()
    assert _d2h_copies(opt) - before == 4 * len(params)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("via", ["step", "grad", "clip"])
def test_step_after_only_accumulated_backwards_sends_the_sums(path, via):
    """Every backward inside accumulate(): step(), grad() and clip_grad_norm_() each bring the
    sums over."""
    model, ref = _mlp(), _mlp()
    opt = _opt(model, path)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    batches = _batches(3)
    for b in batches:
        with opt.accumulate():
            _loss(model, b).backward()
        _loss(ref, b).backward()
    if via == "grad":
        torch.testing.assert_close(opt.grad(model.fc1.weight), ref.fc1.weight.grad, rtol=1e-6, atol=1e-7)
    elif via == "clip":
        norm = opt.clip_grad_norm_(1e3)
        torch.testing.assert_close(norm, torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e3), rtol=1e-6, atol=1e-7)
    opt.step()
    ref_opt.step()
    _assert_matches_adamw(model, opt, ref, ref_opt)


def test_host_accumulation_false_reserves_no_staging():
    """The staging buffers (the parameter's bytes each) are not reserved at all."""
    sizes = {}
    for flag in (True, False):
        model = _mlp(dtype=torch.bfloat16)
        opt = _opt(model, "fake_accel", host_accumulation=flag)
        sizes[flag] = sum(slot.nbytes for slot in opt._slots)  # gradients and staging
        opt.close()
    param_bytes = sum(p.numel() * p.element_size() for p in _mlp(dtype=torch.bfloat16).parameters())
    assert sizes[True] - sizes[False] >= param_bytes
    assert sizes[True] - sizes[False] < param_bytes + 4096 * len(list(_mlp().parameters()))  # slot rounding


@pytest.mark.parametrize("path", PATHS)
def test_host_accumulation_false_still_adds_a_second_gradient_with_a_warning(path):
    """No staging, micro-batches outside accumulate(): still AdamW's result, and a warning that
    says what to do (on the CPU path the host adds directly: no warning needed)."""
    model, ref = _mlp(), _mlp()
    opt = _opt(model, path, host_accumulation=False)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    batches = _batches(8)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _train(model, opt, batches, accum=4, device_accum=False)
    _train(ref, ref_opt, batches, accum=4)
    _assert_matches_adamw(model, opt, ref, ref_opt)
    msgs = [str(w.message) for w in seen if "host_accumulation=False" in str(w.message)]
    if path == "fake_accel":
        assert len(msgs) == 1 and "accumulate()" in msgs[0]
    else:
        assert msgs == []


def test_misuse_is_refused_and_the_mode_ends_with_the_block():
    model = _mlp()
    opt = _opt(model, "cpu")
    batch = _batches(1)[0]
    with opt.step_in_backward():
        with pytest.raises(ValueError, match="inside step_in_backward"):
            with opt.accumulate():
                pass
    with opt.accumulate():
        with pytest.raises(ValueError, match="do not nest"):
            with opt.accumulate():
                pass
        with pytest.raises(ValueError, match="inside accumulate"):
            with opt.step_in_backward():
                pass
    with pytest.raises(TypeError, match="host_accumulation must be a bool"):
        _opt(_mlp(), "cpu", host_accumulation=1)
    # An exception (Ctrl-C included) inside the block ends the mode: the next backward sends.
    with pytest.raises(KeyboardInterrupt):
        with opt.accumulate():
            _loss(model, batch).backward()
            raise KeyboardInterrupt
    assert model.fc1.weight.grad is not None  # kept on the device, nothing lost
    _loss(model, batch).backward()
    assert model.fc1.weight.grad is None
    fresh = _mlp()
    for _ in range(2):
        _loss(fresh, batch).backward()
    torch.testing.assert_close(opt.grad(model.fc1.weight), fresh.fc1.weight.grad, rtol=1e-6, atol=1e-7)
