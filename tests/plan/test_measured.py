"""The planner held against runs that were measured (benchmarks/results/*.json, recorded on the
GPU machines): given the run's model, batch and machine, it recommends what ran and predicts
its host memory and device peak within 10%. A drift of the model fails here, on a CPU."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from tidal.plan import GIB, PlanConfig, build_plan, kept_host, kept_phases, preset, recommend, trl_vllm_kv_cache_bytes

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def _run(name: str, variant: str) -> dict:
    data = json.loads((RESULTS / name).read_text())
    return next(v for v in data["variants"] if v["variant"] == variant)


# The 14B shape inside TRL on one H100 (2026-11-27, e8daabd): 64 x 256 in micro-batches of 16,
# TRL's fused LM head scoring the completion, gradient checkpointing, transformers' fused AdamW.
TRL_STEP = dict(
    prompts=8,
    group=8,
    prompt_len=8,
    gen_len=256,
    grad_ckpt=True,
    logprob_span="completion",
    lm_head="fused",
    adamw_foreach=False,
)
TRL_14B = dict(TRL_STEP, shape="qwen2.5-14b", micro_batch=16)


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


# Qwen2-7B bf16 inside TRL 1.16 (`gpu.sh trl:7b`: bench_trl.py --preset qwen2-7b --dtype bfloat16
# --batch 64 --completion 256, num_generations 8): 8 prompts x 8 completions of 256 tokens, the
# prompts "{i}+{i}=" of at most 8 characters; no --micro-batch, so the 64 completions train in one
# micro-batch (per_device_train_batch_size=64); GRPOConfig's defaults for the rest: gradient
# checkpointing, transformers' fused AdamW (adamw_torch_fused), TRL's fused LM head scoring the
# completion.
TRL_7B = dict(TRL_STEP, shape="qwen2-7b", micro_batch=64)


def test_the_7b_run_on_one_h100_is_what_the_planner_recommends_and_predicts():
    """On an 80 GB H100 the planner keeps AdamW's state with the policy (the timeshare as
    configured, ``optimizer="adamw"``: tidal's ``optimizer_residency="role"``), which is what
    ran, with prefetch: ``role+prefetch`` in the same call was the cheaper of the two tidal
    variants (12.85 s a step at 60.77 GiB against ``stream+prefetch``'s 14.25 s at 70.00 GiB);
    TRL alone runs out of memory there. Its peak is the backward in one micro-batch, where the
    gradients arrive layer by layer: the plan had counted every gradient beside every layer's
    saved input (66.27 GiB, 1.09x). Host: the trainer holds the reference's and the policy's
    weights (``kept_host``: AdamW's state never leaves, the scoring keeps the policy)."""
    run = _run("trl_qwen2-7b_64x256_h100_2026-11-27_5c26944.json", "role+prefetch")
    stream = _run("trl_qwen2-7b_64x256_h100_2026-11-27_5c26944.json", "stream+prefetch")
    assert run["step_s"] < stream["step_s"] and run["peak_bytes"] < stream["peak_bytes"]  # role: the cheaper
    rec = recommend(PlanConfig(**TRL_7B), gpu_mem_bytes=int(79.2 * GIB), host_mem_bytes=run["host_total_bytes"])
    assert rec.fits and rec.levers == []  # as configured: the timeshare, AdamW's state with the policy
    assert rec.plan.config.timeshare and rec.plan.config.optimizer == "adamw"
    # what ran, to type: role residency with prefetch, its peak and host memory as kept_phases says
    (line,) = rec.prefetch_lines()
    assert 'TidalConfig(optimizer_residency="role", prefetch=True)' in line and line in rec.summary()
    assert "(rollout: + reference; reference: + policy)" in line and "28.37 GiB pinned on the host" in line
    kept = kept_phases(rec.plan, rec.usable_bytes - rec.plan.config.cuda_context_bytes)  # as tidal plan --prefetch
    peak = max(p.peak_bytes for p in kept.values())  # allocated bytes, as the run's peak_bytes
    assert abs(peak / run["peak_bytes"] - 1) <= 0.10
    assert abs(sum(kept_host(rec.plan, kept).values()) / run["host_held_bytes"] - 1) <= 0.10


def test_the_7b_run_on_one_h200_is_what_the_planner_recommends_and_predicts():
    """On a 141 GB H200 every role fits at once: the planner recommends TRL alone
    (``no_timeshare``), which ran, and was measured cheaper than tidal there (pooled medians
    11.06 s a step against ``role+prefetch``'s 13.32 s, at the same peak: with that room every
    turn keeps everything). TRL alone pins no host memory (no tidal in its process: the JSON
    records no held bytes and nothing moved); the plan holds none."""
    name = "trl_qwen2-7b_64x256_h200_2026-11-26_j5.json"
    run, tidal = _run(name, "trl"), _run(name, "role+prefetch")
    pooled = json.loads((RESULTS / name).read_text())["pooled"]
    assert pooled["trl"]["median_s"] < pooled["role+prefetch"]["median_s"]
    assert run["peak_bytes"] <= tidal["peak_bytes"]
    rec = recommend(PlanConfig(**TRL_7B), gpu_mem_bytes=int(140.4 * GIB), host_mem_bytes=run["host_total_bytes"])
    assert rec.fits and rec.levers == ["no_timeshare"]
    assert rec.summary()[0].startswith("No timeshare needed")
    assert abs(rec.plan.peak_bytes / run["peak_bytes"] - 1) <= 0.10  # allocated bytes, both
    assert rec.plan.node_host_bytes == 0 and run["moved_gb_per_step"] == 0 and "host_held_bytes" not in run


# The Qwen2.5-32B shape inside TRL 1.16 under FSDP2 on 4 H100s (`gpu.sh multi:fsdp4`: bench_trl.py
# --preset qwen2.5-32b --dtype bfloat16 --batch 64 --completion 256 --nproc 4 --launch fsdp2,
# variant stream+prefetch, the run README.md cites): on each rank 64 completions (8 prompts of the
# char task's "{i}+{i}=", at most 8 characters, x 8) of 256 tokens, 32 prompts over the 4 ranks; no
# --micro-batch, so one micro-batch of 64 a rank; GRPOConfig's defaults for the rest (gradient
# checkpointing, transformers' fused AdamW, TRL's fused LM head scoring the completion); tidal's
# generation gathered for the step (the shards lent to the host, RESULTS.md's 32B section).
TRL_32B_FSDP2 = dict(
    TRL_STEP,
    shape="qwen2.5-32b",
    prompts=32,
    micro_batch=64,
    zero_stage=3,
    zero3_rollout="whole",  # tidal's gathered generation: recommend() decides as the trainer does
)


def _median(run: dict, phase: str) -> float:
    peaks = sorted(step[phase] for step in run["phase_peak_bytes_steps"])
    return peaks[len(peaks) // 2]


def test_the_32b_run_on_four_h100s_under_fsdp2_is_what_the_planner_recommends_and_predicts():
    """Full-parameter GRPO of the 32B shape ran on 4 H100s under FSDP2 with AdamW's state
    streamed (``stream+prefetch``); TRL + FSDP2 alone ran out of memory in its first step (its
    reference, sharded as one unit, gathered whole at its forward). The planner had answered
    "the timeshare off, lora": it planned every set of levers with the policy gathered whole
    beside its shards (81.43 GiB at the rollout) where the trainer lends them, and TRL alone's
    reference with FSDP2's per-unit gathers. It now recommends the streamed state under the
    timeshare, generation lending the shards, and holds the rank's peak (allocated, the
    generation's: predicted 65.68 GiB) and host memory held within 10% of rank 0's, and each
    phase within 10% of its median over the measured steps (a prefetch of which only part fits
    is not counted: the backward's single highest step, 68.16 GiB, is 0.89x)."""
    name = "trl_qwen2.5-32b_64x256_fsdp2x4_h100_2026-11-28_7a3a496.json"
    data = json.loads((RESULTS / name).read_text())
    assert (data["nproc"], data["launch"], data["batch"], data["micro_batch"]) == (4, "fsdp2", 64, None)
    run = _run(name, "stream+prefetch")
    config = PlanConfig(**TRL_32B_FSDP2, dp=4)
    rec = recommend(config, gpu_mem_bytes=int(79.2 * GIB), gpus=4, host_mem_bytes=run["host_total_bytes"])
    assert rec.fits and rec.levers == ["optimizer_stream"]  # what ran: stream residency, full-parameter
    c = rec.plan.config
    assert c.timeshare and not c.lora_rank and c.optim_stream_chunk_bytes == 256 << 20
    assert c.zero3_rollout == "lent"  # the policy gathered whole, its shards lent to the host
    alone = build_plan(config.replace(timeshare=False))  # TRL + FSDP2 alone: out of memory
    assert alone.device_peak_bytes > rec.usable_bytes and alone.peak_phase == "reference"
    kept = kept_phases(rec.plan, rec.usable_bytes - c.cuda_context_bytes)  # as tidal plan --prefetch
    peak = max(p.peak_bytes for p in kept.values())
    assert abs(peak / run["peak_bytes"] - 1) <= 0.10
    assert abs(sum(kept_host(rec.plan, kept).values()) / run["host_held_bytes"] - 1) <= 0.10
    for phase, measured in (("rollout", "generate"), ("reference", "reference"), ("train", "backward")):
        assert abs(kept[phase].peak_bytes / _median(run, measured) - 1) <= 0.10, phase


# TRL with its colocated vLLM engine (`gpu.sh vllm:7b vllm:7b80 vllm:14b`: bench_trl_vllm.py,
# VLLM_ARGS="--max-model-len 320"): the TRL step above, use_vllm=True, vllm_mode="colocate", sleep
# mode, TRL's vllm_gpu_memory_utilization 0.3; tidal's variant `tidal+role+prefetch+kv=auto`
# (optimizer_residency="role", prefetch, the KV cache sized for the batch). Every peak here is the
# device's used memory (driver level: torch's counters keep counting vLLM's pool while it
# sleeps), each phase's from tidal's log (allocated, the sleeping engine's pool left out).
TRL_VLLM = dict(TRL_STEP, rollout_engine="vllm", vllm_max_model_len=320)


def _vllm_run(name: str, variant: str) -> dict:
    data = json.loads((RESULTS / name).read_text())
    return next(v for v in data["rows"] if v["variant"] == variant)


def _trl_alone(config: PlanConfig, device_bytes: int):
    """TRL + vLLM alone: every role resident, the engine's cache what vLLM takes from its share."""
    cache = trl_vllm_kv_cache_bytes(config, device_bytes)
    return build_plan(config.replace(timeshare=False, vllm_kv_cache_bytes=cache))


def _logged(run: dict, phase: str, how=None) -> int:
    """A phase's peak over the measured steps (tidal's log, the warm-up's left out): the median
    unless ``how`` says otherwise."""
    peaks = sorted(log[f"tidal/peak_gib/{phase}"] for log in run["tidal_logs"][1:])
    return int((how(peaks) if how else peaks[len(peaks) // 2]) * GIB)


def test_the_7b_run_with_vllm_on_a_whole_h200_needs_no_timeshare():
    """Where TRL + vLLM alone fits (Qwen2-7B, the whole H200: 110.32 GiB at driver level), the
    planner says so; it predicts that peak (TRL's engine taking 0.3 of the device, every role and
    AdamW's state beside it, the gradients' memory still in torch's cache) within 10%. tidal
    measured no cheaper there (1.011x its step at f575b13, 1.042x in 80 GiB)."""
    run = _vllm_run("trl_vllm_qwen2-7b_64x256_anchor_10steps_h200_2026-12-02_8769aee.json", "trl")
    device = run["workload"]["device_total_bytes"]
    rec = recommend(PlanConfig(**TRL_VLLM, shape="qwen2-7b", micro_batch=64), gpu_mem_bytes=device)
    assert rec.fits and rec.levers == ["no_timeshare"]
    assert "vllm_gpu_memory_utilization=0.3" in "\n".join(rec.summary())
    assert abs(rec.plan.device_peak_bytes / (run["summary"]["peak_gib"] * GIB) - 1) <= 0.10


def test_the_7b_run_with_vllm_in_80_gib_is_what_the_planner_recommends_and_predicts():
    """In 80 GiB of the H200, where TRL + vLLM alone ran out of memory in its second step, the
    planner keeps the timeshare as configured (``role`` residency, the cache for the batch) and
    predicts what ran: the policy with AdamW's state beside the engine, the reference behind the
    generation; the policy kept through the reference's scoring; each phase, the host memory held
    and the driver-level peak within 10%. The generation's peak alternated between steps (72.4
    GiB with the whole reference in behind it, 61.3 GiB with 3.3 GB of it): the plan, keeping a
    role whole or not at all, is the first, and is held to the highest step."""
    name = "trl_vllm_qwen2-7b_64x256_80gib_10steps_h200_2026-12-02_8769aee.json"
    run = _vllm_run(name, "tidal+role+prefetch+kv=auto")
    device = run["workload"]["device_total_bytes"]
    config = PlanConfig(**TRL_VLLM, shape="qwen2-7b", micro_batch=64)
    rec = recommend(config, gpu_mem_bytes=device)
    assert rec.fits and rec.levers == []  # as configured: the timeshare, AdamW's state with the policy
    assert _trl_alone(config, device).device_peak_bytes > rec.usable_bytes
    kept = kept_phases(rec.plan, rec.usable_bytes - config.cuda_context_bytes)
    assert set(kept["rollout"].kept) == {"policy", "policy's optimizer state", "reference"}
    assert abs(kept["rollout"].peak_bytes / _logged(run, "generate", max) - 1) <= 0.10
    assert abs(kept["reference"].peak_bytes / _logged(run, "reference") - 1) <= 0.10
    assert abs(kept["train"].peak_bytes / _logged(run, "backward") - 1) <= 0.10
    assert abs(sum(kept_host(rec.plan, kept).values()) / run["host_held_bytes"] - 1) <= 0.10
    driver = max(p.peak_bytes for p in kept.values()) + config.cuda_context_bytes + rec.plan.engine_own_bytes
    assert abs(driver / (run["summary"]["peak_gib"] * GIB) - 1) <= 0.10


def test_the_14b_run_with_vllm_on_one_h200_is_what_the_planner_recommends_and_predicts():
    """The Qwen2.5-14B shape on the whole H200 (micro-batches of 16): TRL + vLLM alone ran out of
    memory in its first step (fcff718), and the planner says it does not fit; it keeps the
    timeshare as configured, which ran 11 steps (2b087e7, the engine's turns learning from one
    wake out of memory). AdamW's state does not stay beside the engine (with the gradients' memory
    in torch's cache it would not fit: the first measured step's wake ran out of memory with it
    kept, the later steps moved it out first), so the reference's scoring keeps the policy's
    weights only and the state comes back behind the backward: those phases, the host memory held
    and the device's peak over a step (driver level, the median step) within 10%. The generation's
    own allocated peak (114.18 GiB) counts AdamW's state with the engine's weights and cache at
    once: torch's counters count the sleeping engine's pool, and the log does not say whether the
    state was still leaving as the engine woke; the plan's turn (86.44 GiB) is not held to it."""
    alone = _vllm_run("trl_vllm_qwen2.5-14b_64x256_trl_alone_h200_2026-12-03_fcff718.json", "trl")
    assert not alone["ok"] and alone["error"].startswith("OutOfMemoryError")
    name = "trl_vllm_qwen2.5-14b_64x256_learned_keep_h200_2026-12-03_2b087e7.json"
    run = _vllm_run(name, "tidal+role+prefetch+kv=auto")
    device = run["workload"]["device_total_bytes"]
    config = PlanConfig(**TRL_VLLM, shape="qwen2.5-14b", micro_batch=16)
    rec = recommend(config, gpu_mem_bytes=device)
    assert rec.fits and rec.levers == []
    assert _trl_alone(config, device).device_peak_bytes > rec.usable_bytes
    kept = kept_phases(rec.plan, rec.usable_bytes - config.cuda_context_bytes)
    assert set(kept["rollout"].kept) == {"policy", "reference"}
    assert set(kept["reference"].kept) == {"policy"} and kept["reference"].kept["policy"] < 30 * GIB
    assert abs(kept["reference"].peak_bytes / _logged(run, "reference") - 1) <= 0.10
    assert abs(kept["train"].peak_bytes / _logged(run, "backward") - 1) <= 0.10
    assert abs(sum(kept_host(rec.plan, kept).values()) / run["host_held_bytes"] - 1) <= 0.10
    steps = sorted(step["peak_bytes"] for step in run["steps"])
    driver = max(p.peak_bytes for p in kept.values()) + config.cuda_context_bytes + rec.plan.engine_own_bytes
    assert abs(driver / steps[len(steps) // 2] - 1) <= 0.10


def test_the_kv_cache_trl_s_engine_gives_itself_is_what_vllm_gave():
    """vLLM 0.25 sizes its cache from TRL's share of the device (0.3) less its weights and its own
    memory (a constant, its profile run's activations and CUDA graphs varying a little with the
    model): the caches measured at Qwen2-7B and Qwen2-1.5B (bf16, untied embeddings, as the
    benchmarks build them) within 2% (1.5B: 1.5% under; two runs of it were 0.5% apart)."""
    for name, shape in (
        ("trl_vllm_qwen2-7b_64x2048_long_h200_2026-12-03_fcff718.json", preset("qwen2-7b")),
        ("trl_vllm_qwen2-1.5b_64x256_identity_h200_2026-12-03_fcff718.json", preset("qwen2-1.5b")),
    ):
        run = _vllm_run(name, "trl")
        config = PlanConfig(**TRL_VLLM, shape=dataclasses.replace(shape, tied_embeddings=False), micro_batch=64)
        per_token = 2 * shape.layers * shape.kv_dim * 2
        tokens = trl_vllm_kv_cache_bytes(config, run["workload"]["device_total_bytes"]) / per_token
        assert abs(tokens / run["kv_cache_tokens"] - 1) <= 0.02, name
