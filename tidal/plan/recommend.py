"""Which memory levers to turn on so that an RL step fits a GPU, cheapest first.

Levers, in order of what they cost (time, or a change of what is trained):

0. ``no_timeshare``: the timeshare off where every role fits at once (no transitions, nothing
   held on the host): it saves time, so it is chosen wherever it fits without a lever that costs
   more than the timeshare does (``timeshare`` then stays);
1. ``timeshare``: roles take turns on the GPU (transitions at PCIe rate);
2. ``optimizer_stream``: AdamW states on the host, brought in a chunk at a time during the step
   (``"stream"`` residency), then ``optimizer_offload``: the same, brought in whole for the step
   (``"step"``). Streamed is the cheaper: it holds less at the step, and in each run that
   measured both residencies side by side inside TRL it took the shorter step (benchmarks/
   RESULTS.md, "TRL's GRPOTrainer with tidal"). With ``offload_chunk_bytes`` the two are one
   plan, offered once, as ``optimizer_offload``;
3. ``grad_ckpt``: gradient checkpointing (one extra forward per layer in backward);
3b. ``micro_batch``: a smaller train micro-batch, more of them accumulated (the same gradient;
   less work a kernel): the largest of the configured size halved down to 1 that fits;
4. ``cpu_adam``: the optimizer runs on the host, gradients stream out during backward;
5. ``bf16_moments``: the optimizer's moments in bf16 (CPU Adam: 4 instead of 8 host bytes per
   parameter; its fp32 masters stay; rounding measured in benchmarks/RESULTS.md);
6. ``host_grads``: CPU Adam sums the micro-batches' gradients on the host (no gradient stays
   on the GPU; a copy per micro-batch and pinned staging of the parameters' size);
7. ``act_offload``: saved activations stream to the host and back;
8. ``zero1`` / ``zero2`` / ``zero3``: shard across the GPUs (needs ``gpus > 1``; more
   communication per stage);
9. ``lora``: train adapters instead of the full model (a *suggestion*: it changes what is
   trained).

Costs are powers of two in that order, so the chosen set is the one whose most expensive
lever is the cheapest, and every lever in it is needed (dropping any would give a cheaper set
that, by construction, does not fit). Levers the configuration already has cost nothing.
The whole space (at most 2 * 4 * 2 * 2 * 2 * 2 * 4 * 2 = 1024 plans) is evaluated; ``exclude``
leaves levers out (a trainer that cannot apply them).
"""

from __future__ import annotations

import dataclasses
import itertools

from tidal.plan.keeps import kept_host, kept_phases
from tidal.plan.model import GIB, Bandwidth, Plan, PlanConfig, build_plan, gathered_rollout
from tidal.plan.phases import engine_kv_cache_bytes, trl_vllm_kv_cache_bytes

__all__ = ["Recommendation", "recommend", "LEVER_COSTS", "LORA_SUGGESTED_RANK", "RESERVE_FRACTION", "SETTINGS"]

STREAM_CHUNK_BYTES = 256 << 20  # the optimizer_stream lever's chunks (TimeshareConfig.optimizer_chunk_bytes' default)
RESERVE_FRACTION = 0.05  # of a GPU's memory left out of what a plan may use (allocator slack, other processes)

