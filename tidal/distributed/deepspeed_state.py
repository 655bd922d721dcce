"""A DeepSpeed engine's device state, found for tidal's store (used by
:mod:`tidal.distributed.deepspeed`; DeepSpeed is imported only when an engine is checked).

What an engine holds on the device between steps, and how each part is found:

- the module's parameters, their gradients and its buffers. At ZeRO-1/2 the 16-bit
  params are views into one flat buffer per group (``bit16_groups_flat``): the whole buffer,
  alignment padding included, is one storage and moves once. At ZeRO-3 a param's own storage
  is empty unless it is persistent (small params stay gathered); its partition is ``ds_tensor``,
  a view into the flat ``lp_param_buffer``.
- the fp32 master partitions (``single_partition_of_fp32_groups`` at ZeRO-1/2,
  ``fp32_partitioned_groups_flat`` at ZeRO-3, per-param fp32 copies at stage 0): they are the
  params of the inner torch optimizer, so they move as that optimizer's parameters.
- the inner torch optimizer's state (``exp_avg``, ``exp_avg_sq``, keyed by the fp32 partitions):
  the role's optimizer state, so ``optimizer_residency`` applies to it.
- DeepSpeed's own buffers: gradient partitions (ZeRO-3's persistent
  ``grad_partitions_flat_buffer``; ZeRO-1/2's ``averaged_gradients`` and ipg buckets while
  gradients are being accumulated), ZeRO-3's reduce bucket (``ipg_buckets[dtype].buffer``,
  ``reduce_bucket_size`` elements, kept for the engine's life; its contents are dead between
  steps, but it is moved like the rest, which costs its bytes each way), the param coordinator's and
  the parameters' own tensors (``ds_tensor``, ``ds_secondary_tensor``, ``grad_accum``). These
  are found by walking the engine's object graph (DeepSpeed's objects, lists, dicts; never
  into torch modules or optimizers) at every transition, so buffers DeepSpeed creates or drops
  between steps are always the ones moved, and a DeepSpeed release that renames an attribute
  does not leave memory behind silently.
"""

from __future__ import annotations

import functools
import types

import torch
import torch.utils.hooks

from tidal.units import format_bytes
from tidal.state.collect import collect_optimizer_state, collect_tensors

__all__ = ["deepspeed_state_bytes", "describe_deepspeed_state"]

# The walk over DeepSpeed's objects: deep enough for ipg_buckets[dtype].buffer[i] and
# param._hp_mapping.optim_fragment[key]; a cycle or a deep unrelated structure stops here.
_MAX_DEPTH = 8
_LEAVES = (int, float, bool, str, bytes, complex, type(None))
# Exact types never walked into (a set lookup is the walk's cheapest test): scalars, and the
# functions, bound methods and hook handles DeepSpeed attaches to every parameter.
_LEAF_TYPES = frozenset(
    _LEAVES
    + (
        types.FunctionType,
        types.MethodType,
        types.BuiltinFunctionType,
        functools.partial,
        torch.Size,
        torch.dtype,
        torch.device,
        torch.utils.hooks.RemovableHandle,
    )
)
# Engine attributes that are the user's, not the engine's state.
_SKIP_ENGINE_ATTRS = frozenset({"_modules", "_parameters", "_buffers", "training_dataloader"})
_SKIP_PARAM_ATTRS = frozenset({"_hp_mapping"})
# Streams DeepSpeed keeps (torch.cuda.Stream is a class on every build: a stub without CUDA).
_STREAM_TYPES = (torch.Stream, torch.cuda.Stream)


def _import_deepspeed():
    try:
        import deepspeed
    except ImportError as e:
        raise ImportError(
            "tidal's DeepSpeed adapter needs the deepspeed package; install it with "
            '`pip install "tidal[deepspeed]"` (DS_BUILD_OPS=0 builds it without compiling ops)'
        ) from e
    return deepspeed


def _check_engine(engine: object) -> None:
    _import_deepspeed()
    from deepspeed.runtime.engine import DeepSpeedEngine

    if not isinstance(engine, DeepSpeedEngine):
        raise TypeError(
            f"engine must be a deepspeed.runtime.engine.DeepSpeedEngine (what deepspeed.initialize "
            f"returns first), got {type(engine).__name__}"
        )


