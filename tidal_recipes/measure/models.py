"""Qwen2-shape causal LMs with random weights, built on the device, plus AdamW state.

The benchmarks need a realistic *state* (the tensor sizes and counts of a real model and its
optimizer), not trained weights, so nothing is downloaded: the model is built from a config
with random weights, directly on the target device (``with torch.device(device)``), so a 7B
model never passes through host memory.

With transformers importable the model is ``Qwen2ForCausalLM`` from a ``Qwen2Config``;
without it, a plain torch module with the same parameter shapes (what the state layer
sees is the same list of storages). :func:`build_model` says which one it built.
"""

from __future__ import annotations


import torch
from torch import nn

from tidal.plan.shapes import ALL_PRESETS, ModelShape

__all__ = [
    "PRESETS",
    "build_model",
    "make_adamw_state",
    "named_state",
    "StateReference",
]


#: The model shapes by name: the planner's (tidal.plan.shapes), toy ones included.
PRESETS: dict[str, ModelShape] = ALL_PRESETS


def _preset(name: str) -> ModelShape:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}") from None


# ---- the fallback model (no transformers) -------------------------------------------------
class _Attention(nn.Module):
    def __init__(self, p: ModelShape) -> None:
        super().__init__()
        kv_dim = p.kv_heads * (p.hidden // p.heads)
        bias = p.qkv_bias
        self.q_proj = nn.Linear(p.hidden, p.hidden, bias=bias)
        self.k_proj = nn.Linear(p.hidden, kv_dim, bias=bias)
        self.v_proj = nn.Linear(p.hidden, kv_dim, bias=bias)
        self.o_proj = nn.Linear(p.hidden, p.hidden, bias=False)


class _MLP(nn.Module):
    def __init__(self, p: ModelShape) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(p.hidden, p.intermediate, bias=False)
        self.up_proj = nn.Linear(p.hidden, p.intermediate, bias=False)
        self.down_proj = nn.Linear(p.intermediate, p.hidden, bias=False)


class _RMSNormWeight(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))


class _Layer(nn.Module):
    def __init__(self, p: ModelShape) -> None:
        super().__init__()
        self.self_attn = _Attention(p)
        self.mlp = _MLP(p)
        self.input_layernorm = _RMSNormWeight(p.hidden)
        self.post_attention_layernorm = _RMSNormWeight(p.hidden)


class PlainQwen2Shape(nn.Module):
    """Parameters laid out like ``Qwen2ForCausalLM`` (same names and shapes); no forward.
    Only the state matters to the offload benchmark."""

    def __init__(self, p: ModelShape) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(p.vocab, p.hidden)
        self.model.layers = nn.ModuleList(_Layer(p) for _ in range(p.layers))
        self.model.norm = _RMSNormWeight(p.hidden)
        self.lm_head = nn.Linear(p.hidden, p.vocab, bias=False)
        if p.tied_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight


def build_model(
    preset: str, *, device: str | torch.device, dtype: torch.dtype = torch.bfloat16, seed: int = 0
) -> tuple[nn.Module, str]:
    """A causal LM of ``preset``'s shape with random weights, allocated on ``device``
    (``"meta"`` builds it without memory).

    Returns ``(model, description)``; the description names the implementation used
    (transformers' ``Qwen2ForCausalLM`` / ``LlamaForCausalLM``, or the plain-torch fallback
    with the same parameters when transformers is not importable), so callers can print it.
    """
    p = _preset(preset)
    torch.manual_seed(seed)
    try:
        from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config  # noqa: PLC0415 (optional)
    except ImportError:
        AutoModelForCausalLM = None  # noqa: N806
    if AutoModelForCausalLM is not None:
        config = (LlamaConfig if p.family == "llama" else Qwen2Config)(
            hidden_size=p.hidden,
            num_hidden_layers=p.layers,
            num_attention_heads=p.heads,
            num_key_value_heads=p.kv_heads,
            intermediate_size=p.intermediate,
            vocab_size=p.vocab,
            tie_word_embeddings=p.tied_embeddings,
        )
        # The device context makes every parameter born on the device; dtype is passed so
        # no fp32 copy is ever made (a 7B fp32 model would not fit next to its bf16 state).
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        desc = f"transformers {type(model).__name__}"
    else:
        old = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                model = PlainQwen2Shape(p)
        finally:
            torch.set_default_dtype(old)
        desc = f"plain torch {p.family}-shape module (transformers is not importable)"
    model.train()
    return model, desc


