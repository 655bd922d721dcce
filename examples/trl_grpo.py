"""TRL's GRPO with tidal: the policy and the reference take turns on the device, the
optimizer state stays on the host between steps. Runs on the CPU in seconds (a tiny model built
from a config; nothing is downloaded).

    pip install -e ".[trl]" && python examples/trl_grpo.py [--steps 10] [--out tidal-trl]
    torchrun --nproc_per_node 2 examples/trl_grpo.py    # the same, one process per GPU (DDP)

The snippet in docs/trl.md is this script without its two flags.
"""

from __future__ import annotations

import argparse
import os

import torch
from datasets import Dataset
from trl import GRPOConfig

from tidal.integrations.trl import TidalConfig, TidalGRPOTrainer
from tidal_recipes.cli.args import output_problem
from tidal_recipes.grpo.char_task import reward_sevens, save_tiny_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10, help="GRPO steps (default 10)")
    p.add_argument("--out", default="tidal-trl", help="output folder (default tidal-trl)")
    a = p.parse_args()
    if a.steps < 1:
        p.error(f"--steps must be >= 1, got {a.steps}")
    problem = output_problem(a.out, folder=True)
    if problem:
        p.error(f"--out {a.out}: {problem}")
    trainer = TidalGRPOTrainer(  # in place of trl.GRPOTrainer; every argument as for it
        model=save_tiny_model(os.path.join(a.out, "tiny-model")),  # or your model's path or hub name
        reward_funcs=reward_sevens,  # how many 7s each completion holds
        args=GRPOConfig(
            output_dir=a.out,
            beta=0.04,  # > 0: TRL builds a reference, which takes turns with the policy
            learning_rate=5e-3,
            max_steps=a.steps,
            num_generations=8,
            per_device_train_batch_size=16,
            max_completion_length=8,
            logging_steps=5,
            report_to=[],
            use_cpu=not torch.cuda.is_available(),  # TRL's defaults (bf16) expect a GPU
            bf16=False,
            save_strategy="no",
        ),
        train_dataset=Dataset.from_dict({"prompt": [f"{i}+{i}=" for i in range(64)]}),
        tidal=TidalConfig(optimizer_residency="step"),  # optional: "step" (default), "stream", "role"
    )
    trainer.train()  # logs carry tidal/transitions, tidal/moved_gb, tidal/gbps
    print(trainer.timeshare.report())
    if torch.distributed.is_initialized():  # under torchrun: every rank done, then the group closed
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