def _inner_optimizer(engine) -> torch.optim.Optimizer | None:
    """The torch optimizer that owns the master weights and moments: DeepSpeed wraps it one
    level deep (ZeRO-1/2/3, fp16/bf16 wrappers) or uses it as is (fp32, stage 0)."""
    opt = engine.optimizer
    for _ in range(4):
        if opt is None or isinstance(opt, torch.optim.Optimizer):
            return opt
        opt = getattr(opt, "optimizer", None)
    return None


def _deepspeed_fields(obj: object):
    # Only DeepSpeed's own objects are opened (buckets, coordinators, loss scalers): a torch
    # module, optimizer, process group or the user's objects are not the engine's state.
    if isinstance(obj, type) or not type(obj).__module__.startswith("deepspeed."):
        return None
    fields = getattr(obj, "__dict__", None)
    return fields.items() if isinstance(fields, dict) else None


def _path_name(path: tuple) -> str:
    parts: list[str] = []
    while path:
        path, key = path
        if isinstance(key, str):
            parts.append(f".{key}")
        elif isinstance(key, torch.Tensor):
            parts.append(f"[tensor{tuple(key.shape)}]")
        else:
            parts.append(f"[{key!r}]" if isinstance(key, (int, float, torch.dtype)) else f"[{type(key).__name__}]")
    return "".join(reversed(parts)).lstrip(".")


def _walk(engine) -> tuple[dict[int, tuple[torch.Tensor, tuple]], list]:
    """The engine's own tensors: every tensor reachable from the engine's attributes and from
    DeepSpeed's attributes on its parameters, through lists, tuples, dicts and DeepSpeed's
    objects (never into a torch module or optimizer: the role collects those itself).

    Returns ``{storage key: (a tensor on it, its path)}`` (one entry per storage; the path is
    a linked tuple, named by :func:`_path_name` only where needed) and the streams found.
    """
    found: dict[int, tuple[torch.Tensor, tuple]] = {}
    streams: list = []
    seen: set[int] = set()
    stack: list[tuple[object, tuple, int]] = []
    for key, value in vars(engine).items():
        if key not in _SKIP_ENGINE_ATTRS and type(value) not in _LEAF_TYPES:
            stack.append((value, ((), f"engine.{key}"), 1))
    # Attributes DeepSpeed hangs on the parameters: ZeRO-3's partition (ds_tensor) and hpZ
    # copy, gradient accumulators. _hp_mapping holds only views of the flat 16-bit buffer, the
    # masters and the moments, all collected elsewhere: skipped, it is most of the walk.
    for name, p in engine.module.named_parameters():
        for key, value in vars(p).items():
            if key not in _SKIP_PARAM_ATTRS and type(value) not in _LEAF_TYPES:
                stack.append((value, ((), f"param[{name}].{key}"), 1))
    while stack:
        obj, path, depth = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            # The storage is what moves; a tensor's own attributes are not walked.
            found.setdefault(obj.untyped_storage()._cdata, (obj, path))
            continue
        if isinstance(obj, _STREAM_TYPES):
            streams.append(obj)
            continue
        if depth >= _MAX_DEPTH or isinstance(obj, (torch.nn.Module, torch.optim.Optimizer)):
            continue
        if isinstance(obj, dict):
            items = obj.items()
        elif isinstance(obj, (list, tuple)):
            items = enumerate(obj)
        else:
            items = _deepspeed_fields(obj)
            if items is None:
                continue
        depth += 1
        for key, value in items:
            if type(value) not in _LEAF_TYPES:
                stack.append((value, (path, key), depth))
    return found, streams


def _optimizer_storage_keys(opt: torch.optim.Optimizer | None) -> set[int]:
    """Storages the role already collects as the inner optimizer's params and state."""
    keys: set[int] = set()
    if opt is None:
        return keys
    for group in opt.param_groups:
        for p in group["params"]:
            keys.add(p.untyped_storage()._cdata)
            if p.grad is not None:
                keys.add(p.grad.untyped_storage()._cdata)
    for state in opt.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                keys.add(value.untyped_storage()._cdata)
    return keys


