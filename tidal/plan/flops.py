"""The matmul work of one RL step, for its compute floor (arithmetic on shapes, no torch).

A step's *compute floor* is its matmul FLOPs over the matmul rate the GPU reaches: what the
step would take if every matmul ran at that rate and nothing else cost time. The count:

* a token through a decoder layer: ``2 * (linear weights)`` FLOPs forward, plus attention's
  two products ``4 * context * q_dim`` (``context``: the keys the token attends to);
* the LM head: ``2 * hidden * vocab`` per position whose logits are computed;
* backward: twice the forward (gradients of activations and of weights); gradient
  checkpointing runs each layer's forward once more;
* rollout: a prefill of the prompt, then one decode position per generated token but the last
  (the last is sampled, never fed back), each attending to all before it, with logits for the
  last position of each forward only (``logits_to_keep=1``);
* reference and train: a forward over prompt + completion; logits for the completion's
  positions (+1) when ``completion_logits``, else for every position.

Not counted (each well under 1% of these at the demo's shapes, or not matmul work): norms,
activations, softmax, embedding lookups, the optimizer step (memory-bound; its time is in the
step, not in this floor), LoRA adapters' own products.
"""

from __future__ import annotations


from tidal.plan.config import PlanConfig

__all__ = ["step_flops"]


def _layer_flops(c: PlanConfig, tokens: int, avg_context: float) -> float:
    s = c.shape
    linear = sum(a * b for a, b in s.linear_shapes().values())
    return tokens * (2 * linear + 4 * avg_context * s.q_dim) * s.layers


def step_flops(c: PlanConfig) -> dict[str, float]:
    """Matmul FLOPs of one step on one GPU, by phase: ``rollout``, ``reference`` (0 without a
    reference: ``kl_coef`` is not the planner's, so it is always counted), ``train`` (forward,
    recomputation and backward of every micro-batch) and ``total``."""
    s = c.shape
    b, p, g = c.rollout_batch, c.prompt_len, c.gen_len
    seq = p + g
    head = 2 * s.hidden * s.vocab
    # rollout: prefill (p tokens attending to (i+1) keys, mean (p+1)/2), then g-1 decode steps
    # at positions p..p+g-2 (mean context p + g/2), logits at one position per forward.
    prefill = _layer_flops(c, b * p, (p + 1) / 2) + b * head
    decode = _layer_flops(c, b * (g - 1), p + g / 2) + b * (g - 1) * head if g > 1 else 0.0
    rollout = prefill + decode
    logit_positions = (g + 1) if c.completion_logits else seq
    forward = _layer_flops(c, b * seq, (seq + 1) / 2) + b * logit_positions * head
    reference = forward
    layers_fwd = _layer_flops(c, b * seq, (seq + 1) / 2)
    train = 3 * forward + (layers_fwd if c.grad_ckpt else 0.0)
    return {"rollout": rollout, "reference": reference, "train": train, "total": rollout + reference + train}
