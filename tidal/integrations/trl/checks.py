"""What TidalGRPOTrainer and TidalRLOOTrainer refuse before any work, and what they prepare of
the models TRL loaded before registering them."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["check_launch", "own_storages", "refuse_settings"]


def check_launch(accelerator: Any, who: str) -> None:
    """``ValueError`` for a launch tidal cannot work with (read from TRL's accelerator)."""
    state = accelerator.state
    if accelerator.num_processes > 1:
        raise ValueError(
            f"{who} runs in one process ({accelerator.num_processes} were launched): its "
            f"roles take turns on one device. Launch one process per GPU without accelerate's multi-process "
            f"launcher, or use tidal.distributed for sharded roles"
        )
    if getattr(state, "deepspeed_plugin", None) is not None or getattr(state, "fsdp_plugin", None) is not None:
        raise ValueError(
            f"{who} does not work with DeepSpeed or FSDP through accelerate: those engines keep "
            "their own copies of the state. Turn them off in the accelerate config, or use "
            "tidal.distributed (add_deepspeed_role, FSDP2 roles) directly"
        )


def own_storages(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Weights (and, after a resume, optimizer state) loaded on the CPU may be views of the
    memory-mapped checkpoint file, which tidal cannot free; give each such tensor memory of
    its own (same values; the same Parameter object, so optimizer keys and hooks stay valid).
    On a GPU the load already copied them."""
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            if t.numel() and not t.untyped_storage().resizable():
                t.data = t.data.clone()
        if optimizer is not None and not getattr(optimizer, "tidal_state_on_host", False):
            for st in optimizer.state.values():
                for k, v in st.items():
                    if isinstance(v, torch.Tensor) and v.numel() and not v.untyped_storage().resizable():
                        st[k] = v.clone()


def refuse_settings(args: Any, who: str) -> None:
    """Settings tidal cannot work with, found in the GRPOConfig before TRL builds anything."""
    if args is None:
        return
    if getattr(args, "use_vllm", False):
        raise ValueError(
            f"{who} does not support use_vllm=True: vLLM keeps its own copy of the weights and its own "
            "memory pool, which a timeshare cannot move. Set use_vllm=False (generation then runs on the policy, "
            "which takes turns with the reference)"
        )
    if getattr(args, "torch_compile", False):
        raise ValueError(
            f"{who} does not support torch_compile=True: compiled graphs keep the addresses of the "
            "weights tidal moves. Set torch_compile=False"
        )
    if getattr(args, "deepspeed", None):
        raise ValueError(
            f"{who} does not work with deepspeed= in the training arguments: DeepSpeed keeps its own "
            "copies of the state. Remove it, or use tidal.distributed.add_deepspeed_role directly"
        )
    if getattr(args, "fsdp", None):
        raise ValueError(
            f"{who} does not work with fsdp= in the training arguments; remove it, or build FSDP2 roles "
            "with tidal.distributed directly"
        )