class EngineSource:
    """A DeepSpeed engine as a role's state source (:class:`tidal.state.sources.StateSource`):
    the wrapped module's parameters, their gradients and its buffers, then the tensors DeepSpeed
    keeps itself (gradient buckets and partitions, ZeRO-3's partitions and coordinator buffers),
    looked up each time, so it lists what exists *now*. The inner optimizer's parameters (the
    fp32 masters) and state are left out: the role collects those as its optimizer's, so
    ``optimizer_residency`` applies. Every gradient DeepSpeed holds moves with the role
    (dropping one would break its accumulation), whatever the role's grads policy says.

    Guard: the engine's forward and, ahead of DeepSpeed's own hooks, the wrapped module's
    (ZeRO-3's pre-forward hook would gather from empty partitions before any later hook)
    refuse to run while the role is out. Not per tensor: ZeRO-3 frees and regathers its
    parameters' storages itself.

    Before a copy, the current stream waits for DeepSpeed's side streams (reduction,
    all-gather): the copies wait for the current stream, so they then also wait for any
    gradient reduction or parameter gather DeepSpeed left in flight (no host blocking).
    """

    def __init__(self, engine: torch.nn.Module, inner: torch.optim.Optimizer | None) -> None:
        self.engine = engine
        self.inner = inner

    def tensors(self, grads: bool) -> list[tuple[str, torch.Tensor, str]]:
        engine = self.engine
        found, _ = _walk(engine)
        skip = _optimizer_storage_keys(self.inner)
        out: list[tuple[str, torch.Tensor, str]] = []
        for name, p in engine.module.named_parameters(remove_duplicate=False):
            out.append((f"module.{name}", p, "param"))
            if p.grad is not None and p.grad.untyped_storage()._cdata not in skip:
                out.append((f"module.{name}.grad", p.grad, "grad"))
        out += [(f"module.{name}", b, "buffer") for name, b in engine.module.named_buffers(remove_duplicate=False)]
        out += [(_path_name(path), t, "buffer") for key, (t, path) in found.items() if key not in skip]
        return out

    def install(self, store, guard) -> list:
        def hook(module, args):
            guard(self.engine, None)

        return [
            self.engine.register_forward_pre_hook(hook),
            self.engine.module.register_forward_pre_hook(hook, prepend=True),
        ]

    def before_copy(self) -> None:
        _, streams = _walk(self.engine)
        if streams:
            device = _engine_device(self.engine)
            current = torch.get_device_module(device).current_stream(device)
            for s in streams:
                # DeepSpeed's side streams may still write gradient or parameter buffers; the
                # copies that move them wait for the current stream, so it waits for these.
                if s.device == current.device:
                    current.wait_stream(s)


def _engine_device(engine) -> torch.device:
    dev = torch.device(engine.device)
    if dev.type != "cpu" and dev.index is None:
        dev = torch.device(dev.type, torch.get_device_module(dev.type).current_device())
    return dev


def _entries(engine, min_offload_bytes: int) -> list:
    device = _engine_device(engine)
    inner = _inner_optimizer(engine)
    params = [p for g in inner.param_groups for p in g["params"]] if inner is not None else []
    source = EngineSource(engine, inner)
    source.before_copy()
    tensors = source.tensors(True)
    for i, p in enumerate(params):  # as the role lists them: the masters, and their grads
        tensors.append((f"optimizer_param{i}", p, "param"))
        if p.grad is not None:
            tensors.append((f"optimizer_param{i}.grad", p.grad, "grad"))
    entries = collect_tensors(tensors, device, min_offload_bytes=min_offload_bytes)
    if inner is not None:
        keys = {e.key for e in entries}
        entries += [
            e
            for e in collect_optimizer_state([inner], device, min_offload_bytes=min_offload_bytes)
            if e.key not in keys
        ]
    return entries


def deepspeed_state_bytes(engine: torch.nn.Module, *, min_offload_bytes: int = 16) -> int:
    """Bytes of a DeepSpeed engine's state on its device now, each storage once: what
    :func:`add_deepspeed_role` moves (0 for what is offloaded). Storages smaller than
    ``min_offload_bytes`` (scalars, which stay put) are left out, as a timeshare with the
    default ``TimeshareConfig`` does."""
    _check_engine(engine)
    return sum(e.nbytes for e in _entries(engine, min_offload_bytes))


def describe_deepspeed_state(engine: torch.nn.Module) -> str:
    """One line per device storage of the engine's state: bytes, kind and the path that
    reaches it (``engine.optimizer.ipg_buckets[torch.bfloat16].buffer``), largest first. A
    debugging aid: what :func:`add_deepspeed_role` would move now."""
    _check_engine(engine)
    rows = sorted(_entries(engine, 0), key=lambda e: -e.nbytes)
    return "\n".join(f"{format_bytes(e.nbytes):>12}  {e.kind:<6}  {e.name}" for e in rows)
