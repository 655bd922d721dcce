"""A role: the state sources (modules, an engine, anything with the source protocol) and the
optimizers that take turns on a device as one unit."""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch

from tidal.state.collect import GradPolicy, StateEntry, collect_optimizer_state, collect_tensors
from tidal.state.sources import ModuleSource, StateSource

__all__ = ["Role", "OptimizerResidency"]

OptimizerResidency = Literal["step", "stream", "role"]
_GRAD_POLICIES = ("offload", "keep", "drop")
_RESIDENCIES = ("step", "stream", "role")


@dataclasses.dataclass(eq=False)
class Role:
    """One registered role.

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
    # Whether the role counts as on the device. Where each storage is lives in the store;
    # a role's storages are always found from its live tensors, never from a saved list.
    resident: bool = True
    in_use: int = 0
    last_used: int = 0
    optimizer_locked: bool = False  # inside offload_optimizer(): step() must not run
    # Optimizer state may be on the device against the residency policy (a step, a load or a
    # reload happened since the last settle): the end of use() then checks and moves it.
    optim_unsettled: bool = True
    streaming: bool = False  # inside a streamed step: the per-chunk step() calls skip the hooks
    hidden_groups: list | None = None  # param lists a streamed step took from the outer step()
    hidden_optimizer: torch.optim.Optimizer | None = None  # ... of this optimizer
    hooks: list = dataclasses.field(default_factory=list)
    _names: dict[int, str] | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.grads not in _GRAD_POLICIES:
            raise ValueError(f"grads must be one of {_GRAD_POLICIES}, got {self.grads!r}")
        if self.optimizer_residency not in _RESIDENCIES:
            raise ValueError(f"optimizer_residency must be one of {_RESIDENCIES}, got {self.optimizer_residency!r}")

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
        return collect_tensors(tensors, device, min_offload_bytes=min_offload_bytes, include_empty=include_empty)

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
