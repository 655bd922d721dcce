"""TRL's GRPO with tidal: the policy and the reference take turns on the device, the
optimizer state stays on the host between steps. Runs on the CPU in seconds (a tiny model built
from a config; nothing is downloaded).

    pip install -e ".[trl]" && python examples/trl_grpo.py [--steps 20] [--out /tmp/tidal-trl]
"""

from __future__ import annotations

import argparse
import os

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, Qwen2Config
from trl import GRPOConfig

from tidal.integrations.trl import TidalGRPOTrainer
from tidal_recipes.grpo.char_task import EOS_ID, PAD_ID, char_tokenizer, reward_sevens


def save_tiny_model(path: str) -> None:
    """A character-level tokenizer and a 2-layer Qwen2-shape model with random weights."""
    tok = char_tokenizer("0123456789+= ")
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
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", default="tidal-trl")
    a = p.parse_args()
    model_path = os.path.join(a.out, "tiny-model")
    save_tiny_model(model_path)
    trainer = TidalGRPOTrainer(
        model=model_path,
        reward_funcs=reward_sevens,
        args=GRPOConfig(
            output_dir=a.out,
            beta=0.04,
            learning_rate=5e-3,
            max_steps=a.steps,
            num_generations=8,
            per_device_train_batch_size=16,
            max_completion_length=8,
            logging_steps=5,
            report_to=[],
            use_cpu=not torch.cuda.is_available(),
            bf16=False,
            save_strategy="no",
        ),
        train_dataset=Dataset.from_dict({"prompt": [f"{i}+{i}=" for i in range(64)]}),
    )
    trainer.train()
    print(trainer.timeshare.report())


if __name__ == "__main__":
    main()
