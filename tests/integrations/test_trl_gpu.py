"""TRL's GRPOTrainer with tidal on a GPU, against TRL alone in the same process: the same run
with a reward model and ``sync_ref_model`` (whose mix then runs on the device, into the
reference's host copies), and the reference and the reward model off the device after it."""

from __future__ import annotations

import gc

import pytest
import torch

trl = pytest.importorskip("trl")
pytest.importorskip("datasets")

from tests.integrations.test_trl import _args, _data, _history, save_char_models  # noqa: E402
from tidal.integrations.trl import TidalConfig, TidalGRPOTrainer  # noqa: E402
from tidal_recipes.grpo.char_task import reward_sevens  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A policy and a reward model of about 50 M parameters each (fp32: ~200 MB), saved."""
    policy, reward = tmp_path_factory.mktemp("policy"), tmp_path_factory.mktemp("reward")
    save_char_models(policy, reward, hidden=1024, intermediate=4096, layers=4, heads=8, kv_heads=2)
    return str(policy), str(reward)


def _train(cls, models, out, **extra):
    policy, reward = models
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    kw = dict(use_cpu=False, sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=0.5, max_steps=3)
    trainer = cls(
        model=policy, reward_funcs=[reward_sevens, reward], args=_args(out, **kw), train_dataset=_data(), **extra
    )
    trainer.train()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - base
    result = {
        "history": _history(trainer),
        "policy": {k: v.detach().cpu() for k, v in trainer.model.state_dict().items()},
        "reference": {k: v.detach().cpu() for k, v in trainer.ref_model.state_dict().items()},
        "held": held,
        "role_bytes": {r: trainer.timeshare.role_bytes(r) for r in ("reference", "reward")}
        if cls is TidalGRPOTrainer
        else None,
        "records": list(trainer.timeshare.records) if cls is TidalGRPOTrainer else None,
    }
    del trainer
    gc.collect()
    torch.cuda.empty_cache()
    return result


@pytest.mark.parametrize("prefetch", [False, True])
def test_grpo_with_a_reward_model_and_sync_ref_model_is_trl_on_a_gpu(models, tmp_path, prefetch):
    plain = _train(trl.GRPOTrainer, models, tmp_path / "plain")
    ours = _train(TidalGRPOTrainer, models, tmp_path / "ours", tidal=TidalConfig(prefetch=prefetch))
    assert ours["history"] == plain["history"] and len(plain["history"]) == 3
    for part in ("policy", "reference"):  # the reference: mixed on the device, into its host copy
        assert all(torch.equal(plain[part][k], ours[part][k]) for k in plain[part]), part
    # After training, the reference and the reward model are off the device (and the policy's
    # AdamW moments, on the host between steps): TRL alone keeps all of them.
    out_of_device = sum(ours["role_bytes"].values())
    assert ours["held"] <= plain["held"] - out_of_device + (16 << 20), (ours["held"], plain["held"], out_of_device)
    assert any(r.role_in == "reward" and r.kind == "switch" for r in ours["records"])


def test_a_phase_out_of_memory_beside_kept_roles_runs_again_as_trl_on_a_gpu(models, tmp_path):
    """The run-again path on a GPU: every phase made to run out of memory while another role's
    state is on the device beside its role (the generation after a sampled token, with the
    reference arriving behind it; the reference's scoring; the loss's forward) runs again once
    the others are out, the device's random generator set back: the same run as TRL alone."""
    from tests.integrations.test_trl import _out_of_memory_when_crowded, _run, _weights, _with_counters

    policy, _ = models
    plain = _run(trl.GRPOTrainer, policy, tmp_path / "plain", use_cpu=False, temperature=1.0)
    cls = _out_of_memory_when_crowded(_with_counters())
    with pytest.warns(UserWarning, match="ran out of device memory beside the roles its turn kept"):
        ours = _run(
            cls, policy, tmp_path / "ours", tidal_config=TidalConfig(prefetch=True), use_cpu=False, temperature=1.0
        )
    assert _history(ours) == _history(plain)
    want, got = _weights(plain), _weights(ours)
    assert all(torch.equal(want[k], got[k]) for k in want)
    retries = [h["tidal/oom_retries"] for h in ours.state.log_history if "loss" in h]
    assert retries == [0, 3, 3], retries


_HOLDER = """
import sys, torch
target = int(sys.argv[1])
torch.cuda.init()
free, _ = torch.cuda.mem_get_info()
held = torch.empty(max(0, free - target), dtype=torch.uint8, device="cuda")
print("holding", held.numel(), flush=True)
sys.stdin.read()
"""


