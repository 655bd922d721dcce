"""Issue 27: with no opt-in, code that does not know tidal and reads or writes a tensor of a
moved-out role gets a Python exception naming the role and the fix (or the right values),
never a crash. CPU; the GPU side is test_foreign_access_gpu.py.

Before the storage guard, most of these cases read freed memory: a segfault (``p.sum()``,
``model.double()``), garbage (``p.detach().numpy()``), or torch's own bounds error
(``print(p)``, ``p[0]``). A case that would crash runs in a child process
(:func:`test_issue_case_gpt2_lm_head_sum_is_an_error_not_a_signal`), so a regression fails the
test instead of killing the test run.
"""

from __future__ import annotations

import copy
import io
import os
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

import tidal
from tests.helpers import TinyLM, assert_same_state, is_out, lm_loss, make_trained, snapshot_state
from tidal import guard
from tidal.state.strict import strict_access


def test_the_storage_guard_is_built_here():
    """Everything below needs it; without a C++ compiler tidal falls back (and warns)."""
    assert guard.available(), guard.status()


def _expect_tidal_error(fn, role: str, *fixes: str) -> str:
    """``fn()`` raises RuntimeError with tidal's message: it names ``role`` and says what to do."""
    with pytest.raises(RuntimeError) as info:
        fn()
    msg = str(info.value)
    assert f"role {role!r}" in msg, msg
    assert any(f in msg for f in fixes or ("ts.use(", "state_dict()")), msg
    return msg


def _setup(residency: str = "step", device: str = "cpu"):
    model, opt = make_trained(device)
    torch.manual_seed(7)
    ref = TinyLM().to(device)
    ts = tidal.Timeshare(device, config=tidal.TimeshareConfig(optimizer_chunk_bytes=4096))
    ts.add_role("actor", model=model, optimizer=opt, optimizer_residency=residency)
    ts.add_role("reference", model=ref)
    return ts, model, opt, ref


def _param_cases(p: torch.Tensor) -> dict:
    """Every way the issue lists to touch one tensor's bytes (for params, buffers, grads and
    optimizer state alike)."""
    return {
        "sum": lambda: p.sum(),
        "print": lambda: print(p),
        "repr": lambda: repr(p),
        "norm": lambda: p.norm() if p.is_floating_point() else p.abs().max(),
        "data ops": lambda: p.data.add_(1),
        "data read": lambda: p.data.max(),
        "detach clone": lambda: p.detach().clone(),
        "numpy": lambda: p.detach().cpu().numpy(),
        "tolist": lambda: p.tolist(),
        "index": lambda: p[0] + 1,
        "transpose": lambda: p.t().clone() if p.dim() == 2 else p.flip(0),
        "copy into": lambda: p.data.copy_(torch.zeros_like(p)),
        "torch.save": lambda: torch.save(p, io.BytesIO()),
    }


@pytest.mark.parametrize("residency", ["step", "stream", "role"])
def test_every_foreign_access_of_an_offloaded_role_raises_tidal_error(residency):
    check_every_foreign_access(residency, "cpu")


