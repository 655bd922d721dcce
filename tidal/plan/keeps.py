"""What each phase holds when tidal's TRL trainer prefetches: :func:`kept_phases`.

With ``TidalConfig(prefetch=True)`` (:mod:`tidal.integrations.trl`) a turn keeps another role on
the device beside the running one where the device has room for it and for the phase's own
need (what the phase allocated the last time, 10% more and 256 MiB:
:func:`tidal.memory.phase_need_bytes`). The plan's timeshared phases hold only the active
role; this adds to each phase the role the trainer's schedule keeps or brings in beside it:

* ``rollout``: the reference, brought in behind generation;
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
from tidal.plan.model import Phase, Plan

__all__ = ["PREFETCHED_STATE", "KeptPhase", "kept_host", "kept_phases"]

# The key of the optimizer state brought in behind the backward, in a KeptPhase's ``kept``.
PREFETCHED_STATE = "optimizer state (prefetched)"


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
    out["rollout"] = KeptPhase(
        phase=phases["rollout"], kept={"reference": reference} if fits(phases["rollout"], reference) else {}
    )
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
    if plan.config.optimizer == "adamw" and "policy" in kept["reference"].kept:
        host.pop("optimizer states (timeshare host copy)", None)
    return host
