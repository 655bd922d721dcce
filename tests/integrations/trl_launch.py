"""One process of a multi-process TRL run, as ``torchrun`` or ``accelerate launch`` starts it:
TRL's trainer alone, then tidal's in its place, with the same arguments, in the same
processes. Each writes what the test compares (rank 0: the log history and the final weights;
every rank: its own weights' digest, which must agree across ranks).

    torchrun --nproc_per_node 2 tests/integrations/trl_launch.py MODEL OUT [--algo grpo|rloo]
        [--prefetch] [--residency step|stream|role] [--steps N] [--accumulation N] [--runs trl,tidal]
        [--fsdp2 [--lend] [--ram-efficient]] [--sync-ref] [--save-weights]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os

import torch


def _whole_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's whole value on the host (an FSDP2 DTensor gathered: a collective,
    every rank calls it)."""
    out = {}
    for name, p in sorted(model.named_parameters()):
        t = p.detach()
        full = getattr(t, "full_tensor", None)
        out[name] = (full() if callable(full) else t).cpu()
    return out


def _weights_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in _whole_weights(model).items():
        h.update(name.encode())
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


_RAM_EFFICIENT = [False]  # the FSDP2 plugin's cpu_ram_efficient_loading for the next run


def _fsdp2_on_cpu() -> None:
    """accelerate turns FSDP on only for GPU launches (a CPU launch is MULTI_CPU, with no FSDP
    plugin): here the CPU launch gets the FSDP2 plugin TRL's fsdp2.yaml gives a GPU launch, so
    that the same trainer code runs over gloo."""
    import accelerate.state as state
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    init = state.AcceleratorState.__init__

    def with_fsdp2(self, *a, **kw):
        init(self, *a, **kw)
        if self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = FullyShardedDataParallelPlugin(
                fsdp_version=2,
                auto_wrap_policy="transformer_based_wrap",
                transformer_cls_names_to_wrap=["Qwen2DecoderLayer"],
                reshard_after_forward=True,
                state_dict_type="FULL_STATE_DICT",
                cpu_ram_efficient_loading=_RAM_EFFICIENT[0],
            )
        elif getattr(self, "fsdp_plugin", None) is not None:
            self.fsdp_plugin.cpu_ram_efficient_loading = _RAM_EFFICIENT[0]

    state.AcceleratorState.__init__ = with_fsdp2


def _ram_efficient_loading(on: bool) -> None:
    """The next run's FSDP2 loading as with ``fsdp_cpu_ram_efficient_loading: true``: only
    rank 0's weights count, accelerate sends every rank its shards. The other ranks' models
    here are loaded and then filled with NaN, standing for the weights they never read (meta
    tensors under transformers' loading for that launch): a rank that shards its own copy as
    loaded trains on them and its results differ."""
    import accelerate.state as state
    from transformers.modeling_utils import PreTrainedModel

    _RAM_EFFICIENT[0] = on
    if not hasattr(PreTrainedModel, "_tidal_loaded"):
        load = PreTrainedModel.from_pretrained.__func__

        def from_pretrained(cls, *args, **kwargs):
            model = load(cls, *args, **kwargs)
            if _RAM_EFFICIENT[0] and int(os.environ.get("RANK", "0")) != 0:
                with torch.no_grad():
                    # The parameters only: transformers computes the non-persistent buffers
                    # (rotary frequencies) on every rank, as they are not sent.
                    for t in model.parameters():
                        if t.is_floating_point() and t.device.type != "meta":
                            t.fill_(float("nan"))
            return model

        PreTrainedModel.from_pretrained = classmethod(from_pretrained)
        PreTrainedModel._tidal_loaded = True
    shared = getattr(state.AcceleratorState, "_shared_state", {})
    if shared.get("fsdp_plugin") is not None:
        shared["fsdp_plugin"].cpu_ram_efficient_loading = on


