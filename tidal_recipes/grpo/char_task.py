"""A character-level tokenizer and a toy reward, for running Hugging Face trainers (TRL's
GRPO) offline on models built from a config: nothing is downloaded."""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

__all__ = ["PAD_ID", "EOS_ID", "char_tokenizer", "reward_sevens"]

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
