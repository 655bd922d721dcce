"""Per-role module modes: set for the block, restored after it, and followed by the trainer."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tidal_recipes.grpo import DigitTask, GRPOConfig, GRPOTrainer  # noqa: E402
from tidal_recipes.grpo.modes import RoleMode, checkpointing_enabled, role_mode, set_checkpointing  # noqa: E402
from tests.recipes.grpo.test_trainer import tiny_policy  # noqa: E402


def test_role_mode_sets_and_restores():
    m = tiny_policy()
    m.train()
    m.config.use_cache = False
    with role_mode(m, "rollout"):
        assert not m.training and m.config.use_cache is True
    assert m.training and m.config.use_cache is False
    with role_mode(m, RoleMode(training=True, use_cache=False, grad_ckpt=True)):
        assert checkpointing_enabled(m)
    assert not checkpointing_enabled(m)
    # restored on an exception too
    with pytest.raises(RuntimeError, match="boom"):
        with role_mode(m, "reference"):
            assert not m.training
            raise RuntimeError("boom")
    assert m.training and m.config.use_cache is False


def test_checkpointing_really_recomputes():
    """set_checkpointing(True) makes the layers run their forward twice in a train-mode
    backward, and not at all twice in eval mode."""
    m = tiny_policy()
    calls = []
    mlp = m.model.layers[0].mlp
    act = mlp.act_fn

    class Counted(torch.nn.Module):  # counts calls of the forward itself (hooks may be skipped in a recompute)
        def forward(self, x):
            calls.append(1)
            return act(x)

    mlp.act_fn = Counted()
    ids = torch.randint(0, 12, (2, 8))
    set_checkpointing(m, True)
    with role_mode(m, "actor_train"):
        m(input_ids=ids).logits.sum().backward()
    assert len(calls) == 2  # forward + recompute in backward
    calls.clear()
    with role_mode(m, "rollout"), torch.no_grad():
        m(input_ids=ids)
    assert len(calls) == 1


def test_errors():
    with pytest.raises(ValueError, match="unknown role mode"):
        with role_mode(torch.nn.Linear(2, 2), "critic"):
            pass
    with pytest.raises(TypeError, match="Hugging Face"):
        set_checkpointing(torch.nn.Linear(2, 2), True)
    # a plain module still gets train/eval
    lin = torch.nn.Linear(2, 2)
    with role_mode(lin, "rollout"):
        assert not lin.training
    assert lin.training


def test_trainer_runs_each_role_in_its_mode():
    """Rollout forwards in eval mode with the cache on; training forwards in train mode with
    the cache off and checkpointing on; the reference in eval mode with the cache off."""
    cfg = GRPOConfig(
        task=DigitTask(name="copy", num_digits=3), prompts_per_step=2, group_size=4, micro_batch=8, grad_ckpt=True
    )
    tr = GRPOTrainer(tiny_policy(), config=cfg)
    seen = []

    def hook(name):
        def fn(module, args, kwargs):
            seen.append((name, module.training, module.config.use_cache, checkpointing_enabled(module)))

        return fn

    tr.policy.register_forward_pre_hook(hook("policy"), with_kwargs=True)
    tr.reference.register_forward_pre_hook(hook("reference"), with_kwargs=True)
    tr.step()
    tr.close()
    modes = {(n, t, c) for n, t, c, _ in seen}
    assert ("policy", False, True) in modes  # rollout
    assert ("policy", True, False) in modes  # training
    assert ("reference", False, False) in modes  # reference
    assert all(ck for n, t, c, ck in seen if n == "policy" and t)
