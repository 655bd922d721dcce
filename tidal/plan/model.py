"""The per-phase peak-memory model of one colocated RL (GRPO) step on one GPU.

One step runs four phases in order: ``rollout`` (generation with a KV cache), ``reference``
(frozen model, log-probs only), ``train`` (forward + backward of micro-batches) and
``optimizer_step``. Each phase's peak = *resident* state (the roles that must be on the GPU)
+ the phase's largest *transient* (KV cache, activations, logits, temporaries). Both are in
bytes allocated through torch's caching allocator (what ``torch.cuda.max_memory_allocated``
reports); the CUDA context is a separate constant (:attr:`PlanConfig.cuda_context_bytes`),
added only for driver-level totals.

With ``timeshare=True`` only the active role's state is resident in a phase (tidal's
:class:`~tidal.Timeshare`); ``all_resident`` gives the same phases with every role resident,
for comparison. Transition times are bytes moved / bandwidth, the out-going and in-coming
copies overlapped on separate copy engines.

Every modelling choice is listed by :func:`Plan.assumptions`; :func:`predict_phases` is the
calibration hook (predicted peak allocated bytes per phase for a configuration).
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from tidal.plan import activations as act
from tidal.plan.assumptions import assumptions
from tidal.plan.config import GIB, MIB, OPTIMIZERS, PHASES, PlanConfig
from tidal.plan.phases import (
    accumulates_unsharded,
    cpu_adam_step_transient,
    engine_generation_transient,
    engine_kv_cache_bytes,
    engine_weights_bytes,
    gathered_params,
    reference_transient,
    role_state,
    rollout_transient,
    train_transient,
)
from tidal.plan.shapes import load_shape

__all__ = [
    "PlanConfig",
    "PUSH_SOURCE",
    "Bandwidth",
    "Phase",
    "Transition",
    "Plan",
    "build_plan",
    "gathered_rollout",
    "lends_shards",
    "predict_phases",
    "PHASES",
    "OPTIMIZERS",
    "MIB",
    "GIB",
]


# With a vLLM engine, the rollout's transient at the push: the policy's weights beside the
# engine's, beyond what the cache and the generation take once the policy has left.
PUSH_SOURCE = "policy's weights beside the engine's at the push (beyond the cache)"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Bandwidth:
    """Host<->GPU copy rates in GB/s (1e9 bytes/s). Defaults: pinned copies measured on an
    H200 (DESIGN.md): 55 GB/s each way, ~100 GB/s with both copy engines busy."""

    d2h_gbps: float = 55.0
    h2d_gbps: float = 55.0
    bidir_gbps: float = 100.0

    def __post_init__(self) -> None:
        for name in ("d2h_gbps", "h2d_gbps", "bidir_gbps"):
            x = getattr(self, name)
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x <= 0:
                raise ValueError(f"Bandwidth.{name} must be a finite number of GB/s > 0, got {x!r}")

    def seconds(self, bytes_out: int, bytes_in: int) -> float:
        """Time of an overlapped switch: each direction at its own rate, both together at
        most at the bidirectional rate."""
        t = max(bytes_out / (self.d2h_gbps * 1e9), bytes_in / (self.h2d_gbps * 1e9))
        return max(t, (bytes_out + bytes_in) / (self.bidir_gbps * 1e9))

    @classmethod
    def from_bench_json(cls, source: str | dict) -> "Bandwidth":
        """The line rate of a ``tidal bench --json PATH`` file (or its loaded dict)."""
        where = "the bench JSON" if isinstance(source, dict) else str(source)
        if isinstance(source, dict):
            data = source
        else:
            try:
                with open(source) as f:
                    data = json.load(f)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(
                    f"{where} is not a JSON file ({e}); pass what `tidal bench --json PATH` wrote"
                ) from None
            except OSError as e:
                raise ValueError(
                    f"{where} cannot be read ({e.strerror or e}); pass the file `tidal bench --json PATH` wrote"
                ) from None
        line = data.get("line_rate", data) if isinstance(data, dict) else None
        if not isinstance(line, dict) or any(k not in line for k in ("d2h_gbps", "h2d_gbps", "bidir_gbps")):
            raise ValueError(
                f"{where} has no line_rate with d2h_gbps, h2d_gbps and bidir_gbps; pass what `tidal bench --json PATH` "
                f"wrote"
            )
        try:
            return cls(**{k: float(line[k]) for k in ("d2h_gbps", "h2d_gbps", "bidir_gbps")})
        except (TypeError, ValueError) as e:
            raise ValueError(
                f"{where}: unusable line rate ({e}); measure it again with `tidal bench --json PATH`"
            ) from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Phase:
    """One phase's peak: ``resident`` and ``transient`` components (name -> bytes)."""

    name: str
    resident: dict[str, int]
    transient: dict[str, int]

    @property
    def resident_bytes(self) -> int:
        return sum(self.resident.values())

    @property
    def transient_bytes(self) -> int:
        return sum(self.transient.values())

    @property
    def peak_bytes(self) -> int:
        return self.resident_bytes + self.transient_bytes

    def to_dict(self) -> dict:
        return {"resident": dict(self.resident), "transient": dict(self.transient), "peak_bytes": self.peak_bytes}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Transition:
    """Bytes moved between two phases and the predicted time of the overlapped switch."""

    before: str
    after: str
    bytes_out: int
    bytes_in: int
    seconds: float

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    """The result of :func:`build_plan`. ``phases`` follows ``config.timeshare``;
    ``timeshared`` / ``all_resident`` hold both modes for comparison. Under ZeRO 3 over several
    GPUs ``all_resident`` is TRL alone under FSDP2 (the ``no_timeshare`` lever): its generation
    gathers per unit whatever ``zero3_rollout`` says (only tidal's trainer gathers the policy
    whole), and TRL shards the reference as one unit, so the reference's forward gathers all
    of it beside every shard. ``streamed``: bytes per
    step that cross PCIe overlapped with compute (CPU Adam gradients/weights, activation
    offload), with their time at the one-way rate. ``host``: the host memory the plan holds for
    one GPU's process, by component (pinned: timeshare host copies, offloaded optimizer
    states, CPU Adam's buffers, offloaded activations)."""

    config: PlanConfig
    bandwidth: Bandwidth
    timeshared: dict[str, Phase]
    all_resident: dict[str, Phase]
    transitions: list[Transition]
    streamed: dict[str, int]
    host: dict[str, int]
    assumptions: list[str]

    @property
    def host_bytes(self) -> int:
        """Host memory held for one GPU's state (the sum of :attr:`host`)."""
        return sum(self.host.values())

    @property
    def node_host_bytes(self) -> int:
        """Host memory the plan holds on a machine running all ``dp`` GPUs' processes."""
        return self.host_bytes * self.config.dp

    @property
    def phases(self) -> dict[str, Phase]:
        return self.timeshared if self.config.timeshare else self.all_resident

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda p: self.phases[p].peak_bytes)

    @property
    def peak_bytes(self) -> int:
        """Peak allocated bytes of the configured mode (CUDA context not included)."""
        return self.phases[self.peak_phase].peak_bytes

    @property
    def timeshare_peak_bytes(self) -> int:
        return max(p.peak_bytes for p in self.timeshared.values())

    @property
    def all_resident_peak_bytes(self) -> int:
        return max(p.peak_bytes for p in self.all_resident.values())

    @property
    def device_peak_bytes(self) -> int:
        """Driver-level estimate: peak allocated + CUDA context (+ a vLLM engine's own memory,
        which stays taken while it sleeps); allocator caching and fragmentation on top are not
        modelled."""
        return self.peak_bytes + self.config.cuda_context_bytes + self.engine_own_bytes

    @property
    def engine_own_bytes(self) -> int:
        """A vLLM engine's memory outside torch's counters in every phase
        (:attr:`PlanConfig.vllm_own_bytes`); 0 without one."""
        return self.config.vllm_own_bytes if self.config.rollout_engine == "vllm" else 0

    @property
    def transition_seconds(self) -> float:
        return sum(t.seconds for t in self.transitions)

    def to_dict(self) -> dict:
        return {
            "config": self.config.to_dict(),
            "bandwidth": dataclasses.asdict(self.bandwidth),
            "phases": {k: v.to_dict() for k, v in self.phases.items()},
            "timeshared": {k: v.to_dict() for k, v in self.timeshared.items()},
            "all_resident": {k: v.to_dict() for k, v in self.all_resident.items()},
            "peak_phase": self.peak_phase,
            "peak_bytes": self.peak_bytes,
            "timeshare_peak_bytes": self.timeshare_peak_bytes,
            "all_resident_peak_bytes": self.all_resident_peak_bytes,
            "cuda_context_bytes": self.config.cuda_context_bytes,
            "device_peak_bytes": self.device_peak_bytes,
            "transitions": [t.to_dict() for t in self.transitions],
            "transition_seconds": self.transition_seconds,
            "streamed": dict(self.streamed),
            "host_bytes": self.host_bytes,
            "host": dict(self.host),
            "node_host_bytes": self.node_host_bytes,
            "assumptions": list(self.assumptions),
        }


