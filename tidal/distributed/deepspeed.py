"""DeepSpeed engines as timeshare roles (extra ``tidal[deepspeed]``; DeepSpeed is imported only
when one of these functions is called).

``add_deepspeed_role(ts, "actor_train", engine)`` registers a ``deepspeed.initialize`` engine
(ZeRO stage 0-3) with a :class:`tidal.Timeshare`; ``ts.use`` / ``ts.offload`` / switches then
move this rank's share of the engine's device state with tidal's transfer engine (pinned once,
both copy engines, storages resized to 0 so tensor objects and DeepSpeed's views stay valid).

What is moved, and how it is found, is described in :mod:`tidal.distributed.deepspeed_state`.

Scalars (the grad norm, the overflow flag) stay put (``TimeshareConfig.min_offload_bytes``).
State DeepSpeed already keeps on the host (ZeRO-Offload's CPU optimizer) is not touched.

:class:`DeepSpeedOffload` moves one engine out and back outside a timeshare, either with
tidal's transfer engine (``via="tidal"``, every stage) or with DeepSpeed's own
``engine.offload_states()`` / ``reload_states()`` (``via="deepspeed"``), so the two can be
compared on the same engine (``benchmarks/bench_deepspeed.py``). DeepSpeed 0.19.8 implements
those for its ZeRO-1/2 optimizer with any torch optimizer and for ZeRO-3 with its own
``FusedAdam`` only; not at stage 0, nor for its ``BF16_Optimizer`` (what ZeRO-1 becomes with
bf16 params and fp32 gradient accumulation), nor with ``offload_param``: those are refused
with a ``ValueError`` saying so. Its ZeRO-3 offload drops the reduce bucket's contents and the
gathered persistent params (rebuilt at the next forward) instead of moving them.

Storages come back at new device addresses (as with FSDP's resharding): views stay valid, but
anything that captured a ``data_ptr()`` (a CUDA graph) must be captured again.
"""

from __future__ import annotations

import time
import weakref
from typing import Literal

import torch
import torch.utils.hooks
from typing_extensions import Self  # a dependency of torch

from tidal.distributed.deepspeed_state import (
    _check_engine,
    _engine_device,
    EngineSource,
    _import_deepspeed,
    _inner_optimizer,
    deepspeed_state_bytes,
    describe_deepspeed_state,
)
from tidal.memory import snapshot
from tidal.state.result import MoveResult
from tidal.timeshare.role import OptimizerResidency, Role
from tidal.timeshare import Timeshare, TimeshareConfig
from tidal.transfer.context import TransferContext

__all__ = ["DeepSpeedOffload", "Via", "add_deepspeed_role", "deepspeed_state_bytes", "describe_deepspeed_state"]

Via = Literal["tidal", "deepspeed"]
_VIAS = ("tidal", "deepspeed")
_RESIDENCIES = ("role", "step")


class _EngineOwner:
    """Who manages an engine's state, as claimed in the device's transfer context: two
    managers of one engine would each think they own its storages."""

    def __init__(self, what: str) -> None:
        self.what = what

    def __repr__(self) -> str:
        return self.what


def _claim(context: TransferContext, engine: torch.nn.Module, what: str) -> _EngineOwner:
    owner = _EngineOwner(what)
    context.claim(engine, owner, what="DeepSpeed engine")
    return owner