def check_every_foreign_access(residency: str, device: str) -> None:
    """Each case of the issue on each kind of state of a role moved out on ``device``: tidal's
    error (or, for ``model.to(device)``, nothing read); then the role comes back bit-exact."""
    ts, model, opt, ref = _setup(residency, device)
    want = snapshot_state(model, opt)
    params = list(model.parameters())
    ts.load("reference")  # the actor goes out whole
    assert all(is_out(p) for p in params)
    tensors = {
        "param": model.blocks[0][1].weight,
        "tied param": model.head.weight,
        "non-contiguous param": model.mix,
        "bf16 param": model.gate_bf16,
        "buffer": model.flat,
        "int buffer": model.steps,
        "grad": model.blocks[0][1].weight.grad,
        "exp_avg": opt.state[model.blocks[0][1].weight]["exp_avg"],
        "exp_avg_sq": opt.state[model.embed.weight]["exp_avg_sq"],
    }
    for what, t in tensors.items():
        assert is_out(t), what
        for case, fn in _param_cases(t).items():
            if case == "numpy" and t.dtype == torch.bfloat16:
                continue  # numpy has no bfloat16 (torch refuses before reading)
            msg = _expect_tidal_error(fn, "actor")
            assert msg.startswith("tidal: "), (what, case, msg)  # the storage guard's own message
            if what in ("exp_avg", "exp_avg_sq"):
                assert "optimizer state" in msg and "optimizer.state_dict()" in msg, (case, msg)
            if what == "grad":
                assert "gradient" in msg, (case, msg)
    # The module-level cases.
    _expect_tidal_error(lambda: model.double(), "actor")
    _expect_tidal_error(lambda: copy.deepcopy(model), "actor")
    _expect_tidal_error(lambda: torch.save(model, io.BytesIO()), "actor")
    _expect_tidal_error(lambda: model.blocks[0](torch.zeros(2, 3, 32, device=device)), "actor")  # forward guard
    x = torch.ones(2, 32, device=device)
    _expect_tidal_error(lambda: nn.functional.linear(x, model.blocks[0][1].weight), "actor")
    if device == "cpu":
        assert model.to("cpu") is model  # on the CPU a no-op: nothing read, nothing moved
    else:
        _expect_tidal_error(lambda: model.to("cpu"), "actor")
    # Nothing above changed anything: same objects, bit-exact values once back.
    assert list(model.parameters()) == params and all(is_out(p) for p in params)
    ts.close()  # everything back (step/stream residency keep the optimizer state out until then)
    assert_same_state(snapshot_state(model, opt), want)


@pytest.mark.parametrize("residency", ["step", "stream"])
def test_optimizer_state_kept_on_the_host_between_steps_says_so_while_the_role_is_resident(residency):
    ts, model, opt, ref = _setup(residency)
    with ts.use("actor"):
        pass  # the state goes to the host at the end of the first use
    with ts.use("actor"):
        p = model.blocks[1][3].weight
        assert not is_out(p) and is_out(opt.state[p]["exp_avg"])
        msg = _expect_tidal_error(lambda: opt.state[p]["exp_avg"].sum(), "actor", "optimizer.state_dict()")
        assert f"optimizer_residency={residency!r}" in msg and "optimizer_residency='role'" in msg
        p.sum()  # the parameter itself is resident
        sd = opt.state_dict()  # the sanctioned way to read it: the host copies
        assert torch.equal(sd["state"][0]["exp_avg"], sd["state"][0]["exp_avg"])
    ts.close()


def test_offload_optimizer_block_names_the_role_and_the_block():
    ts, model, opt, ref = _setup("role")
    p = model.blocks[0][1].weight
    with ts.use("actor"), tidal.offload_optimizer(opt):
        msg = _expect_tidal_error(lambda: opt.state[p]["exp_avg"].sum(), "actor", "optimizer.state_dict()")
        assert "offload_optimizer()" in msg
    with ts.use("actor"):
        opt.state[p]["exp_avg"].sum()
    ts.close()


def test_standalone_offload_optimizer_is_guarded_too():
    model, opt = make_trained()
    p = model.blocks[0][1].weight
    with tidal.offload_optimizer(opt, grads=True):
        for t in (opt.state[p]["exp_avg"], p.grad):
            with pytest.raises(RuntimeError, match="tidal: .*offload_optimizer"):
                t.sum()
    assert torch.isfinite(opt.state[p]["exp_avg"].sum())


def test_a_prefetching_role_is_guarded_until_claimed():
    ts, model, opt, ref = _setup()
    ts.load("actor")
    want = {k: v.clone() for k, v in ref.state_dict().items()}
    rec = ts.prefetch("reference", write_back=False)
    assert rec is not None and rec.bytes_in > 0
    w = ref.blocks[0][1].weight
    assert is_out(w) and w.untyped_storage().nbytes() > 0  # allocated, its bytes not its own yet
    msg = _expect_tidal_error(lambda: w.sum(), "reference")
    assert "prefetched" in msg
    assert all(torch.equal(v, want[k]) for k, v in ref.state_dict().items())  # the host copies
    with ts.use("reference"):
        assert all(torch.equal(v, want[k]) for k, v in ref.state_dict().items())
        w.sum()
    ts.close()


