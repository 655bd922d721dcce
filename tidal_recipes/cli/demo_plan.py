"""The demo's plan: :mod:`tidal.plan`'s configuration for exactly what ``tidal demo`` runs, and
the memory levers the planner chooses for the machine it runs on.

The demo applies four levers on top of AdamW with its state on the host, streamed in during
``step()`` (the others need what its trainer does not do: activation offload, ZeRO over
several GPUs, LoRA as a default): CPU Adam instead, gradient checkpointing, CPU Adam's moments
in bf16, and CPU Adam summing gradients on the host; then the largest micro-batch that fits.
With ``--prefetch`` AdamW's state starts with the training role instead (``--optimizer-residency
role``), kept on the device by each turn where it fits; without, that is the user's choice.
Levers the user set on the command line stay as set; the planner chooses the others, cheapest
first, so that the step fits the GPU and the host.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tidal.plan import GIB, ModelShape, PlanConfig, Recommendation, build_plan, recommend

__all__ = [
    "BEYOND_RESIDENT_PRESETS",
    "LEVER_SETTINGS",
    "Workload",
    "choose_levers",
    "host_need_bytes",
    "plan_config",
    "plan_kwargs",
    "plan_shape",
    "workload_beyond_resident",
]

# The demo setting each lever turns, and the planner levers the demo never applies.
LEVER_SETTINGS = {
    "optimizer_offload": "optimizer_residency",
    "optimizer_stream": "optimizer_residency",
    "cpu_adam": "optimizer",
    "grad_ckpt": "grad_ckpt",
    "bf16_moments": "optim_state_dtype",
    "host_grads": "grad_accumulation",
}
# The demo exists to show the roles taking turns: the timeshare stays on (its all-resident loop
# is run beside it for the comparison), whatever fits; its micro-batch it sizes itself (the
# largest that fits with the levers chosen).
NOT_IN_DEMO = ("no_timeshare", "micro_batch", "act_offload", "zero1", "zero2", "zero3", "lora")
STREAM_CHUNK_BYTES = 256 << 20  # TimeshareConfig.optimizer_chunk_bytes' default
_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def plan_kwargs(s: Any) -> dict:
    """:class:`~tidal.plan.PlanConfig` fields (all but ``shape``) for the demo settings ``s``
    (a :class:`tidal_recipes.cli.demo.DemoSettings`): prompts of digits+2 tokens with no
    padding mask; its own sampling loop over the 10 digit ids; reference and train forwards
    computing logits of the answer (+1) positions only and log-probs over the 10 digit ids; a
    timeshared step whose optimizer step runs inside the train phase (AdamW: fused, its state
    where ``s.optimizer_residency`` says: with the training role, or on the host and brought in
    for ``step()``, whole or a chunk at a time; CPU Adam: gradients summed where
    ``s.grad_accumulation`` says, at most its default 512 MiB of copies pending)."""
    cpu_adam = s.optimizer == "cpu_adam"
    on_host = not cpu_adam and s.optimizer_residency != "role"
    return dict(
        param_dtype=_DTYPES[s.dtype],
        optimizer="cpu_adam" if cpu_adam else "adamw_offload" if on_host else "adamw",
        optim_state_dtype=("bf16" if s.optim_state_dtype == "bf16" else None) if cpu_adam else None,
        cpu_adam_grad_accumulation=s.grad_accumulation,
        adamw_foreach=False,  # the trainer uses the fused AdamW on a GPU
        prompts=s.prompts,
        group=s.group,
        prompt_len=s.digits + 2,
        gen_len=s.digits,
        micro_batch=s.micro_batch,
        padding_mask=False,
        logprob_span="completion",
        grad_ckpt=s.grad_ckpt,
        timeshare=True,
        lora_rank=s.lora_rank,
        lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"),
        completion_logits=True,
        action_vocab=10,
        keep_logits=False,  # logits_to_keep=answer+1, 10 digit ids
        sampling="own",
        sampling_fp32_buffers=3,  # the digit slice in fp32, / temperature, softmax
        repeat_kv_in_decode=False,
        step_in_train=True,
        # AdamW on the host: all of it in for step() ("step") or a chunk at a time ("stream",
        # TimeshareConfig.optimizer_chunk_bytes' default)
        optim_stream_chunk_bytes=STREAM_CHUNK_BYTES if on_host and s.optimizer_residency == "stream" else None,
    )


def plan_shape(preset: str) -> ModelShape:
    """The planner's shape of the demo preset ``preset`` (:data:`tidal.plan.shapes.ALL_PRESETS`:
    the released checkpoints' and the toy ones)."""
    from tidal.plan.shapes import ALL_PRESETS  # noqa: PLC0415

    return ALL_PRESETS[preset]


