"""A role: the modules and optimizers that take turns on a device as one unit."""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch

from tidal.state.collect import GradPolicy, StateEntry, collect_module_state, collect_optimizer_state

__all__ = ["Role", "OptimizerResidency"]

OptimizerResidency = Literal["step", "role"]
_GRAD_POLICIES = ("offload", "keep", "drop")
_RESIDENCIES = ("step", "role")


@dataclasses.dataclass(eq=False)
class Role:
    """One registered role.

    Attributes:
        grads: ``"offload"`` moves ``.grad`` tensors with the role, ``"keep"`` leaves them on
            the device, ``"drop"`` sets them to ``None`` when the role goes out (nothing moved).
        optimizer_residency: ``"step"`` (default) keeps optimizer state on the host except
            during ``optimizer.step()`` (loaded by a step pre-hook, offloaded by a post-hook),
            so forward/backward peaks never include it; ``"role"`` moves it with the role.
    """

    name: str
    modules: list[torch.nn.Module]
    optimizers: list[torch.optim.Optimizer]
    grads: GradPolicy = "offload"
    optimizer_residency: OptimizerResidency = "step"
    resident: bool = True
    in_use: int = 0
    last_used: int = 0
    # Storage keys of the role's state when it went out, in transfer order. Keys, not
    # tensors: a storage that dies while parked (a dropped grad) must not be kept alive.
    parked_keys: list[int] = dataclasses.field(default_factory=list)
    parked_optim_keys: list[int] = dataclasses.field(default_factory=list)
    param_keys: frozenset[int] = frozenset()
    hooks: list = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        if self.grads not in _GRAD_POLICIES:
            raise ValueError(f"grads must be one of {_GRAD_POLICIES}, got {self.grads!r}")
        if self.optimizer_residency not in _RESIDENCIES:
            raise ValueError(
                f"optimizer_residency must be one of {_RESIDENCIES}, got {self.optimizer_residency!r}"
            )

    def param_names(self) -> dict[int, str]:
        names: dict[int, str] = {}
        for i, m in enumerate(self.modules):
            prefix = f"model{i}." if i else ""
            for n, p in m.named_parameters():
                names.setdefault(id(p), prefix + n)
        return names

    def loose_params(self) -> list[torch.Tensor]:
        """Parameters an optimizer of the role holds that none of its modules registers."""
        known = {id(p) for m in self.modules for p in m.parameters()}
        return [p for o in self.optimizers for g in o.param_groups for p in g["params"] if id(p) not in known]

    def model_entries(self, device: torch.device, min_offload_bytes: int) -> list[StateEntry]:
        """Parameters, buffers and (by policy) gradients, found now."""
        return collect_module_state(
            self.modules, device, extra_params=self.loose_params(), grads=self.grads,
            min_offload_bytes=min_offload_bytes,
        )

    def optim_entries(self, device: torch.device, min_offload_bytes: int) -> list[StateEntry]:
        """Tensors of every ``optimizer.state``, found now (state appears at the first step)."""
        if not self.optimizers:
            return []
        return collect_optimizer_state(
            self.optimizers, device, names=self.param_names(), min_offload_bytes=min_offload_bytes
        )

    def drop_grads(self) -> None:
        for m in self.modules:
            for p in m.parameters():
                p.grad = None
        for p in self.loose_params():
            p.grad = None
