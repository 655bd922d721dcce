"""Optimizer residency as strategies: where a role's optimizer state lives between steps and
what happens around ``optimizer.step()``.

A strategy is chosen per role by ``optimizer_residency`` and consulted by the timeshare's
step hooks, its transitions and the end of ``use()``; adding a policy means adding a class
here, not branches in the timeshare.

* ``"step"``: on the host between steps; the pre-hook loads it, the post-hook sends it back.
* ``"stream"``: on the host between steps; the pre-hook runs the update a chunk of
  parameters at a time (:mod:`tidal.timeshare.stream`), the post-hook gives the outer
  ``step()`` its param groups back.
* ``"role"``: moves with the role; the pre-hook brings back anything left on the host.
"""

from __future__ import annotations


import torch

from tidal.timeshare.stream import restore_groups, streamed_step

from tidal.timeshare.core import TimeshareCore

from tidal.timeshare.role import Role

__all__ = ["ResidencyPolicy", "policy_for"]


class ResidencyPolicy:
    """The protocol (and the ``"role"`` strategy, the simplest)."""

    name = "role"
    #: whether a switch moves the optimizer state with the role's weights
    moves_with_role = True

    def before_step(self, ts: TimeshareCore, role: Role, opt: torch.optim.Optimizer) -> None:
        """Run by the step pre-hook of a resident role, after the common checks."""
        ts.reload_optimizer_state(role.name)  # anything an offload_optimizer() block left out

    def after_step(self, ts: TimeshareCore, role: Role, opt: torch.optim.Optimizer) -> None:
        """Run by the step post-hook."""


class StepResidency(ResidencyPolicy):
    name = "step"
    moves_with_role = False

    def after_step(self, ts: TimeshareCore, role: Role, opt: torch.optim.Optimizer) -> None:
        ts.offload_optimizer_state(role.name)
        role.optimizer_settled()


class StreamResidency(ResidencyPolicy):
    name = "stream"
    moves_with_role = False

    def before_step(self, ts: TimeshareCore, role: Role, opt: torch.optim.Optimizer) -> None:
        if getattr(opt, "tidal_state_on_host", False):
            return  # nothing of it is on the device to stream (CPUAdam)
        streamed_step(ts, role, opt)  # the real update, chunk by chunk; the outer step() finds empty groups

    def after_step(self, ts: TimeshareCore, role: Role, opt: torch.optim.Optimizer) -> None:
        groups = role.take_hidden(opt)
        if groups is not None:
            restore_groups(opt, groups)  # the state went out chunk by chunk already
            role.optimizer_settled()  # all of it on the host, where the budget does not count it


_POLICIES = {p.name: p for p in (ResidencyPolicy(), StepResidency(), StreamResidency())}


def policy_for(residency: str) -> ResidencyPolicy:
    """The strategy for an ``optimizer_residency`` value (validated by :class:`Role`)."""
    return _POLICIES[residency]
