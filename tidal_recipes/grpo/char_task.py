"""A character-level tokenizer and a toy reward, for running Hugging Face trainers (TRL's
GRPO) offline on models built from a config: nothing is downloaded."""

from __future__ import annotations

import os

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
    ``model="path"``) then loads; returns ``path``. Nothing is downloaded.

    Safe to call from every process of a launch (``torchrun``, ``accelerate launch``) at once:
    each writes a folder of its own beside ``path`` and renames it into place; where ``path``
    holds a saved model already (another process's, or an earlier run's), that one is kept."""
    import shutil  # noqa: PLC0415
    import tempfile  # noqa: PLC0415

    import torch  # noqa: PLC0415
    from transformers import AutoModelForCausalLM, Qwen2Config  # noqa: PLC0415

    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tiny-model-", dir=parent)
    try:
        tok = char_tokenizer(chars)
        tok.save_pretrained(tmp)
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
        AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp)
        if os.path.isdir(path) and not os.listdir(path):
            os.rmdir(path)  # an empty folder made for it: taken by the rename
        try:
            os.rename(tmp, path)
        except OSError:
            if not os.path.isfile(os.path.join(path, "config.json")):
                raise  # not another process's model: a folder in the way
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path
