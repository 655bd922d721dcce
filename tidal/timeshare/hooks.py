"""The hooks a role installs: :class:`RoleHooks`, the part of :class:`~tidal.Timeshare` that
builds the forward guard, the optimizer's step pre- and post-hooks and the after-load hook."""

from __future__ import annotations

from tidal.state.foreign import moved_out
from tidal.timeshare.role import Role
from tidal.timeshare.residency import policy_for

__all__ = ["RoleHooks"]


class RoleHooks:
    """The hooks of a role, a mixin of :class:`~tidal.Timeshare`."""

    def _make_guard(self, role: Role):
        def guard(where, tensors):
            # Called by the role's sources before their state is used (a module's forward).
            if self.transitions.interrupted:
                with self._lock:
                    if self.transitions.interrupted:
                        self._start_clock()  # the recovery's record counts from here
                        self.transitions.recover()
            if role.resident:
                return
            # The role is out; a module may still run if its own tensors are on the device
            # (shared with a resident role, or too small to move). Its children check theirs.
            if tensors is not None and not any(moved_out(t) for t in tensors):
                return
            what = f"{type(where).__name__}" if where is not None else "its state"
            raise RuntimeError(
                f"role {role.name!r} is offloaded: {what} has no device memory (its bytes are on the host). "
                f"Run it inside `with ts.use({role.name!r}):`, or call ts.load({role.name!r}) first. To read "
                f"its values without loading it, use state_dict()"
            )

        return guard

    def _make_step_pre_hook(self, role: Role):
        def pre(opt, args, kwargs):
            if role.streaming:  # one chunk of a streamed step: its state is in already
                return
            with self._lock:
                step_pre(opt)

        def step_pre(opt):
            self._start_clock()
            self.transitions.recover_if_interrupted()
            self._restore_groups(role, opt)
            if role.optimizer_locked:
                raise RuntimeError(
                    f"optimizer.step() of role {role.name!r} was called inside offload_optimizer(): "
                    f"its state is on the host. Step after the `with` block ends"
                )
            if not role.resident:
                raise RuntimeError(
                    f"optimizer.step() of role {role.name!r} was called while the role is "
                    f"offloaded; step inside `with ts.use({role.name!r}):`"
                )
            role.optimizer_touched()  # the step reloads or creates state on the device
            policy_for(role.optimizer_residency).before_step(self, role, opt)

        return pre

    def _make_step_post_hook(self, role: Role):
        def post(opt, args, kwargs):
            if role.streaming:
                return
            with self._lock:
                policy_for(role.optimizer_residency).after_step(self, role, opt)

        return post
