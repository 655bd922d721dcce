"""The launches TidalGRPOTrainer and TidalRLOOTrainer run under, read from TRL's accelerator
before it wraps any model: one process; several under ``torchrun`` or ``accelerate launch``
with DDP (each rank's roles take turns on its own device, moving their whole state). What
else is refused, before any work, names the launch that works."""

from __future__ import annotations

from typing import Any, Literal

import torch

__all__ = ["Launch", "check_launch", "runs_collectives", "use_bucket_views"]

Launch = Literal["single", "ddp"]

# accelerate's distributed types that wrap the policy in DistributedDataParallel.
_DDP_TYPES = frozenset(
    {"MULTI_CPU", "MULTI_GPU", "MULTI_NPU", "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA", "MULTI_XPU", "MULTI_HPU"}
)


def check_launch(accelerator: Any, who: str) -> Launch:
    """The launch ``accelerator`` stands for. ``ValueError`` for one tidal cannot work with:
    DeepSpeed or FSDP through accelerate (those engines keep their own copies of the state),
    and multi-process types other than DDP's."""
    state = accelerator.state
    ways = (
        "Launch with torchrun or with accelerate's multi_gpu config (DDP: each rank's roles take turns on its own GPU)"
    )
    if getattr(state, "deepspeed_plugin", None) is not None:
        raise ValueError(
            f"{who} does not work with DeepSpeed through accelerate: its engine keeps its own copies of the "
            f"state, which tidal cannot move from the trainer. {ways}; or drive a DeepSpeed engine yourself with "
            "tidal.distributed.add_deepspeed_role"
        )
    if getattr(state, "fsdp_plugin", None) is not None:
        raise ValueError(f"{who} does not work with FSDP through accelerate yet. {ways}")
    if accelerator.num_processes <= 1:
        return "single"
    kind = str(getattr(state.distributed_type, "value", state.distributed_type))
    if kind not in _DDP_TYPES:
        raise ValueError(
            f"{who} does not work with accelerate's {kind} launch ({accelerator.num_processes} processes). {ways}"
        )
    return "ddp"


def use_bucket_views(accelerator: Any) -> None:
    """Make the DistributedDataParallel wrapper that ``accelerator.prepare`` builds keep the
    gradients as views of its buckets (``gradient_as_bucket_view=True``: the same values, one
    copy of the gradients less), so that tidal can free the buckets between steps
    (:class:`tidal.distributed.GradientBuckets`). Called before the trainer prepares the model."""
    from accelerate.utils import DistributedDataParallelKwargs

    handler = getattr(accelerator, "ddp_handler", None)
    if handler is None:
        handler = accelerator.ddp_handler = DistributedDataParallelKwargs()
    handler.gradient_as_bucket_view = True


def runs_collectives(model: torch.nn.Module) -> bool:
    """A forward of ``model`` takes part in collectives (a DDP wrapper syncs its buffers and
    prepares the reducer): run again on one rank alone, it would meet the other ranks in
    another collective. The module inside the wrapper runs none."""
    return isinstance(model, torch.nn.parallel.DistributedDataParallel)