def plan_config(s: Any) -> PlanConfig:
    return PlanConfig(shape=plan_shape(s.preset), **plan_kwargs(s))


def host_need_bytes(s: Any) -> int:
    """Host memory a CPU run of the demo settings ``s`` needs, by the planner: the timeshared
    step's peak plus the host copies of the roles moved out, or the all-resident baseline's
    peak if that is higher (no CUDA context on a CPU)."""
    config = plan_config(s).replace(cuda_context_bytes=0)
    plan = build_plan(config)
    need = plan.device_peak_bytes + plan.node_host_bytes
    if s.baseline_steps:
        need = max(need, build_plan(config.replace(timeshare=False)).device_peak_bytes)
    return need


def choose_levers(
    s: Any, *, fixed: tuple[str, ...] = (), gpu_mem_bytes: int, host_mem_bytes: int | None
) -> tuple[Any, Recommendation]:
    """The settings ``s`` with the planner's levers applied, and its recommendation.

    ``fixed``: the settings the user chose (``"optimizer"``, ``"optimizer_residency"``,
    ``"grad_ckpt"``, ``"optim_state_dtype"``, ``"grad_accumulation"``, ``"micro_batch"``),
    kept as they are in ``s``; the others start off (AdamW with its state on the host and
    streamed in during ``step()``, or with ``s.prefetch`` moving with the training role; no
    checkpointing, fp32 moments, gradients summed on the GPU) and the planner turns on the cheapest set that fits ``gpu_mem_bytes`` and ``host_mem_bytes``
    (None: the host is not checked), at ``s.micro_batch``. Then, unless fixed, the
    micro-batch grows (halving down from the whole batch) to the largest that still fits
    with those levers: fewer, larger forwards and backwards, the same result up to
    summation order. When nothing fits, ``recommendation.fits`` is False and the settings
    are the planner's best attempt. Raises ``ValueError`` for an unknown name in ``fixed``."""
    allowed = sorted(set(LEVER_SETTINGS.values()) | {"micro_batch", "evict"})
    unknown = sorted(set(fixed) - set(allowed))
    if unknown:
        raise ValueError(f"fixed names unknown settings {unknown}; the demo's planned settings are {allowed}")
    # AdamW's state starts on the host, streamed in during step(): measured at 1.05x the
    # all-resident step at 0.5B (benchmarks/RESULTS.md). With prefetch it starts with the
    # training role: each turn then keeps it on the device where the phase's measured need
    # fits beside it, and where it does not, its moves run behind the rollout and the scoring
    # instead of inside step() (7B on an H100: see benchmarks/RESULTS.md, 2026-11-26).
    start = {
        "optimizer": "adamw",
        "optimizer_residency": "role" if s.prefetch else "stream",
        "grad_ckpt": False,
        "optim_state_dtype": "fp32",
        "grad_accumulation": "device",
    }
    base = dataclasses.replace(s, **{k: v for k, v in start.items() if k not in fixed})
    exclude = NOT_IN_DEMO + tuple(lever for lever, setting in LEVER_SETTINGS.items() if setting in fixed)
    rec = recommend(
        plan_config(base),
        gpu_mem_bytes=gpu_mem_bytes,
        host_mem_bytes=host_mem_bytes,
        exclude=exclude,
        offload_chunk_bytes=STREAM_CHUNK_BYTES,
    )
    chosen = dict(
        optimizer_residency="stream"
        if {"optimizer_offload", "optimizer_stream"} & set(rec.levers)
        else base.optimizer_residency,
        optimizer="cpu_adam" if "cpu_adam" in rec.levers else base.optimizer,
        grad_ckpt=True if "grad_ckpt" in rec.levers else base.grad_ckpt,
        optim_state_dtype="bf16" if "bf16_moments" in rec.levers else base.optim_state_dtype,
        grad_accumulation="host" if "host_grads" in rec.levers else base.grad_accumulation,
    )
    settings = dataclasses.replace(base, **chosen)
    if rec.fits and "micro_batch" not in fixed:
        settings = dataclasses.replace(settings, micro_batch=_largest_micro_batch(settings, rec))
    if rec.fits and not {"evict", "optimizer", "optimizer_residency"} & set(fixed):
        settings = _keep_resident_if_all_fits(settings, rec)
    return settings, rec


