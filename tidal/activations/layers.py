"""Which modules are the layer groups, and how checkpointing is applied or detected on them.

Layers are given explicitly (``layers=model.model.layers`` or any iterable of modules) or
found by class (``layer_cls=Qwen2DecoderLayer``, a tuple of classes, or class names as
strings). Every layer must be a submodule of the model, listed once, and no layer may contain
another (a group is one layer's forward; nested groups have no order).

Checkpointing: a layer counts as checkpointed by the user when Hugging Face's
``gradient_checkpointing`` flag is on for it (``model.gradient_checkpointing_enable``). Only
the non-reentrant variant composes with saved-tensor hooks; the reentrant one is refused here,
before any forward runs. The planner's RECOMPUTE modes checkpoint a layer themselves by
wrapping its ``forward`` in non-reentrant ``torch.utils.checkpoint`` for the duration of the
context (:class:`RecomputePatch`), and leave the user's own checkpointing alone.
"""

from __future__ import annotations

import functools
from typing import Any, Iterable, Sequence

import torch
import torch.nn as nn
import torch.utils.checkpoint as torch_checkpoint

__all__ = ["resolve_layers", "user_checkpointed", "check_checkpointing", "RecomputePatch", "REENTRANT_HELP"]

REENTRANT_HELP = (
    "use non-reentrant checkpointing instead: "
    "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False}) "
    "for Hugging Face models, or torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)"
)


def _class_matches(module: nn.Module, spec: Sequence[type | str]) -> bool:
    for s in spec:
        if isinstance(s, str):
            if type(module).__name__ == s or any(c.__name__ == s for c in type(module).__mro__):
                return True
        elif isinstance(module, s):
            return True
    return False