@pytest.fixture(scope="module")
def large_policy(tmp_path_factory):
    """A policy of about 0.5 B parameters (fp32: ~1.9 GB), saved: TRL alone holds it, its
    gradients, AdamW's moments and the reference (~9.7 GB); tidal streaming the optimizer state
    a fraction of that."""
    policy = tmp_path_factory.mktemp("large_policy")
    save_char_models(policy, hidden=2048, intermediate=8192, layers=8, heads=16, kv_heads=4)
    return str(policy)


def test_with_another_process_holding_device_memory_prefetch_keeps_only_what_fits(large_policy, tmp_path):
    """Another process holds all of the device but room for tidal's run without prefetch
    (its peak, reserved, and 512 MiB): TRL alone no longer fits there; tidal with prefetch,
    whose keeps and prefetches read the driver's free memory (the other process's share
    counted), runs without running out of memory (no phase run again) and gives TRL's
    results."""
    import subprocess
    import sys

    from tests.integrations.test_trl import _run, _weights

    def peak_reserved(cls, out, **kw):
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        trainer = _run(cls, large_policy, out, use_cpu=False, **kw)
        torch.cuda.synchronize()
        return trainer, torch.cuda.max_memory_reserved()

    streamed = dict(optimizer_residency="stream")
    plain, trl_peak = peak_reserved(trl.GRPOTrainer, tmp_path / "plain")
    want, history = _weights(plain), _history(plain)
    del plain
    bare, tidal_peak = peak_reserved(TidalGRPOTrainer, tmp_path / "bare", tidal_config=TidalConfig(**streamed))
    bare.timeshare.close()
    del bare
    room = tidal_peak + (512 << 20)
    assert room < trl_peak, (room, trl_peak)  # the hold leaves TRL alone no room: the case is real
    gc.collect()
    torch.cuda.empty_cache()
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(room)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().startswith("holding")
        with pytest.raises(torch.OutOfMemoryError):
            _run(trl.GRPOTrainer, large_policy, tmp_path / "plain_held", use_cpu=False)
        gc.collect()
        torch.cuda.empty_cache()
        cfg = TidalConfig(prefetch=True, **streamed)
        ours = _run(TidalGRPOTrainer, large_policy, tmp_path / "ours", use_cpu=False, tidal_config=cfg)
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    assert _history(ours) == history
    got = _weights(ours)
    assert all(torch.equal(want[k], got[k]) for k in want)
    retries = [h["tidal/oom_retries"] for h in ours.state.log_history if "loss" in h]
    assert retries == [0, 0, 0], retries


def test_a_backward_and_an_optimizer_step_out_of_memory_beside_kept_state_run_again_as_trl_on_a_gpu(models, tmp_path):
    """The run-again paths of the backward and the optimizer step on a GPU: the loss's backward
    made to run out of memory while the reference kept through the loss or the optimizer state
    brought in behind it is on the device runs again from the same inputs once they are out;
    the optimizer step made to run out of memory while tidal brings its state in beside a kept
    role steps again: the same run as TRL alone."""
    from tests.integrations.test_trl import (
        PolicyReadyHook,
        _RaiseWhere,
        _crowded,
        _in_step_beside_another_role,
        _marking_the_step,
        _run,
        _weights,
        _with_counters,
    )
    from tidal.device import use_sync_policy

    policy, _ = models
    plain = _run(trl.GRPOTrainer, policy, tmp_path / "plain", use_cpu=False)
    box = {"raised": 0}

    class Crowded(PolicyReadyHook, _marking_the_step(_with_counters({"backward": 1 << 20}), box)):
        def _policy_ready(self, own):
            ready = own()
            if ready and not getattr(self, "_crowding", False):
                self._crowding = True

                def check(grad):
                    if _crowded(self.timeshare):
                        box["raised"] += 1
                        raise torch.OutOfMemoryError("CUDA out of memory (faked by the test)")

                self.accelerator.unwrap_model(self.model).model.embed_tokens.weight.register_hook(check)
            return ready

    with use_sync_policy(_RaiseWhere("reload_allocated", lambda: _in_step_beside_another_role(box))) as policy_:
        with pytest.warns(UserWarning, match="ran out of device memory"):
            ours = _run(Crowded, policy, tmp_path / "ours", use_cpu=False, tidal_config=TidalConfig(prefetch=True))
    assert _history(ours) == _history(plain)
    want, got = _weights(plain), _weights(ours)
    assert all(torch.equal(want[k], got[k]) for k in want)
    retries = [h["tidal/oom_retries"] for h in ours.state.log_history if "loss" in h]
    assert sum(retries) == box["raised"] + policy_.raised > 0, (retries, box, policy_.raised)
