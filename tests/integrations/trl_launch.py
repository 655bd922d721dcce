"""One process of a multi-process TRL run, as ``torchrun`` or ``accelerate launch`` starts it:
TRL's trainer alone, then tidal's in its place, with the same arguments, in the same
processes. Each writes what the test compares (rank 0: the log history and the final weights;
every rank: its own weights' digest, which must agree across ranks).

    torchrun --nproc_per_node 2 tests/integrations/trl_launch.py MODEL OUT [--algo grpo|rloo]
        [--prefetch] [--residency step|stream|role] [--steps N] [--accumulation N]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os

import torch


def _weights_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        t = p.detach()
        full = getattr(t, "full_tensor", None)  # an FSDP2 DTensor: its whole value
        t = full() if callable(full) else t
        h.update(name.encode())
        h.update(t.cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    import trl
    from datasets import Dataset

    from tidal.distributed import GradientBuckets
    from tidal.integrations.trl import TidalConfig, TidalGRPOTrainer, TidalRLOOTrainer
    from tidal_recipes.grpo.char_task import reward_sevens

    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("out")
    p.add_argument("--algo", choices=("grpo", "rloo"), default="grpo")
    p.add_argument("--prefetch", action="store_true")
    p.add_argument("--residency", default="step")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--accumulation", type=int, default=1)
    p.add_argument("--only", choices=("trl", "tidal"), default=None)
    a = p.parse_args()
    torch.set_num_threads(1)  # one process per core
    freed: list[int] = []  # what each release of DDP's buckets gave back
    release = GradientBuckets.release

    def counted_release(self):
        n = release(self)
        if n:
            freed.append(n)
        return n

    GradientBuckets.release = counted_release
    rank = int(os.environ.get("RANK", "0"))
    config_cls, plain_cls, tidal_cls = {
        "grpo": (trl.GRPOConfig, trl.GRPOTrainer, TidalGRPOTrainer),
        "rloo": (trl.RLOOConfig, trl.RLOOTrainer, TidalRLOOTrainer),
    }[a.algo]
    runs = [
        ("trl", plain_cls, {}),
        ("tidal", tidal_cls, {"tidal": TidalConfig(prefetch=a.prefetch, optimizer_residency=a.residency)}),
    ]
    for name, cls, extra in runs:
        if a.only not in (None, name):
            continue
        out = os.path.join(a.out, name)
        args = config_cls(
            output_dir=out,
            per_device_train_batch_size=4,
            gradient_accumulation_steps=a.accumulation,
            num_generations=4,
            max_completion_length=6,
            max_steps=a.steps,
            beta=0.1,
            learning_rate=1e-2,
            logging_steps=1,
            report_to=[],
            use_cpu=not torch.cuda.is_available(),
            seed=0,
            save_strategy="no",
            bf16=False,
        )
        trainer = cls(
            model=a.model,
            reward_funcs=reward_sevens,
            args=args,
            train_dataset=Dataset.from_dict({"prompt": [f"{i}+{i}=" for i in range(16)]}),
            **extra,
        )
        trainer.train()
        policy = trainer.accelerator.unwrap_model(trainer.model)
        digest = _weights_digest(policy)
        report = {"rank": rank, "digest": digest, "world": trainer.accelerator.num_processes}
        if name == "tidal":
            recs = trainer.timeshare.records
            report["moves"] = [[r.kind, list(r.roles_out), r.role_in, r.bytes_out, r.bytes_in] for r in recs]
            report["buckets_freed"] = list(freed)
            report["param_bytes"] = sum(p.numel() * p.element_size() for p in policy.parameters())
            report["tidal_logs"] = [
                {k: v for k, v in h.items() if k.startswith("tidal/")} for h in trainer.state.log_history
            ]
        if rank == 0:
            keys = ("loss", "reward", "kl", "grad_norm")
            report["history"] = [[h.get(k) for k in keys] for h in trainer.state.log_history if "loss" in h]
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(report, f)
        if name == "tidal":
            trainer.timeshare.close()
        del trainer


if __name__ == "__main__":
    main()