LEVER_COSTS = {
    "no_timeshare": -1,
    "timeshare": 1,
    "optimizer_stream": 2,
    "optimizer_offload": 3,
    "grad_ckpt": 4,
    "micro_batch": 8,
    "cpu_adam": 16,
    "bf16_moments": 32,
    "host_grads": 64,
    "act_offload": 128,
    "zero1": 256,
    "zero2": 512,
    "zero3": 1024,
    "lora": 2048,
}
LORA_SUGGESTED_RANK = 16
_WHY = {
    "no_timeshare": "every role fits on the GPU at once: no timeshare needed (no transitions, no host copies of the roles)",
    "timeshare": "roles take turns: only the active role's state is on the GPU",
    "optimizer_offload": "AdamW states wait on the host outside the optimizer step",
    "optimizer_stream": "AdamW states wait on the host and come in for the step a chunk at a time",
    "grad_ckpt": "layers keep only their input; backward recomputes one layer at a time",
    "micro_batch": "fewer sequences a forward and backward, more of them summed (gradient accumulation: the same "
    "gradient); the activations shrink with the micro-batch",
    "cpu_adam": "no optimizer state or gradient stays on the GPU",
    "bf16_moments": "the optimizer's moments kept in bf16 (half their bytes; fp32 masters stay)",
    "host_grads": "CPU Adam sums the micro-batches' gradients on the host: none stays on the GPU",
    "act_offload": "at most two layers' activations stay on the GPU",
    "zero1": "optimizer states sharded across the GPUs",
    "zero2": "optimizer states and gradients sharded across the GPUs",
    "zero3": "optimizer states, gradients and params sharded across the GPUs",
    "lora": f"train rank-{LORA_SUGGESTED_RANK} adapters: trainable state becomes tiny and the reference shares the base "
    "(changes what is trained)",
}


#: What to type for each lever: in a TRL script, and in ``tidal demo``'s flags.
SETTINGS = {
    "no_timeshare": ("TRL's GRPOTrainer alone (no TidalGRPOTrainer)", "the all-resident loop (--baseline-steps)"),
    "timeshare": ("TidalGRPOTrainer(..., tidal=TidalConfig())", "the default"),
    "optimizer_offload": ('TidalConfig(optimizer_residency="step")', "--optimizer-residency step"),
    "optimizer_stream": ('TidalConfig(optimizer_residency="stream")', "--optimizer-residency stream"),
    "grad_ckpt": ("GRPOConfig(gradient_checkpointing=True)", "--grad-ckpt"),
    "micro_batch": (
        "GRPOConfig(per_device_train_batch_size={m}, gradient_accumulation_steps={steps})",
        "--micro-batch {m}",
    ),
    "cpu_adam": ("optimizers=(tidal.CPUAdam(model.parameters(), lr=...), None)", "--optimizer cpu_adam"),
    "bf16_moments": ("tidal.CPUAdam(..., state_dtype=torch.bfloat16)", "--optim-state-dtype bf16"),
    "host_grads": ("tidal.CPUAdam(..., host_accumulation=True) (its default)", "--grad-accumulation host"),
    "act_offload": ("TidalConfig(activation_offload=True)", "not in the demo"),
    "zero1": ("no TRL launch of tidal's shards only the optimizer state: FSDP2 (zero3)", "not in the demo"),
    "zero2": (
        "no TRL launch of tidal's shards only the optimizer state and gradients: FSDP2 (zero3)",
        "not in the demo",
    ),
    "zero3": ("accelerate launch --config_file fsdp2.yaml (TRL's FSDP2 config)", "not in the demo"),
    "lora": (
        f'GRPOTrainer(..., peft_config=LoraConfig(r={LORA_SUGGESTED_RANK}, target_modules="all-linear")): '
        "changes what is trained",
        f"--lora-rank {LORA_SUGGESTED_RANK}",
    ),
}


# Levers only tidal's trainer gives (TidalConfig's): with them "the timeshare off" is tidal keeping every role.
_TIDAL_ONLY = {"optimizer_stream", "optimizer_offload", "act_offload"}


def _residency(c: PlanConfig) -> str:
    """``TidalConfig``'s ``optimizer_residency`` for the plan's optimizer, as a keyword to append
    (``', optimizer_residency="role"'``); empty with CPU Adam (the trainer's own optimizer)."""
    if c.optimizer == "adamw":
        return ', optimizer_residency="role"'
    if c.optimizer == "adamw_offload":
        return f', optimizer_residency="{"stream" if c.optim_stream_chunk_bytes else "step"}"'
    return ""


