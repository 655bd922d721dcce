"""Rollout: sample answers from a Hugging Face causal LM with its KV cache.

The loop is ours, not ``model.generate``: the policy samples only among the action ids
(digit tokens), every answer has the same length, and nothing of the generation (KV cache,
logits) outlives the call, so the caller can confirm at driver level that the rollout's
memory is gone before the next role moves in.

Memory: the KV cache of ``batch x (prompt + new)`` tokens (2 x layers x kv_heads x head_dim
x dtype bytes per token) plus one step's logits (``batch x vocab``); prefill keeps the logits
of the last position only (``logits_to_keep=1``).
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch

__all__ = ["check_sampling", "draw_answers", "logits_kwargs", "sample_answers"]


def logits_kwargs(model: torch.nn.Module, keep: int) -> dict:
    """Keyword arguments that make ``model`` compute logits for its last ``keep`` positions
    only (transformers >= 4.50: ``logits_to_keep``; older: ``num_logits_to_keep``), or {} if
    it has no such argument. Saves a (B, T, vocab) tensor where only the tail is needed."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft wrapper
    params = inspect.signature(base.forward).parameters
    for name in ("logits_to_keep", "num_logits_to_keep"):
        if name in params:
            return {name: keep}
    return {}


def cache_name(model: torch.nn.Module) -> str:
    """The name under which ``model``'s forward takes and returns its KV cache: ``cache`` in
    the transformers releases that renamed it (5.2x: ``past_key_values`` still works there,
    with a FutureWarning), ``past_key_values`` before."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft wrapper
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


def check_sampling(new_tokens: int, temperature: float) -> None:
    """``ValueError`` unless ``new_tokens >= 1`` and ``temperature > 0`` (before any work)."""
    if new_tokens < 1:
        raise ValueError(f"new_tokens must be >= 1, got {new_tokens}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def draw_answers(
    logits: torch.Tensor,
    new_tokens: int,
    action_ids: tuple[int, int],
    *,
    generator: torch.Generator,
    temperature: float,
    on_step: Callable[[int], None] | None,
    next_logits: Callable[[torch.Tensor, int], torch.Tensor],
) -> torch.Tensor:
    """The sampling loop of every rollout here: draw each answer token from
    ``softmax(logits[lo:hi] / temperature)`` with ``generator``, then ask ``next_logits(token, i)``
    for the logits after it (an eager decode step, or a graph's replay). ``logits``: (B, vocab)
    after the prompt. Returns (B, new_tokens) int64 ids."""
    lo, hi = action_ids
    picked = []
    for i in range(new_tokens):
        probs = torch.softmax(logits[:, lo:hi].float() / temperature, dim=-1)
        tok = torch.multinomial(probs, 1, generator=generator) + lo
        picked.append(tok)
        if on_step is not None:
            on_step(i)
        if i + 1 == new_tokens:
            break
        logits = next_logits(tok, i)
    return torch.cat(picked, dim=1)


@torch.no_grad()
def sample_answers(
    model: torch.nn.Module,
    prompts: torch.Tensor,
    new_tokens: int,
    action_ids: tuple[int, int],
    *,
    generator: torch.Generator,
    temperature: float = 1.0,
    on_step=None,
) -> torch.Tensor:
    """Sample ``new_tokens`` tokens after each prompt; returns (B, new_tokens) int64 ids.

    ``prompts`` (B, P) on the model's device, all of one length (no padding). Tokens are drawn
    from ``softmax(logits[lo:hi] / temperature)`` with ``generator`` (on the model's device),
    so a seeded run is reproducible. ``on_step(i)`` is called after each decoded token (the
    demo samples memory there).
    """
    check_sampling(new_tokens, temperature)
    was_training = model.training
    model.eval()  # no dropout while sampling
    try:
        out = model(input_ids=prompts, use_cache=True, **logits_kwargs(model, 1))
        name = cache_name(model)
        state = {"cache": out[name]}
        first = out.logits[:, -1]
        del out

        def next_logits(tok: torch.Tensor, _i: int) -> torch.Tensor:
            step = model(input_ids=tok, use_cache=True, **{name: state["cache"]})
            state["cache"] = step[name]
            return step.logits[:, -1]

        answers = draw_answers(
            first,
            new_tokens,
            action_ids,
            generator=generator,
            temperature=temperature,
            on_step=on_step,
            next_logits=next_logits,
        )
        state.clear()  # the KV cache dies here: nothing of the rollout outlives the call
        return answers
    finally:
        model.train(was_training)
