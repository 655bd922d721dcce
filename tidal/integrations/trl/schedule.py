"""The phases of a TRL step as :class:`~tidal.timeshare.schedule.PhaseSchedule` reads them:
:data:`TRL_PHASES`. The keep and prefetch decisions themselves are the library's."""

from __future__ import annotations

from tidal.timeshare.schedule import StepPhases

__all__ = ["TRL_PHASES"]

#: Generation (the policy), the reference's scoring, reward models, then the loss (the policy
#: again, held through the backward and the optimizer step after it, measured as a phase of
#: its own). The policy's scoring of its own samples (``"score"``) runs inside one of these.
TRL_PHASES = StepPhases(
    order=("policy", "reference", "reward"),
    turn_phase={"policy": "loss"},
    generation="generate",
    loss="loss",
    backward="backward",
)