def test_region_role_released_in_place_is_guarded():
    from tests.timeshare.test_region_role import _setup as region_setup

    ts, region, tag, drv, a, b = region_setup()
    ref = {k: v.clone() for k, v in a.state_dict().items()}
    ptrs = [p.data_ptr() for p in a.parameters()]
    with ts.use("b"):
        assert not tag.resident  # unmapped in place
        for p in a.parameters():
            _expect_tidal_error(lambda p=p: p.sum(), "a")
            _expect_tidal_error(lambda p=p: print(p), "a")
            _expect_tidal_error(lambda p=p: p.data_ptr(), "a")  # no address handed out while unmapped
    with ts.use("a"):
        assert [p.data_ptr() for p in a.parameters()] == ptrs  # same addresses
        assert all(torch.equal(v, ref[k]) for k, v in a.state_dict().items())
    ts.close()


def test_nothing_is_checked_per_op_and_resident_tensors_carry_no_guard():
    """The guard is a flag torch tests on every data access anyway: no dispatch mode, no
    thread-local dispatch key, no tensor hook is installed, and resident tensors' flags are off."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    ts, model, opt, ref = _setup("role")
    ts.load("reference")
    assert _get_current_dispatch_mode() is None
    assert not torch._C._dispatch_tls_local_include_set().has(torch._C.DispatchKey.Python)
    assert not any(p._backward_hooks for p in ref.parameters())
    assert all(not guard.flag_set(p.untyped_storage()) for p in ref.parameters())
    assert all(guard.flag_set(p.untyped_storage()) for p in model.parameters())
    ts.load("actor")
    assert all(not guard.flag_set(p.untyped_storage()) for p in model.parameters())
    assert all(not guard.flag_set(v.untyped_storage()) for st in opt.state.values() for v in st.values())
    ts.close()
    assert guard.sealed_count() == 0 or all(not guard.is_sealed(p.untyped_storage()) for p in ref.parameters())


def test_detach_numpy_of_a_moved_out_parameter_raises_instead_of_returning_garbage():
    ts, model, opt, ref = _setup()
    true_sum = float(model.blocks[0][1].weight.detach().double().sum())
    ts.load("reference")
    _expect_tidal_error(lambda: model.blocks[0][1].weight.detach().numpy().sum(), "actor")
    ts.load("actor")
    assert float(model.blocks[0][1].weight.detach().numpy().astype("float64").sum()) == pytest.approx(true_sum)
    ts.close()


def test_strict_mode_print_and_tolist_give_tidal_errors():
    ts, model, opt, ref = _setup()
    ts.load("reference")
    w = model.blocks[0][1].weight
    with strict_access(ts):
        for fn in (lambda: print(w), lambda: w.tolist(), lambda: w[0].sum(), lambda: w.sum()):
            with pytest.raises(RuntimeError, match=r"role 'actor'") as info:
                fn()
            assert "setStorage" not in str(info.value) and "unallocated storage" not in str(info.value)
    ts.close()


def test_torch_save_and_deepcopy_of_a_registered_model_work_while_resident():
    ts, model, opt, ref = _setup()
    ts.load("actor")
    buf = io.BytesIO()
    torch.save(model, buf)  # was: Can't pickle local object '_module_guard.<locals>.hook'
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))
    pickle.loads(pickle.dumps(nn.Sequential(model.blocks[0])))  # a submodule too: its hooks pickle as inert ones
    twin = copy.deepcopy(model)
    ts.load("reference")  # the actor goes out; its copy is no role's state and still runs
    ids = torch.randint(0, 64, (2, 5))
    assert torch.isfinite(lm_loss(twin, ids)) and torch.isfinite(lm_loss(loaded, ids))
    ts.close()


def test_a_failed_foreign_access_leaves_the_role_usable():
    ts, model, opt, ref = _setup("step")
    ts.load("reference")
    for _ in range(3):
        _expect_tidal_error(lambda: model.embed.weight.sum(), "actor")
    with ts.use("actor"):
        lm_loss(model, torch.randint(0, 64, (2, 5))).backward()
        opt.step()
    ts.close()
    assert all(not is_out(p) for p in model.parameters())


_ISSUE_CASE = textwrap.dedent(
    """
    import torch, transformers, tidal
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32)
    actor = transformers.GPT2LMHeadModel(cfg)
    other = torch.nn.Linear(64, 64)
    ts = tidal.Timeshare("cpu")
    ts.add_role("actor", model=actor)
    ts.add_role("other", model=other)
    ts.offload("actor")
    try:
        actor.lm_head.weight.sum()
    except RuntimeError as e:
        print("RAISED", str(e).splitlines()[0])
    torch.ones(4).sum()  # the process goes on
    ts.load("actor")
    print("SUM", float(actor.lm_head.weight.sum()))
    ts.close()
    """
)


def test_issue_case_gpt2_lm_head_sum_is_an_error_not_a_signal():
    """The issue's CPU case (it died with signal 11): a child process, so a crash fails this test."""
    pytest.importorskip("transformers")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, "-c", _ISSUE_CASE], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, f"child exited with {done.returncode}: {done.stderr[-2000:]}"
    assert "RAISED tidal: role 'actor' is offloaded" in done.stdout, done.stdout
    assert "SUM" in done.stdout