def lends_shards(c: PlanConfig) -> bool:
    """Whether the rollout lends the policy's shards to the host (``zero3_rollout="lent"``,
    where the policy is sharded: ZeRO 3 over several GPUs, full-parameter)."""
    return c.zero3_rollout == "lent" and c.zero_stage >= 3 and c.dp > 1 and not c.lora_rank


def gathered_rollout(c: PlanConfig, usable_bytes: int, *, bandwidth: Bandwidth | None = None) -> str:
    """How tidal's TRL trainer holds a sharded policy for generation on GPUs of
    ``usable_bytes`` (:func:`tidal.integrations.trl.launch.gathered_for_generation`'s rule on
    the plan's figures): ``"whole"`` where the gathered copy + 10% and 256 MiB fits beside what
    the rollout's turn leaves, ``"lent"`` where it fits once the policy's shards are out,
    else ``"layers"``. ``c`` as planned with ``zero3_rollout="whole"`` or ``"lent"``; a plan
    with nothing sharded (one GPU, ZeRO < 3) returns ``c.zero3_rollout``."""
    if c.zero_stage < 3 or c.dp == 1:
        return c.zero3_rollout
    whole = dataclasses.replace(c, zero3_rollout="whole")
    rollout = build_plan(whole, bandwidth=bandwidth).timeshared["rollout"]
    # tidal.memory.phase_need_bytes (torch's side of tidal; the plan imports no torch)
    need = int(1.1 * rollout.transient.get("zero3 whole policy gathered", 0)) + (256 << 20)
    if rollout.resident_bytes + need <= usable_bytes:
        return "whole"
    shards = rollout.resident.get("actor params", 0)
    if rollout.resident_bytes - shards + need <= usable_bytes and not c.lora_rank:
        return "lent"
    return "layers"


