"""transformers' Trainer with tidal: CPU Adam (no optimizer state or gradient kept on the device)
and activation offload (the activations saved for backward wait on the host), switched on by
configuration. A tiny model learns to count; runs on the CPU in seconds (nothing is downloaded).

    pip install -e ".[dev]" && python examples/hf_trainer.py [--steps 30] [--out tidal-trainer]

The snippet in docs/trainer.md is this script without its two flags.
"""

from __future__ import annotations

import argparse
import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainingArguments

from tidal.integrations.hf import TidalTrainer, TidalTrainerConfig
from tidal_recipes.cli.args import output_problem
from tidal_recipes.grpo.char_task import save_tiny_model


def counting(tokenizer, n: int = 256, length: int = 24) -> list[dict]:
    """``n`` rows of digits counting up (mod 10) from a random start: each next token follows."""
    starts = torch.randint(0, 10, (n,), generator=torch.Generator().manual_seed(0)).tolist()
    rows = []
    for s in starts:
        ids = torch.tensor(tokenizer("".join(str((s + i) % 10) for i in range(length)))["input_ids"])
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30, help="optimizer steps (default 30)")
    p.add_argument("--out", default="tidal-trainer", help="output folder (default tidal-trainer)")
    a = p.parse_args()
    if a.steps < 1:
        p.error(f"--steps must be >= 1, got {a.steps}")
    problem = output_problem(a.out, folder=True)
    if problem:
        p.error(f"--out {a.out}: {problem}")
    path = save_tiny_model(os.path.join(a.out, "tiny-model"))  # or your model's path or hub name
    trainer = TidalTrainer(  # in place of transformers.Trainer; every argument as for it
        model=AutoModelForCausalLM.from_pretrained(path),
        args=TrainingArguments(
            output_dir=a.out,
            max_steps=a.steps,
            per_device_train_batch_size=16,
            learning_rate=3e-3,
            max_grad_norm=1.0,
            logging_steps=10,
            report_to=[],
            use_cpu=not torch.cuda.is_available(),
            save_strategy="no",
        ),
        train_dataset=counting(AutoTokenizer.from_pretrained(path)),
        tidal=TidalTrainerConfig(
            cpu_adam=True,  # tidal.CPUAdam from the TrainingArguments: no optimizer state on the device
            activation_offload=True,  # the loss forward's saved activations wait on the host
            activation_min_offload_bytes=0,  # this model's are tiny: offload them all the same
        ),
    )
    trainer.train()  # logs carry tidal/act_offloaded_gb, tidal/act_reloaded_gb, tidal/optimizer_step_s
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {a.steps} steps")


if __name__ == "__main__":
    main()