def test_without_the_guard_release_falls_back_to_resize_and_warns():
    """TIDAL_STORAGE_GUARD=off (or no compiler): a warning at the timeshare's construction, and
    transitions as before (storages of size 0), still bit-exact."""
    code = textwrap.dedent(
        """
        import warnings, torch, tidal
        from tests.helpers import make_trained, snapshot_state, assert_same_state
        model, opt = make_trained()
        want = snapshot_state(model, opt)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ts = tidal.Timeshare("cpu")
        assert any("storage guard" in str(w.message) for w in caught), [str(w.message) for w in caught]
        ts.add_role("actor", model=model, optimizer=opt, optimizer_residency="role")
        # The forward pre-hooks are the only guard left: every submodule carries one.
        assert all(len(m._forward_pre_hooks) == 1 for m in model.modules())
        ts.offload("actor")
        assert model.embed.weight.untyped_storage().nbytes() == 0
        assert model.state_dict()["embed.weight"].shape == (64, 32)
        try:
            model.blocks[0](torch.randn(2, 32))
        except RuntimeError as e:
            assert "role 'actor' is offloaded" in str(e), str(e)
        else:
            raise AssertionError("a block of an offloaded role ran")
        ts.load("actor")
        assert_same_state(snapshot_state(model, opt), want)
        ts.close()
        print("OK")
        """
    )
    env = dict(os.environ, TIDAL_STORAGE_GUARD="off", PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and "OK" in done.stdout, done.stderr[-2000:]


def test_with_the_guard_only_the_top_level_module_carries_a_forward_hook():
    """Issue 26: a pre-hook on each of a model's submodules cost every decoding step of TRL's
    generation a Python call per module (about 2 us each). With the storage guard the top-level
    module's hook is enough: it checks all of the model's tensors (only while the role is out),
    and a block called directly meets its storages' guard, which names the role."""
    if not guard.available():
        pytest.skip(f"storage guard unavailable: {guard.status()}")
    model, opt = make_trained()
    ts = tidal.Timeshare("cpu")
    ts.add_role("actor", model=model, optimizer=opt)
    assert len(model._forward_pre_hooks) == 1
    assert not any(m._forward_pre_hooks for m in model.modules() if m is not model)
    ts.offload("actor")
    with pytest.raises(RuntimeError, match=r"role 'actor' is offloaded.*ts\.use\('actor'\)"):
        model(torch.tensor([[1, 2]]))
    with pytest.raises(RuntimeError, match=r"role 'actor' is offloaded.*ts\.use\('actor'\)"):
        model.blocks[0](torch.randn(2, 32))
    ts.load("actor")
    model.blocks[0](torch.randn(2, 32))
    ts.close()
    assert not any(m._forward_pre_hooks for m in model.modules())  # close() removes it
