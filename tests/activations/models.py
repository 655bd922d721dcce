"""Small models for the activation-offload tests."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint

from tests.helpers import enable_checkpointing


class AttnBlock(nn.Module):
    """Attention-shaped: fused qkv split into views, transposes, softmax (saves its output),
    dropout on the probabilities, a tensor saved as a strided view."""

    def __init__(self, hidden: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)  # three views of one storage
        q, k, v = (t.reshape(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-1, -2) / (h // self.heads) ** 0.5
        probs = self.drop(scores.softmax(-1))
        ctx = (probs @ v).transpose(1, 2).reshape(b, s, h)
        return x + self.out(ctx)


class MLPBlock(nn.Module):
    """Gated MLP: silu saves its input, the product saves both factors, dropout."""

    def __init__(self, hidden: int, dropout: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden, bias=False)
        self.gate = nn.Linear(hidden, 4 * hidden, bias=False)
        self.down = nn.Linear(4 * hidden, hidden)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.drop(self.down(F.silu(self.gate(h)) * self.up(h)))


class MixedLM(nn.Module):
    """Embedding, alternating attention / MLP blocks, final norm, head tied to the embedding.
    ``checkpoint=True`` wraps every block in non-reentrant ``torch.utils.checkpoint``;
    ``checkpoint="reentrant"`` in the reentrant one."""

    def __init__(
        self,
        vocab: int = 96,
        hidden: int = 32,
        heads: int = 4,
        pairs: int = 2,
        dropout: float = 0.1,
        checkpoint: bool | str = False,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        blocks: list[nn.Module] = []
        for _ in range(pairs):
            blocks += [AttnBlock(hidden, heads, dropout), MLPBlock(hidden, dropout)]
        self.blocks = nn.ModuleList(blocks)
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.checkpoint = checkpoint

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for blk in self.blocks:
            if self.checkpoint == "reentrant":
                x = torch_checkpoint.checkpoint(blk, x, use_reentrant=True)
            elif self.checkpoint:
                x = torch_checkpoint.checkpoint(blk, x, use_reentrant=False)
            else:
                x = blk(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def tiny_qwen2(
    layers: int = 3,
    *,
    checkpointing: bool = False,
    reentrant: bool = False,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    seed: int = 0,
    attn: str = "eager",
    hidden: int = 64,
    intermediate: int = 128,
    vocab: int = 128,
):
    """A Qwen2 model built from a tiny config (no download), in training mode."""
    from transformers import AutoModelForCausalLM, Qwen2Config  # noqa: PLC0415

    torch.manual_seed(seed)
    cfg = Qwen2Config(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab,
        tie_word_embeddings=True,
        attention_dropout=0.1,
        max_position_embeddings=256,
    )
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=dtype).to(device)
    model.train()
    if checkpointing:
        enable_checkpointing(model, use_reentrant=reentrant)
    return model


def grads_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)), k
