"""Find the storages that make up a role's state, deduplicated.

A role's state is every device storage reachable from its modules (parameters, buffers,
gradients) and its optimizers (every tensor value in ``optimizer.state``). Tensors are
reduced to their *storages*, so tied weights, views, non-contiguous tensors and slices of
one flat buffer are counted and moved once, and moving the whole storage keeps every view
valid. Wrapper subclasses (DTensor, quantised tensors) are opened with
``__tensor_flatten__`` down to their plain inner tensors.

Tensors on other devices (Adam's ``step`` on the CPU), empty storages, and storages smaller
than ``min_offload_bytes`` (scalars such as a fused Adam's device ``step``) are left where
they are: moving them costs time and saves nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Iterator, Literal

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

__all__ = ["StateEntry", "collect_module_state", "collect_optimizer_state", "storage_key", "GradPolicy"]

GradPolicy = Literal["offload", "keep", "drop"]
Kind = Literal["param", "grad", "buffer", "optim"]


def storage_key(storage: torch.UntypedStorage) -> int:
    """A key that is stable for a storage's lifetime, across ``resize_`` (its C++ address)."""
    return storage._cdata


@dataclasses.dataclass
class StateEntry:
    """One storage of a role. ``nbytes`` is its size when resident."""

    storage: torch.UntypedStorage
    key: int
    nbytes: int
    kind: Kind
    name: str


def _plain_tensors(t: torch.Tensor, name: str) -> Iterator[tuple[torch.Tensor, str]]:
    if t.layout != torch.strided:
        raise TypeError(
            f"{name}: tensors with layout {t.layout} cannot be offloaded (tidal moves strided "
            f"storages); keep this tensor out of the role, or convert it to dense"
        )
    if type(t) not in (torch.Tensor, torch.nn.Parameter) and is_traceable_wrapper_subclass(t):
        attrs, _ = t.__tensor_flatten__()
        for attr in attrs:
            inner = getattr(t, attr)
            # Flattening may also list opaque non-tensors (DTensor: its device mesh).
            if isinstance(inner, torch.Tensor):
                yield from _plain_tensors(inner, f"{name}.{attr}")
        return
    yield t, name


_PLAIN = (torch.Tensor, torch.nn.Parameter)


class _Collector:
    def __init__(self, device: torch.device | str, min_offload_bytes: int, include_empty: bool = False) -> None:
        # Normalise: a str never equals a torch.device, and CPU tensors report "cpu" with no
        # index, so "cpu" or "cpu:0" as given would silently match nothing.
        dev = torch.device(device)
        self.device = torch.device("cpu") if dev.type == "cpu" else dev
        self.min_offload_bytes = min_offload_bytes
        # Empty storages are either offloaded already (the store knows them by key) or
        # freed by someone else (FSDP's unsharded params); callers that need to recognise the
        # former ask for them.
        self.include_empty = include_empty
        self.entries: dict[int, StateEntry] = {}

    def add(self, tensor: torch.Tensor, kind: Kind, name: str) -> None:
        # Called for every tensor of a role at every transition: plain tensors skip the
        # generator, and the name is only formatted for a new storage.
        if type(tensor) in _PLAIN and tensor.layout == torch.strided:
            self._add_plain(tensor, kind, name)
        else:
            for t, tname in _plain_tensors(tensor, name):
                self._add_plain(t, kind, tname)

    def _add_plain(self, t: torch.Tensor, kind: Kind, name: str) -> None:
        if t.device != self.device:
            return
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.entries:
            return
        nbytes = storage.nbytes()
        if nbytes == 0 and not self.include_empty:
            return
        if 0 < nbytes < self.min_offload_bytes:
            return
        if not storage.resizable():
            raise TypeError(
                f"{name}: its storage is not resizable (it wraps memory torch does not own, "
                f"e.g. from numpy, DLPack or a CUDA IPC handle), so tidal cannot free it; "
                f"clone it into a torch-owned tensor before adding the role"
            )
        self.entries[key] = StateEntry(storage, key, nbytes, kind, name)


def collect_module_state(
    modules: Iterable[torch.nn.Module],
    device: torch.device,
    *,
    extra_params: Iterable[torch.Tensor] = (),
    grads: GradPolicy = "offload",
    min_offload_bytes: int = 0,
    include_empty: bool = False,
) -> list[StateEntry]:
    """Entries for the parameters, buffers and (if ``grads == "offload"``) gradients of
    ``modules`` and of ``extra_params`` (parameters an optimizer holds outside the modules),
    in registration order, each storage once. ``include_empty`` also lists 0-byte storages
    (with ``nbytes == 0``), so offloaded ones can be recognised by key."""
    col = _Collector(device, min_offload_bytes, include_empty)
    named: list[tuple[str, torch.Tensor]] = []
    for i, module in enumerate(modules):
        prefix = f"model{i}." if i else ""
        for name, p in module.named_parameters(remove_duplicate=False):
            col.add(p, "param", prefix + name)
            named.append((prefix + name, p))
        for name, b in module.named_buffers(remove_duplicate=False):
            col.add(b, "buffer", prefix + name)
    for i, p in enumerate(extra_params):
        col.add(p, "param", f"optimizer_param{i}")
        named.append((f"optimizer_param{i}", p))
    if grads == "offload":
        for name, p in named:
            if p.grad is not None:
                col.add(p.grad, "grad", name + ".grad")
    return list(col.entries.values())


def _state_tensors(value: object, where: str) -> Iterator[tuple[torch.Tensor, str]]:
    """Tensors in an optimizer state value, also inside lists, tuples and dicts (LBFGS keeps
    its history in lists). Other leaves (ints, floats, None) are not state tidal moves."""
    if isinstance(value, torch.Tensor):
        yield value, where
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _state_tensors(v, f"{where}[{i}]")
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _state_tensors(v, f"{where}[{k!r}]")
    elif isinstance(value, (set, frozenset)) and any(isinstance(v, torch.Tensor) for v in value):
        raise TypeError(
            f"{where} is a set of tensors; a set has no stable order to restore it by. "
            f"Keep optimizer state in tensors, lists or dicts"
        )


def collect_optimizer_state(
    optimizers: Iterable[torch.optim.Optimizer],
    device: torch.device,
    *,
    names: dict[int, str] | None = None,
    min_offload_bytes: int = 0,
    include_empty: bool = False,
) -> list[StateEntry]:
    """Entries for every tensor of ``optimizer.state`` on ``device``, also inside lists and
    dicts. Raises ``TypeError`` for state tidal cannot move (sparse tensors, non-resizable
    storages, sets of tensors) before anything is moved. Non-tensor values stay untouched."""
    names = names or {}
    col = _Collector(device, min_offload_bytes, include_empty)
    for i, opt in enumerate(optimizers):
        for param, state in opt.state.items():
            pname = names.get(id(param), f"param@{id(param):x}")
            if not isinstance(state, dict):
                raise TypeError(f"optimizer{i}.state[{pname}] is a {type(state).__name__}, expected a dict")
            for key, value in state.items():
                for t, where in _state_tensors(value, f"optimizer{i}.state[{pname}][{key!r}]"):
                    col.add(t, "optim", where)
    return list(col.entries.values())