def _binding(peak: int, host: int, usable: int, host_usable: int | None, dp: int) -> str:
    over = []
    if peak > usable:
        over.append(f"GPU: {peak / GIB:.2f} GiB peak (with context), {usable / GIB:.2f} GiB usable")
    if host_usable is not None and host > host_usable:
        procs = f" for {dp} GPUs' processes" if dp > 1 else ""
        over.append(f"host: {host / GIB:.2f} GiB to pin{procs}, {host_usable / GIB:.2f} GiB usable")
    return "; ".join(over) or "fits"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Recommendation:
    """The outcome of :func:`recommend`.

    ``levers``: levers to turn on (cheapest first), with ``reasons[lever]`` saying what it
    does and what the peak would be without it. ``plan``: the plan with them. ``fits``:
    ``plan.device_peak_bytes <= usable_bytes`` and, when the host was checked
    (``host_usable_bytes`` not None), ``plan.node_host_bytes <= host_usable_bytes``. When
    False, ``plan`` is the best plan found: of those that fit the GPU the one holding the least
    host memory (``host_miss_bytes`` says by how much it exceeds the host), else the lowest
    peak (``miss_bytes`` says by how much it exceeds ``usable_bytes``).
    """

    fits: bool
    levers: list[str]
    reasons: dict[str, str]
    plan: Plan
    gpu_mem_bytes: int
    usable_bytes: int
    miss_bytes: int
    baseline_device_peak_bytes: int
    host_usable_bytes: int | None = None
    host_miss_bytes: int = 0
    baseline_host_bytes: int = 0

    def binding(self, device_peak_bytes: int, host_bytes: int) -> str:
        """What a plan with these figures overruns, both sides' bytes named (GPU, host or
        both), or ``"fits"``."""
        return _binding(device_peak_bytes, host_bytes, self.usable_bytes, self.host_usable_bytes, self.plan.config.dp)

    def summary(self) -> list[str]:
        """Readable lines: what to enable and why, or by how much nothing fits. Whenever a
        lever is recommended or nothing fits, the constraint that binds is named with both
        sides' bytes (``host: 56.74 GiB to pin, 19.23 GiB usable``)."""
        use, peak = self.usable_bytes / GIB, self.plan.device_peak_bytes / GIB
        host = self.plan.node_host_bytes / GIB
        procs = f" for {self.plan.config.dp} GPUs' processes" if self.plan.config.dp > 1 else ""
        host_line = (
            f"Host memory: {host:.2f} GiB pinned{procs} of {self.host_usable_bytes / GIB:.2f} GiB usable."
            if self.host_usable_bytes is not None
            else f"Host memory: {host:.2f} GiB pinned{procs} (not checked: no host memory given)."
        )
        if self.fits and not self.levers:
            return [
                f"Fits as configured: {peak:.2f} GiB peak (with context) of {use:.2f} GiB usable.",
                host_line,
                *self._engine_lines(),
                *self.prefetch_lines(),
            ]
        if self.fits and self.levers == ["no_timeshare"]:
            return [
                f"No timeshare needed: every role fits at once, {peak:.2f} GiB peak (with context) of {use:.2f} GiB "
                "usable; run without it.",
                host_line,
                f"    no_timeshare: {self.reasons['no_timeshare']}",
                *self.settings(),
            ]
        named = ", ".join("the timeshare off" if x == "no_timeshare" else x for x in self.levers)
        if self.fits:
            lines = [
                f"Enable: {named} -> {peak:.2f} GiB peak (with context) of {use:.2f} GiB usable. "
                f"As configured it does not fit: "
                f"{self.binding(self.baseline_device_peak_bytes, self.baseline_host_bytes)}.",
                host_line,
            ]
        elif self.host_miss_bytes:
            lines = [
                f"Nothing fits the host: the plan that fits the GPU with the least host memory "
                f"({', '.join(self.levers) or 'as configured'}, {peak:.2f} GiB peak) holds {host:.2f} GiB pinned{procs}, "
                f"{self.host_miss_bytes / GIB:.2f} GiB over the {self.host_usable_bytes / GIB:.2f} GiB usable. Use a "
                "machine with more RAM or more machines, train LoRA adapters, or lower the model size."
            ]
        else:
            lines = [
                f"Nothing fits: the best plan ({', '.join(self.levers) or 'as configured'}) peaks at {peak:.2f} GiB "
                f"with context, {self.miss_bytes / GIB:.2f} GiB over the {use:.2f} GiB usable. Lower the micro-batch, "
                "the rollout batch (prompts x group per GPU) or the sequence length, or use more GPUs."
            ]
        lines += [f"  {lever}: {self.reasons[lever]}" for lever in self.levers]
        return lines + (self.settings() + self.prefetch_lines() if self.fits else [])

    def prefetch_lines(self) -> list[str]:
        """For a timeshared plan that fits: what prefetch (``TidalConfig(prefetch=True)``) adds.
        It costs no memory beyond the room: each turn keeps a role beside its phase only where it
        fits (:func:`~tidal.plan.keeps.kept_phases` on the usable bytes), so it saves the copies
        of what is kept and hides the next role's behind compute; ``prefetch_peak_bytes`` bounds
        the keeps lower (to leave room for another process). None without the timeshare or with
        LoRA (nothing to keep)."""
        c = self.plan.config
        if not self.fits or not c.timeshare or c.lora_rank:
            return []
        extra = c.cuda_context_bytes + self.plan.engine_own_bytes
        kept = kept_phases(self.plan, self.usable_bytes - c.cuda_context_bytes)
        peak = max(k.peak_bytes for k in kept.values()) + extra
        host = sum(kept_host(self.plan, kept).values()) * c.dp
        beside = "; ".join(f"{p}: + {', '.join(k.kept)}" for p, k in kept.items() if k.kept) or "nothing fits beside"
        return [
            f"  prefetch: TidalConfig({_residency(c).lstrip(', ')}{', ' if _residency(c) else ''}prefetch=True) "
            "(demo: --prefetch): each turn keeps what fits beside it and "
            f"brings the next role in behind its compute ({beside}): {peak / GIB:.2f} GiB peak (with context) of "
            f"{self.usable_bytes / GIB:.2f} usable, {host / GIB:.2f} GiB pinned on the host; "
            "TidalConfig(prefetch_peak_bytes=...) bounds it lower"
        ]

    def settings(self) -> list[str]:
        """What to type for the recommended levers (:data:`SETTINGS`): in a TRL script, and
        ``tidal demo``'s flags; none where it fits as configured (but the vLLM engine's)."""
        if not self.levers:
            return self._engine_lines()
        lines = ["  To type (TRL; tidal demo):"]
        for lever, (trl, demo) in self._typed().items():
            lines.append(f"    {lever}: {trl}; demo: {demo}")
        return lines + self._engine_lines()

    def _typed(self) -> dict[str, tuple[str, str]]:
        """:data:`SETTINGS` of the recommended levers, the micro-batch's with its size filled in."""
        c = self.plan.config
        m, steps = c.micro_batch, c.micro_batches
        typed = {lever: tuple(x.format(m=m, steps=steps) for x in SETTINGS[lever]) for lever in self.levers}
        if "no_timeshare" in typed and set(self.levers) & _TIDAL_ONLY:
            # those levers are tidal's trainer's: with prefetch every role stays where it fits
            typed["no_timeshare"] = (
                "TidalGRPOTrainer(..., tidal=TidalConfig(prefetch=True)): every role stays on the GPU, only the "
                "levers below move state",
                typed["no_timeshare"][1],
            )
        return typed

    def _engine_lines(self) -> list[str]:
        """With a vLLM engine: its settings, and its KV cache as planned."""
        c = self.plan.config
        if c.rollout_engine != "vllm":
            return []
        cache = engine_kv_cache_bytes(c) / GIB
        trl = 'GRPOConfig(use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=True'
        if not c.timeshare:
            return [
                f"  vLLM engine: {trl}, vllm_gpu_memory_utilization={c.vllm_gpu_memory_utilization}): "
                f"its KV cache {cache:.2f} GiB, what vLLM gives itself from that share"
            ]
        auto = c.vllm_kv_cache_bytes is None
        sized = f" ({c.rollout_batch} sequences of {c.engine_max_len} tokens at once)" if auto else ""
        size = '"auto"' if auto else str(c.vllm_kv_cache_bytes)
        residency = _residency(c)
        return [
            f"  vLLM engine: {trl}) with TidalConfig(vllm_kv_cache_bytes={size}{residency}, prefetch=True): "
            f"its KV cache {cache:.2f} GiB{sized}"
        ]

    def to_dict(self) -> dict:
        return {
            "fits": self.fits,
            "levers": list(self.levers),
            "reasons": dict(self.reasons),
            "gpu_mem_bytes": self.gpu_mem_bytes,
            "usable_bytes": self.usable_bytes,
            "miss_bytes": self.miss_bytes,
            "device_peak_bytes": self.plan.device_peak_bytes,
            "peak_phase": self.plan.peak_phase,
            "baseline_device_peak_bytes": self.baseline_device_peak_bytes,
            "baseline_host_bytes": self.baseline_host_bytes,
            "host_bytes": self.plan.node_host_bytes,
            "host_usable_bytes": self.host_usable_bytes,
            "host_miss_bytes": self.host_miss_bytes,
            "config": self.plan.config.to_dict(),
            "settings": {lever: dict(zip(("trl", "demo"), typed)) for lever, typed in self._typed().items()},
        }


