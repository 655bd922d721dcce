"""A character-level tokenizer and a toy reward, for running Hugging Face trainers (TRL's
GRPO) offline on models built from a config: nothing is downloaded."""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

__all__ = ["PAD_ID", "EOS_ID", "char_tokenizer", "reward_sevens", "save_tiny_model"]

PAD_ID, EOS_ID = 0, 1


def char_tokenizer(chars: Sequence[str]) -> PreTrainedTokenizerFast:
    """One token per character of ``chars``, after ``<pad>`` (id 0) and ``<eos>`` (id 1);
    unknown characters map to ``<pad>``."""
    vocab = {c: i for i, c in enumerate(["<pad>", "<eos>", *chars])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def reward_sevens(completions: Sequence[str], **kwargs) -> list[float]:
    """How many 7s each completion holds: a task a small model learns in a few steps."""
    return [float(c.count("7")) for c in completions]


def save_tiny_model(path: str, *, chars: str = "0123456789+= ", seed: int = 0) -> str:
    """Save a character-level tokenizer over ``chars`` and a 2-layer Qwen2-shape causal LM with
    random weights (seeded) to the folder ``path``, which ``from_pretrained`` (and TRL's
    ``model="path"``) then loads; returns ``path``. Nothing is downloaded."""
    import torch  # noqa: PLC0415
    from transformers import AutoModelForCausalLM, Qwen2Config  # noqa: PLC0415

    tok = char_tokenizer(chars)
    tok.save_pretrained(path)
    cfg = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=PAD_ID,
        eos_token_id=EOS_ID,
        bos_token_id=EOS_ID,
    )
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path
