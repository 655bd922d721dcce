"""The planner held against runs that were measured (benchmarks/results/*.json, recorded on the
GPU machines): given the run's model, batch and machine, it recommends what ran and predicts
its host memory and device peak within 10%. A drift of the model fails here, on a CPU."""

from __future__ import annotations

import json
from pathlib import Path

from tidal.plan import GIB, PlanConfig, build_plan, recommend

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def _run(name: str, variant: str) -> dict:
    data = json.loads((RESULTS / name).read_text())
    return next(v for v in data["variants"] if v["variant"] == variant)


# The 14B shape inside TRL on one H100 (2026-11-27, e8daabd): 64 x 256 in micro-batches of 16,
# TRL's fused LM head scoring the completion, gradient checkpointing, transformers' fused AdamW.
TRL_14B = dict(
    shape="qwen2.5-14b",
    prompts=8,
    group=8,
    prompt_len=8,
    gen_len=256,
    micro_batch=16,
    grad_ckpt=True,
    logprob_span="completion",
    lm_head="fused",
    adamw_foreach=False,
)


def test_the_14b_run_on_one_h100_is_what_the_planner_recommends_and_predicts():
    """The run streamed AdamW's state through the step (``optimizer_residency="stream"``); the
    planner, which searched only the whole-state offload, had recommended CPU Adam (275 GiB
    pinned), which has not run at that size. It searches the streamed step as a lever now."""
    run = _run("trl_qwen2.5-14b_64x256_h100_2026-11-27_e8daabd.json", "stream+prefetch")
    rec = recommend(PlanConfig(**TRL_14B), gpu_mem_bytes=int(79.2 * GIB), host_mem_bytes=run["host_total_bytes"])
    assert rec.fits and rec.levers == ["optimizer_stream"]  # what ran: stream residency
    assert rec.plan.config.optim_stream_chunk_bytes == 256 << 20
    assert 'TidalConfig(optimizer_residency="stream")' in "\n".join(rec.summary())
    plan = build_plan(PlanConfig(**TRL_14B, optimizer="adamw_offload", optim_stream_chunk_bytes=256 << 20))
    assert abs(plan.node_host_bytes / run["host_held_bytes"] - 1) <= 0.10
    assert abs(plan.device_peak_bytes / run["peak_bytes"] - 1) <= 0.10
    assert rec.plan.node_host_bytes == plan.node_host_bytes