def _engine_as_built(c: PlanConfig, gpu_mem_bytes: int) -> PlanConfig:
    """Without the timeshare a vLLM engine is TRL's alone: its KV cache is what vLLM gives
    itself from ``vllm_gpu_memory_utilization`` of the device, whatever the plan configured."""
    if c.rollout_engine != "vllm" or c.timeshare:
        return c
    return c.replace(vllm_kv_cache_bytes=max(1, trl_vllm_kv_cache_bytes(c, gpu_mem_bytes)))


def _apply(base: PlanConfig, levers: tuple[str, ...], gpus: int, offload_chunk_bytes: int | None = None) -> PlanConfig:
    ch: dict = {}
    for lever in levers:
        if lever == "timeshare":
            ch["timeshare"] = True
        elif lever == "no_timeshare":
            ch["timeshare"] = False
        elif lever == "optimizer_offload":
            ch["optimizer"] = "adamw_offload"
            ch["optim_stream_chunk_bytes"] = offload_chunk_bytes
        elif lever == "optimizer_stream":
            ch["optimizer"] = "adamw_offload"
            ch["optim_stream_chunk_bytes"] = offload_chunk_bytes or STREAM_CHUNK_BYTES
        elif lever == "cpu_adam":
            ch["optimizer"] = "cpu_adam"
            ch["optim_stream_chunk_bytes"] = None  # an AdamW-offload setting: CPU Adam streams nothing
        elif lever == "bf16_moments":
            ch["optim_state_dtype"] = "bf16"
        elif lever == "host_grads":
            ch["cpu_adam_grad_accumulation"] = "host"
        elif lever in ("grad_ckpt", "act_offload"):
            ch[lever] = True
        elif lever.startswith("zero"):
            ch["zero_stage"], ch["dp"] = int(lever[4]), gpus
        elif lever == "lora":
            ch["lora_rank"] = LORA_SUGGESTED_RANK
        # micro_batch: its size is searched by recommend (_smaller_micro_batch)
    return base.replace(**ch)


