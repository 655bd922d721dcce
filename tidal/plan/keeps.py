"""What each phase holds when tidal's TRL trainer prefetches: :func:`kept_phases`.

With ``TidalConfig(prefetch=True)`` (:mod:`tidal.integrations.trl`) a turn keeps another role on
the device beside the running one where the device has room for it and for the phase's own
need (what the phase allocated the last time, 10% more and 256 MiB:
:func:`tidal.memory.phase_need_bytes`). The plan's timeshared phases hold only the active
role; this adds to each phase the role the trainer's schedule keeps or brings in beside it:

* ``rollout``: the reference, brought in behind generation; with a vLLM engine
  (``rollout_engine="vllm"``) first the policy and its optimizer state where they fit beside
  the engine (:func:`_beside_the_engine`), and a state that left for the engine's turn comes
  back behind the backward;
* ``reference``: the policy (its weights, and its optimizer state where it moves with the
  policy: ``optimizer="adamw"``, ``optimizer_residency="role"``), kept through the scoring;
* ``train``: the reference, kept through the loss and its backward; and, where the optimizer
  state lives on the host between steps (``optimizer="adamw_offload"``), that state, brought in
  behind the backward for the step;
* ``optimizer_step``: the reference, where it was kept through ``train`` and the step's own
  need leaves room (the trainer makes that room before the step); the whole optimizer state
  where ``train`` brought it in (the step finds it there instead of streaming it).

A role's host copy is made the first time it leaves the device (:func:`kept_host`).

Each is kept whole or not at all. Not modelled: the part of a role or of the optimizer state
the trainer brings in where only part fits (it fills the room left), and the allocator's
fragments, which the trainer leaves free beside a phase's need.
"""

from __future__ import annotations

import dataclasses

from tidal.units import phase_need_bytes
from tidal.plan.model import PUSH_SOURCE, Phase, Plan

__all__ = ["ENGINE_GENERATION_BYTES", "ENGINE_KEPT_STATE", "PREFETCHED_STATE", "KeptPhase", "kept_host", "kept_phases"]

# The key of the optimizer state brought in behind the backward, in a KeptPhase's ``kept``.
PREFETCHED_STATE = "optimizer state (prefetched)"
# The key of the policy's optimizer state kept beside a vLLM engine, in the rollout's ``kept``.
ENGINE_KEPT_STATE = "policy's optimizer state"
# What a vLLM engine's turn keeps free for the generation's own memory beside the engine's
# (tidal.integrations.trl.adapter.VLLM_GENERATION_BYTES: the trainer's side; this layer imports no torch).
ENGINE_GENERATION_BYTES = 1 << 30


@dataclasses.dataclass(frozen=True, kw_only=True)
class KeptPhase:
    """A timeshared phase with what the prefetching schedule keeps beside it: ``kept`` (a
    role's name -> bytes) is empty where the role did not fit."""

    phase: Phase
    kept: dict[str, int]

    @property
    def peak_bytes(self) -> int:
        return self.phase.peak_bytes + sum(self.kept.values())

    def to_dict(self) -> dict:
        return {"kept": dict(self.kept), "peak_bytes": self.peak_bytes}


def kept_phases(plan: Plan, usable_bytes: int) -> dict[str, KeptPhase]:
    """Each timeshared phase of ``plan`` with what TRL's prefetching schedule keeps beside it
    on a GPU whose memory for allocations is ``usable_bytes`` (see the module docstring).

    Raises ``ValueError`` for a plan without timeshare (every role is resident there already)
    or a LoRA plan (the reference is the policy with its adapters off: nothing to keep), or
    ``usable_bytes`` <= 0."""
    c = plan.config
    if not c.timeshare:
        raise ValueError("kept_phases needs a timeshared plan (PlanConfig(timeshare=True))")
    if c.lora_rank:
        raise ValueError("kept_phases: with LoRA the reference is the policy itself; nothing is kept beside it")
    if usable_bytes <= 0:
        raise ValueError(f"usable_bytes must be > 0, got {usable_bytes}")
    phases = plan.timeshared
    reference = phases["reference"].resident.get("reference params", 0)
    policy = phases["train"].resident.get("actor params", 0) + phases["train"].resident.get("optimizer states", 0)

    def fits(p: Phase, extra: int) -> bool:
        return p.resident_bytes + phase_need_bytes(p.transient_bytes) + extra <= usable_bytes

    out: dict[str, KeptPhase] = {}
    if c.rollout_engine == "vllm":
        out["rollout"] = _beside_the_engine(plan, usable_bytes)
    else:
        out["rollout"] = KeptPhase(
            phase=phases["rollout"], kept={"reference": reference} if fits(phases["rollout"], reference) else {}
        )
    if c.rollout_engine == "vllm" and ENGINE_KEPT_STATE not in out["rollout"].kept:
        # the state left for the engine's turn: it comes back behind the backward, not before
        policy = phases["train"].resident.get("actor params", 0)
    out["reference"] = KeptPhase(
        phase=phases["reference"], kept={"policy": policy} if fits(phases["reference"], policy) else {}
    )
    through_train = fits(phases["train"], reference)
    in_train = {"reference": reference} if through_train else {}
    # On the host between steps: prefetch_optimizer brings it in as the backward starts.
    state = plan.host.get("optimizer states (timeshare host copy)", 0) if c.optimizer == "adamw_offload" else 0
    state_in = bool(state) and fits(phases["train"], sum(in_train.values()) + state)
    if state_in:
        in_train[PREFETCHED_STATE] = state
    out["train"] = KeptPhase(phase=phases["train"], kept=in_train)
    step = phases["optimizer_step"]
    at_step = {"reference": reference} if through_train and fits(step, reference) else {}
    beyond_chunks = state - step.resident.get("optimizer states", 0)
    if state_in and beyond_chunks > 0:  # the whole state, where the step alone holds its streamed chunks
        at_step[PREFETCHED_STATE] = beyond_chunks
    out["optimizer_step"] = KeptPhase(phase=step, kept=at_step)
    return out


