"""tidal.plan: a per-phase peak-memory model of a colocated RL step, and a lever recommender.

Imports only the standard library (no torch, no CUDA): a plan is arithmetic on shapes.

* :class:`ModelShape` (presets, ``ModelShape.from_hf_config``, ``ModelShape.from_json``);
* :class:`PlanConfig` -> :func:`build_plan` -> :class:`Plan` (per-phase breakdown, peaks with
  and without timeshare, transition times, assumptions);
* :func:`predict_phases`: the calibration hook (predicted peak allocated bytes per phase);
* :func:`gathered_rollout`: how tidal's TRL trainer holds a sharded policy for generation;
* :func:`recommend`: the cheapest set of memory levers that fits a GPU;
* :func:`trl_vllm_kv_cache_bytes`: the KV cache TRL's colocated vLLM engine gives itself;
* :func:`step_flops`: a step's matmul FLOPs by phase (its compute floor at a measured rate).
"""

from tidal.plan.flops import step_flops
from tidal.plan.model import (
    GIB,
    MIB,
    OPTIMIZERS,
    PHASES,
    Bandwidth,
    Phase,
    Plan,
    PlanConfig,
    Transition,
    build_plan,
    gathered_rollout,
    predict_phases,
)
from tidal.plan.keeps import KeptPhase, kept_host, kept_phases
from tidal.plan.phases import trl_vllm_kv_cache_bytes
from tidal.plan.recommend import LEVER_COSTS, Recommendation, recommend
from tidal.plan.report import format_plan
from tidal.plan.shapes import LORA_TARGETS, PRESETS, ModelShape, load_shape, preset

__all__ = [
    "Bandwidth",
    "GIB",
    "KeptPhase",
    "LEVER_COSTS",
    "LORA_TARGETS",
    "MIB",
    "ModelShape",
    "OPTIMIZERS",
    "PHASES",
    "PRESETS",
    "Phase",
    "Plan",
    "PlanConfig",
    "Recommendation",
    "Transition",
    "build_plan",
    "format_plan",
    "gathered_rollout",
    "kept_host",
    "kept_phases",
    "load_shape",
    "predict_phases",
    "preset",
    "recommend",
    "step_flops",
    "trl_vllm_kv_cache_bytes",
]
