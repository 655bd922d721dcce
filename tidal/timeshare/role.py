"""A role: the state sources (modules, an engine, anything with the source protocol) and the
optimizers that take turns on a device as one unit."""

from __future__ import annotations

import dataclasses
import enum
from typing import Literal

import torch

from tidal.state.collect import GradPolicy, StateEntry, collect_optimizer_state, collect_tensors
from tidal.state.sources import ModuleSource, StateSource

__all__ = ["Role", "OptimizerPhase", "OptimizerResidency"]

OptimizerResidency = Literal["step", "stream", "role"]
_GRAD_POLICIES = ("offload", "keep", "drop")
_RESIDENCIES = ("step", "stream", "role")


class OptimizerPhase(enum.Enum):
    """Where a role's optimizer state stands against its residency policy."""

    SETTLED = "settled"  # where the policy keeps it (on the host between steps, or with the role)
    UNSETTLED = "unsettled"  # a step, a load or a reload may have put some of it on the device
    LOCKED = "locked"  # inside offload_optimizer(): on the host, step() refused
    STREAMING = "streaming"  # inside a streamed step: the per-chunk step() calls skip the hooks


# Legal optimizer-phase changes; any other is a bug (asserted).
_PHASE_EDGES = {
    OptimizerPhase.SETTLED: {OptimizerPhase.UNSETTLED, OptimizerPhase.LOCKED, OptimizerPhase.SETTLED},
    OptimizerPhase.UNSETTLED: {
        OptimizerPhase.SETTLED,
        OptimizerPhase.LOCKED,
        OptimizerPhase.STREAMING,
        OptimizerPhase.UNSETTLED,
    },
    OptimizerPhase.LOCKED: {OptimizerPhase.UNSETTLED},
    OptimizerPhase.STREAMING: {OptimizerPhase.UNSETTLED},
}


