"""ZeRO stages 0-3 as FSDP2 (``fully_shard``) settings, for roles that span several ranks.

``shard_model(model, zero_stage=3, layers=model.model.layers)`` shards ``model`` in place with
torch's FSDP2 and returns it. Its parameters become ``DTensor`` s whose local shards are plain
tensors, and an optimizer built *after* sharding keeps its moments as ``DTensor`` s of the
same local shape, so a :class:`tidal.Timeshare` role built on the sharded model moves only this
rank's shards (``state/collect.py`` opens each ``DTensor`` down to its local tensor).

How the stages map, and where FSDP2 is not ZeRO (said plainly, since the names promise more
than the mechanics deliver):

- stage 0: ``replicate`` (FSDP2's DDP mode). Every rank holds all params, grads and optimizer
  state; grads are all-reduced. Same as ZeRO-0 / DDP.
- stage 1: ``fully_shard(reshard_after_forward=False)``, and :func:`no_sync` skips gradient
  sync on non-final micro-batches. ZeRO-1 keeps full params at rest and shards only the
  optimizer state; FSDP2 shards the params at rest too (less memory) and all-gathers them at
  the first forward of a step (the traffic ZeRO-1 spends after its step instead).
- stage 2: ``fully_shard(reshard_after_forward=False)``, grads reduce-scattered every
  micro-batch. ZeRO-2 likewise keeps full params at rest; grads and optimizer state are
  sharded as in ZeRO-2.
- stage 3: ``fully_shard(reshard_after_forward=True)``. Params are gathered per unit for the
  forward and again for the backward, as in ZeRO-3.

So stages 1 and 2 differ only with gradient accumulation: stage 1 keeps full (unsharded)
gradients across micro-batches and reduces once (ZeRO-1's trade: more memory, less traffic),
stage 2 reduce-scatters each micro-batch. Between steps every stage >= 1 holds only shards.

Memory (per rank, P = parameter bytes, N = ranks): at rest P/N params + P/N grads + the
optimizer's share of P/N (stage 0: all of P). During forward/backward, stage 3 adds the
unsharded params of about two layers (``layers`` given) or of the whole model (not given);
stages 1/2 add all unsharded params from the first forward until the end of backward.

Stage 0 is FSDP2's DDP mode rather than ``DistributedDataParallel`` so that every stage has the
same parameter type (``DTensor``), policies and checkpoint format. Its cost: from the forward
until the end of backward each rank also holds an unsharded copy of the params (the
all-gather buffer of a 1-rank shard), where DDP holds gradient buckets instead.

Timeshare contract: between calls a role must hold only its shards, since tidal moves what the
module registers. FSDP2 keeps unsharded params after a forward that no backward follows at
stages 0-2 (``reshard_after_forward=False``), e.g. a ``torch.no_grad()`` rollout; so by default
(``reshard_after_no_grad=True``) a forward run with grad disabled reshards when it returns, as
stage 3 always does. A generation loop at stage 1/2 that wants params kept unsharded across
decode steps sets it to ``False`` and calls :func:`reshard` before the role is switched out.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from tidal.state.collect import fsdp_param_groups, unique_storage_bytes

__all__ = [
    "ZERO_STAGES",
    "gathered",
    "gathered_bytes",
    "hooks_off_while_gathered",
    "local_state_bytes",
    "no_sync",
    "reshard",
    "reshard_after_no_grad_forward",
    "shard_model",
    "zero_stage_of",
]

ZERO_STAGES = (0, 1, 2, 3)
_STAGE_ATTR = "_tidal_zero_stage"


def _default_mesh(model: torch.nn.Module) -> DeviceMesh:
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if device.type == "meta":
        raise ValueError("the model is on the meta device; pass mesh= to say which device type to shard onto")
    return init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("dp",))


def _replicate(module: torch.nn.Module, **kwargs) -> None:
    try:  # FSDP2's DDP mode: same hooks, DTensor params and policies as fully_shard
        from torch.distributed._composable.replicate_with_fsdp import replicate
    except ImportError as e:  # pragma: no cover - depends on the torch build
        raise ValueError(
            f"zero_stage=0 needs torch.distributed._composable.replicate_with_fsdp (torch >= 2.9); "
            f"this torch {torch.__version__} lacks it. Use zero_stage=1 (shards only at rest) or "
            f"upgrade torch"
        ) from e
    replicate(module, **kwargs)


def shard_model(
    model: torch.nn.Module,
    *,
    zero_stage: int,
    mesh: DeviceMesh | None = None,
    layers: Iterable[torch.nn.Module] | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy: OffloadPolicy | None = None,
    reshard_after_no_grad: bool = True,
) -> torch.nn.Module:
    """Shard ``model`` in place for ZeRO stage ``zero_stage`` and return it.

    Args:
        zero_stage: 0, 1, 2 or 3 (see the module docstring for what each means in FSDP2).
        mesh: a 1-D data-parallel device mesh. ``None``: all ranks of the default process
            group, on the device type of the model's parameters (``"cpu"`` uses gloo).
        layers: sub-modules to shard as their own units (transformer blocks). Each is
            all-gathered on its own, so the unsharded peak is about two layers instead of the
            whole model. ``None`` shards the model as one unit.
        mp_policy: FSDP2 mixed precision, e.g. ``MixedPrecisionPolicy(param_dtype=torch.bfloat16,
            reduce_dtype=torch.float32)``. Sharded params (and so the optimizer) stay in
            their own dtype.
        offload_policy: ``CPUOffloadPolicy()`` keeps the sharded params, grads and optimizer
            step on the host for good (FSDP2's own offload). Such a role has nothing on the
            GPU between steps, so do not add it to a GPU timeshare; tidal's timeshare is the
            alternative that keeps it on the GPU while it computes.
        reshard_after_no_grad: at stages 0-2, free the unsharded params when a forward run
            with grad disabled returns (no backward will free them). See the module docstring.

    Build the optimizer after this call: it must hold the sharded parameters.
    """
    if isinstance(zero_stage, bool) or zero_stage not in ZERO_STAGES:
        raise ValueError(f"zero_stage must be one of {ZERO_STAGES}, got {zero_stage!r}")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(model, FSDPModule) or getattr(model, _STAGE_ATTR, None) is not None:
        raise ValueError("this model is sharded already; shard a model once, before building its optimizer")
    if mp_policy is not None and not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(
            f"mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy, got {type(mp_policy).__name__}"
        )
    if offload_policy is not None and not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(
            f"offload_policy must be a torch.distributed.fsdp.OffloadPolicy (e.g. CPUOffloadPolicy()), "
            f"got {type(offload_policy).__name__}"
        )
    if mesh is None:
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError(
                "shard_model needs torch.distributed initialised (dist.init_process_group, e.g. "
                "under torchrun) or an explicit mesh="
            )
        mesh = _default_mesh(model)
    elif not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim != 1:
        raise ValueError(
            f"mesh must be 1-D (one data-parallel dimension), got {mesh.ndim} dimensions; "
            f"HSDP meshes are not mapped to ZeRO stages yet"
        )
    kwargs: dict = {"mesh": mesh}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    if offload_policy is not None:
        kwargs["offload_policy"] = offload_policy
    units = list(layers) if layers is not None else []
    if any(u is model for u in units):
        raise ValueError("layers must be sub-modules of model, not the model itself")
    if zero_stage == 0:
        for unit in units:
            _replicate(unit, **kwargs)
        _replicate(model, **kwargs)
    else:
        reshard = zero_stage == 3
        for unit in units:
            fully_shard(unit, reshard_after_forward=reshard, **kwargs)
        # The root's params (embeddings, final norm, head) are gathered at its forward and
        # used again at the end of it; FSDP2 never reshards the root after forward anyway.
        fully_shard(model, reshard_after_forward=reshard, **kwargs)
    if reshard_after_no_grad and zero_stage < 3:
        reshard_after_no_grad_forward(model)
    setattr(model, _STAGE_ATTR, zero_stage)
    return model


def reshard_after_no_grad_forward(model: torch.nn.Module) -> Any:
    """Free every unsharded parameter of ``model`` (an FSDP2 model, sharded by any means)
    when a forward of it run with grad disabled returns: no backward will free them, and a
    timeshare role must hold only its shards between calls (FSDP2 keeps the root's parameters,
    and those of units built with ``reshard_after_forward=False``, unsharded after a forward).
    Not inside :func:`gathered`, which keeps them on purpose. Returns the hook's handle."""
    # Registered after fully_shard's own hooks, so it runs after FSDP2's post-forward.
    return model.register_forward_hook(_reshard_if_no_grad, always_call=True)


def _reshard_if_no_grad(module: torch.nn.Module, args, output) -> None:
    if not torch.is_grad_enabled() and not getattr(module, _GATHERED_ATTR, False):
        reshard(module)


_GATHERED_ATTR = "_tidal_gathered"


def gathered_bytes(model: torch.nn.Module) -> int:
    """The device bytes :func:`gathered` adds on this rank: every FSDP2 parameter of
    ``model`` whole, in the dtype its units all-gather in (their mixed-precision
    ``param_dtype``, else their own), less nothing (the shards stay where they are)."""
    total = 0
    for m in _fsdp_modules(model):
        for group in _groups(m):
            cast = group.mp_policy.param_dtype
            for fp in group.fsdp_params:
                own = fp.sharded_param.dtype
                dtype = cast if cast is not None and own.is_floating_point else own
                total += math.prod(fp._orig_size) * dtype.itemsize
    return total


@contextlib.contextmanager
def gathered(model: torch.nn.Module, *, on_unit: Callable[[list[torch.Tensor]], None] | None = None) -> Iterator[None]:
    """All-gather every FSDP2 unit of ``model`` once, keep the full parameters through the
    block, and reshard as it ends: forwards inside run no collective (generation then costs
    one all-gather of the model, not one per layer per token, and a rank finishing early
    waits for nobody). The same values as gathering per unit per forward, so the same results.

    ``on_unit``: called after each unit's gather with its sharded parameters (DTensors), which
    nothing reads again until the block has resharded: a timeshare's
    :meth:`~tidal.Timeshare.lending` moves their local shards to the host, so that the gather
    needs room for one unit's shards at a time beside the full copy, not all of them.

    Collective on entry: every rank must enter together, in the same order of modules; decide
    that on every rank alike (with the room: :func:`gathered_bytes`), as an all-gather that
    runs out of memory on one rank leaves the others waiting. Memory cost: ``gathered_bytes``
    on the device for the block. Not for a block that runs a backward (the gradients'
    reduce-scatter expects FSDP's own schedule)."""
    modules = _fsdp_modules(model)
    saved = [
        (
            m,
            getattr(m._get_fsdp_state(), "_auto_reshard_after_forward", None),
            [g.post_forward_mesh_info for g in _groups(m)],
        )
        for m in modules
    ]
    setattr(model, _GATHERED_ATTR, True)
    try:
        for m in modules:
            m.set_reshard_after_forward(False, recurse=False)  # the forwards in the block keep them
        for m in modules:
            m.unshard()
            if on_unit is not None:
                on_unit([fp.sharded_param for g in _groups(m) for fp in g.fsdp_params])
        yield
    finally:
        # FSDP's own settings back as they were (set_reshard_after_forward has no getter).
        for m, auto, infos in saved:
            if auto is not None:
                m._get_fsdp_state()._auto_reshard_after_forward = auto
            for g, info in zip(_groups(m), infos):
                g.post_forward_mesh_info = info
        for m in modules:
            m.reshard()
        setattr(model, _GATHERED_ATTR, False)


@contextlib.contextmanager
def hooks_off_while_gathered(model: torch.nn.Module) -> Iterator[bool]:
    """Inside :func:`gathered` (every parameter of ``model`` unsharded): FSDP2's forward hooks
    taken off every unit for the block, so that a forward runs the model's own code alone.
    Yields whether they were. Generation is one forward per token, and on a host-bound decode
    each unit's pre- and post-forward hook (its state's bookkeeping, profiler ranges, the
    root's input walk and stream waits) costs host time every token: about 50 us a unit on a
    CPU, 2.4 ms a token for a 48-layer model (one process of two, gloo, 2026-11-27).

    With every parameter already unsharded those hooks do nothing the forward needs, except
    where a unit casts: a mixed-precision policy (``param_dtype`` or ``output_dtype``) casts
    the inputs and outputs in them, so then the hooks stay (yields False), as they do outside
    :func:`gathered`. Units of several modules (``fully_shard([norm, lm_head])``, as accelerate
    groups a model's tail) lose the hooks of each. The hooks come back as the block ends, in
    their places among any hooks registered meanwhile (those go after them, even one
    registered with ``prepend=True``).

    Raises ``RuntimeError`` from a forward of ``model`` run with grad enabled inside the block,
    before it runs: without FSDP2's hooks its gradients would never be reduce-scattered (a
    decode loop runs under ``torch.no_grad()``)."""
    modules = _fsdp_modules(model)
    ids: dict[int, set[int]] = {}  # a module -> the ids of its FSDP2 state's forward hooks
    usable = bool(modules) and getattr(model, _GATHERED_ATTR, False)
    for m in modules if usable else []:
        state = m._get_fsdp_state()
        mp = getattr(state, "_mp_policy", None)
        hook_ids = _hook_ids(getattr(state, "_pre_forward_hook_handle", None))
        hook_ids |= _hook_ids(getattr(state, "_post_forward_hook_handle", None))
        if mp is None or mp.param_dtype is not None or mp.output_dtype is not None or not hook_ids:
            usable = False
            break
        for owner in getattr(state, "_modules", (m,)):
            ids[id(owner)] = hook_ids
    if not usable:
        yield False
        return
    taken: list[tuple[torch.nn.Module, str, list, dict]] = []
    owners = {id(o): o for m in modules for o in getattr(m._get_fsdp_state(), "_modules", (m,))}
    guard = model.register_forward_pre_hook(_refuse_grad, prepend=True)
    try:
        for key, m in owners.items():
            for name in ("_forward_pre_hooks", "_forward_hooks"):
                hooks = getattr(m, name)
                order = list(hooks)
                off = {k: hooks[k] for k in order if k in ids[key]}
                for k in off:
                    del hooks[k]
                taken.append((m, name, order, off))
        yield True
    finally:
        guard.remove()
        for m, name, order, off in taken:
            hooks = getattr(m, name)
            now = dict(hooks)
            hooks.clear()
            for k in order:  # the hooks there before, in their order, FSDP2's back among them
                if k in off:
                    hooks[k] = off[k]
                elif k in now:
                    hooks[k] = now.pop(k)
            hooks.update(now)  # registered during the block: after them, as registered


def _refuse_grad(module: torch.nn.Module, args: Any) -> None:
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"{type(module).__name__} ran a forward with grad enabled inside hooks_off_while_gathered(): FSDP2's "
            f"hooks are off there, so its gradients would not be reduce-scattered. Run it under torch.no_grad(), or "
            f"outside the block"
        )


