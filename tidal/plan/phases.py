"""Per-phase pieces of the memory model: each role's persistent state and each phase's
largest transient, for a :class:`~tidal.plan.model.PlanConfig` (see that module for the
contract and :mod:`tidal.plan.activations` for the per-token formulas).

All functions return bytes per GPU; dicts map a component name (shown in reports) to bytes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tidal.plan import activations as act

if TYPE_CHECKING:
    from tidal.plan.model import PlanConfig

__all__ = ["role_state", "gathered_params", "rollout_transient", "reference_transient", "train_transient",
           "CPU_ADAM_CHUNK"]

CPU_ADAM_CHUNK = 64 << 20  # tidal.optim.cpu_adam's fp32 chunk copied back per update


def _div(n: int, d: int) -> int:
    return -(-n // d)


def role_state(c: "PlanConfig") -> dict[str, int]:
    """Per-GPU bytes of each role's persistent state, after ZeRO sharding."""
    s, e = c.shape, act.dtype_bytes(c.param_dtype)
    le = act.dtype_bytes(c.lora_dtype) if c.lora_rank else e  # the trainable params' dtype
    ge = act.dtype_bytes(c.grad_dtype) if c.grad_dtype else le
    se = act.dtype_bytes(c.optim_state_dtype) if c.optim_state_dtype else le
    lora = s.lora_params(c.lora_rank, c.lora_targets)
    trainable = lora if c.lora_rank else s.param_count()
    p_div = c.dp if c.zero_stage >= 3 else 1
    base = _div(s.param_count() * e, p_div)
    adapters = _div(lora * le, p_div)
    return {
        "base": base,
        "adapters": adapters,
        "reference": 0 if c.lora_rank else base,
        "rollout_copy": 0 if c.rollout_shares_weights else base + adapters,
        "grads": 0 if c.optimizer == "cpu_adam" else _div(trainable * ge, c.dp if c.zero_stage >= 2 else 1),
        "optim": 0 if c.optimizer == "cpu_adam" else _div(
            trainable * (2 * se + (4 if c.master_weights else 0)), c.dp if c.zero_stage >= 1 else 1),
        "step_temp": _div(trainable * se, c.dp if c.zero_stage >= 1 else 1) if c.optimizer != "cpu_adam" and c.adamw_foreach else 0,
        "trainable": trainable, "ge": ge, "le": le,
    }


def gathered_params(c: "PlanConfig") -> dict[str, int]:
    if c.zero_stage < 3 or c.dp == 1:
        return {}
    s, e = c.shape, act.dtype_bytes(c.param_dtype)
    layers = min(c.zero3_gathered_layers, s.layers)
    return {"zero3 gathered params": (s.root_params() + layers * s.layer_params()) * e}


def rollout_transient(c: "PlanConfig") -> dict[str, int]:
    """Rollout transient: the larger of prefill, the last decode forward, the last sampling."""
    s, e = c.shape, act.dtype_bytes(c.param_dtype)
    kv_e = act.dtype_bytes(c.kv_dtype or c.param_dtype)
    b, per_tok = c.rollout_batch, act.kv_cache_bytes_per_token(s, kv_e=kv_e)
    kv = b * c.seq_len * per_tok
    vocab_row = b * s.vocab
    forward = {
        "kv cache": kv,
        # generate's loop still references the previous step's fp32 logits, scores, probs
        "previous sampling buffers": vocab_row * 12,
        # DynamicCache appends with torch.cat: one layer's keys exist twice for a moment
        "kv append copy": b * c.seq_len * s.kv_dim * kv_e,
        "decode repeat_kv": (2 * b * c.seq_len * s.q_dim * e
                             if c.repeat_kv_in_decode and c.padding_mask and s.kv_heads != s.heads else 0),
        "last-position logits": vocab_row * e,
    }
    sample = {"kv cache": kv, "sampling logits": vocab_row * (e + 4 * c.sampling_fp32_buffers)}
    t = b * c.prompt_len
    prefill = {
        "kv cache": t * per_tok,
        "prefill workspace": t * act.forward_workspace_bytes_per_token(s, e=e, padding_mask=c.padding_mask),
        "prefill mask": b * c.prompt_len ** 2 * (1 + e) if c.padding_mask else 0,
    }
    return max((forward, sample, prefill), key=lambda d: sum(d.values()))


