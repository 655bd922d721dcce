"""Registering roles with a timeshare: :class:`Registration` (``add_role``, a mixin of
:class:`~tidal.timeshare.timeshare.Timeshare`), and the claim a role holds on its optimizers
(:class:`RoleClaim`, :func:`timeshare_of`)."""

from __future__ import annotations

import dataclasses
import itertools
import warnings
import weakref
from typing import Any, Sequence

import torch

from tidal.guard import address
from tidal.state.collect import GradPolicy
from tidal.state.foreign import install_optimizer_hooks
from tidal.state.sources import ModuleSource, StateSource
from tidal.state.store import OffloadStore
from tidal.timeshare.role import OptimizerResidency, Role
from tidal.timeshare.threads import serialised
from tidal.transfer.context import TransferContext
from tidal.vmm import RegionTag

__all__ = ["Registration", "RoleClaim", "timeshare_of"]


@dataclasses.dataclass(frozen=True, eq=False)
class RoleClaim:
    """The claim a timeshare role holds on an optimizer in its transfer context, so
    ``offload_optimizer()`` defers to the role instead of keeping a second record."""

    timeshare: weakref.ref  # to the Timeshare
    role: str

    def __repr__(self) -> str:
        return f"role {self.role!r} of a Timeshare"


def timeshare_of(optimizer: torch.optim.Optimizer, context: TransferContext | None = None) -> tuple[Any, str] | None:
    """The open timeshare and role an optimizer was registered with, if any, found in
    ``context`` (default: the process's context for the optimizer's device)."""
    if context is None:
        device = next((p.device for g in optimizer.param_groups for p in g["params"]), None)
        if device is None:
            return None
        context = TransferContext.of(device)
    claim = context.owner_of(optimizer)
    if not isinstance(claim, RoleClaim):
        return None
    ts = claim.timeshare()
    return (ts, claim.role) if ts is not None and not ts.closed else None


def _as_list(obj, cls, what: str) -> list:
    if obj is None:
        return []
    items = list(obj) if isinstance(obj, (list, tuple)) else [obj]
    for x in items:
        if not isinstance(x, cls):
            raise TypeError(
                f"{what} must be a {cls.__module__}.{cls.__qualname__} (or a list of them), got {type(x).__name__}"
            )
    return items


