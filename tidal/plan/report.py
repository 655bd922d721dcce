"""Text rendering of a :class:`~tidal.plan.model.Plan` (and a recommendation) for ``tidal plan``.

Layout: a per-phase table in GiB (one column per phase, timeshared and all-resident peaks),
each phase's components, the transitions with predicted times, the recommendation, then the
assumptions. Pure formatting: every number comes from the plan.
"""

from __future__ import annotations

from tidal.plan.model import GIB, PHASES, Plan

__all__ = ["format_plan", "gib"]


def gib(n: int) -> str:
    return f"{n / GIB:.2f}"


def _table(plan: Plan) -> list[str]:
    cols = list(PHASES)
    w = max(len(c) for c in cols) + 2
    head = f"{'GiB':<34}" + "".join(f"{c:>{w}}" for c in cols)
    ts, allr = plan.timeshared, plan.all_resident
    rows = [
        ("resident state (timeshare)", [ts[c].resident_bytes for c in cols]),
        ("transient", [ts[c].transient_bytes for c in cols]),
        ("peak allocated, timeshare", [ts[c].peak_bytes for c in cols]),
        ("peak allocated, all resident", [allr[c].peak_bytes for c in cols]),
    ]
    lines = [head, "-" * len(head)]
    lines += [f"{name:<34}" + "".join(f"{gib(v):>{w}}" for v in vals) for name, vals in rows]
    return lines


def _components(plan: Plan) -> list[str]:
    lines = []
    for name, ph in plan.phases.items():
        parts = [f"{k} {gib(v)}" for k, v in ph.resident.items()]
        parts += [f"{k} {gib(v)} (transient)" for k, v in ph.transient.items()]
        lines.append(f"  {name:<15} {gib(ph.peak_bytes):>7} GiB = " + (" + ".join(parts) or "nothing"))
    return lines


def format_plan(plan: Plan, recommendation=None) -> str:
    """The full ``tidal plan`` report as one string (no trailing newline)."""
    c, s = plan.config, plan.config.shape
    mode = "timeshare" if c.timeshare else "all roles resident"
    lines = [
        f"tidal plan: {s.name}, {s.param_count() / 1e9:.2f} B params, {c.param_dtype}, optimizer {c.optimizer}, "
        f"ZeRO {c.zero_stage} x dp {c.dp}"
        + (f", LoRA r={c.lora_rank}" if c.lora_rank else "")
        + (", grad ckpt" if c.grad_ckpt else "")
        + (", activation offload" if c.act_offload else ""),
        f"RL step per GPU: {c.rollout_batch} sequences of {c.prompt_len}+{c.gen_len} tokens, "
        f"{c.micro_batches} micro-batch(es) of {c.micro_batch}",
        "",
        *_table(plan),
        "",
        f"components ({mode}):",
        *_components(plan),
        "",
        f"peak ({mode}): {gib(plan.peak_bytes)} GiB allocated in {plan.peak_phase}, "
        f"{gib(plan.device_peak_bytes)} GiB with the CUDA context ({gib(c.cuda_context_bytes)})",
        f"peak with timeshare {gib(plan.timeshare_peak_bytes)} GiB vs all roles resident "
        f"{gib(plan.all_resident_peak_bytes)} GiB "
        f"({plan.timeshare_peak_bytes / max(plan.all_resident_peak_bytes, 1):.2f}x)",
    ]
    if plan.transitions:
        lines += ["", "transitions per step (predicted):"]
        for t in plan.transitions:
            lines.append(
                f"  {t.before:>14} -> {t.after:<14} out {gib(t.bytes_out):>6} GiB  in {gib(t.bytes_in):>6} GiB"
                f"  {t.seconds * 1e3:8.1f} ms"
            )
        lines.append(f"  total {plan.transition_seconds * 1e3:.1f} ms per step")
    if plan.streamed:
        lines += ["", "streamed per step (overlapped with compute):"]
        for k, v in plan.streamed.items():
            lines.append(f"  {k}: {gib(v)} GiB, {v / (plan.bandwidth.d2h_gbps * 1e9) * 1e3:.1f} ms at the one-way rate")
    lines.append(f"host memory held for the GPU state: {gib(plan.host_bytes)} GiB (pinned), of it:")
    lines += [f"  {k}: {gib(v)} GiB" for k, v in plan.host.items()]
    if plan.config.dp > 1:
        lines.append(f"  on a machine running all {plan.config.dp} GPUs' processes: {gib(plan.node_host_bytes)} GiB")
    if recommendation is not None:
        r = recommendation
        lines += [
            "",
            f"recommendation for {r.plan.config.dp} GPU(s) of {gib(r.gpu_mem_bytes)} GiB "
            f"({gib(r.usable_bytes)} usable):",
        ]
        lines += ["  " + x for x in r.summary()]
    lines += ["", "assumptions:"] + [f"  - {a}" for a in plan.assumptions]
    return "\n".join(lines)