def reference_transient(c: "PlanConfig") -> dict[str, int]:
    s, e = c.shape, act.dtype_bytes(c.param_dtype)
    mb = c.reference_micro_batch or c.micro_batch
    t = mb * c.seq_len
    span = mb * (c.seq_len if c.logprob_span == "sequence" else c.gen_len)
    mask = mb * c.seq_len ** 2 * (1 + e) if c.padding_mask else 0
    layer = t * act.forward_workspace_bytes_per_token(s, e=e, padding_mask=c.padding_mask) + mask
    logits = t * s.vocab * e + span * s.vocab * 4 * 2  # logits, fp32 copy, log-softmax output
    if logits >= layer:
        return {"logits + log-softmax": logits, "final hidden": t * s.hidden * e}
    return {"layer workspace": layer}


def train_transient(c: "PlanConfig", st: dict[str, int]) -> tuple[dict[str, int], int]:
    """Train transient components at the peak, and the gradient bytes resident then."""
    s, e = c.shape, act.dtype_bytes(c.param_dtype)
    t = c.micro_batch * c.seq_len
    span = c.micro_batch * (c.seq_len if c.logprob_span == "sequence" else c.gen_len)
    lora_targets = c.lora_targets if c.lora_rank else ()
    layer = t * act.layer_saved_bytes_per_token(
        s, e=e, seq=c.seq_len, attn=c.attn, padding_mask=c.padding_mask,
        lora_rank=c.lora_rank, lora_targets=lora_targets, lora_e=st["le"])
    ckpt_in = t * s.hidden * e
    held = min(2, s.layers) if c.act_offload else s.layers
    saved = held * (ckpt_in if c.grad_ckpt else layer)
    extra = t * act.model_extra_saved_bytes_per_token(s, e=e, grad_ckpt=c.grad_ckpt)
    # Forward: model-dtype logits, fp32 copy, log-softmax output. Backward (log-softmax's):
    # its output, incoming and outgoing gradients (+ the logits if the caller still holds them).
    logits = max(t * s.vocab * e + span * s.vocab * 8,
                 span * s.vocab * 4 * c.logit_fp32_buffers + (t * s.vocab * e if c.keep_logits else 0))
    grads = st["grads"]
    if c.micro_batches == 1 and not c.lora_rank:
        # One micro-batch: at the logits backward only the LM head's gradient exists yet.
        first_grads = _div(s.vocab * s.hidden * st["ge"], c.dp if c.zero_stage >= 2 else 1)
    else:
        first_grads = grads  # from the 2nd micro-batch on, every gradient exists
    if c.optimizer == "cpu_adam":
        first_grads = 0
    staging = {}
    if c.optimizer == "cpu_adam":
        biggest = s.largest_param() if not c.lora_rank else max(
            c.lora_rank * max(a, b) for a, b in s.linear_shapes().values())
        staging["cpu adam grad staging"] = biggest * (st["ge"] + 4)
    bucket = {"zero2 grad bucket": s.layer_params() * st["ge"]} if c.zero_stage >= 2 and c.dp > 1 and not c.lora_rank else {}
    at_logits = {"saved activations": saved, "model-level saved": extra, "logits + log-softmax": logits, **staging}
    at_layer = {"saved activations": saved, "model-level saved": extra,
                "recompute (one layer)": layer if c.grad_ckpt else 0,
                "backward workspace": t * act.backward_workspace_bytes_per_token(s, e=e), **staging, **bucket}
    a, b = sum(at_logits.values()) + first_grads, sum(at_layer.values()) + grads
    return (at_logits, first_grads) if a >= b else (at_layer, grads)
