"""A role's optimizer state moved apart from its parameters: :class:`OptimizerStateMoves`, the
part of :class:`~tidal.Timeshare` that the step hooks, the residency strategies and
``offload_optimizer`` use."""

from __future__ import annotations

import torch

from tidal.state.collect import StateEntry
from tidal.timeshare.role import Role
from tidal.timeshare.residency import policy_for
from tidal.timeshare.stream import restore_groups
from tidal.timeshare.threads import serialised
from tidal.timeshare.telemetry import TransitionRecord

__all__ = ["OptimizerStateMoves"]


class OptimizerStateMoves:
    """Moving a role's optimizer state (and grads) out and in, a mixin of :class:`~tidal.Timeshare`."""

    @serialised
    def offload_optimizer_state(
        self, name: str, *, grads: bool = False, kind: str = "optim-out"
    ) -> TransitionRecord | None:
        """Move the role's optimizer state (and its params' grads if ``grads``) to the host;
        its params stay. Storages another resident role holds stay too."""
        self._start_clock()
        self.transitions.recover_if_interrupted()
        role = self.role(name)
        if grads:
            role.before_copy()  # grads come from the sources, which may still write them
        live = self._optimizer_live(role, grads)
        others = self.resident_keys(exclude=(role,))
        entries = [e for e in live if e.nbytes > 0 and e.key not in others]
        if not entries:
            return None
        wait = self.config.wait_for_copies
        move = self.transitions.guarded(lambda: self.store.offload(entries, wait=wait), touches_model=grads)
        return self.record_move(kind, (name,), None, move, note="optimizer state" + (" + grads" if grads else ""))

    @serialised
    def reload_optimizer_state(
        self, name: str, *, grads: bool = False, kind: str = "optim-in"
    ) -> TransitionRecord | None:
        """Bring the role's offloaded optimizer state (and grads if ``grads``) back."""
        self._start_clock()
        self.transitions.recover_if_interrupted()
        role = self.role(name)
        role.optimizer_touched()
        live = self._optimizer_live(role, grads)
        entries = [e for e in self.store.resolve(live) if self.store.is_offloaded(e.key)]
        if not entries:
            return None
        move = self.transitions.guarded(
            lambda: self.store.reload(
                entries, what=f"reloading the optimizer state of role {name!r}", wait=self.config.wait_for_copies
            ),
            touches_model=grads,
        )
        return self.record_move(kind, (), name, move, note="optimizer state" + (" + grads" if grads else ""))

    def _optimizer_live(self, role: Role, grads: bool) -> list[StateEntry]:
        """The role's optimizer state tensors (and its params' grads if ``grads``), live."""
        min_b = self.config.min_offload_bytes
        live = role.optim_entries(self.device, min_b)
        if grads:
            live = [e for e in role.model_entries(self.device, min_b, grads=True) if e.kind == "grad"] + live
        return live

    def _settle_optimizer(self, role: Role) -> None:
        # With step residency the state belongs on the host outside step(); a step that
        # raised skipped the post-hook and left it on the device. A role that is out keeps
        # none of it on the device (a load_state_dict may have created it there).
        # Walking the optimizer state costs milliseconds for a large model: only after something
        # may have put state on the device (a step, a load, a reload) since it last settled.
        off_device = not role.resident or not policy_for(role.optimizer_residency).moves_with_role
        if off_device and role.optim_unsettled:
            if any(e.nbytes > 0 for e in role.optim_entries(self.device, self.config.min_offload_bytes)):
                self.offload_optimizer_state(role.name)
            role.optimizer_settled()

    def _restore_groups(self, role: Role, opt: torch.optim.Optimizer) -> None:
        # A streamed step empties the param groups for the outer step(); its post-hook puts
        # them back. Should that step have raised after the streamed update (another hook),
        # the next step or the end of the use() block puts them back instead.
        groups = role.take_hidden(opt)
        if groups is not None:
            restore_groups(opt, groups)

    def _make_after_load(self, role: Role):
        def after_load(opt):
            # torch's load_state_dict replaced the state tensors it could not load in place
            # with new ones on the device: the old ones' host copies are dead, the new ones
            # go where this role keeps its optimizer state now.
            with self._lock:
                self.store.forget_unreferenced()
                role.optimizer_touched()
                if role.in_use == 0 or policy_for(role.optimizer_residency).moves_with_role:
                    self._settle_optimizer(role)

        return after_load