def _beside_the_engine(plan: Plan, usable_bytes: int) -> KeptPhase:
    """The vLLM engine's turn (:class:`~tidal.integrations.vllm.VllmEngine` with
    ``keep_free_bytes``): the policy stays beside the engine where the engine's memory (+10%,
    256 MiB) and :data:`ENGINE_GENERATION_BYTES` fit beside it (its weights first, then its
    optimizer state where that moves with it and the room holds the gradients' bytes as well:
    the memory they leave in torch's cache after the step, measured at the engine's turn as
    fragments of the gradients' size, 13.2 GiB at Qwen2-7B and 30-35 GiB at the 14B shape, which
    a vLLM wake cannot use; where the room lacks it, tidal's engine learns it from one wake out
    of memory and moves the state out first from then on); once the cache's room is made, the reference comes
    in behind the generation where it fits with that much still free."""
    phases = plan.timeshared
    rollout = phases["rollout"]
    engine = rollout.resident.get("engine weights", 0) + rollout.transient.get("engine kv cache", 0)
    room = usable_bytes - phase_need_bytes(engine) - ENGINE_GENERATION_BYTES
    policy = phases["train"].resident.get("actor params", 0)
    state = phases["train"].resident.get("optimizer states", 0)  # with the policy: optimizer="adamw"
    # After the optimizer step the gradients' memory stays in torch's cache, in segments the kept
    # state shares; vLLM maps its memory from the driver and cannot use it: a state kept beside
    # the engine keeps that much taken with it.
    grads = phases["optimizer_step"].resident.get("grads", 0)
    kept: dict[str, int] = {}
    if policy <= room:
        kept["policy"] = policy
        if state and policy + state + grads <= room:
            kept[ENGINE_KEPT_STATE] = state
    transient = {k: v for k, v in rollout.transient.items() if k != PUSH_SOURCE}
    generating = dataclasses.replace(rollout, transient=transient)  # the push is over by then
    if kept:  # the policy stays: the push's moment holds nothing beyond the engine and the cache
        rollout = generating
    reference = phases["reference"].resident.get("reference params", 0)
    if generating.peak_bytes + sum(kept.values()) + ENGINE_GENERATION_BYTES + reference <= usable_bytes:
        kept["reference"] = reference
    return KeptPhase(phase=rollout, kept=kept)


def kept_host(plan: Plan, kept: dict[str, KeptPhase]) -> dict[str, int]:
    """The host memory the prefetching trainer holds for ``plan`` (components as
    :attr:`~tidal.plan.model.Plan.host`), given its phases' ``kept`` (:func:`kept_phases`).

    tidal takes a role's host memory the first time the role leaves the device. The
    reference leaves as the trainer is built, the policy's weights at the first step's
    scoring (no phase's need is known yet, so every other role goes). AdamW's state does not
    exist then (torch creates it at the first ``step()``); where it moves with the policy
    (``optimizer="adamw"``: ``optimizer_residency="role"``) it leaves only if a later scoring
    does not keep the policy, so its host copy is counted only then. A streamed or offloaded
    state (``optimizer="adamw_offload"``) lives on the host whatever is kept."""
    host = dict(plan.host)
    if plan.config.rollout_engine == "vllm":
        return host  # the engine's first turns, before its memory is measured, move every role out
    if plan.config.optimizer == "adamw" and "policy" in kept["reference"].kept:
        host.pop("optimizer states (timeshare host copy)", None)
    return host
