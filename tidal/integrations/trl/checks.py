"""The training arguments TidalGRPOTrainer and TidalRLOOTrainer refuse before any work, and
what they prepare of the models TRL loaded before registering them (the launch: ``launch``)."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from tidal.optim import CPUAdam

__all__ = [
    "colocated_vllm",
    "own_storages",
    "place_models_whole",
    "refuse_host_optimizer",
    "refuse_settings",
    "refuse_vllm_launch",
]


def own_storages(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Weights (and, after a resume, optimizer state) loaded on the CPU may be views of the
    memory-mapped checkpoint file, which tidal cannot free; give each such tensor memory of
    its own (same values; the same Parameter object, so optimizer keys and hooks stay valid).
    On a GPU the load already copied them."""
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            if isinstance(t, DTensor):
                continue  # its shard is memory FSDP allocated when it sharded the model
            if t.numel() and not t.untyped_storage().resizable():
                t.data = t.data.clone()
        if optimizer is not None and not getattr(optimizer, "tidal_state_on_host", False):
            for st in optimizer.state.values():
                for k, v in st.items():
                    plain = isinstance(v, torch.Tensor) and not isinstance(v, DTensor)
                    if plain and v.numel() and not v.untyped_storage().resizable():
                        st[k] = v.clone()


def colocated_vllm(args: Any) -> bool:
    """The training arguments ask for TRL's vLLM engine in this process (``use_vllm=True``,
    ``vllm_mode="colocate"``)."""
    return bool(getattr(args, "use_vllm", False)) and getattr(args, "vllm_mode", "colocate") == "colocate"


def refuse_settings(args: Any, who: str, tidal: Any = None) -> None:
    """Settings tidal cannot work with, found in the GRPOConfig (and ``tidal``, the
    TidalConfig) before TRL builds anything."""
    if args is None:
        return
    if getattr(tidal, "vllm_kv_cache_bytes", None) == "auto" and colocated_vllm(args):
        if getattr(args, "vllm_max_model_length", None) is None:
            raise ValueError(
                f"{who}: TidalConfig(vllm_kv_cache_bytes='auto') sizes the engine's KV cache for every sequence "
                "of a generation at its longest, and needs that length: set vllm_max_model_length in the "
                "GRPOConfig (the longest prompt plus max_completion_length), or give vllm_kv_cache_bytes in bytes"
            )
    if getattr(args, "use_vllm", False):
        mode = getattr(args, "vllm_mode", "colocate")
        if mode not in ("colocate", "server"):
            raise ValueError(
                f"{who} supports use_vllm=True with vllm_mode='colocate' (the engine in this process, a turn of the "
                f"timeshare) or 'server' (the engine on other GPUs), not vllm_mode={mode!r}"
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
            f"{who} does not work with fsdp= in the training arguments; remove it and launch with accelerate's "
            "FSDP2 config (accelerate launch --config_file fsdp2.yaml, fsdp_version: 2), which tidal supports"
        )


def place_models_whole(args: Any) -> None:
    """Under FSDP, TRL loads the models it builds from a path (the policy, the reference) with
    ``device_map="auto"``, which spreads each over every GPU the process sees (it sets
    ``device_map=None`` only for DDP and DeepSpeed launches): the reference is then sharded
    across GPUs and its first forward fails on tensors of two devices. Where the training
    arguments name no ``device_map``, they get ``None`` (each rank loads whole, and FSDP shards
    onto the rank's GPU), as TRL does for DDP."""
    if args is None:
        return
    state = getattr(args, "distributed_state", None)
    kind = str(getattr(getattr(state, "distributed_type", None), "value", getattr(state, "distributed_type", "")))
    kwargs = getattr(args, "model_init_kwargs", None)
    if kind == "FSDP" and "device_map" not in (kwargs or {}):
        args.model_init_kwargs = {**(kwargs or {}), "device_map": None}


def refuse_host_optimizer(optimizer: Any, launch: str, who: str) -> None:
    """``ValueError`` for :class:`tidal.CPUAdam` in a launch of several processes: it takes each
    gradient to the host as the backward produces it, before DDP's all-reduce or FSDP2's
    reduce-scatter has made it the gradient of the whole batch, so every rank would step on its
    own gradients."""
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper holds the torch one
    if launch != "single" and isinstance(inner, CPUAdam):
        raise ValueError(
            f"{who} cannot use tidal.CPUAdam with several processes ({launch}): it takes each gradient to the "
            f"host as the backward produces it, before the ranks' gradients are reduced. Use torch's AdamW with "
            f"TidalConfig(optimizer_residency='stream') (its state on the host between steps), or one process"
        )


def refuse_vllm_launch(args: Any, launch: str, who: str) -> None:
    """``ValueError`` for vLLM generation in a launch of several processes (each rank's engine
    taking turns with its roles is not built yet)."""
    if getattr(args, "use_vllm", False) and launch != "single":
        raise ValueError(
            f"{who} runs use_vllm=True in one process for now, not under a {launch} launch of several. "
            "Run one process, or set use_vllm=False (generation on the policy, which works under DDP and FSDP2)"
        )