class Registration:
    """``add_role``. Reads the timeshare's ``config``, ``context``, ``store``, ``device``,
    ``_residency`` and ``_roles``, and its hooks' factories (:class:`~tidal.timeshare.hooks.RoleHooks`)."""

    @serialised
    def add_role(
        self,
        name: str,
        *,
        model: torch.nn.Module | Sequence[torch.nn.Module] | None = None,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
        source: StateSource | Sequence[StateSource] | None = None,
        grads: GradPolicy = "offload",
        optimizer_residency: OptimizerResidency = "step",
        frozen: bool = False,
        skip_unchanged: bool = False,
        region: RegionTag | None = None,
    ) -> Role:
        """Register a role. Nothing moves; host memory for the role's current state is reserved
        and pinned here (once), so the first transition runs at line rate. Roles may share
        modules: a shared storage is counted once and stays resident while any role holding
        it is resident. A role whose state is partly offloaded already (it shares a module with
        an offloaded role) starts as not resident; ``use()`` brings it in.

        ``model`` (modules) and ``source`` (anything implementing
        :class:`~tidal.state.sources.StateSource`, e.g. a DeepSpeed engine's) say what the role
        holds besides its optimizers' state. Raises ``ValueError``/``TypeError`` for a role
        with nothing to move or state tidal cannot move, before anything is registered.

        ``frozen=True`` declares that nothing writes the role's parameters and buffers (a
        reference or reward model): once they have gone out, their host copy stays valid, so
        every later offload of the role releases its device memory without copying (only the
        reload moves bytes). With ``TransferConfig(verify=...)`` on, each such offload first
        checks the bytes and refuses (``ValueError``, nothing moved) if they changed. A
        ``load_state_dict`` into the role's modules is seen and handled. A frozen role has no
        optimizer (``ValueError``).

        ``skip_unchanged=True`` is the check without the promise: every offload of the role
        digests its parameters and buffers on the device (one read of their bytes, at HBM
        bandwidth, and one host synchronisation) and copies only those whose bytes differ from
        their host copy; the others are released without a copy (``bytes_skipped`` in the
        records). For a role that is often not written between its turns (a reference or reward
        model updated now and then, a rollout copy of the policy while the policy trains
        elsewhere); a role written every turn pays the digest for nothing.

        ``region`` (a :class:`~tidal.vmm.RegionTag` with policy ``"discard"``) makes the role's
        storages that were allocated in that tag address-stable: an offload copies them out as
        usual, then unmaps the tag's memory in place; a reload maps it again at the same
        addresses before copying the bytes back, so CUDA graphs and raw pointers into the role
        stay valid. Its other storages (gradients, optimizer state made outside the tag) move by
        resizing. Raises ``ValueError`` if none of the role's storages lies in the tag (build
        the model inside ``with region.allocate(tag):``) or the tag's policy is ``"backup"``.
        """
        self._check_open()
        self._start_clock()  # a recovery's record counts from here, not from the last verb
        self.transitions.recover_if_interrupted()
        if not isinstance(name, str) or not name:
            raise ValueError(f"role name must be a non-empty string, got {name!r}")
        if name in self._roles:
            raise ValueError(
                f"a role named {name!r} already exists; role names must be unique (registered: {sorted(self._roles)})"
            )
        modules = _as_list(model, torch.nn.Module, "model")
        optimizers = _as_list(optimizer, torch.optim.Optimizer, "optimizer")
        sources = list(source) if isinstance(source, (list, tuple)) else ([source] if source is not None else [])
        for s in sources:
            if not all(callable(getattr(s, m, None)) for m in ("tensors", "install", "before_copy")):
                raise TypeError(
                    f"source must implement tidal.state.sources.StateSource (tensors, install, before_copy), "
                    f"got {type(s).__name__}"
                )
        if modules:
            sources.insert(0, ModuleSource(modules, verify=self.config.verify_storage_sets))
        if not sources and not optimizers:
            raise ValueError(f"role {name!r} needs a model, a source or an optimizer")
        if frozen and optimizers:
            raise ValueError(
                f"role {name!r}: frozen=True declares its state is never written, but it has an optimizer "
                f"that updates it; drop frozen=True for a trained role"
            )
        for opt in optimizers:
            owner = timeshare_of(opt, self.context)
            if owner is not None:
                raise ValueError(
                    f"this optimizer already belongs to role {owner[1]!r}; an optimizer "
                    f"can belong to one role only (its step hooks move its state)"
                )
            held = self.context.owner_of(opt)
            if isinstance(held, OffloadStore) and held.offloaded_bytes:
                raise ValueError(
                    f"role {name!r}: this optimizer's state is still on the host from an "
                    f"offload_optimizer() block that could not bring it back; run its step() (which "
                    f"reloads it) before adding it to a role"
                )
        role = Role(
            name,
            sources,
            optimizers,
            grads=grads,
            optimizer_residency=optimizer_residency,
            frozen=frozen,
            skip_unchanged=skip_unchanged,
        )
        # A region tag is served from here on (its storages may be non-resizable), and no
        # longer if the role is refused below.
        added = self._residency.add(region) if region is not None else False
        try:
            # Collect now: validates the state (raises TypeError for unsupported tensors) before
            # anything else is registered, and sizes the host slots.
            model_live = role.model_entries(self.device, self.config.min_offload_bytes)
            entries = self.store.resolve(model_live) + self.store.resolve(
                role.optim_entries(self.device, self.config.min_offload_bytes)
            )
            if not entries:
                raise ValueError(f"role {name!r} has {self._why_no_state(role)}")
            if region is not None and not any(region.find(address(e.storage)) is not None for e in entries):
                raise ValueError(
                    f"role {name!r}: none of its storages lies in region {region.region.name!r}, tag {region.name!r}; "
                    f"build the model inside `with region.allocate({region.name!r}, policy='discard'):`"
                )
        except BaseException:
            if added:
                self._residency.remove(region)
            raise
        role.found(not any(self.store.is_offloaded(e.key) for e in entries))
        self.store.prepare([e for e in entries if not self.store.is_offloaded(e.key)])
        guard = self._make_guard(role)
        for s in sources:
            role.hooks += s.install(self.store, guard)
        for opt in optimizers:
            role.hooks.append(opt.register_step_pre_hook(self._make_step_pre_hook(role)))
            role.hooks.append(opt.register_step_post_hook(self._make_step_post_hook(role)))
            role.hooks += install_optimizer_hooks(self.store, opt, after_load=self._make_after_load(role))
            # The role takes the claim over from offload_optimizer()'s own store (idle, checked above).
            if isinstance(self.context.owner_of(opt), OffloadStore):
                self.context.release(opt)
            self.context.claim(opt, RoleClaim(weakref.ref(self), name), what="optimizer")
        self._roles[name] = role
        role.touched(self._tick())
        if optimizer_residency != "step" and optimizers and not role.device_optimizers():
            warnings.warn(
                f"role {name!r}: optimizer_residency={optimizer_residency!r} ignored: "
                f"{', '.join(role.host_optimizers())} keeps its state on the host already, so "
                f"there is no device state to place",
                stacklevel=2,
            )
        return role

    def _why_no_state(self, role: Role) -> str:
        tensors = [t for m in role.modules for t in itertools.chain(m.parameters(), m.buffers())]
        tensors += [p for o in role.optimizers for g in o.param_groups for p in g["params"]]
        elsewhere = sorted({str(t.device) for t in tensors if t.device != self.device})
        if elsewhere:
            return (
                f"no state on {self.device}: its tensors are on {', '.join(elsewhere)}. Move the model "
                f"to {self.device} before adding the role"
            )
        if not tensors:
            return "no tensors at all (no parameters, buffers or optimizer parameters)"
        return (
            f"no state to move: its {len(tensors)} tensors are empty or smaller than "
            f"min_offload_bytes={self.config.min_offload_bytes}, so they stay where they are"
        )
