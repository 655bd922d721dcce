"""Optimizer state on the host while it is not needed (NeMo-Aligner style, during rollout).

``with tidal.offload_optimizer(opt): generate(...)`` moves every tensor of
``opt.state`` (Adam's moments: 2x the model's bytes in fp32) to pinned host memory for the
block and brings it back after. The tensors keep their identity; ``opt.step()`` inside the
block raises instead of silently stepping on empty storages.

If ``opt`` belongs to a :class:`~tidal.Timeshare` role, the role's bookkeeping is used (one
host copy, one report). Otherwise a private store is kept per optimizer, so the host memory
is pinned on the first call only and reused after.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Iterator

import torch

from tidal.device import DeviceOps
from tidal.state.collect import StateEntry, collect_module_state, collect_optimizer_state
from tidal.state.store import MoveResult, OffloadStore
from tidal.timeshare.timeshare import timeshare_of
from tidal.transfer.engine import TransferConfig

__all__ = ["offload_optimizer"]

_STANDALONE: "weakref.WeakKeyDictionary[torch.optim.Optimizer, OffloadStore]" = weakref.WeakKeyDictionary()


def _optimizer_device(optimizer: torch.optim.Optimizer) -> torch.device:
    for group in optimizer.param_groups:
        for p in group["params"]:
            return p.device
    raise ValueError("the optimizer has no parameters, so there is no state to offload")


def _standalone_store(optimizer: torch.optim.Optimizer, device: torch.device,
                      config: TransferConfig | None) -> OffloadStore:
    store = _STANDALONE.get(optimizer)
    if store is None or store.ops.device != device:
        store = OffloadStore(DeviceOps(device), config)
        _STANDALONE[optimizer] = store
    return store


class OptimizerOffload:
    """What :func:`offload_optimizer` did: the two transfers, for telemetry."""

    def __init__(self) -> None:
        self.out: MoveResult | None = None
        self.back: MoveResult | None = None


@contextlib.contextmanager
def offload_optimizer(
    optimizer: torch.optim.Optimizer,
    *,
    grads: bool = False,
    min_offload_bytes: int = 16,
    config: TransferConfig | None = None,
) -> Iterator[OptimizerOffload]:
    """Keep ``optimizer``'s state (and the params' ``.grad`` if ``grads``) on the host for
    the block.

    Memory: frees the state's device bytes for the block; holds the same bytes in pinned host
    memory (kept for reuse across calls). On exit the state returns, or, for a timeshare role
    with the default ``optimizer_residency="step"``, stays on the host until the next
    ``step()`` brings it in.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"offload_optimizer needs a torch.optim.Optimizer, got {type(optimizer).__name__}")
    result = OptimizerOffload()
    owner = timeshare_of(optimizer)
    if owner is not None:
        ts, name = owner
        role = ts.role(name)
        if role.optimizer_locked:
            raise RuntimeError(f"offload_optimizer() is already active for role {name!r}; blocks do not nest")
        role.optimizer_locked = True  # the role's step pre-hook refuses while set
        try:
            if role.resident:  # otherwise the whole role is on the host already
                ts.offload_optimizer_state(name, grads=grads, kind="optim-ctx")
            yield result
        finally:
            role.optimizer_locked = False
            if role.resident and not ts.closed:
                # Grads come back now; the state too unless it lives on the host between
                # steps anyway (step residency), where the next step() brings it in.
                if grads:
                    ts.reload_optimizer_state(name, grads=True, kind="optim-ctx")
                if role.optimizer_residency == "role":
                    ts.reload_optimizer_state(name, kind="optim-ctx")
        return

    device = _optimizer_device(optimizer)
    store = _standalone_store(optimizer, device, config)
    entries: list[StateEntry] = collect_optimizer_state([optimizer], device, min_offload_bytes=min_offload_bytes)
    if grads:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        grad_entries = collect_module_state([], device, extra_params=params, grads="offload",
                                            min_offload_bytes=min_offload_bytes)
        entries = [e for e in grad_entries if e.kind == "grad"] + entries

    def refuse_step(opt, args, kwargs):
        raise RuntimeError(
            "optimizer.step() was called inside offload_optimizer(): its state is on the host. "
            "Step after the `with` block ends"
        )

    handle = optimizer.register_step_pre_hook(refuse_step)
    try:
        result.out = store.offload(entries)
        try:
            yield result
        finally:
            result.back = store.reload(entries, what="reloading optimizer state after offload_optimizer()")
    finally:
        handle.remove()