def build_plan(config: PlanConfig, *, bandwidth: Bandwidth | None = None) -> Plan:
    """Predict every phase of one RL step for ``config``, in both residency modes."""
    c, bw = config, bandwidth or Bandwidth()
    st = role_state(c)
    gathered = gathered_params(c)
    actor_params = st["base"] + st["adapters"]
    optim_in_train = st["optim"] if c.optimizer == "adamw" else 0
    train_t, train_grads = train_transient(c, st)
    # FSDP2 under accelerate's no_sync keeps them whole until the last micro-batch
    train_grads_key = "grads (unsharded through the micro-batches)" if accumulates_unsharded(c) else "grads"
    step_t = {"adamw step temporary": st["step_temp"]} if st["step_temp"] else {}
    if c.optimizer == "cpu_adam":
        step_t = cpu_adam_step_transient(c)
    step_states = st["optim"]
    if c.optim_stream_chunk_bytes is not None:
        # Streamed step: a chunk closes once it holds >= chunk bytes of state, so a chunk is at
        # most chunk + one parameter's state; the embedding (the first parameter) is alone in
        # its chunk when its state is that big. Two chunks at once: the next comes in while
        # this one goes out.
        s = c.shape
        per = st["optim"] / max(st["trainable"], 1)  # state bytes per trainable element
        big = (
            s.largest_param()
            if not c.lora_rank
            else max(c.lora_rank * max(a, b) for a, b in s.linear_shapes().values())
        ) * per
        layer_max = max(a * b for a, b in s.linear_shapes().values()) * per if not c.lora_rank else big
        chunk = c.optim_stream_chunk_bytes
        step_states = min(st["optim"], int(max(big, chunk) + chunk + layer_max))
    engine = c.rollout_engine == "vllm"
    if engine:
        # The engine's memory while it generates: its weights, then its cache (the generation's
        # own workspace beside it). Its weights are pushed from the policy's on the device, and the
        # policy leaves before the cache wakes: the push's moment holds both weights.
        weights, cache = engine_weights_bytes(c), engine_kv_cache_bytes(c)
        generation = {"engine kv cache": cache, **engine_generation_transient(c)}
        push = {"engine weights": weights}
        source = actor_params - sum(generation.values())
        rollout_t = {
            **generation,
            PUSH_SOURCE: max(0, source),
        }
    else:
        rollout_t = {**rollout_transient(c), **gathered_params(c, rollout=True)}
    transients = {
        "rollout": rollout_t,
        "reference": {**reference_transient(c), **gathered},
        "train": {**train_t, **gathered},
        "optimizer_step": step_t,
    }
    all_transients = dict(transients)
    if engine:  # every role resident: the engine's weights and cache beside them all
        # After the optimizer step the gradients' memory stays in torch's cache, in segments the
        # resident optimizer state shares: vLLM maps its own from the driver and cannot use it
        # (measured as fragments of the gradients' size at the engine's turn, benchmarks/RESULTS.md).
        held = st["grads"] if optim_in_train else 0
        all_transients["rollout"] = {**generation, "gradients' memory left in torch's cache": held}
    if gathered:  # every role resident: TRL alone under FSDP2 (what the no_timeshare lever names)
        all_transients["rollout"] = {**rollout_transient(c), **gathered}  # per unit: it gathers nothing whole
        if st["reference"]:
            # TRL's prepare_fsdp shards the reference as one unit: its forward gathers all of it at once
            whole_reference = c.shape.param_count() * act.dtype_bytes(c.param_dtype)
            all_transients["reference"] = {
                **reference_transient(c),
                "zero3 reference gathered whole (TRL: one unit)": whole_reference,
            }

    rollout_weights = {"rollout weights": st["rollout_copy"]} if st["rollout_copy"] else {"actor params": actor_params}
    lent = lends_shards(c)
    if lent:  # out on the host while the whole copy generates
        rollout_weights = {"actor params (lent to the host while gathered)": 0}
    ref_weights = (
        {"actor params (base shared, adapters off)": actor_params}
        if c.lora_rank
        else {"reference params": st["reference"]}
    )
    if engine:
        rollout_weights = push  # the policy is out once its weights are in the engine
    ts_res = {
        "rollout": rollout_weights,
        "reference": ref_weights,
        "train": {"actor params": actor_params, train_grads_key: train_grads, "optimizer states": optim_in_train},
        "optimizer_step": {"actor params": actor_params, "grads": st["grads"], "optimizer states": step_states},
    }
    everything = {
        "actor params": actor_params,
        "reference params": st["reference"],
        "rollout weights": st["rollout_copy"],
        "optimizer states": optim_in_train,
    }
    all_res = {p: dict(everything) for p in PHASES}
    if engine:
        all_res["rollout"].update(push)
    all_res["train"][train_grads_key] = train_grads
    all_res["optimizer_step"].update({"grads": st["grads"], "optimizer states": st["optim"]})
    if c.optim_stream_chunk_bytes is not None:  # the states are on the host even with every role "resident"
        all_res["optimizer_step"]["optimizer states"] = step_states

    def phases(res: dict[str, dict[str, int]], trans: dict[str, dict[str, int]]) -> dict[str, Phase]:
        res = {p: {**r, "misc (cuBLAS workspace, small tensors)": c.misc_bytes} for p, r in res.items()}
        out = {
            p: Phase(
                name=p,
                resident={k: v for k, v in res[p].items() if v},
                transient={k: v for k, v in trans[p].items() if v},
            )
            for p in PHASES
        }
        step = out["optimizer_step"]
        if c.step_in_train and step.peak_bytes > out["train"].peak_bytes:
            # step() runs inside the train phase: its peak is the phase's.
            out["train"] = Phase(
                name="train",
                resident=dict(step.resident),
                transient={f"optimizer step: {k}": v for k, v in step.transient.items()},
            )
        return out

    moves: list[tuple[str, str, int, int]] = []
    off_optim = st["optim"] if c.optimizer == "adamw_offload" else 0
    if c.timeshare:
        # What each switch moves. With LoRA the base stays (the reference is the base with
        # adapters off) and only trainable state moves; a separate rollout copy swaps with
        # the actor's params at both ends of the rollout.
        base_moves = 0 if c.lora_rank else actor_params
        own_optim = st["optim"] if c.optimizer != "cpu_adam" else 0
        moves = [
            ("rollout", "reference", st["rollout_copy"] or base_moves, st["reference"]),
            ("reference", "train", st["reference"], base_moves + optim_in_train),
            ("train", "optimizer_step", 0, off_optim),
            ("optimizer_step", "rollout", own_optim + (actor_params if st["rollout_copy"] else 0), st["rollout_copy"]),
        ]
    elif off_optim:
        moves = [("train", "optimizer_step", 0, off_optim), ("optimizer_step", "rollout", off_optim, 0)]
    transitions = [
        Transition(before=a, after=b, bytes_out=o, bytes_in=i, seconds=bw.seconds(o, i))
        for a, b, o, i in moves
        if o or i
    ]
    if lent and c.timeshare:  # in the rollout: the shards out as their units are gathered, back after (not overlapped)
        transitions.append(
            Transition(
                before="rollout",
                after="rollout",
                bytes_out=actor_params,
                bytes_in=actor_params,
                seconds=bw.seconds(actor_params, 0) + bw.seconds(0, actor_params),
            )
        )

    streamed: dict[str, int] = {}
    if c.optimizer == "cpu_adam":
        # the first micro-batch's gradients cross cast to fp32, later ones as they are; summed
        # on the device, only the sums cross (cast to fp32)
        later = 0 if c.cpu_adam_grad_accumulation == "device" else st["ge"] * (c.micro_batches - 1)
        streamed["cpu adam grads D2H"] = st["trainable"] * (4 + later)
        streamed["cpu adam weights H2D (fp32)"] = st["trainable"] * 4
    if c.act_offload and train_t.get("saved activations") and c.shape.layers > 2:
        per = train_t["saved activations"] // min(2, c.shape.layers)
        streamed["activation offload D2H+H2D"] = 2 * per * (c.shape.layers - 2) * c.micro_batches
    host = host_components(c, st, actor_params, streamed)
    return Plan(
        config=c,
        bandwidth=bw,
        timeshared=phases(ts_res, transients),
        all_resident=phases(all_res, all_transients),
        transitions=transitions,
        streamed=streamed,
        host=host,
        assumptions=assumptions(c, bw),
    )


