"""GRPO's arithmetic: group-relative advantages, log-probabilities over the action space,
the clipped policy loss, the k3 KL estimator and the entropy.

Pure functions on tensors; the trainer (:mod:`tidal_recipes.grpo.trainer`) moves the roles and calls
them. Every response token is scored (the tasks answer with a fixed number of tokens), so
the means are over all response tokens of a micro-batch.
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["LossConfig", "group_advantages", "action_logprobs", "grpo_loss", "kl_k3"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossConfig:
    """
    Attributes:
        clip_eps: PPO ratio clip (the ratio is kept in ``[1 - clip_eps, 1 + clip_eps]``).
        kl_coef: weight of the KL penalty to the reference (k3 estimator); 0 skips the
            reference role altogether.
        entropy_coef: weight of the entropy bonus (subtracted from the loss).
    """

    clip_eps: float = 0.2
    kl_coef: float = 0.02
    entropy_coef: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 < self.clip_eps < 1.0:
            raise ValueError(f"clip_eps must be in (0, 1), got {self.clip_eps}")
        if self.kl_coef < 0 or self.entropy_coef < 0:
            raise ValueError(f"kl_coef and entropy_coef must be >= 0, got {self.kl_coef}, {self.entropy_coef}")


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """GRPO's advantage: each reward minus its group's mean, over the group's std (+eps).

    ``rewards`` is (num_prompts * group_size,), the samples of one prompt adjacent. A group
    whose samples all scored the same gets advantage 0 (it carries no signal).
    """
    if rewards.dim() != 1 or group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} do not split into groups of {group_size}")
    r = rewards.float().view(-1, group_size)
    std = r.std(dim=1, keepdim=True, unbiased=False) if group_size > 1 else torch.ones_like(r[:, :1])
    return ((r - r.mean(dim=1, keepdim=True)) / (std + eps)).view(-1)


def action_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, action_ids: tuple[int, int], *, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probability of ``tokens`` under ``logits`` restricted to the action ids
    ``[lo, hi)`` (the policy samples only those), computed in fp32.

    ``logits`` (B, T, V) are the predictions for ``tokens`` (B, T). Returns (B, T) log-probs
    and, with ``with_entropy``, the (B, T) entropy of the restricted distribution.
    Memory: one fp32 (B, T, hi - lo) tensor (plus its grad in training), not (B, T, V).
    """
    lo, hi = action_ids
    if tokens.min() < lo or tokens.max() >= hi:
        raise ValueError(f"tokens outside the action ids [{lo}, {hi})")
    logp_all = torch.log_softmax(logits[..., lo:hi].float(), dim=-1)
    logp = logp_all.gather(-1, (tokens - lo).unsqueeze(-1)).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1) if with_entropy else None
    return logp, ent


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token KL(policy || reference), the k3 estimator: ``exp(d) - d - 1`` with
    ``d = ref_logp - logp``. Non-negative, unbiased, low variance."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    config: LossConfig,
    *,
    ref_logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The GRPO loss of one micro-batch, mean over its response tokens, and its statistics.

    ``logp``/``old_logp``/``ref_logp``/``entropy`` are (B, T); ``advantages`` (B,) is one
    value per sequence, shared by its tokens.
    """
    ratio = torch.exp(logp - old_logp)
    adv = advantages.unsqueeze(1).to(logp.dtype)
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - config.clip_eps, 1.0 + config.clip_eps) * adv
    loss = -torch.minimum(unclipped, clipped).mean()
    stats = {"clip_frac": float(((ratio - 1.0).abs() > config.clip_eps).float().mean())}
    if ref_logp is not None and config.kl_coef > 0:
        kl = kl_k3(logp, ref_logp).mean()
        loss = loss + config.kl_coef * kl
        stats["kl"] = float(kl.detach())
    if entropy is not None:
        ent = entropy.mean()
        if config.entropy_coef > 0:
            loss = loss - config.entropy_coef * ent
        stats["entropy"] = float(ent.detach())
    stats["policy_loss"] = float(loss.detach())
    return loss, stats
