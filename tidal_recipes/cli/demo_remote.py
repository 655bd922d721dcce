"""``tidal demo --roles ray|processes``: the GRPO demo with its roles in separate processes.

The policy (rollout + actor_train) and the reference are workers of their own processes on one
device, taking turns through a cross-process GPU lease; the verifier runs in CPU workers
(:class:`tidal_recipes.grpo.RemoteGRPO`). Prints the per-phase table, the hand-overs between the
processes (seconds, and the driver-level free memory each release confirmed), the reward, and
writes ``demo.jsonl`` and a ``timeline.png`` merged from the workers' timelines.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import statistics
import time
from typing import Callable

import torch

from tidal_recipes.cli.demo import (
    PHASES,
    _grpo_config,
    _phase_rows,
    build_policy,
    log_phase_table,
    run_steps,
    write_outputs,
)
from tidal.device import DeviceOps
from tidal.units import format_bytes
from tidal_recipes.grpo import RemoteConfig, RemoteGRPO
from tidal.timeline import MemoryTimeline

__all__ = ["run_remote_demo"]


def _start_ray(device: str, gpu_resource: str) -> bool:
    """Start a local Ray instance unless one is running; returns whether it was started here."""
    try:
        import ray  # noqa: PLC0415  (optional dependency: tidal[ray])
    except ImportError as e:
        raise ImportError(
            "--roles ray runs the roles as Ray actors: pip install 'tidal[ray]' "
            "(or --roles processes, which needs no Ray)"
        ) from e
    if ray.is_initialized():
        return False
    # On the CPU a custom resource stands in for the GPU the colocated roles share.
    resources = {gpu_resource: 1} if device == "cpu" else None
    # Ray's CPUs are logical: at least 4, so the three workers fit on a small machine too.
    ray.init(num_cpus=max(4, os.cpu_count() or 1), resources=resources, include_dashboard=False, log_to_driver=True)
    return True


def run_remote_demo(s, *, log: Callable[[str], None] = print) -> dict:
    """Run the demo with ``s.roles`` in ``("ray", "processes")``; returns its figures."""
    if s.lora_rank:  # DemoSettings refuses it too
        raise ValueError(
            "--roles ray|processes runs a full-weight policy; LoRA (--lora-rank) runs with "
            "--roles local, where the base with adapters off is the reference"
        )
    device = "cpu" if s.device == "cpu" else "cuda"
    gpu_resource = "tidal_device" if device == "cpu" else "GPU"
    started_ray = _start_ray(device, gpu_resource) if s.roles == "ray" else False
    # The policy worker gets the host's CPUs but two (the reference and the verifier): Ray
    # caps an actor's torch threads at its CPUs, and CPU Adam's update runs on them.
    policy_cpus = 1
    if s.roles == "ray":
        import ray  # noqa: PLC0415

        policy_cpus = max(1, int(ray.available_resources().get("CPU", 1)) - 2)
    remote = RemoteConfig(backend=s.roles, device=device, gpu_resource=gpu_resource, policy_cpus=policy_cpus)
    cfg = _grpo_config(s, timeshare=True)
    log(
        f"tidal demo: GRPO on '{s.task}' ({s.digits} digits), {s.preset}, {s.prompts} prompts x {s.group} "
        f"samples, optimizer {s.optimizer}; roles in separate processes ({s.roles}): policy "
        f"(rollout + actor_train) and reference share {s.device} through a GPU lease, the verifier "
        f"runs in a CPU worker"
    )
    results = []
    t_start = time.perf_counter()
    try:
        with RemoteGRPO(functools.partial(build_policy, s), config=cfg, remote=remote) as run:
            log(f"workers started in {time.perf_counter() - t_start:.1f} s")
            if run.placement is not None:
                log(run.placement.report())
            results = run_steps(run.step, s.steps, log)
            timelines = run.timelines()
    finally:
        if started_ray:
            import ray  # noqa: PLC0415

            ray.shutdown()

    rows = _phase_rows(results)
    steady = results[1:] or results
    step_s = statistics.fmean(r.seconds for r in steady)
    trans_s = sum(v["transition_seconds"] for v in rows.values())
    k = max(1, s.steps // 10)
    first = statistics.fmean(r.reward_mean for r in results[:k])
    last = statistics.fmean(r.reward_mean for r in results[-k:])
    # Each hand-over: the previous holder's release, confirmed at driver level in its process.
    handovers = [
        r.phases[n]["previous_holder"]
        for r in steady
        for n in PHASES
        if n in r.phases and r.phases[n].get("previous_holder")
    ]
    frees = [
        h["confirmation"]["driver_free_bytes"]
        for h in handovers
        if isinstance(h.get("confirmation"), dict) and "driver_free_bytes" in h["confirmation"]
    ]

    on_gpu = s.device != "cpu"
    log("")
    log_phase_table(rows, on_gpu=on_gpu, mem_name="peak alloc", log=log)
    log(
        f"step {step_s:.3f} s; hand-overs (offload in one process, confirm, reload in the next) "
        f"{trans_s:.4f} s = {100 * trans_s / step_s:.1f}% of the step (steps after the first)"
    )
    if on_gpu and frees:
        log(
            f"driver-level free memory confirmed by each releasing process: min {format_bytes(min(frees))}, "
            f"max {format_bytes(max(frees))} over {len(frees)} hand-overs"
        )
    log(f"mean reward: first {k} steps {first:.3f} -> last {k} steps {last:.3f}")

    summary = {
        "type": "summary",
        "settings": dataclasses.asdict(s),
        "phases": rows,
        "step_seconds": step_s,
        "transition_seconds": trans_s,
        "transition_fraction": trans_s / step_s,
        "reward_first": first,
        "reward_last": last,
        "handovers": len(handovers),
        "min_confirmed_driver_free_bytes": min(frees) if frees else None,
        "device_name": torch.cuda.get_device_name(0) if on_gpu and torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
    }
    # The driver reads no device itself (it would take a CUDA context on the shared GPU):
    # the merged timeline is the workers' samples.
    ops = DeviceOps("cpu")
    if on_gpu:
        ops = _RemoteOps()
    timeline = MemoryTimeline.merge(ops, timelines)
    write_outputs(
        timeline,
        results,
        summary,
        jsonl=os.path.join(s.out_dir, "demo.jsonl"),
        png=os.path.join(s.out_dir, "timeline.png"),
        log=log,
        title=f"tidal demo ({s.roles}): GRPO on {s.preset}, {summary['device_name']}: memory of "
        f"the role processes taking turns",
    )
    return summary


class _RemoteOps:
    """Stands in for the device's ops when plotting samples taken in other processes: the
    plot only asks whether the samples came from an accelerator, and the device's name."""

    is_accelerator = True
    device = "the shared GPU"
