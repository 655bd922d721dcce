"""State sources: what a role holds, how its use is refused while it is out, and what a copy of
its state must wait for.

A role is one or more sources plus its optimizers. A source lists the tensors it holds *now*
(their storages are what moves), installs the guards that refuse its use while the role is out,
and orders the current stream after any work of its own still in flight before a copy reads
its state. Modules are a source (:class:`ModuleSource`); so is a DeepSpeed engine
(``tidal.distributed.deepspeed``), and any object with these three methods can be::

    class MySource:
        def tensors(self, grads: bool) -> list[tuple[str, torch.Tensor, Kind]]: ...
        def install(self, store, guard) -> list: ...     # hook handles, removed at close()
        def before_copy(self) -> None: ...

``guard(where, tensors)`` is the timeshare's check, to be called before the source's state is
used: it raises if the role is out and any of ``tensors`` has no device memory (``tensors``
None: if the role is out at all). ``tensors`` may be a generator: it is read only while the
role is out, so a resident role's check costs one attribute test. ``tensors(grads)`` lists
(name, tensor, kind) with kind "param", "buffer" or "grad"; the role's optimizer state comes
from its optimizers, not from its sources.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Iterable, Protocol, Sequence

import torch

from tidal import guard as storage_guard
from tidal.state.collect import Kind, ModuleSlots
from tidal.state.foreign import _inert_hook, install_module_hooks

__all__ = ["Guard", "ModuleSource", "StateSource"]

Guard = Callable[[Any, "Iterable[torch.Tensor] | None"], None]


class StateSource(Protocol):
    def tensors(self, grads: bool) -> list[tuple[str, torch.Tensor, Kind]]:
        """What the source holds now; with ``grads`` the gradients that move with it too."""
        ...

    def install(self, store: Any, guard: Guard) -> list:
        """Install the guards (and whatever makes foreign access right while the state is
        out, e.g. state-dict hooks reading ``store``'s host copies); returns the handles."""
        ...

    def before_copy(self) -> None:
        """Order the current stream after the source's own work that may still write its
        state (a copy waits for the current stream)."""
        ...


class ModuleSource:
    """One or more ``nn.Module``: their parameters, buffers and (by the role's policy) the
    parameters' gradients, read through cached slots (:class:`ModuleSlots`).

    Guards: the state-dict hooks of ``tidal.state.foreign``, and forward pre-hooks that
    refuse a forward whose tensors are out, naming the role, before anything runs (a module
    shared with a resident role runs). With the storage guard (:mod:`tidal.guard`) only the
    top-level modules carry one: every moved-out storage raises its role's message at its
    first access anyway, so a block called directly is refused too, and nothing runs per
    submodule call (a hook on each of a 1.5B model's ~400 modules costs about 2 us each per
    forward: a few percent of a decoding step, where each generated token is one forward).
    Without it (``TIDAL_STORAGE_GUARD=off``, no compiler) every submodule carries one,
    checking its own tensors, as the only guard there is."""

    def __init__(self, modules: Sequence[torch.nn.Module], *, verify: bool = False) -> None:
        """``verify``: debug mode, every read of the cached slots is checked against a module
        walk (a walk per read: milliseconds on a large model)."""
        self.modules = list(modules)
        self._slots = ModuleSlots(self.modules, verify=verify)

    def tensors(self, grads: bool) -> list[tuple[str, torch.Tensor, Kind]]:
        params, buffers = self._slots.named()
        out: list[tuple[str, torch.Tensor, Kind]] = [(n, p, "param") for n, p in params]
        out += [(n, b, "buffer") for n, b in buffers]
        if grads:
            out += [(n + ".grad", p.grad, "grad") for n, p in params if p.grad is not None]
        return out

    def install(self, store: Any, guard: Guard) -> list:
        handles = []
        if storage_guard.available():
            # The top-level modules, checking all of their tensors (read only while the role
            # is out); a block called directly meets its storages' guards.
            for top in dict.fromkeys(self.modules):
                handles.append(top.register_forward_pre_hook(_ModuleGuard(guard, deep=True)))
            return handles + install_module_hooks(store, self.modules)
        seen: set[int] = set()
        for top in self.modules:
            # Every submodule: code that calls a block of the model directly is checked too,
            # not only the model's own forward.
            for m in top.modules():
                if id(m) not in seen:
                    seen.add(id(m))
                    handles.append(m.register_forward_pre_hook(_ModuleGuard(guard, deep=False)))
        return handles + install_module_hooks(store, self.modules)

    def before_copy(self) -> None:
        pass  # module state is written on the current stream only


class _ModuleGuard:
    """The forward pre-hook that refuses a module's forward while its tensors are out. A module
    holding it can still be pickled (``torch.save(model)``) or deep-copied: the copy is no
    role's state, so it gets an inert hook."""

    def __init__(self, guard: Guard, *, deep: bool) -> None:
        self.guard = guard
        self.deep = deep  # all of the module's tensors, or only its own (each submodule has a hook)

    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        if self.deep:
            tensors = itertools.chain(module.parameters(), module.buffers())
        else:
            tensors = (
                t for t in itertools.chain(module._parameters.values(), module._buffers.values()) if t is not None
            )
        self.guard(module, tensors)

    def __reduce__(self) -> tuple:
        return (_inert_hook, ())

    def __deepcopy__(self, memo: dict) -> Any:
        return _inert_hook()
