"""Small models and state snapshots shared by the tests."""

from __future__ import annotations

import torch
import torch.nn as nn


class TinyLM(nn.Module):
    """A small language-model-shaped module that exercises every storage layout tidal must
    survive: tied weights, a parameter that is a view of a buffer, a non-contiguous
    parameter, mixed dtypes (bf16, int64, bool buffers), dropout."""

    def __init__(self, vocab: int = 64, hidden: int = 32, layers: int = 2, dropout: float = 0.1) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.LayerNorm(hidden),
                nn.Linear(hidden, 4 * hidden),
                nn.GELU(),
                nn.Linear(4 * hidden, hidden),
                nn.Dropout(dropout),
            )
            for _ in range(layers)
        )
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("flat", torch.randn(hidden * 3))
        self.scale = nn.Parameter(self.flat[hidden : 2 * hidden].view(hidden))  # view of a buffer
        self.mix = nn.Parameter(torch.randn(hidden, 8).t())  # non-contiguous
        self.gate_bf16 = nn.Parameter(torch.randn(hidden, dtype=torch.bfloat16))
        self.register_buffer("steps", torch.arange(7, dtype=torch.int64))
        self.register_buffer("mask", torch.rand(hidden) > 0.5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for blk in self.blocks:
            x = x + blk(x)
        x = x * self.scale * self.gate_bf16.float() * self.mask
        x = x + (x @ self.mix.t()) @ self.mix
        return self.head(x)


def lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def snapshot_state(model: nn.Module, opt: torch.optim.Optimizer | None = None) -> dict[str, torch.Tensor]:
    """Host copies of every param, grad, buffer and optimizer state tensor, by name (on the
    host so that a snapshot never counts against device memory)."""
    out: dict[str, torch.Tensor] = {}
    for n, p in model.named_parameters():
        out[n] = p.detach().to("cpu", copy=True)
        if p.grad is not None:
            out[n + ".grad"] = p.grad.to("cpu", copy=True)
    for n, b in model.named_buffers():
        out["buf:" + n] = b.to("cpu", copy=True)
    if opt is not None:
        names = {id(p): n for n, p in model.named_parameters()}
        for p, st in opt.state.items():
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    out[f"opt:{names.get(id(p), id(p))}.{k}"] = v.to("cpu", copy=True)
    return out


def assert_same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        # Compare bytes, so NaN payloads and -0.0 count too.
        assert torch.equal(
            a[k].reshape(-1).view(torch.uint8) if a[k].dtype != torch.bool else a[k],
            b[k].reshape(-1).view(torch.uint8) if b[k].dtype != torch.bool else b[k],
        ), k


def make_trained(device: str = "cpu", seed: int = 0, **opt_kwargs):
    """A TinyLM with grads and AdamW state after one step."""
    torch.manual_seed(seed)
    model = TinyLM().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, **opt_kwargs)
    ids = torch.randint(0, 64, (4, 9), device=device)
    lm_loss(model, ids).backward()
    opt.step()
    lm_loss(model, ids).backward()  # leave grads in place
    return model, opt


def enable_checkpointing(model: nn.Module, *, use_reentrant: bool | None = None) -> None:
    """Hugging Face gradient checkpointing on ``model``, by the name this transformers gives it
    (5.2x renamed it activation checkpointing; the old name still works there, with a warning).
    ``use_reentrant=None`` keeps transformers' default."""
    new = hasattr(model, "activation_checkpointing_enable")
    enable = model.activation_checkpointing_enable if new else model.gradient_checkpointing_enable
    if use_reentrant is None:
        enable()
    else:
        key = "activation_checkpointing_kwargs" if new else "gradient_checkpointing_kwargs"
        enable(**{key: {"use_reentrant": use_reentrant}})


def is_out(x: torch.Tensor | torch.UntypedStorage) -> bool:
    """Whether the storage of a tensor (or a storage) holds none of its bytes: moved out by tidal
    (a released storage keeps its size while guarded, so this is not ``nbytes() == 0``), or
    empty (a ZeRO-3 placeholder)."""
    from tidal.state.backends import holds_memory

    return not holds_memory(x.untyped_storage() if isinstance(x, torch.Tensor) else x)


def held_bytes(x: torch.Tensor | torch.UntypedStorage) -> int:
    """The device bytes a tensor's (or a storage's) storage holds: its size, or 0 when tidal
    released its memory."""
    from tidal.state.backends import counted_nbytes

    return counted_nbytes(x.untyped_storage() if isinstance(x, torch.Tensor) else x)


class FakeAllocator:
    """The device's allocated bytes and peak counter, driven by the test."""

    def __init__(self) -> None:
        self.now = self.high = 0

    def set(self, nbytes: int) -> None:
        self.now = nbytes
        self.high = max(self.high, nbytes)

    def reset(self) -> None:
        self.high = self.now