def resolve_layers(model: nn.Module, layers: Iterable[nn.Module] | None, layer_cls: Any) -> list[nn.Module]:
    """The layer groups, in the model's module order, validated."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if hasattr(model, "_orig_mod") or getattr(model, "_compiled_call_impl", None) is not None:
        raise TypeError(
            "activation offload does not support torch.compile'd models: the saved-tensor hooks "
            "and per-layer module hooks run in eager mode only; offload the eager model"
        )
    if (layers is None) == (layer_cls is None):
        raise ValueError(
            "give exactly one of layers= (the transformer blocks, e.g. model.model.layers) or "
            "layer_cls= (their class, a tuple of classes, or class names)"
        )
    all_modules = list(model.modules())
    if layers is not None:
        if isinstance(layers, nn.Module) and not isinstance(layers, (nn.ModuleList, nn.Sequential)):
            layers = [layers]
        found = list(layers)
        for i, m in enumerate(found):
            if not isinstance(m, nn.Module):
                raise TypeError(f"layers[{i}] is a {type(m).__name__}, not an nn.Module")
        ids = {id(m) for m in all_modules}
        missing = [i for i, m in enumerate(found) if id(m) not in ids]
        if missing:
            raise ValueError(
                f"layers {missing} are not submodules of the model: hooks on them would never "
                f"run in its forward; pass the blocks of this model (e.g. model.model.layers)"
            )
        if len({id(m) for m in found}) != len(found):
            raise ValueError("a layer is listed more than once; list each block once")
    else:
        spec = layer_cls if isinstance(layer_cls, (tuple, list)) else (layer_cls,)
        for s in spec:
            if not (isinstance(s, str) or (isinstance(s, type) and issubclass(s, nn.Module))):
                raise TypeError(f"layer_cls entries must be nn.Module classes or class names, got {s!r}")
        found = [m for m in all_modules if m is not model and _class_matches(m, spec)]
        # Outermost matches only: a block's sub-blocks of the same class are part of it.
        inside: set[int] = set()
        for m in found:
            for sub in m.modules():
                if sub is not m:
                    inside.add(id(sub))
        found = [m for m in found if id(m) not in inside]
        if not found:
            names = [s if isinstance(s, str) else s.__name__ for s in spec]
            raise ValueError(f"no submodule of the model is of class {names}; pass layers= instead")
    order = {id(m): i for i, m in enumerate(all_modules)}
    for m in found:
        for sub in m.modules():
            if sub is not m and id(sub) in {id(x) for x in found}:
                raise ValueError(
                    f"layer {type(m).__name__} contains another listed layer ({type(sub).__name__}); "
                    f"groups must not nest: list the outer blocks only"
                )
        if getattr(m, "_compiled_call_impl", None) is not None:
            raise TypeError(
                f"layer {type(m).__name__} is torch.compile'd (module.compile()); activation "
                f"offload runs in eager mode only"
            )
    return sorted(found, key=lambda m: order[id(m)])


def _hf_checkpoint_func(layer: nn.Module) -> Any:
    if getattr(layer, "gradient_checkpointing", False) is True:
        return getattr(layer, "_gradient_checkpointing_func", torch_checkpoint.checkpoint)
    return None


def user_checkpointed(layer: nn.Module) -> bool:
    """True if the user turned Hugging Face gradient checkpointing on for this layer."""
    return _hf_checkpoint_func(layer) is not None and layer.training


def check_checkpointing(layers: Sequence[nn.Module]) -> None:
    """Refuse checkpointing set-ups that cannot compose with the offload hooks."""
    for i, layer in enumerate(layers):
        func = _hf_checkpoint_func(layer)
        if func is None or not layer.training:
            continue
        keywords = func.keywords if isinstance(func, functools.partial) else {}
        inner = func.func if isinstance(func, functools.partial) else func
        reentrant = keywords.get("use_reentrant", True)  # torch's default when not given
        if reentrant is not False:
            raise ValueError(
                f"layer {i} ({type(layer).__name__}) uses reentrant gradient checkpointing "
                f"(use_reentrant={reentrant}). It cannot compose with activation offload: it runs "
                f"the layer under no_grad, saves the inputs through an autograd.Function after the "
                f"layer returns, and recomputes inside a nested backward, so the saved-tensor hooks "
                f"never see the layer's activations in order and prefetch cannot follow. "
                f"{REENTRANT_HELP}"
            )
        code = getattr(inner, "__code__", None)
        if code is not None and "save_on_cpu" in code.co_names:
            raise ValueError(
                f"layer {i} ({type(layer).__name__}) checkpoints with Hugging Face's offload=True, "
                f"which pushes torch's save_on_cpu hooks inside each layer; they would shadow "
                f"tidal's hooks (one saved-tensor hook stack, innermost wins). Enable checkpointing "
                f"without offload=True and let tidal offload the checkpointed inputs"
            )


class RecomputePatch:
    """Wraps the ``forward`` of chosen layers in non-reentrant checkpointing while active.

    The wrapper is an instance attribute, removed on :meth:`restore`; a checkpoint frame made
    during the forward keeps the original bound method, so recomputation in a backward that
    runs after the context exits still works. RNG state is preserved (dropout recomputes the
    same mask) and the recompute's determinism check stays on.
    """

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        self._patched: list[tuple[nn.Module, bool, Any]] = []
        for layer in layers:
            had = "forward" in layer.__dict__
            original = layer.forward
            self._patched.append((layer, had, layer.__dict__.get("forward")))

            def forward(*args: Any, __fn=original, **kwargs: Any) -> Any:
                if not torch.is_grad_enabled():
                    return __fn(*args, **kwargs)
                return torch_checkpoint.checkpoint(__fn, *args, use_reentrant=False, **kwargs)

            layer.forward = forward  # type: ignore[method-assign]

    def restore(self) -> None:
        for layer, had, previous in self._patched:
            if had:
                layer.forward = previous  # type: ignore[method-assign]
            else:
                layer.__dict__.pop("forward", None)
        self._patched = []