@dataclasses.dataclass(eq=False)
class Role:
    """One registered role, and its state machine.

    The role's state lives here and changes only through the methods below (the timeshare,
    ``offload_optimizer`` and the streamed step call them; none assigns a field):

    * residency: ``resident`` (all of its state on the device) or not. :meth:`came_in`,
      :meth:`went_out`, :meth:`found` (after an interrupted transition, from where its
      tensors are).
    * use: ``in_use`` counts the open ``use()`` blocks (:meth:`enter_use`, :meth:`leave_use`),
      ``users`` the threads they are open in; a role in use is never evicted. ``last_used``
      orders eviction.
    * optimizer phase (:class:`OptimizerPhase`): :meth:`optimizer_touched`,
      :meth:`optimizer_settled`, :meth:`lock_optimizer` / :meth:`unlock_optimizer`,
      :meth:`begin_stream` / :meth:`end_stream`.

    Attributes:
        grads: ``"offload"`` moves ``.grad`` tensors with the role, ``"keep"`` leaves them on
            the device, ``"drop"`` sets them to ``None`` when the role goes out (nothing moved).
        optimizer_residency: ``"step"`` (default) keeps optimizer state on the host except
            during ``optimizer.step()`` (loaded by a step pre-hook, offloaded by a post-hook),
            so forward/backward peaks never include it; ``"stream"`` is ``"step"`` with the
            state moved in and out a chunk of parameters at a time during ``step()``
            (``TimeshareConfig.optimizer_chunk_bytes``), so the step's peak holds one chunk of
            it, not all; ``"role"`` moves it with the role.
            (A ``step()`` that raises skips the post-hook; the state then goes back to the
            host when the role's ``use()`` block ends.)
    """

    name: str
    sources: list[StateSource]
    optimizers: list[torch.optim.Optimizer]
    grads: GradPolicy = "offload"
    optimizer_residency: OptimizerResidency = "step"
    frozen: bool = False  # nothing writes its parameters and buffers (see Timeshare.add_role)
    skip_unchanged: bool = False  # offloads digest its parameters and buffers, copying only changed ones
    hooks: list = dataclasses.field(default_factory=list)
    _resident: bool = dataclasses.field(default=True, repr=False)
    _in_use: int = dataclasses.field(default=0, repr=False)
    _users: dict[int, int] = dataclasses.field(default_factory=dict, repr=False)  # thread id -> open use() blocks
    _last_used: int = dataclasses.field(default=0, repr=False)
    # UNSETTLED at registration: the end of the first use() checks where the state is.
    _phase: OptimizerPhase = dataclasses.field(default=OptimizerPhase.UNSETTLED, repr=False)
    # A streamed step's param lists, taken from the outer step() (see stream.py), and whose.
    _hidden: tuple[torch.optim.Optimizer, list] | None = dataclasses.field(default=None, repr=False)
    _names: dict[int, str] | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.grads not in _GRAD_POLICIES:
            raise ValueError(f"grads must be one of {_GRAD_POLICIES}, got {self.grads!r}")
        if self.optimizer_residency not in _RESIDENCIES:
            raise ValueError(f"optimizer_residency must be one of {_RESIDENCIES}, got {self.optimizer_residency!r}")

    # ---- state (read-only) ------------------------------------------------------------------
    @property
    def resident(self) -> bool:
        """Whether the role counts as on the device (where each storage is lives in the store)."""
        return self._resident

    @property
    def in_use(self) -> int:
        """Open ``use()`` blocks of this role."""
        return self._in_use

    @property
    def users(self) -> set[int]:
        """The threads (``threading.get_ident()``) inside a ``use()`` block of this role."""
        return set(self._users)

    @property
    def last_used(self) -> int:
        return self._last_used

    @property
    def optimizer_phase(self) -> OptimizerPhase:
        return self._phase

    @property
    def optimizer_locked(self) -> bool:
        """Inside ``offload_optimizer()``: ``step()`` must not run."""
        return self._phase is OptimizerPhase.LOCKED

    @property
    def optim_unsettled(self) -> bool:
        """Optimizer state may be on the device against the residency policy: the end of
        ``use()`` then checks and moves it."""
        return self._phase is OptimizerPhase.UNSETTLED

    @property
    def streaming(self) -> bool:
        return self._phase is OptimizerPhase.STREAMING

    # ---- transitions ------------------------------------------------------------------------
    def came_in(self, clock: int) -> None:
        """All of the role's state is on the device now."""
        self._resident = True
        self._last_used = clock

    def went_out(self) -> None:
        """The role's state went to the host, with whatever of its optimizer state was on the
        device (so that is settled too)."""
        assert self._in_use == 0, f"role {self.name!r} went out while in use"
        self._resident = False
        if self._phase is OptimizerPhase.UNSETTLED:
            self._phase = OptimizerPhase.SETTLED

    def found(self, resident: bool) -> None:
        """Set from where the role's tensors are (registration, recovery, close)."""
        self._resident = resident

    def enter_use(self, thread: int | None = None) -> None:
        """Open a ``use()`` block (in ``thread``, a ``threading.get_ident()``, when given)."""
        self._in_use += 1
        if thread is not None:
            self._users[thread] = self._users.get(thread, 0) + 1

    def leave_use(self, clock: int, thread: int | None = None) -> bool:
        """Close one ``use()`` block; returns whether the role is now idle."""
        assert self._in_use > 0
        self._in_use -= 1
        if thread is not None:
            left = self._users.get(thread, 0) - 1
            assert left >= 0, f"role {self.name!r}: a use() block closed in a thread that did not open one"
            if left:
                self._users[thread] = left
            else:
                del self._users[thread]
        self._last_used = clock
        return self._in_use == 0

    def touched(self, clock: int) -> None:
        self._last_used = clock

    def optimizer_touched(self) -> None:
        """A step, a load or a reload may have put optimizer state on the device."""
        if self._phase is not OptimizerPhase.LOCKED:
            self._move_phase(OptimizerPhase.UNSETTLED)

    def optimizer_settled(self) -> None:
        """The optimizer state is where the residency policy keeps it."""
        if self._phase is OptimizerPhase.UNSETTLED:
            self._move_phase(OptimizerPhase.SETTLED)

    def lock_optimizer(self) -> None:
        """Enter ``offload_optimizer()``. Raises RuntimeError if a block is open already."""
        if self._phase is OptimizerPhase.LOCKED:
            raise RuntimeError(f"offload_optimizer() is already active for role {self.name!r}; blocks do not nest")
        self._move_phase(OptimizerPhase.LOCKED)

    def unlock_optimizer(self) -> None:
        """Leave ``offload_optimizer()``: whatever comes back next is checked at the end of use()."""
        self._move_phase(OptimizerPhase.UNSETTLED)

    def begin_stream(self) -> None:
        self._move_phase(OptimizerPhase.STREAMING)

    def end_stream(self, hidden: tuple[torch.optim.Optimizer, list] | None) -> None:
        """The streamed update is over; ``hidden``: the (optimizer, param lists) it took from the
        outer ``step()``, returned by :meth:`take_hidden` (None if it raised)."""
        self._move_phase(OptimizerPhase.UNSETTLED)
        self._hidden = hidden

    def take_hidden(self, opt: torch.optim.Optimizer) -> list | None:
        """The param lists a streamed step took from ``opt``'s groups, once (None if none)."""
        if self._hidden is None or self._hidden[0] is not opt:
            return None
        groups, self._hidden = self._hidden[1], None
        return groups

    @property
    def has_hidden(self) -> bool:
        return self._hidden is not None

    def _move_phase(self, to: OptimizerPhase) -> None:
        assert to in _PHASE_EDGES[self._phase], f"role {self.name!r}: optimizer {self._phase.value} -> {to.value}"
        self._phase = to

    @property
    def modules(self) -> list[torch.nn.Module]:
        """The modules among the role's sources."""
        return [m for s in self.sources if isinstance(s, ModuleSource) for m in s.modules]

    def before_copy(self) -> None:
        """Order the current stream after the sources' own work in flight (see StateSource)."""
        for s in self.sources:
            s.before_copy()

    def param_names(self) -> dict[int, str]:
        """id(param) -> name, computed once: it only names tensors in error messages, and a
        module walk per transition costs milliseconds on a large model."""
        if self._names is None:
            self._names = {}
            for i, m in enumerate(self.modules):
                prefix = f"model{i}." if i else ""
                for n, p in m.named_parameters():
                    self._names.setdefault(id(p), prefix + n)
        return self._names

    def loose_params(self) -> list[torch.Tensor]:
        """Parameters an optimizer of the role holds that none of its modules registers (a
        module param replaced since registration also counts: it is collected either way)."""
        known = self.param_names()
        return [p for o in self.optimizers for g in o.param_groups for p in g["params"] if id(p) not in known]

    def model_entries(
        self, device: torch.device, min_offload_bytes: int, *, grads: bool | None = None, include_empty: bool = True
    ) -> list[StateEntry]:
        """What the sources hold now (parameters, buffers, and by policy, or as ``grads``
        says, gradients), then the optimizers' parameters no module registers; with
        ``include_empty`` offloaded (0-byte) storages are listed too."""
        with_grads = self.grads == "offload" if grads is None else grads
        tensors = [t for s in self.sources for t in s.tensors(with_grads)]
        for i, p in enumerate(self.loose_params()):
            tensors.append((f"optimizer_param{i}", p, "param"))
            if with_grads and p.grad is not None:
                tensors.append((f"optimizer_param{i}.grad", p.grad, "grad"))
        return collect_tensors(
            tensors, device, min_offload_bytes=min_offload_bytes, include_empty=include_empty, owner=self.name
        )

    def optim_entries(
        self, device: torch.device, min_offload_bytes: int, *, include_empty: bool = True
    ) -> list[StateEntry]:
        """Tensors of every ``optimizer.state``, found now (state appears at the first step)."""
        movable = self.device_optimizers()
        if not movable:
            return []
        return collect_optimizer_state(
            movable,
            device,
            names=self.param_names(),
            min_offload_bytes=min_offload_bytes,
            include_empty=include_empty,
            owner=self.name,
        )

    def device_optimizers(self) -> list[torch.optim.Optimizer]:
        """Optimizers whose state a switch moves: not those that keep it on the host by design
        (``tidal.CPUAdam`` says so with ``tidal_state_on_host``)."""
        return [o for o in self.optimizers if not getattr(o, "tidal_state_on_host", False)]

    def host_optimizers(self) -> list[str]:
        return [type(o).__name__ for o in self.optimizers if getattr(o, "tidal_state_on_host", False)]

    def grad_storages(self) -> list[tuple[torch.Tensor, torch.UntypedStorage]]:
        """(param, its grad's storage) for every param of the role that has a grad."""
        params = [p for m in self.modules for p in m.parameters()] + self.loose_params()
        return [(p, p.grad.untyped_storage()) for p in dict.fromkeys(params) if p.grad is not None]