def host_components(c: PlanConfig, st: dict[str, int], actor_params: int, streamed: dict[str, int]) -> dict[str, int]:
    """Host memory one GPU's process holds for the plan, by component (all of it pinned)."""
    host: dict[str, int] = {}
    if c.timeshare:  # every role's state that leaves the GPU at some switch (grads are dropped)
        host["reference weights (timeshare host copy)"] = st["reference"]
        host["actor weights (timeshare host copy)"] = 0 if c.lora_rank else actor_params
        host["optimizer states (timeshare host copy)"] = st["optim"]
        host["rollout weights copy (timeshare host copy)"] = st["rollout_copy"]
    elif c.optimizer == "adamw_offload":
        host["optimizer states (offloaded)"] = st["optim"]
    if c.optimizer == "cpu_adam":
        t = st["trainable"]
        host["CPU Adam fp32 master weights"] = 4 * t
        moments = c.optim_state_dtype or "fp32"  # CPUAdam(state_dtype=...)
        host[f"CPU Adam moments ({moments} exp_avg, exp_avg_sq)"] = 2 * t * act.dtype_bytes(moments)
        host["CPU Adam fp32 gradients"] = 4 * t
        if c.cpu_adam_grad_accumulation == "host":  # CPUAdam(host_accumulation=True)
            host["CPU Adam gradient staging (trainable dtype)"] = t * st["le"]
    offloaded = streamed.get("activation offload D2H+H2D", 0)
    if offloaded:
        # One micro-batch's offloaded layers wait on the host for its backward.
        host["activation offload (one micro-batch's offloaded layers)"] = offloaded // (2 * c.micro_batches)
    return {k: v for k, v in host.items() if v}


def predict_phases(shape: Any, **config: Any) -> dict[str, int]:
    """Predicted peak *allocated* bytes per phase (``torch.cuda.max_memory_allocated`` with the
    peak reset right after the phase's role switch), for the same configuration as a
    measured run: ``{"rollout", "reference", "train", "optimizer_step"}`` plus
    ``"cuda_context"`` (the constant to add for driver-level figures, not in the others).

    ``shape``: a :class:`ModelShape`, a preset name, a ``config.json`` path or a transformers
    config object; ``config``: any :class:`PlanConfig` field (``timeshare`` defaults to True).
    """
    plan = build_plan(PlanConfig(shape=load_shape(shape), **config))
    out = {name: phase.peak_bytes for name, phase in plan.phases.items()}
    out["cuda_context"] = plan.config.cuda_context_bytes
    return out