def make_adamw_state(model: nn.Module, *, seed: int = 1) -> torch.optim.AdamW:
    """An AdamW over ``model`` whose state exists: every parameter gets a random ``.grad``
    (same dtype and device) and one ``step()`` runs, so the state is params + grads +
    ``exp_avg`` + ``exp_avg_sq`` (plus Adam's scalar ``step``, on the CPU).

    ``foreach=False``: the multi-tensor path makes temporaries the size of every parameter
    at once, which a 7B model on an 80 GB GPU has no room for; one parameter at a time
    needs a temporary of the largest parameter only. The resulting state is the same.
    """
    gen_device = next(model.parameters()).device
    gen = torch.Generator(device=gen_device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.grad = torch.randn(p.shape, dtype=p.dtype, device=p.device, generator=gen)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False, fused=False)
    opt.step()
    return opt


def named_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor of the state by a stable name: ``param:<name>``, ``grad:<name>``,
    ``optim:<name>:<key>``. Looked up afresh each call, so it follows code that swaps
    ``.data`` or replaces ``optimizer.state`` values (the anchor does both)."""
    out: dict[str, torch.Tensor] = {}
    names: dict[int, str] = {}
    for name, p in model.named_parameters():  # tied weights appear once
        names[id(p)] = name
        out[f"param:{name}"] = p
        if p.grad is not None:
            out[f"grad:{name}"] = p.grad
    for p, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                out[f"optim:{names.get(id(p), hex(id(p)))}:{key}"] = value
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    # Compare bytes, not values: NaN != NaN, and -0.0 == 0.0, would fool a value compare.
    return t.reshape(-1).view(torch.uint8)


def _fingerprint(t: torch.Tensor) -> tuple[int, int, int]:
    """(byte count, plain sum, position-weighted sum) of the tensor's bytes, computed on its
    device in chunks. The weighted sum changes for any changed, lost or moved element."""
    flat = t.detach().reshape(-1)
    words = flat.view(torch.int32) if flat.numel() * flat.element_size() % 4 == 0 else flat.view(torch.uint8)
    total = weighted = torch.zeros((), dtype=torch.int64, device=t.device)
    chunk = 1 << 26
    for start in range(0, words.numel(), chunk):
        x = words[start : start + chunk].to(torch.int64)
        w = torch.arange(start + 1, start + 1 + x.numel(), dtype=torch.int64, device=t.device) % 1_000_003 + 1
        total = total + x.sum()
        weighted = weighted + (x * w).sum()
    return int(flat.numel() * flat.element_size()), int(total), int(weighted)


class StateReference:
    """What the state looked like at one moment, to check later that it came back bit-exact.

    ``mode="clone"`` keeps an exact host copy of every tensor (strongest check; costs host
    RAM equal to the state); ``mode="fingerprint"`` keeps per-tensor checksums computed on
    the device (for states too large to copy next to the offloaded ones).
    """

    def __init__(self, tensors: dict[str, torch.Tensor], *, mode: str) -> None:
        if mode not in ("clone", "fingerprint"):
            raise ValueError(f"mode must be 'clone' or 'fingerprint', got {mode!r}")
        self.mode = mode
        self._meta = {k: (t.dtype, tuple(t.shape), t.device) for k, t in tensors.items()}
        if mode == "clone":
            self._data = {k: t.detach().to("cpu", copy=True) for k, t in tensors.items()}
        else:
            self._data = {k: _fingerprint(t) for k, t in tensors.items()}

    def mismatches(self, tensors: dict[str, torch.Tensor]) -> list[str]:
        """Names whose tensor differs (in bytes, dtype, shape or device) or went missing."""
        bad = sorted(set(self._meta) ^ set(tensors))
        for k in self._meta.keys() & tensors.keys():
            t = tensors[k]
            if (t.dtype, tuple(t.shape), t.device) != self._meta[k]:
                bad.append(k)
            elif self.mode == "clone":
                if not torch.equal(_bytes(t.detach().cpu()), _bytes(self._data[k])):
                    bad.append(k)
            elif _fingerprint(t) != self._data[k]:
                bad.append(k)
        return bad