def _out_of_memory_once_in_a_crowded_generation(trainer) -> None:
    """The first forward of ``trainer``'s policy in a generation gathered whole (no parameter
    a DTensor) with another role's state on the device (resident, or brought in by a prefetch)
    raises ``torch.OutOfMemoryError``, once."""
    from torch.distributed.tensor import DTensor

    policy, ts = trainer.model, trainer.timeshare
    state = {"raised": False}

    def crowded(module, args):
        if state["raised"] or torch.is_grad_enabled():
            return
        gathered = not any(isinstance(p, DTensor) for p in policy.parameters())
        if gathered and (len(ts.resident_roles) > 1 or ts.store.prefetched_keys()):
            state["raised"] = True
            raise torch.OutOfMemoryError("CUDA out of memory (faked by the test)")

    policy.register_forward_pre_hook(crowded)


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
    p.add_argument("--runs", default="trl,tidal", help="the runs, in order: trl or tidal, each once or more")
    p.add_argument("--save-weights", action="store_true", help="rank 0 also saves the final weights (whole)")
    p.add_argument("--fsdp2", action="store_true", help="an FSDP2 launch (see _fsdp2_on_cpu)")
    p.add_argument("--sync-ref", action="store_true", help="sync_ref_model=True, every step")
    p.add_argument(
        "--lend",
        action="store_true",
        help="with --fsdp2: the policy gathered for generation lends its shards to the host (as without the room)",
    )
    p.add_argument(
        "--oom-generation-on",
        type=int,
        default=None,
        help="tidal's runs: this rank's policy raises torch.OutOfMemoryError once, in a forward of a "
        "gathered generation with another role's state on its device (as a step whose generation grew)",
    )
    p.add_argument(
        "--ram-efficient",
        action="store_true",
        help="with --fsdp2: tidal's runs load as with fsdp_cpu_ram_efficient_loading (only rank 0 loads)",
    )
    a = p.parse_args()
    if a.fsdp2:
        _fsdp2_on_cpu()
    torch.set_num_threads(1)  # one process per core
    freed: list[int] = []  # what each release of DDP's buckets gave back
    release = GradientBuckets.release

    def counted_release(self):
        n = release(self)
        if n:
            freed.append(n)
        return n

    GradientBuckets.release = counted_release
    gathers: list[int] = []  # generations run with the policy gathered once (FSDP2)
    import tidal.integrations.trl.launch as launch_mod

    gathered = launch_mod.gathered

    def counted_gathered(model, **kw):
        gathers.append(1)
        return gathered(model, **kw)

    launch_mod.gathered = counted_gathered
    hooks_off: list[bool] = []  # whether each gathered generation ran without FSDP2's hooks
    off = launch_mod.hooks_off_while_gathered

    @contextlib.contextmanager
    def counted_off(model):
        with off(model) as taken:
            hooks_off.append(taken)
            yield taken

    launch_mod.hooks_off_while_gathered = counted_off
    if a.lend:
        # As where a full copy fits only once the policy's own shards are out (at 32B on 4 GPUs).
        mode = launch_mod.gather_mode
        launch_mod.gather_mode = lambda *args: "lending" if mode(*args) == "whole" else mode(*args)
    rank = int(os.environ.get("RANK", "0"))
    config_cls, plain_cls, tidal_cls = {
        "grpo": (trl.GRPOConfig, trl.GRPOTrainer, TidalGRPOTrainer),
        "rloo": (trl.RLOOConfig, trl.RLOOTrainer, TidalRLOOTrainer),
    }[a.algo]
    cfg = TidalConfig(prefetch=a.prefetch, optimizer_residency=a.residency)
    seen: dict[str, int] = {}
    for kind in a.runs.split(","):
        seen[kind] = seen.get(kind, 0) + 1
        name = kind if seen[kind] == 1 else f"{kind}{seen[kind]}"  # trl, trl2, ...
        cls, extra = (plain_cls, {}) if kind == "trl" else (tidal_cls, {"tidal": cfg})
        if a.fsdp2:
            _ram_efficient_loading(a.ram_efficient and kind == "tidal")
        freed.clear()
        gathers.clear()
        hooks_off.clear()
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
            # Each rank loads the models whole (TRL's device_map="auto" under FSDP spreads them
            # over the GPUs the process sees; tidal sets this itself, TRL alone needs it said).
            model_init_kwargs={"device_map": None},
            **({"sync_ref_model": True, "ref_model_sync_steps": 1, "ref_model_mixup_alpha": 0.5} if a.sync_ref else {}),
        )
        trainer = cls(
            model=a.model,
            reward_funcs=reward_sevens,
            args=args,
            train_dataset=Dataset.from_dict({"prompt": [f"{i}+{i}=" for i in range(16)]}),
            **extra,
        )
        if kind == "tidal" and a.oom_generation_on == rank:
            _out_of_memory_once_in_a_crowded_generation(trainer)
        trainer.train()
        policy = trainer.accelerator.unwrap_model(trainer.model)
        digest = _weights_digest(policy)
        report = {
            "rank": rank,
            "digest": digest,
            "world": trainer.accelerator.num_processes,
            "launch": str(trainer.accelerator.distributed_type),
        }
        if kind == "tidal":
            recs = trainer.timeshare.records
            report["moves"] = [[r.kind, list(r.roles_out), r.role_in, r.bytes_out, r.bytes_in, r.note] for r in recs]
            report["buckets_freed"] = list(freed)
            report["gathered_generations"] = len(gathers)
            report["hooks_off"] = list(hooks_off)
            if trainer.ref_model is not None:
                from torch.distributed.fsdp import FSDPModule

                report["reference_units"] = sum(isinstance(m, FSDPModule) for m in trainer.ref_model.modules())
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
        if a.save_weights:
            whole = _whole_weights(policy)
            if rank == 0:
                torch.save(whole, os.path.join(out, "weights.pt"))
        if kind == "tidal":
            trainer.timeshare.close()
        del trainer
    if torch.distributed.is_initialized():  # every rank done, then its process group closed
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
