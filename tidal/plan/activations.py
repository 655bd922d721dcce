"""Activation, KV-cache and logits bytes, per token, of a Llama/Qwen2 decoder.

These are the formulas the planner is built on. Each one counts the *unique storages* that
autograd keeps for backward (parameters excluded), per token of a micro-batch, for the
transformers implementation (``Qwen2DecoderLayer`` / ``LlamaDecoderLayer``, transformers 5)
in a single dtype of itemsize ``e`` (no autocast). Derivation, per decoder layer:

* each RMSNorm upcasts its input to fp32 (``4h``: kept by ``pow`` and ``mul``; when the model
  is fp32 this is the input itself), keeps the normalised value in the model dtype for the
  ``weight *`` product (``e h``), and its output is kept by the next linears (``e h``); plus
  one fp32 ``rsqrt`` per token (4 bytes). Two norms: ``8h + 4eh + 8``.
* attention, ``attn_implementation="sdpa"`` (flash / memory-efficient kernels, no ``s^2``
  score matrix): the rotary products keep only cos/sin (shared by all layers, counted once
  per model), SDPA keeps q (``e q_dim``), k and v (``2 e kv_dim``), its output (``e q_dim``,
  which is also ``o_proj``'s input: one storage) and a fp32 log-sum-exp per head (``4 H``).
  With a padding mask (padded batches) transformers cannot use SDPA's GQA path: k and v are
  repeated to ``q_dim`` first (``2 e q_dim`` instead of ``2 e kv_dim``) and SDPA keeps the
  mask converted to the model dtype (``e s`` per token: a ``(b, 1, s, s)`` tensor per layer).
* attention, ``"eager"``: q, repeated k and v, the transposed output copy (``4 e q_dim``),
  the fp32 softmax output and the probabilities in the model dtype (``H s (4 + e)``; one
  storage when fp32). This *is* quadratic in the sequence length.
* MLP: gate output (kept by SiLU), SiLU output and up output (kept by the product), product
  (kept by ``down_proj``): ``4 e i``.

LoRA (peft, ``lora_dropout=0``): the frozen base linears keep nothing (their weight needs no
gradient); each adapter keeps its input cast to the adapter dtype (``e_lora * in``) and the
``A`` output (``e_lora * rank``). The qkv / gate-up / down inputs that only the base linears
kept are dropped; the SDPA output stays (SDPA keeps it); the frozen RMSNorm weights no
longer need the normalised value (``-2 e h``).

With gradient checkpointing (HF ``GradientCheckpointingLayer``) each layer keeps only its
input (``e h``); backward re-runs one layer at a time, so one layer's full set exists at once.
"""

from __future__ import annotations

__all__ = [
    "DTYPE_BYTES",
    "dtype_bytes",
    "layer_saved_bytes_per_token",
    "model_extra_saved_bytes_per_token",
    "forward_workspace_bytes_per_token",
    "backward_workspace_bytes_per_token",
    "kv_cache_bytes_per_token",
    "ATTN_IMPLEMENTATIONS",
]

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1}
ATTN_IMPLEMENTATIONS = ("sdpa", "eager")


def dtype_bytes(name: str) -> int:
    """Itemsize of a dtype spelled ``bf16``, ``fp16``, ``fp32`` (or ``fp8`` for a KV cache)."""
    aliases = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}
    key = aliases.get(name, name)
    try:
        return DTYPE_BYTES[key]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use one of {sorted(DTYPE_BYTES)}") from None


def _norm_bytes(h: int, e: int) -> int:
    """One RMSNorm: fp32 upcast (4h), normalised value (e h), output (e h), rsqrt (4)."""
    return 4 * h + 2 * e * h + 4