def add_deepspeed_role(
    ts: Timeshare,
    name: str,
    engine: torch.nn.Module,
    *,
    optimizer_residency: OptimizerResidency = "role",
) -> Role:
    """Register a DeepSpeed engine as role ``name`` of ``ts``; returns the :class:`Role`.

    Contract: afterwards ``ts.use(name)`` / ``ts.offload(name)`` / switches move this rank's
    device state of the engine (module params and buffers, fp32 masters, optimizer moments,
    DeepSpeed's gradient and bucket buffers; see the module docstring), bit-exact and in place.
    Run the engine (``engine(...)``, ``engine.backward``, ``engine.step``) only while the role
    is resident: its forward raises otherwise, as does the inner optimizer's ``step()``. Do not
    call ``engine.offload_states()`` on a registered engine, nor save a checkpoint with
    ``engine.save_checkpoint`` while it is offloaded (its tensors are empty then). Every
    gradient buffer DeepSpeed holds moves with the role (dropping one would break its
    accumulation), so there is no ``grads`` choice. Between steps ZeRO-1/2 hold no gradient
    buffers; ZeRO-3 keeps its gradient partitions and a reduce bucket of
    ``reduce_bucket_size`` elements, both moved.

    Args:
        ts: the timeshare; its device must be the engine's (``engine.device``).
        name: the role's name.
        engine: what ``deepspeed.initialize`` returned first (ZeRO stage 0-3, fp32/fp16/bf16).
        optimizer_residency: ``"role"`` (default) moves the optimizer moments with the role.
            ``"step"`` keeps them on the host except during the inner optimizer's ``step()``,
            so forward and backward never hold them; DeepSpeed calls that ``step()`` once per
            parameter group (ZeRO-1/2) or sub-group (ZeRO-3), so with several groups the
            moments cross PCIe once per group per step. The fp32 masters are the inner
            optimizer's parameters and move with the role either way. ``"stream"`` is refused:
            its chunked update would split DeepSpeed's flat partitions.

    Memory cost: host RAM equal to the engine's device state bytes (pinned once, here), device
    memory of one staging bucket per direction during a transition. Each transition walks the
    engine's objects (milliseconds for a model of a few hundred tensors).
    """
    _check_engine(engine)
    if not isinstance(ts, Timeshare):
        raise TypeError(f"ts must be a tidal.Timeshare, got {type(ts).__name__}")
    if optimizer_residency not in _RESIDENCIES:
        why = (
            (
                " (its chunked step would split DeepSpeed's flat master partitions and bypass the "
                "wrapper's per-group step)"
            )
            if optimizer_residency == "stream"
            else ""
        )
        raise ValueError(
            f"optimizer_residency for a DeepSpeed role must be one of {_RESIDENCIES}, got {optimizer_residency!r}{why}"
        )
    device = _engine_device(engine)
    if device != ts.device:
        raise ValueError(
            f"the engine lives on {device} but the timeshare on {ts.device}; create the "
            f"Timeshare on the engine's device (engine.device)"
        )
    owner = _claim(ts.context, engine, f"role {name!r} of a Timeshare")
    early: list = []
    try:
        inner = _inner_optimizer(engine)
        if optimizer_residency == "step" and inner is not None:
            # Registered before the timeshare's hooks, so it runs before the one that sends
            # the moments back to the host.
            early = _link_moments_while_resident(engine.optimizer, inner)
        role = ts.add_role(
            name,
            source=EngineSource(engine, inner),
            optimizer=inner,
            grads="offload",
            optimizer_residency=optimizer_residency,
        )
    except BaseException:
        for h in early:
            h.remove()
        ts.context.release(engine, owner)
        raise
    role.hooks.extend(early)
    role.hooks.append(_Release(ts.context, engine, owner))
    return role


def _link_moments_while_resident(wrapper, inner: torch.optim.Optimizer) -> list:
    """With step residency, let DeepSpeed make its views of the moments while they are on the
    device.

    After the first optimizer step, DeepSpeed's ZeRO-1/2 and BF16 wrappers create views of the
    new ``exp_avg`` / ``exp_avg_sq`` for each parameter (``_hp_mapping.optim_fragment``, read by
    ``safe_get_full_optimizer_state``), once, after the inner ``step()`` returns. By then the
    timeshare's step post-hook has sent the moments to the host, and a view of an emptied
    storage is refused. This post-hook, registered first, asks the wrapper to link right after
    the inner step, on the state it has. At ZeRO-1/2 the wrapper steps one group at a time with
    only that group visible, so this links the first group, as DeepSpeed's own lazy link does
    (it finds no state for the other groups at that point either). Wrappers without the lazy
    link (ZeRO-3, stage 0) get no hook.
    """
    link = getattr(wrapper, "_lazy_init_hp_params_optimizer_state", None)
    if not callable(link) or getattr(wrapper, "_hp_optimizer_states_linked", True):
        return []

    def link_now(opt, args, kwargs) -> None:
        if not wrapper._hp_optimizer_states_linked:
            link()

    return [inner.register_step_post_hook(link_now)]


class _Release:
    """A role hook handle: releases the engine's claim when the timeshare closes."""

    def __init__(self, context: TransferContext, engine, owner: _EngineOwner) -> None:
        self._context, self._engine, self._owner = context, weakref.ref(engine), owner

    def remove(self) -> None:
        engine = self._engine()
        if engine is not None:
            self._context.release(engine, self._owner)


def _check_offload_states(engine, deepspeed) -> None:
    """Raise if DeepSpeed's own offload_states cannot move this engine's whole state."""
    opt = engine.optimizer
    stage = engine.zero_optimization_stage()
    version = deepspeed.__version__
    if opt is None or not hasattr(opt, "offload_states") or not hasattr(engine, "offload_states"):
        raise ValueError(
            f"DeepSpeed {version} implements engine.offload_states() only for ZeRO stages 1-3 with an "
            f"optimizer; this engine is stage {stage} with {type(opt).__name__ if opt is not None else 'no'} "
            f"optimizer. Use via='tidal', which moves any stage"
        )
    param_offload = engine.zero_offload_param()
    if param_offload is not None and str(getattr(param_offload.device, "value", param_offload.device)) != "none":
        raise ValueError(
            "DeepSpeed's offload_states refuses engines whose parameters are offloaded "
            "(zero_optimization.offload_param); they are on the host already"
        )
    if stage == 3:
        from deepspeed.ops.adam import FusedAdam

        inner = _inner_optimizer(engine)
        if type(inner) is not FusedAdam:
            raise ValueError(
                f"DeepSpeed {version}'s ZeRO-3 offload_states moves the master weights and moments only "
                f"for DeepSpeed's FusedAdam (it asserts so); this engine's optimizer is "
                f"{type(inner).__name__}. Use via='tidal' (any torch optimizer), or build the engine "
                f"with deepspeed.ops.adam.FusedAdam"
            )