def _micro_batches(base: PlanConfig) -> list[int]:
    """The micro-batch sizes the ``micro_batch`` lever tries, largest first: the configured one
    halved until one sequence."""
    sizes, m = [], base.micro_batch // 2
    while m >= 1:
        sizes.append(m)
        m //= 2
    if sizes and sizes[-1] != 1:
        sizes.append(1)
    return sizes


def _choices(base: PlanConfig, gpus: int, offload_chunk_bytes: int | None = None) -> list[list[tuple[str, ...]]]:
    """Per lever family, the options not already in ``base`` (the empty tuple = leave as is);
    ``optimizer_stream`` only where ``optimizer_offload`` does not stream (no
    ``offload_chunk_bytes``); ``cpu_adam`` only on one GPU (it takes each gradient to the host as
    the backward makes it, before the ranks' gradients are reduced: tidal's trainers refuse it
    with several processes)."""
    fams: list[list[tuple[str, ...]]] = []
    if not base.timeshare:
        fams.append([(), ("timeshare",)])
    else:
        fams.append([(), ("no_timeshare",)])
    optim = [()]
    if base.optimizer == "adamw":
        optim.append(("optimizer_offload",))
        if offload_chunk_bytes is None:  # else optimizer_offload streams already: the same plan
            optim.append(("optimizer_stream",))
    if base.optimizer != "cpu_adam" and gpus == 1:
        optim.append(("cpu_adam",))
    fams.append(optim)
    if base.optim_state_dtype != "bf16":
        fams.append([(), ("bf16_moments",)])
    if base.cpu_adam_grad_accumulation == "device":  # changes something only with CPU Adam
        fams.append([(), ("host_grads",)])
    for flag in ("grad_ckpt", "act_offload"):
        if not getattr(base, flag):
            fams.append([(), (flag,)])
    if min(base.micro_batch, base.rollout_batch) > 1:
        fams.append([(), ("micro_batch",)])
    if gpus > 1:
        fams.append([()] + [(f"zero{s}",) for s in range(max(base.zero_stage + 1, 1), 4)])
    if not base.lora_rank:
        fams.append([(), ("lora",)])
    return fams