def layer_saved_bytes_per_token(
    shape,
    *,
    e: int,
    seq: int,
    attn: str = "sdpa",
    padding_mask: bool = True,
    lora_rank: int = 0,
    lora_targets: tuple[str, ...] = (),
    lora_e: int = 4,
) -> int:
    """Bytes autograd keeps per token for one decoder layer (no checkpointing), see module doc.

    ``seq`` matters only for the quadratic terms (eager scores, SDPA's converted mask).
    """
    if attn not in ATTN_IMPLEMENTATIONS:
        raise ValueError(f"attn must be one of {ATTN_IMPLEMENTATIONS}, got {attn!r}")
    h, q, kv, i, H = shape.hidden, shape.q_dim, shape.kv_dim, shape.intermediate, shape.heads
    n = 2 * _norm_bytes(h, e)
    # (norm outputs are counted inside _norm_bytes; LoRA may remove them below)
    if attn == "sdpa":
        repeated = padding_mask and shape.kv_heads != shape.heads
        n += e * q + 2 * e * (q if repeated else kv) + e * q + 4 * H
        if padding_mask:
            n += e * seq
    else:
        probs = H * seq * (4 + e) if e != 4 else H * seq * 4
        n += 4 * e * q + probs
    if shape.qk_norm:  # per-head RMSNorm on q and k: fp32 upcasts + normalised values
        n += (4 + e) * (q + kv) + 4 * (H + shape.kv_heads)
    n += 4 * e * i
    if lora_rank > 0 and lora_targets:
        shapes = shape.linear_shapes()
        # Inputs that only frozen base linears kept (the SDPA output feeding o_proj stays:
        # SDPA keeps it). Without a cast (adapter dtype == model dtype) an adapter keeps the
        # very same input storage, so the group's input is kept after all.
        groups = ((("q_proj", "k_proj", "v_proj"), e * h), (("gate_proj", "up_proj"), e * h), (("down_proj",), e * i))
        n -= 2 * e * h  # the frozen norm weights: ``weight * x`` no longer keeps x
        for members, nbytes in groups:
            if lora_e != e or not any(t in lora_targets for t in members):
                n -= nbytes
        for t in lora_targets:
            fan_in = shapes[t][0]
            n += (lora_e * fan_in if lora_e != e else 0) + lora_e * lora_rank
    return n


def model_extra_saved_bytes_per_token(shape, *, e: int, grad_ckpt: bool = False) -> int:
    """Saved bytes outside the decoder layers, per token: token ids kept by the embedding
    (int64), the final RMSNorm with its output kept by the LM head (``4h + 2eh + 4``) and,
    without checkpointing, rotary cos/sin shared by every layer (``2 e head_dim``; ``2 e head_dim / batch`` when positions are shared by the batch, which
    is not assumed). Checkpointed layers receive cos/sin as keyword arguments, not saved."""
    return 8 + _norm_bytes(shape.hidden, e) + (0 if grad_ckpt else 2 * e * shape.head_dim)


def forward_workspace_bytes_per_token(shape, *, e: int, padding_mask: bool = True) -> int:
    """Peak transient bytes per token of a forward without grad (reference, prefill).

    At the MLP of a decoder layer (measured on an H200, transformers 5.17, within 1%): the
    embedding output (held by the model's forward), the layer's input (held by the caller),
    the post-attention residual and the normalised input (``4 e h``), the SiLU output, the up
    output and their product (``3 e i``), rotary cos/sin (``2 e head_dim``). The attention
    block (q, k, v, k/v repeated to ``q_dim`` under a padding mask, output) is taken if larger.
    """
    h, q, kv, i, d = shape.hidden, shape.q_dim, shape.kv_dim, shape.intermediate, shape.head_dim
    kvw = q if (padding_mask and shape.kv_heads != shape.heads) else kv
    attn = 4 * e * h + e * q + 2 * e * (kv + kvw) + e * q
    mlp = 4 * e * h + 3 * e * i
    return max(attn, mlp) + 2 * e * d


def backward_workspace_bytes_per_token(shape, *, e: int) -> int:
    """Gradients in flight while one decoder layer runs backward, per token: the incoming and
    outgoing residual-stream gradients and the normalised input's gradient (``3 e h``) and
    the gradients of the MLP intermediates (SiLU output, up output, gate output: ``3 e i``)."""
    return 3 * e * shape.hidden + 3 * e * shape.intermediate


def kv_cache_bytes_per_token(shape, *, kv_e: int) -> int:
    """KV cache bytes per token of one sequence, all layers: ``2 * layers * kv_dim * e``."""
    return 2 * shape.layers * shape.kv_dim * kv_e
