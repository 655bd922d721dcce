"""Activation offload: saved activations grouped by layer, copied to pinned host memory while
the next layers compute, prefetched during backward; composes with non-reentrant gradient
checkpointing; a planner chooses keep / offload / recompute per layer from a memory budget.

Imports nothing that touches CUDA; an offloader on an accelerator initialises it."""

from tidal.activations.config import ActivationOffloadConfig, LayerMode, StepReport
from tidal.activations.offload import ActivationOffloader, offload_activations
from tidal.activations.planner import ActivationPlan, LayerProfile, plan_from_report, plan_layers, simulate

__all__ = [
    "ActivationOffloadConfig",
    "ActivationOffloader",
    "ActivationPlan",
    "LayerMode",
    "LayerProfile",
    "StepReport",
    "offload_activations",
    "plan_from_report",
    "plan_layers",
    "simulate",
]