def recommend(
    config: PlanConfig,
    *,
    gpu_mem_bytes: int,
    gpus: int = 1,
    reserve_fraction: float = RESERVE_FRACTION,
    bandwidth: Bandwidth | None = None,
    allow_lora: bool = True,
    host_mem_bytes: int | None = None,
    host_reserve_fraction: float = 0.1,
    exclude: tuple[str, ...] = (),
    offload_chunk_bytes: int | None = None,
) -> Recommendation:
    """The cheapest set of levers on top of ``config`` whose driver-level peak (allocated +
    CUDA context) fits ``gpu_mem_bytes * (1 - reserve_fraction)`` on each of ``gpus`` GPUs and,
    given ``host_mem_bytes`` (the machine's RAM the job may use, e.g.
    ``tidal.memory.host_memory().available_bytes``), whose host memory for all ``gpus``
    processes (``Plan.node_host_bytes``) fits ``host_mem_bytes * (1 - host_reserve_fraction)``.

    ``reserve_fraction`` (default 5%) is kept free for allocator fragmentation and caching,
    which the model does not predict; ``host_reserve_fraction`` (default 10%) for what the
    model does not count on the host (the processes themselves, Python, data, the model as
    loaded before it moves to the GPU). ``config.dp`` is set to ``gpus`` (data parallel over
    all of them, on one machine). ``exclude``: levers never to choose (names of
    :data:`LEVER_COSTS`; ``allow_lora=False`` is ``exclude=("lora",)``). ``offload_chunk_bytes``:
    the ``optimizer_offload`` lever streams the state in chunks of this size during ``step()``
    (the timeshare's ``optimizer_residency="stream"``); None: all of it at once (``"step"``).
    With ZeRO 3 over several GPUs and ``config.zero3_rollout`` ``"whole"`` or ``"lent"``
    (tidal's gathered generation), each timeshared set of levers is planned with the rollout
    tidal's trainer would hold for it on these GPUs (:func:`~tidal.plan.gathered_rollout`:
    whole, lending the shards, or per unit); a set without the timeshare is TRL alone, whose
    generation gathers per unit. Returns a :class:`Recommendation`. Raises ``ValueError`` on an unknown lever name.
    """
    unknown = sorted(set(exclude) - set(LEVER_COSTS))
    if unknown:
        raise ValueError(f"exclude names unknown levers {unknown}; the levers are {sorted(LEVER_COSTS)}")
    if gpu_mem_bytes <= 0 or gpus < 1 or not 0 <= reserve_fraction < 1:
        raise ValueError("gpu_mem_bytes must be > 0, gpus >= 1, 0 <= reserve_fraction < 1")
    if host_mem_bytes is not None and (host_mem_bytes <= 0 or not 0 <= host_reserve_fraction < 1):
        raise ValueError("host_mem_bytes must be > 0 (or None) and 0 <= host_reserve_fraction < 1")
    base = config.replace(dp=gpus)
    usable = int(gpu_mem_bytes * (1 - reserve_fraction))
    host_usable = None if host_mem_bytes is None else int(host_mem_bytes * (1 - host_reserve_fraction))
    baseline = build_plan(_engine_as_built(base, gpu_mem_bytes), bandwidth=bandwidth)
    fams = _choices(base, gpus, offload_chunk_bytes)
    banned = set(exclude) | (set() if allow_lora else {"lora"})
    fams = [[opt for opt in f if not banned & set(opt)] for f in fams]
    scored = []
    for combo in itertools.product(*fams):
        levers = tuple(x for part in combo for x in part)
        candidate = _apply(base, levers, gpus, offload_chunk_bytes)
        if base.zero3_rollout != "layers" and candidate.timeshare:
            # tidal's trainer gathers the policy for generation as the candidate's room allows
            # (whole, lending the shards, or per unit): decided for each set of levers, not once
            mode = gathered_rollout(
                candidate.replace(zero3_rollout="whole"), usable - candidate.cuda_context_bytes, bandwidth=bandwidth
            )
            candidate = candidate.replace(zero3_rollout=mode)
        # with the micro_batch lever: the largest smaller micro-batch that fits (GPU and host), else the smallest
        for m in _micro_batches(candidate) if "micro_batch" in levers else [candidate.micro_batch]:
            plan = build_plan(_engine_as_built(candidate.replace(micro_batch=m), gpu_mem_bytes), bandwidth=bandwidth)
            if plan.device_peak_bytes <= usable and (host_usable is None or plan.node_host_bytes <= host_usable):
                break
        scored.append((sum(LEVER_COSTS[x] for x in levers), plan.device_peak_bytes, levers, plan))
    dp = base.dp
    on_gpu = [x for x in scored if x[1] <= usable]
    fitting = [x for x in on_gpu if host_usable is None or x[3].node_host_bytes <= host_usable]
    fits = bool(fitting)
    if fits:
        cost, peak, levers, plan = min(fitting, key=lambda x: (x[0], x[1]))
    elif on_gpu:  # the host is the limit: the plan holding the least of it
        cost, peak, levers, plan = min(on_gpu, key=lambda x: (x[3].node_host_bytes, x[0]))
    else:
        cost, peak, levers, plan = min(scored, key=lambda x: (x[1], x[0]))
    by_levers = {x[2]: x[3] for x in scored}
    reasons = {}
    for lever in levers:
        # Each family offers "leave as is", so the same set without this lever was evaluated;
        # when the set fits, that one does not (it would be cheaper), and its overrun is named.
        without = by_levers[tuple(x for x in levers if x != lever)]
        over = _binding(without.device_peak_bytes, without.node_host_bytes, usable, host_usable, dp)
        if lever == "no_timeshare":
            over = (
                f"the timeshare pins {without.node_host_bytes / GIB:.2f} GiB on the host and spends "
                f"{without.transition_seconds * 1e3:.0f} ms a step on transitions"
            )
        elif over == "fits":  # a set that does not fit either: the lever lowers the peak
            over = f"{without.device_peak_bytes / GIB:.2f} GiB peak (with context)"
        why = _WHY[lever]
        if lever == "micro_batch":
            why += (
                f": {plan.config.micro_batch} sequences, {plan.config.micro_batches} a step (from {base.micro_batch})"
            )
        reasons[lever] = f"{why}; with it {over}" if lever == "no_timeshare" else f"{why}; without it {over}"
    levers_sorted = sorted(levers, key=LEVER_COSTS.get)
    return Recommendation(
        fits=fits,
        levers=levers_sorted,
        reasons=reasons,
        plan=plan,
        gpu_mem_bytes=gpu_mem_bytes,
        usable_bytes=usable,
        miss_bytes=max(0, peak - usable),
        baseline_device_peak_bytes=baseline.device_peak_bytes,
        baseline_host_bytes=baseline.node_host_bytes,
        host_usable_bytes=host_usable,
        host_miss_bytes=max(0, plan.node_host_bytes - host_usable) if host_usable is not None and not fits else 0,
    )
