"""Per-role model modes: one Hugging Face module serves several roles with different settings.

The rollout wants the KV cache and no gradient checkpointing (nothing to recompute without a
backward; eval mode, no dropout); training wants no cache and, optionally, checkpointing
(train mode); the reference wants neither. When roles share one module (rollout and
actor_train, or a LoRA policy and its adapter-free reference) these settings must follow the
role in use, not whichever was set last. :func:`role_mode` applies a role's settings for a
block and restores the previous ones after it, so a caller's own settings survive.

What is set: ``module.train()``/``eval()``; ``config.use_cache`` (the default of forwards that
do not pass ``use_cache``); gradient checkpointing through the model's own
``gradient_checkpointing_enable``/``disable`` (non-reentrant, which composes with saved-tensor
hooks; renamed ``activation_checkpointing_*`` in newer transformers; both are handled).
Modules that are not Hugging Face models get train/eval only. Costs no memory; switching
checkpointing walks the modules once.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator

import torch

__all__ = ["ROLE_MODES", "RoleMode", "checkpointing_enabled", "role_mode", "set_checkpointing"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RoleMode:
    """A role's module settings. ``grad_ckpt=None`` leaves checkpointing as it is."""

    training: bool
    use_cache: bool
    grad_ckpt: bool | None = None


# Checkpointing is left as set (None) in the modes of the no-grad roles: Hugging Face layers
# checkpoint only in train mode, so eval mode already turns it off without toggling hooks
# every step.
ROLE_MODES = {
    "rollout": RoleMode(training=False, use_cache=True),
    "reference": RoleMode(training=False, use_cache=False),
    "actor_train": RoleMode(training=True, use_cache=False),
}


def _config(model: torch.nn.Module):
    return getattr(model, "config", None)


def checkpointing_enabled(model: torch.nn.Module) -> bool:
    """Whether any submodule of ``model`` has Hugging Face gradient checkpointing on."""
    # transformers >= 5.2x: is_activation_checkpointing (the old name warns)
    flag = getattr(model, "is_activation_checkpointing", None)
    if not isinstance(flag, bool):
        flag = getattr(model, "is_gradient_checkpointing", None)
    if isinstance(flag, bool):
        return flag
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


def set_checkpointing(model: torch.nn.Module, enabled: bool) -> None:
    """Turn a Hugging Face model's gradient checkpointing on (non-reentrant) or off.
    Raises ``TypeError`` for a module without the Hugging Face switch."""
    if checkpointing_enabled(model) == enabled:
        return
    # transformers >= 5.2x renamed the methods (the old names warn); both take the same kwargs.
    new = hasattr(model, "activation_checkpointing_enable")
    if enabled:
        enable = model.activation_checkpointing_enable if new else getattr(model, "gradient_checkpointing_enable", None)
        if enable is None:
            raise TypeError(
                f"{type(model).__name__} has no gradient_checkpointing_enable(): gradient "
                f"checkpointing per role needs a Hugging Face model (or wrap the layers in "
                f"torch.utils.checkpoint yourself and pass grad_ckpt=None)"
            )
        key = "activation_checkpointing_kwargs" if new else "gradient_checkpointing_kwargs"
        enable(**{key: {"use_reentrant": False}})
    else:
        disable = (
            model.activation_checkpointing_disable if new else getattr(model, "gradient_checkpointing_disable", None)
        )
        if disable is not None:
            disable()


@contextlib.contextmanager
def role_mode(model: torch.nn.Module, mode: RoleMode | str) -> Iterator[RoleMode]:
    """Apply ``mode`` (a :class:`RoleMode` or a name in :data:`ROLE_MODES`) to ``model`` for the
    block; the previous train/eval state, ``config.use_cache`` and checkpointing come back
    after it (also on an exception)."""
    if isinstance(mode, str):
        if mode not in ROLE_MODES:
            raise ValueError(f"unknown role mode {mode!r}; known: {sorted(ROLE_MODES)}, or pass a RoleMode")
        mode = ROLE_MODES[mode]
    was_training = model.training
    cfg = _config(model)
    had_cache = getattr(cfg, "use_cache", None) if cfg is not None else None
    had_ckpt = checkpointing_enabled(model) if mode.grad_ckpt is not None else None
    try:
        model.train(mode.training)
        if cfg is not None and hasattr(cfg, "use_cache"):
            cfg.use_cache = mode.use_cache
        if mode.grad_ckpt is not None and mode.grad_ckpt != had_ckpt:
            set_checkpointing(model, mode.grad_ckpt)
        yield mode
    finally:
        if had_ckpt is not None and checkpointing_enabled(model) != had_ckpt:
            set_checkpointing(model, had_ckpt)
        if cfg is not None and had_cache is not None:
            cfg.use_cache = had_cache
        model.train(was_training)
