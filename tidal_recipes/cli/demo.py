"""``tidal demo``: the GRPO loop with its roles colocated on one device, and what it cost.

Runs :class:`tidal_recipes.grpo.GRPOTrainer` on a Qwen2-shape model with random weights (no
download) learning a digit task from scratch, with a progress bar; then prints a per-phase
table (seconds, peak memory, bytes moved, transition GB/s), the peak with the timeshare
against all roles resident (computed, and measured by a short run of the same loop without
the timeshare), and writes ``timeline.png`` and ``demo.jsonl`` to the output folder.
"""

from __future__ import annotations

import importlib.util

import dataclasses
import math
import os
import statistics
import sys
import time
from typing import Callable

import torch

from tidal.units import format_bytes, gbps

__all__ = ["DemoSettings", "defaults_for", "run_demo"]

PHASES = ("rollout", "reference", "train")
# where the roles run: this process (a Timeshare), or workers of their own processes sharing
# the device through a GPU lease (Ray actors, or spawned processes)
ROLE_PLACES = ("local", "processes", "ray")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DemoSettings:
    """What ``tidal demo`` runs; :func:`defaults_for` fills what the user left out."""

    preset: str
    device: str
    steps: int
    task: str = "copy"
    digits: int = 4
    prompts: int = 16
    group: int = 8
    micro_batch: int = 64
    lr: float = 1e-3
    optimizer: str = "adamw"
    grad_accumulation: str = "device"
    optim_state_dtype: str = "fp32"
    optimizer_residency: str = "stream"
    dtype: str = "float32"
    grad_ckpt: bool = False
    rollout_graph: bool = False
    rollout_engine: str = "hf"
    prefetch: bool = False
    async_transitions: bool = False
    kl_coef: float = 0.02
    lora_rank: int = 0
    baseline_steps: int = 2
    baseline_optimizers: tuple[str, ...] = ("same", "adamw")
    # The GPU cannot hold this workload with every role resident (the planner says so at any
    # micro-batch): the all-resident loop runs once, to where it runs out of memory, and is drawn so.
    beyond_resident: bool = False
    switch_extra_mib: int | None = 256
    evict: str = "others"
    headroom_mib: int | None = None  # None: 0, or on a GPU what the planner picks
    seed: int = 0
    out_dir: str = "tidal-demo"
    roles: str = "local"

    def __post_init__(self) -> None:
        # Numbers that parse but make no sense are refused here, before a model is built.
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"--lr must be a finite number > 0, got {self.lr}")
        if not (math.isfinite(self.kl_coef) and self.kl_coef >= 0):
            raise ValueError(f"--kl-coef must be a finite number >= 0 (0: no reference role), got {self.kl_coef}")
        if self.group < 2:
            raise ValueError(
                f"--group {self.group}: GRPO scores each sample against the others of its group, so a group of "
                f"{self.group} learns nothing; use --group 2 or more"
            )
        from tidal_recipes.measure import PRESETS  # noqa: PLC0415
        from tidal_recipes.grpo.tasks import DigitTask  # noqa: PLC0415

        if self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; choose one of {sorted(PRESETS)}")
        DigitTask(name=self.task, num_digits=self.digits)  # raises on a task it cannot pose
        p = PRESETS[self.preset]
        narrowest = min(p.hidden, p.kv_heads * (p.hidden // p.heads))  # of q, k, v and o
        if self.lora_rank > narrowest:
            raise ValueError(
                f"--lora-rank {self.lora_rank} is more than {narrowest}, the narrowest side of the layers LoRA "
                f"adapts in {self.preset}: a larger rank adds parameters but no expressiveness; use a rank <= "
                f"{narrowest}"
            )
        if self.lora_rank and self.roles != "local":
            raise ValueError(
                "--roles ray|processes runs a full-weight policy; LoRA (--lora-rank) runs with "
                "--roles local, where the base with adapters off is the reference"
            )
        if self.evict not in ("others", "as_needed"):
            raise ValueError(f"evict must be 'others' or 'as_needed', got {self.evict!r}")
        if self.headroom_mib is not None and self.headroom_mib < 0:
            raise ValueError(f"headroom_mib must be >= 0, got {self.headroom_mib}")
        if self.roles not in ROLE_PLACES:
            raise ValueError(f"roles must be one of {ROLE_PLACES}, got {self.roles!r}")
        if self.rollout_graph and not str(self.device).startswith("cuda"):
            raise ValueError(
                f"--rollout-graph captures the decode step in a CUDA graph: it needs the policy on a CUDA device, "
                f"got --device {self.device}"
            )
        if self.prefetch and self.roles != "local":
            raise ValueError(
                f"--prefetch brings the next role in within this process (--roles local), not roles={self.roles!r}"
            )
        if self.async_transitions and self.roles != "local":
            raise ValueError(
                f"--async-transitions keeps freed memory in this process, where every role lives with --roles local; with "
                f"roles={self.roles!r} the other processes need it back from the driver: drop --async-transitions"
            )
        if self.rollout_graph and self.roles != "local":
            raise ValueError(
                f"--rollout-graph runs with the roles in this process (--roles local), not roles={self.roles!r}"
            )
        if self.rollout_engine == "vllm" and importlib.util.find_spec("vllm") is None:
            raise ValueError(
                "--rollout-engine vllm needs vLLM installed (pip install vllm, on a machine with a CUDA device); "
                "the default --rollout-engine hf rolls out with the policy's own forward"
            )
        if self.beyond_resident and (self.roles != "local" or not str(self.device).startswith("cuda")):
            raise ValueError(
                "beyond_resident: a workload the GPU cannot hold with every role resident is a GPU's, with the roles "
                f"in this process (--roles local), not device={self.device!r}, roles={self.roles!r}"
            )
        if self.rollout_engine == "vllm" and (self.roles != "local" or self.baseline_steps or self.rollout_graph):
            raise ValueError(
                "--rollout-engine vllm runs one vLLM engine in this process beside the roles (--roles local), with no "
                "all-resident comparison (vLLM takes one engine a process: --baseline-steps 0) and no --rollout-graph"
            )


def defaults_for(device: str | None) -> dict:
    """On the CPU: a tiny model that learns within a minute. On a GPU: a Qwen2-0.5B shape with
    bf16 weights, CPU Adam and gradient checkpointing, with rollouts long enough that
    generation dominates. With ``--roles local`` (the default) the planner then replaces the
    levers not given on the command line by the cheapest set that fits the GPU
    (``demo_plan.choose_levers``); these stand for the roles run as processes."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return {
            "device": "cpu",
            "preset": "nano",
            "steps": 200,
            "lr": 1e-3,
            "optimizer": "adamw",
            "dtype": "float32",
            "digits": 4,
            "prompts": 16,
            "group": 8,
            "micro_batch": 64,
        }
    # Many samples of a short task: the reward rises within a few steps, and the rollout,
    # reference and micro-batched training of 1024 samples make a step long enough that the
    # switches are a small part of it. Gradient checkpointing keeps the training transient
    # small next to the weights the roles swap.
    return {
        "device": device,
        "preset": "qwen2-0.5b",
        "steps": 30,
        "lr": 1e-4,
        "optimizer": "cpu_adam",
        "dtype": "bfloat16",
        "digits": 8,
        "prompts": 64,
        "group": 16,
        "micro_batch": 64,
        "grad_ckpt": True,
    }


def build_policy(s: DemoSettings, device: str | None = None):
    """The demo's policy on ``device`` (default ``s.device``): a picklable factory for the
    role workers is ``functools.partial(build_policy, settings)``."""
    if device is not None:
        s = dataclasses.replace(s, device=device)
    try:
        import transformers  # noqa: F401, PLC0415 (the demo needs a Hugging Face model)
    except ImportError as e:
        raise ImportError("tidal demo trains a Hugging Face model: pip install 'tidal[demo]'") from e
    from tidal_recipes.measure import build_model  # noqa: PLC0415

    model, _ = build_model(s.preset, device=s.device, dtype=getattr(torch, s.dtype), seed=s.seed)
    if s.lora_rank:
        try:
            from peft import LoraConfig, get_peft_model  # noqa: PLC0415 (optional extra)
        except ImportError as e:
            raise ImportError("--lora-rank needs peft: pip install 'tidal[lora]'") from e
        model = get_peft_model(
            model,
            LoraConfig(
                r=s.lora_rank, lora_alpha=2 * s.lora_rank, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]
            ),
        )
    return model


def _grpo_config(s: DemoSettings, *, timeshare: bool):
    from tidal_recipes.grpo import DigitTask, GRPOConfig, LossConfig  # noqa: PLC0415
    from tidal.timeshare import TimeshareConfig  # noqa: PLC0415

    # A capped switch overlap keeps a switch's peak at one role's state plus the cap, instead
    # of both roles' state at once; the copies still run on both engines.
    extra = None if s.switch_extra_mib is None else s.switch_extra_mib << 20
    return GRPOConfig(
        task=DigitTask(name=s.task, num_digits=s.digits),
        prompts_per_step=s.prompts,
        group_size=s.group,
        micro_batch=s.micro_batch,
        lr=s.lr,
        optimizer=s.optimizer,
        grad_accumulation=s.grad_accumulation if s.optimizer == "cpu_adam" else "device",
        cpu_adam_state_dtype=s.optim_state_dtype if s.optimizer == "cpu_adam" else "fp32",
        optimizer_residency=s.optimizer_residency,
        grad_ckpt=s.grad_ckpt,
        rollout_graph=s.rollout_graph,
        rollout_engine=s.rollout_engine,
        loss=LossConfig(kl_coef=s.kl_coef),
        timeshare=timeshare,
        timeshare_config=TimeshareConfig(
            switch_extra_bytes=extra,
            evict=s.evict,
            headroom_bytes=(s.headroom_mib or 0) << 20,
            # --async-transitions: what TidalGRPOTrainer does (every role in this process)
            release_to_driver=not s.async_transitions,
            wait_for_copies=not s.async_transitions,
        ),
        prefetch=s.prefetch and timeshare,
        seed=s.seed,
    )


def _trainer(s: DemoSettings, *, timeshare: bool, timeline=None):
    from tidal_recipes.grpo import GRPOTrainer  # noqa: PLC0415

    return GRPOTrainer(build_policy(s), config=_grpo_config(s, timeshare=timeshare), timeline=timeline)


def _resident_to_failure(s: DemoSettings, log: Callable[[str], None]):
    """The loop with every role resident (GPU AdamW), which the planner says this GPU cannot hold:
    built and stepped until it runs out of device memory. Returns ``(title, timeline)`` for the
    picture, its memory up to the failure and where it failed marked; or, should it run after all,
    the timeline of its steps and a note in the log."""
    from tidal.device import DeviceOps  # noqa: PLC0415
    from tidal.timeline import MemoryTimeline  # noqa: PLC0415

    ops = DeviceOps(s.device)
    timeline = MemoryTimeline(ops)
    timeline.capacity_bytes = ops.driver_free_bytes()[1]
    base = None
    try:
        base = _trainer(dataclasses.replace(s, optimizer="adamw"), timeshare=False, timeline=timeline)
        for _ in range(max(1, s.baseline_steps)):
            base.step()
        log("all roles resident (GPU AdamW, no timeshare): it ran, which the planner did not expect")
        title = "the same loop, all roles resident (GPU AdamW): it ran"
    except torch.OutOfMemoryError as e:
        timeline.out_of_memory(e)
        where = timeline.marks[-1]["phase"] or "building the models"
        log(f"all roles resident (GPU AdamW, no timeshare): out of device memory in {where}: {str(e).splitlines()[0]}")
        title = f"the same loop, all roles resident (GPU AdamW): out of memory in {where}"
    finally:
        if base is not None:
            base.close()
        base = None
        _free_device(s.device)
    return title, timeline


def _progress(steps: int):
    try:
        from tqdm import tqdm  # noqa: PLC0415 (comes with transformers)
    except ImportError:
        return None
    return tqdm(total=steps, desc="GRPO", unit="step", file=sys.stderr, dynamic_ncols=True)


def run_steps(step: Callable[[], object], steps: int, log: Callable[[str], None]) -> list:
    """``steps`` calls of ``step()`` with a progress bar (or a log line every tenth step)
    showing the reward and KL; returns the step results."""
    results = []
    bar = _progress(steps)
    for i in range(steps):
        r = step()
        results.append(r)
        if bar is not None:
            bar.set_postfix(reward=f"{r.reward_mean:.3f}", kl=f"{r.stats.get('kl', 0.0):.3f}")
            bar.update(1)
        elif i % max(1, steps // 10) == 0 or i == steps - 1:
            log(f"  step {i:>4}  reward {r.reward_mean:.3f}  kl {r.stats.get('kl', 0.0):.3f}")
    if bar is not None:
        bar.close()
    return results


def log_phase_table(rows: dict[str, dict], *, on_gpu: bool, mem_name: str, log: Callable[[str], None]) -> None:
    """The per-phase table of :func:`_phase_rows`."""
    log(
        f"{'phase':<10} {'s/step':>8} {mem_name:>11} {'peak used':>10} {'moved/step':>11} {'transit s':>9} "
        f"{'GB/s':>6} {'host RSS':>10}"
    )
    for name, v in rows.items():
        used = format_bytes(v["peak_driver_used_bytes"]) if on_gpu else "-"
        rss = v.get("host_peak_rss_bytes")
        log(
            f"{name:<10} {v['seconds']:>8.3f} {format_bytes(v['peak_allocated_bytes']):>11} {used:>10} "
            f"{format_bytes(int(v['moved_bytes'])):>11} {v['transition_seconds']:>9.4f} {v['transition_gbps']:>6.1f} "
            f"{format_bytes(rss) if rss else '-':>10}"
        )


def write_outputs(
    timeline,
    results: list,
    summary: dict,
    *,
    jsonl: str,
    png: str,
    title: str,
    log: Callable[[str], None],
    beside: list = (),
) -> None:
    """``demo.jsonl`` (samples, phases, marks, steps, summary) and the timeline PNG (skipped
    with a note when matplotlib is missing), with the runs of ``beside`` (``(title, timeline)``)
    drawn next to it on the same scale; sets ``summary["png"]`` when written. One output
    that cannot be written does not stop the other: it is listed in ``summary["unwritten"]``
    and said through ``log`` (the table is printed before)."""
    unwritten = []
    try:
        # The folder is made only now, when there is something to put in it.
        os.makedirs(os.path.dirname(jsonl) or ".", exist_ok=True)
        timeline.write_jsonl(jsonl, extra=[r.as_dict() for r in results] + [summary])
        log(f"wrote {jsonl}")
    except OSError as e:
        unwritten.append(jsonl)
        log(f"could not write {jsonl} ({e})")
    try:
        timeline.plot(png, title=title, rewards=[r.reward_mean for r in results], beside=list(beside))
        summary["png"] = png
        log(f"wrote {png}")
    except ImportError as e:
        log(f"no PNG: {e}")
    except OSError as e:
        unwritten.append(png)
        log(f"could not write {png} ({e})")
    if unwritten:
        summary["unwritten"] = unwritten


def _free_device(device: str) -> None:
    import gc  # noqa: PLC0415

    gc.collect()
    if device != "cpu":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _flop(n: float) -> str:
    return f"{n / 1e12:.1f} TFLOP" if n >= 1e12 else f"{n / 1e9:.1f} GFLOP"


def _compute_floor(s: DemoSettings, model_config) -> dict:
    """The step's matmul FLOPs (the planner's count for this model and batch) over the matmul
    rate measured on this device now (see :mod:`tidal_recipes.cli.floor`)."""
    from tidal.plan import ModelShape, PlanConfig, step_flops  # noqa: PLC0415
    from tidal_recipes.cli.demo_plan import plan_kwargs  # noqa: PLC0415
    from tidal_recipes.cli.floor import matmul_rate  # noqa: PLC0415

    shape = ModelShape.from_hf_config(model_config, name=s.preset)
    flops = step_flops(PlanConfig(shape=shape, **plan_kwargs(s)))["total"]
    n = 8192 if s.device != "cpu" else 1024
    rate = matmul_rate(s.device, getattr(torch, s.dtype), n=n)
    return {"flops": flops, "rate": rate, "n": n, "seconds": flops / rate}


def _phase_rows(results: list) -> dict[str, dict]:
    """Per phase over the steps after the first (whose transitions include start-up): mean
    seconds, max peaks, mean bytes moved and transition seconds."""
    steady = results[1:] or results
    rows = {}
    for name in PHASES:
        ph = [r.phases[name] for r in steady if name in r.phases]
        if not ph:
            continue
        moved = statistics.fmean(p["moved_bytes"] for p in ph)
        trans = statistics.fmean(p["transition_seconds"] for p in ph)
        rows[name] = {
            "seconds": statistics.fmean(p["seconds"] for p in ph),
            # peaks over every step: the first one counts too
            "peak_allocated_bytes": max(r.phases[name]["peak_allocated_bytes"] for r in results if name in r.phases),
            "peak_driver_used_bytes": max(
                r.phases[name]["peak_driver_used_bytes"] for r in results if name in r.phases
            ),
            "compute_peak_allocated_bytes": max(
                r.phases[name]["compute_peak_allocated_bytes"] for r in results if name in r.phases
            ),
            "switch_peak_allocated_bytes": max(
                r.phases[name]["switch_peak_allocated_bytes"] for r in results if name in r.phases
            ),
            "moved_bytes": moved,
            "prefetched_bytes": statistics.fmean(p.get("prefetched_bytes", 0) for p in ph),
            "written_back_bytes": statistics.fmean(p.get("written_back_bytes", 0) for p in ph),
            "transition_seconds": trans,
            "transition_gbps": gbps(moved, trans),
            # every step's; None where the process cannot reset its peak per phase
            "host_peak_rss_bytes": max(
                (r.phases[name].get("host_peak_rss_bytes") or 0 for r in results if name in r.phases), default=0
            )
            or None,
        }
    return rows


def run_demo(s: DemoSettings, *, log: Callable[[str], None] = print) -> dict:
    """Run the demo with its roles in this process (``s.roles == "local"``; the others run
    through :func:`tidal_recipes.cli.demo_remote.run_remote_demo`); returns every figure it printed
    (also in ``demo.jsonl``)."""
    if s.roles != "local":
        raise ValueError(f"run_demo runs the roles in this process; roles={s.roles!r} runs through run_remote_demo")
    torch.manual_seed(s.seed)
    trainer = _trainer(s, timeshare=True)
    trainer_config = trainer.policy.config  # the model's shape, for the compute floor
    n_params = sum(p.numel() for p in trainer.policy.parameters())
    log(
        f"tidal demo: GRPO on '{s.task}' ({s.digits} digits), {s.preset} ({n_params / 1e6:.1f}M params, "
        f"{s.dtype}), {s.prompts} prompts x {s.group} samples, optimizer {s.optimizer}"
        + (
            f" ({s.optim_state_dtype} moments, micro-batch gradients summed on the {s.grad_accumulation})"
            if s.optimizer == "cpu_adam"
            else f" (state residency {s.optimizer_residency})"
        )
        + (", gradient checkpointing" if s.grad_ckpt else "")
        + (f", LoRA r={s.lora_rank}" if s.lora_rank else "")
        + f", on {s.device}"
    )
    all_state = trainer.all_resident_state_bytes()
    jsonl = os.path.join(s.out_dir, "demo.jsonl")
    t_run = time.perf_counter()
    results = run_steps(trainer.step, s.steps, log)
    run_s = time.perf_counter() - t_run
    timeline = trainer.timeline
    if s.beyond_resident:  # the device's memory beside the run, and beside the loop that does not fit it
        timeline.capacity_bytes = trainer.ops.driver_free_bytes()[1]
    report = trainer.ts.report() if trainer.ts is not None else ""
    records = trainer.ts.records if trainer.ts is not None else []
    # What the driver did not get back after each switch (allocator segments still shared
    # with live tensors); and what the rollout left allocated (its KV cache must be gone).
    unreleased = max((r.unreleased_bytes for r in records), default=0)
    # After the first step: that one also allocates lazily created workspaces (cuBLAS).
    rollout_left = max(r.phases["rollout"]["left_allocated_bytes"] for r in (results[1:] or results))
    captures = trainer.decoder.captures if trainer.decoder is not None else None
    engine_cache = trainer.engine_decoder.kv_cache_bytes if trainer.engine_decoder is not None else None
    graph_tags = [trainer.region.tags[n] for n in ("kv", "graph")] if trainer.region is not None else []
    # The rollout's cache and graph workspace: their size, and what stays mapped after a rollout.
    graph_mem = (sum(t.allocated_bytes for t in graph_tags), sum(t.mapped_bytes for t in graph_tags))
    trainer.close()
    del trainer
    _free_device(s.device)

    k = max(1, s.steps // 10)
    first = statistics.fmean(r.reward_mean for r in results[:k])
    last = statistics.fmean(r.reward_mean for r in results[-k:])
    rows = _phase_rows(results)
    step_s = statistics.fmean(r.seconds for r in (results[1:] or results))
    trans_s = sum(v["transition_seconds"] for v in rows.values())
    peak_ts = max(v["peak_allocated_bytes"] for v in rows.values())

    # The same loop with every role resident: with this run's optimizer, and the usual way
    # (GPU AdamW), each measured in this process after the timeshare run is gone. Where it runs
    # out of memory at this run's micro-batch, at the largest half of it that fits: what the
    # device runs without the timeshare (the micro-batch changes no result, only the memory).
    baselines: dict[str, int | str] = {}
    baseline_step_s: dict[str, float] = {}  # their step seconds (steps after the first)
    baseline_mb: dict[str, int] = {}  # the micro-batch each ran at
    baseline_timelines: list = []  # (title, timeline) of the one with this run's optimizer, for the picture
    if s.baseline_steps == 1 and s.optimizer == "adamw":
        log(
            "all-resident baseline of 1 step: AdamW creates its state in that step's step(), after the forward and "
            "backward, so the peak of a later step (the state beside the activations) is not measured"
        )
    if s.beyond_resident and s.baseline_steps:
        title, failed = _resident_to_failure(s, log)
        baseline_timelines.append((title, failed))
        baselines["adamw"] = "OOM" if failed.marks and failed.marks[-1].get("kind") == "oom" else "ran"
    for which in dict.fromkeys(s.optimizer if b == "same" else b for b in s.baseline_optimizers):
        if s.baseline_steps == 0 or s.beyond_resident:
            break
        mb = s.micro_batch
        while which not in baselines:
            try:
                base = _trainer(dataclasses.replace(s, optimizer=which, micro_batch=mb), timeshare=False)
                base_results = [base.step() for _ in range(s.baseline_steps)]
                baselines[which] = max(v["peak_allocated_bytes"] for v in _phase_rows(base_results).values())
                baseline_step_s[which] = statistics.fmean(r.seconds for r in (base_results[1:] or base_results))
                baseline_mb[which] = mb
                if which == s.optimizer:
                    title = f"the same loop, all roles resident ({which}, no timeshare"
                    title += f", micro-batch {mb})" if mb != s.micro_batch else ")"
                    baseline_timelines.append((title, base.timeline))
                base.close()
            except torch.OutOfMemoryError as e:
                log(
                    f"all-resident baseline ({which}) at micro-batch {mb} ran out of device memory: "
                    f"{str(e).splitlines()[0]}"
                )
                if mb == 1:
                    baselines[which] = "OOM"
                mb = max(1, mb // 2)
            base = base_results = None  # nothing of a failed attempt stays alive
            _free_device(s.device)
    baseline_peak = baselines.get(s.optimizer)

    # ---- print ---------------------------------------------------------------------------
    on_gpu = s.device != "cpu"
    mem_name = "peak alloc" if on_gpu else "peak state"
    log("")
    log_phase_table(rows, on_gpu=on_gpu, mem_name=mem_name, log=log)
    log(
        f"step {step_s:.3f} s; transitions {trans_s:.4f} s = {100 * trans_s / step_s:.1f}% of the step "
        f"(steps after the first; {run_s:.1f} s in all)"
    )
    what = "allocated device memory" if on_gpu else "role state on the device (CPU run: no device allocator)"
    log(
        f"peak {what} with the timeshare: {format_bytes(peak_ts)}; state of all roles resident at once: "
        f"{format_bytes(all_state)}"
    )
    for which, peak in baselines.items():
        how = f"optimizer {which}" + (" as above" if which == s.optimizer else " on the device, the usual way")
        if peak == "ran":
            log(f"all roles resident ({how}, no timeshare): ran (see above)")
        elif peak == "OOM":
            log(f"all roles resident ({how}, no timeshare): out of memory")
        else:
            at = f", micro-batch {baseline_mb[which]}" if baseline_mb[which] != s.micro_batch else ""
            log(
                f"all roles resident ({how}, no timeshare{at}, {s.baseline_steps} steps): peak "
                f"{format_bytes(peak)}; timeshare / all-resident = {peak_ts / peak:.2f}; step "
                f"{baseline_step_s[which]:.3f} s, timeshare / all-resident = {step_s / baseline_step_s[which]:.3f}"
            )
    if captures is not None:
        log(
            f"rollout KV cache and graph workspace: {format_bytes(graph_mem[0])} in the rollout region, "
            f"{format_bytes(graph_mem[1])} of it mapped after the last rollout (released to the driver between "
            f"rollouts; torch's allocated counter still counts these blocks, and the policy's weights in the "
            f"region, while unmapped: read the driver's 'peak used'); the driver got back all but "
            f"{format_bytes(unreleased)} of what every switch freed ({len(records)} transitions)"
        )
    elif engine_cache is not None:
        # The engine's cache is its own pool's, back with the driver while it sleeps; what torch
        # counts across a rollout is the roles moving around the engine's turn, not a cache left.
        log(
            f"rollout: vLLM's engine, its KV cache {format_bytes(engine_cache)} in its own pool (sized for the "
            f"step's sequences; back with the driver while it sleeps); the driver got back all but "
            f"{format_bytes(unreleased)} of what every switch freed ({len(records)} transitions)"
        )
    elif on_gpu:
        log(
            f"rollout KV cache: {format_bytes(rollout_left)} left allocated after a rollout (its sampled "
            f"tokens; steps after the first); the driver got "
            f"back all but {format_bytes(unreleased)} of what every switch freed ({len(records)} transitions)"
        )
    rollout_tps = s.prompts * s.group * s.digits / rows["rollout"]["seconds"]
    how = f"decode step in a CUDA graph, captured {captures} time(s)" if captures is not None else "eager decode"
    how = "vLLM's engine" if engine_cache is not None else how
    log(f"rollout: {rollout_tps:,.0f} sampled tokens/s ({how}; steps after the first)")
    # Training runs forward and backward over every token of every sequence (prompt + answer),
    # and the optimizer step, inside the train phase.
    train_tps = s.prompts * s.group * (2 * s.digits + 2) / rows["train"]["seconds"]
    log(f"training: {train_tps:,.0f} tokens/s (prompt + answer tokens through forward, backward and the step)")
    floor = _compute_floor(s, trainer_config)
    log(
        f"compute floor: {floor['seconds']:.3f} s a step ({_flop(floor['flops'])} of matmuls at "
        f"{floor['rate'] / 1e12:.1f} TFLOP/s, a {floor['n']}^3 {s.dtype} matmul measured here); the step is "
        f"{step_s / floor['seconds']:.1f}x it"
        + "".join(f", all resident ({which}) {sec / floor['seconds']:.1f}x" for which, sec in baseline_step_s.items())
    )
    log(f"mean reward: first {k} steps {first:.3f} -> last {k} steps {last:.3f}")
    png = os.path.join(s.out_dir, "timeline.png")
    summary = {
        "type": "summary",
        "settings": dataclasses.asdict(s),
        "params": n_params,
        "phases": rows,
        "step_seconds": step_s,
        "transition_seconds": trans_s,
        "transition_fraction": trans_s / step_s,
        "peak_timeshare_bytes": peak_ts,
        "all_resident_state_bytes": all_state,
        "peak_all_resident_bytes": baseline_peak,
        "peak_all_resident_by_optimizer": baselines,
        "step_all_resident_seconds_by_optimizer": baseline_step_s,
        "micro_batch_all_resident_by_optimizer": baseline_mb,
        "reward_first": first,
        "reward_last": last,
        "rollout_left_allocated_bytes": rollout_left if engine_cache is None else None,
        "rollout_engine_kv_cache_bytes": engine_cache,
        "rollout_tokens_per_second": rollout_tps,
        "train_tokens_per_second": train_tps,
        "compute_floor": floor,
        "rollout_graph_captures": captures,
        "rollout_graph_region_bytes": graph_mem[0] if captures is not None else None,
        "rollout_graph_mapped_after_bytes": graph_mem[1] if captures is not None else None,
        "max_unreleased_bytes": unreleased,
        "device_name": torch.cuda.get_device_name(s.device) if on_gpu else "cpu",
        "torch": torch.__version__,
    }
    write_outputs(
        timeline,
        results,
        summary,
        jsonl=jsonl,
        png=png,
        log=log,
        title=f"tidal demo: GRPO on {s.preset}, {summary['device_name']}: memory of the roles taking turns",
        beside=baseline_timelines,
    )
    if report:
        summary["timeshare_report"] = report
    return summary