def _keep_resident_if_all_fits(s: Any, rec: Recommendation) -> Any:
    """When every role fits at once (AdamW with its state on the GPU, the plan's all-resident
    peak within what ``rec`` had usable, at ``s``'s micro-batch), the settings that keep them
    resident: the timeshare evicts only as needed (``TimeshareConfig(evict="as_needed")``) with
    the largest transient need of a phase as headroom, and AdamW's state stays with the
    training role. Nothing then moves between phases. Otherwise ``s`` unchanged. LoRA and
    CPU Adam are left as they are (the planner chose them for a reason, or the user did)."""
    if s.optimizer != "adamw" or s.lora_rank:
        return s
    resident = dataclasses.replace(s, optimizer_residency="role")
    plan = build_plan(plan_config(resident))  # the timeshare's host copies stay pinned all the same
    host_ok = rec.host_usable_bytes is None or plan.node_host_bytes <= rec.host_usable_bytes
    if plan.all_resident_peak_bytes + plan.config.cuda_context_bytes > rec.usable_bytes or not host_ok:
        return s
    headroom = max(p.transient_bytes for p in plan.all_resident.values())
    # A headroom the user gave (--headroom-mib, 0 included) stays.
    mib = -(-headroom // (1 << 20)) if s.headroom_mib is None else s.headroom_mib
    return dataclasses.replace(resident, evict="as_needed", headroom_mib=mib)


def _largest_micro_batch(s: Any, rec: Recommendation) -> int:
    """The largest micro-batch, halving down from the whole batch to ``s.micro_batch``, whose
    plan with the same settings fits what ``rec`` had usable (GPU and host)."""
    mb = s.prompts * s.group
    while mb > s.micro_batch:
        plan = build_plan(plan_config(dataclasses.replace(s, micro_batch=mb)))
        host_ok = rec.host_usable_bytes is None or plan.node_host_bytes <= rec.host_usable_bytes
        if plan.device_peak_bytes <= rec.usable_bytes and host_ok:
            return mb
        mb //= 2
    return s.micro_batch


# The released shapes the demo tries, smallest first, for a workload the GPU cannot hold with
# every role resident.
BEYOND_RESIDENT_PRESETS = ("qwen2-0.5b", "qwen2-1.5b", "qwen2-7b", "qwen2.5-14b", "qwen2.5-32b")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
    """What :func:`workload_beyond_resident` found: ``preset`` (None: no shape qualifies), the
    all-resident loop's planned peak at a micro-batch of one with checkpointing (driver level),
    the GPU's usable bytes, and ``why`` in words."""

    preset: str | None
    all_resident_bytes: int
    usable_bytes: int
    why: str


def workload_beyond_resident(
    s: Any, *, fixed: tuple[str, ...] = (), gpu_mem_bytes: int, host_mem_bytes: int | None
) -> Workload:
    """The smallest of :data:`BEYOND_RESIDENT_PRESETS` that this GPU cannot hold with every
    role resident, however small the micro-batch (GPU AdamW, gradient checkpointing, one sequence a
    forward: the all-resident loop at its least), and that runs with the roles taking turns and the
    planner's levers (:func:`choose_levers` fits the GPU and the host). ``s``: the demo settings
    whose batch, task and dtype the workload keeps. Arithmetic only: nothing is built."""
    from tidal.plan.recommend import RESERVE_FRACTION  # noqa: PLC0415

    usable = int(gpu_mem_bytes * (1 - RESERVE_FRACTION))
    misses = []
    floor = 0
    for preset in BEYOND_RESIDENT_PRESETS:
        candidate = dataclasses.replace(s, preset=preset)
        least = dataclasses.replace(
            candidate, optimizer="adamw", optimizer_residency="role", micro_batch=1, grad_ckpt=True
        )
        floor = build_plan(plan_config(least).replace(timeshare=False)).device_peak_bytes
        if floor <= usable:
            continue  # every role fits at once, at some micro-batch: nothing to show
        _, rec = choose_levers(candidate, fixed=fixed, gpu_mem_bytes=gpu_mem_bytes, host_mem_bytes=host_mem_bytes)
        if rec.fits:
            return Workload(
                preset=preset,
                all_resident_bytes=floor,
                usable_bytes=usable,
                why=f"{preset}: with every role resident it needs {floor / GIB:.2f} GiB at a micro-batch of one "
                f"(GPU AdamW, checkpointing), more than the {usable / GIB:.2f} GiB usable here; the roles taking "
                "turns fit",
            )
        misses.append(f"{preset}: {rec.binding(rec.plan.device_peak_bytes, rec.plan.node_host_bytes)}")
    return Workload(
        preset=None,
        all_resident_bytes=floor,
        usable_bytes=usable,
        why="no shape that this GPU cannot hold with every role resident fits with the roles taking turns either"
        + (f" ({'; '.join(misses)})" if misses else ""),
    )
