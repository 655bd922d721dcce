"""Optimizer state on the host while it is not needed (NeMo-Aligner style, during rollout).

``with tidal.offload_optimizer(opt): generate(...)`` moves every tensor of
``opt.state`` (Adam's moments: 2x the model's bytes in fp32) to pinned host memory for the
block and brings it back after. The tensors keep their identity; ``opt.step()`` inside the
block raises instead of silently stepping on empty storages.

If ``opt`` belongs to a :class:`~tidal.Timeshare` role, the role's bookkeeping is used (one
host copy, one report). Otherwise a store of its own is kept for the optimizer, found again
through its claim in the device's :class:`~tidal.transfer.TransferContext`, so the host
memory is pinned on the first call only and reused after.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Iterator

import torch

from tidal.state.collect import StateEntry, collect_module_state, collect_optimizer_state
from tidal.state.foreign import install_optimizer_hooks
from tidal.state.result import MoveResult
from tidal.state.store import OffloadStore
from tidal.timeshare.registration import timeshare_of
from tidal.transfer.context import TransferContext
from tidal.transfer.engine import TransferConfig

__all__ = ["offload_optimizer"]


def _optimizer_device(optimizer: torch.optim.Optimizer) -> torch.device:
    for group in optimizer.param_groups:
        for p in group["params"]:
            return p.device
    raise ValueError("the optimizer has no parameters, so there is no state to offload")


def _standalone_store(
    optimizer: torch.optim.Optimizer, context: TransferContext, config: TransferConfig | None
) -> OffloadStore:
    store = context.owner_of(optimizer)
    if not isinstance(store, OffloadStore):
        store = OffloadStore(context.ops, config, context=context, owner=context.label("offload_optimizer"))
        store.backend.describe = _describe_standalone  # type: ignore[attr-defined]
        context.claim(optimizer, store, what="optimizer")
    return store


def _describe_standalone(storage: torch.UntypedStorage, why: str) -> bytes:
    """What optimizer state (or a gradient) moved out by an offload_optimizer() block says
    when touched."""
    return (
        b"tidal: this optimizer state (or gradient) is in host memory for an offload_optimizer() block; it "
        b"comes back when the block ends (or, if it could not, at the next optimizer.step()). Read it through "
        b"optimizer.state_dict() (the host copies, no reload)"
    )


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
    context: TransferContext | None = None,
) -> Iterator[OptimizerOffload]:
    """Keep ``optimizer``'s state (and the params' ``.grad`` if ``grads``) on the host for
    the block.

    Memory: frees the state's device bytes for the block; holds the same bytes in pinned host
    memory (kept for reuse across calls). On exit the state returns, or, for a timeshare role
    with the default ``optimizer_residency="step"``, stays on the host until the next
    ``step()`` brings it in. ``optimizer.state_dict()`` and ``load_state_dict()`` are right
    inside the block (they read and write the host copies).

    If the state cannot come back on exit (:class:`~tidal.InsufficientMemoryError`: the block
    left too little room), the error is raised and nothing is lost: the state stays on the
    host and the next ``step()`` (or a backward reaching a gradient that is out) brings it in
    first. An optimizer whose state lives on the host by design (:class:`tidal.CPUAdam`) has
    nothing to move: the block runs unchanged, with a warning.

    ``context``: the transfer context to look for the optimizer's manager in and to move
    through (default: the process's one for the optimizer's device).
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"offload_optimizer needs a torch.optim.Optimizer, got {type(optimizer).__name__}")
    result = OptimizerOffload()
    if getattr(optimizer, "tidal_state_on_host", False):
        warnings.warn(
            f"offload_optimizer() ignored: {type(optimizer).__name__} keeps its state and gradients on "
            f"the host already, so there is nothing to move; the block runs as it is",
            stacklevel=3,
        )
        yield result
        return
    device = _optimizer_device(optimizer)
    if context is None:
        context = TransferContext.of(device)
    owner = timeshare_of(optimizer, context)
    if owner is not None:
        ts, name = owner
        role = ts.role(name)
        role.lock_optimizer()  # the role's step pre-hook refuses while locked; raises if nested
        try:
            if role.resident:  # otherwise the whole role is on the host already
                ts.offload_optimizer_state(name, grads=grads, kind="optim-ctx")
            yield result
        finally:
            role.unlock_optimizer()
            if role.resident and not ts.closed:
                # Grads come back now; the state too unless it lives on the host between
                # steps anyway (step residency), where the next step() brings it in.
                if grads:
                    ts.reload_optimizer_state(name, grads=True, kind="optim-ctx")
                if role.optimizer_residency == "role":
                    ts.reload_optimizer_state(name, kind="optim-ctx")
        return

    store = _standalone_store(optimizer, context, config)
    entries: list[StateEntry] = collect_optimizer_state([optimizer], device, min_offload_bytes=min_offload_bytes)
    if grads:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        grad_entries = collect_module_state(
            [], device, extra_params=params, grads="offload", min_offload_bytes=min_offload_bytes
        )
        entries = [e for e in grad_entries if e.kind == "grad"] + entries

    def refuse_step(opt, args, kwargs):
        raise RuntimeError(
            "optimizer.step() was called inside offload_optimizer(): its state is on the host. "
            "Step after the `with` block ends"
        )

    handles = [optimizer.register_step_pre_hook(refuse_step), *install_optimizer_hooks(store, optimizer)]
    back = False
    try:
        result.out = store.offload(entries)
        yield result
    finally:
        try:
            result.back = store.reload(entries, what="reloading optimizer state after offload_optimizer()")
            back = True
        finally:
            for h in handles:
                h.remove()
            if not back:
                # The state could not come back (no room, or an exception interrupted the
                # moves): it stays on the host, found again by whatever touches it next.
                _Stranded(optimizer, store, entries).install()


class _Stranded:
    """Optimizer state (and grads) that ``offload_optimizer`` could not bring back. The next
    ``step()``, or a backward reaching a parameter whose gradient is out, reloads it first
    (raising :class:`~tidal.InsufficientMemoryError` again, with nothing lost, if there is
    still no room); ``state_dict()``/``load_state_dict()`` read and write its host copies."""

    def __init__(self, optimizer: torch.optim.Optimizer, store: OffloadStore, entries: list[StateEntry]) -> None:
        self.store = store
        self.entries = entries
        self.handles: list = []
        self.optimizer = optimizer

    def install(self) -> None:
        opt = self.optimizer
        self.handles += install_optimizer_hooks(self.store, opt)
        self.handles.append(opt.register_step_pre_hook(lambda o, args, kwargs: self.reload()))
        for g in opt.param_groups:
            for p in g["params"]:
                if p.grad is not None and self.store.is_offloaded(p.grad.untyped_storage()._cdata):
                    # Runs before autograd accumulates into p.grad.
                    self.handles.append(p.register_hook(self._before_accumulate))

    def _before_accumulate(self, grad: torch.Tensor) -> torch.Tensor:
        self.reload()
        return grad

    def reload(self) -> None:
        if not self.handles:
            return
        self.store.reload(self.entries, what="reloading optimizer state that offload_optimizer() left on the host")
        for h in self.handles:
            h.remove()
        self.handles = []