def _hook_ids(handle: Any) -> set[int]:
    """The hook ids a removable handle stands for (a group's handle holds one per module)."""
    if handle is None:
        return set()
    inner = getattr(handle, "handles", None)
    if inner is not None:
        return {h.id for h in inner}
    return {handle.id}


_groups = fsdp_param_groups  # the module's FSDP parameter groups (tidal.state reads them too)


def zero_stage_of(model: torch.nn.Module) -> int | None:
    """The stage :func:`shard_model` applied, or None for a model it did not shard."""
    return getattr(model, _STAGE_ATTR, None)


def _fsdp_modules(model: torch.nn.Module) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def no_sync(model: torch.nn.Module) -> Iterator[None]:
    """Run non-final micro-batches of a gradient-accumulation step inside this block.

    Stages 0 and 1 skip the gradient reduction in the block and keep full local gradients
    (DDP's ``no_sync``; ZeRO-1 semantics); the next backward outside the block reduces the
    accumulated sum. Stages 2 and 3 reduce-scatter every micro-batch as ZeRO-2/3 do, so the
    block changes nothing. Memory at stages 0/1: full-size gradients until the final
    micro-batch's reduction.
    """
    stage = zero_stage_of(model)
    if stage is None:
        raise ValueError("no_sync() needs a model sharded by tidal.distributed.shard_model")
    if stage >= 2:
        yield
        return
    roots = _fsdp_modules(model)
    for m in roots:
        m.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        for m in roots:
            m.set_requires_gradient_sync(True, recurse=False)


def reshard(model: torch.nn.Module) -> None:
    """Free the unsharded parameters FSDP2 still holds (after a forward without backward at
    stages 0-2), so only the shards tidal moves remain. Cheap when nothing is unsharded."""
    for m in _fsdp_modules(model):
        m.reshard()


def local_state_bytes(model: torch.nn.Module) -> int:
    """Bytes of this rank's parameters and buffers (local shards of DTensors), deduplicated
    by storage: what a timeshare moves for the model part of a role."""
    return unique_storage_bytes(itertools.chain(model.parameters(), model.buffers()))