class DeepSpeedOffload:
    """Move one DeepSpeed engine's device state to the host and back, outside a timeshare.

    ``via="tidal"`` (default): a one-role :class:`tidal.Timeshare` on ``engine.device`` made
    with ``config``, through :func:`add_deepspeed_role` (every ZeRO stage; storages resized in
    place; pinned host memory reserved here, once). ``via="deepspeed"``: DeepSpeed's
    ``engine.offload_states(pin_memory=True, non_blocking=True)`` and
    ``reload_states(non_blocking=True)``, then a device synchronize; DeepSpeed 0.19 supports
    this for ZeRO-1/2 and, with DeepSpeed's ``FusedAdam`` only, ZeRO-3 (checked here, with a
    ``ValueError`` naming what is missing). DeepSpeed pins its host buffers at the first
    offload and replaces tensors' ``.data`` rather than resizing storages.

    :meth:`offload` and :meth:`reload` block until the copies are done and return a
    :class:`~tidal.state.store.MoveResult`. For ``via="tidal"`` its bytes are the storages
    moved; for ``via="deepspeed"`` they are the change of the allocator's allocated bytes
    (what DeepSpeed freed or allocated), and ``release_seconds`` is 0 since DeepSpeed returns
    the memory to the driver inside its own call.

    Memory cost: host RAM equal to the moved bytes (tidal: pinned at construction; DeepSpeed:
    pinned at the first offload and kept).
    """

    def __init__(self, engine: torch.nn.Module, *, via: Via = "tidal", config: TimeshareConfig | None = None) -> None:
        _check_engine(engine)
        if via not in _VIAS:
            raise ValueError(f"via must be one of {_VIAS}, got {via!r}")
        if config is not None and via != "tidal":
            raise ValueError("config applies to via='tidal' only (DeepSpeed's offload_states has its own settings)")
        self.engine = engine
        self.via = via
        self.offloaded = False
        self.device = _engine_device(engine)
        self.timeshare: Timeshare | None = None
        if via == "deepspeed":
            _check_offload_states(engine, _import_deepspeed())
            self._context = TransferContext.of(self.device)
            self._owner = _claim(self._context, engine, "DeepSpeedOffload(via='deepspeed')")
            self._ops = self._context.ops
        else:
            self.timeshare = Timeshare(self.device, config=config)
            add_deepspeed_role(self.timeshare, "engine", engine)
            self._ops = self.timeshare.ops

    def state_bytes(self) -> int:
        """Bytes of the engine's state on its device now (0 while offloaded): module params and
        buffers, masters, moments and DeepSpeed's buffers, each storage once."""
        return deepspeed_state_bytes(self.engine)

    def offload(self) -> MoveResult:
        """Move the engine's state to the host and return its device memory to the driver."""
        if self.offloaded:
            raise RuntimeError("the engine is offloaded already; call reload() first")
        if self.timeshare is not None:
            self.timeshare.offload("engine")
            move = self.timeshare.store.last_move
        else:
            move = self._deepspeed_move(out=True)
        self.offloaded = True
        return move

    def reload(self) -> MoveResult:
        """Bring the engine's state back to the device (bit-exact)."""
        if not self.offloaded:
            raise RuntimeError("the engine is not offloaded; call offload() first")
        if self.timeshare is not None:
            self.timeshare.load("engine")
            move = self.timeshare.store.last_move
        else:
            move = self._deepspeed_move(out=False)
        self.offloaded = False
        return move

    def _deepspeed_move(self, *, out: bool) -> MoveResult:
        ops = self._ops
        # Kernels still queued (a step) must finish before DeepSpeed reads or replaces the state,
        # and the timing below must not include them.
        ops.synchronize()
        before = snapshot(ops)
        t0 = time.perf_counter()
        if out:
            self.engine.offload_states(pin_memory=True, non_blocking=True)
        else:
            self.engine.reload_states(non_blocking=True)
        # DeepSpeed's non-blocking copies: done only when the device says so.
        ops.synchronize()
        seconds = time.perf_counter() - t0
        after = snapshot(ops)
        delta = before.allocated_bytes - after.allocated_bytes
        return MoveResult(
            bytes_out=max(delta, 0) if out else 0,
            bytes_in=0 if out else max(-delta, 0),
            seconds=seconds,
            release_seconds=0.0,
            driver_free_before=before.driver_free_bytes,
            driver_free_after=after.driver_free_bytes,
            segments=0,
        )

    def close(self) -> None:
        """Bring the state back if it is out and release the engine (and tidal's host memory)."""
        if self.offloaded:
            self.reload()
        if self.timeshare is not None:
            self.timeshare.close()
        else:
            self._context.release(self.engine, self._owner)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        where = "host" if self.offloaded else "device"
        return f"DeepSpeedOffload(via={self.via!r}, device={str(self.device)!r}, state on {where})"
