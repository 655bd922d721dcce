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
            yield from _plain_tensors(getattr(t, attr), f"{name}.{attr}")
        return
    yield t, name


class _Collector:
    def __init__(self, device: torch.device | str, min_offload_bytes: int) -> None:
        # Normalise: a str never equals a torch.device, and CPU tensors report "cpu" with no
        # index, so "cpu" or "cpu:0" as given would silently match nothing.
        dev = torch.device(device)
        self.device = torch.device("cpu") if dev.type == "cpu" else dev
        self.min_offload_bytes = min_offload_bytes
        self.entries: dict[int, StateEntry] = {}

    def add(self, tensor: torch.Tensor, kind: Kind, name: str) -> None:
        for t, tname in _plain_tensors(tensor, name):
            if t.device != self.device:
                continue
            storage = t.untyped_storage()
            nbytes = storage.nbytes()
            if nbytes == 0 or nbytes < self.min_offload_bytes:
                continue
            key = storage_key(storage)
            if key in self.entries:
                continue
            if not storage.resizable():
                raise TypeError(
                    f"{tname}: its storage is not resizable (it wraps memory torch does not own, "
                    f"e.g. from numpy, DLPack or a CUDA IPC handle), so tidal cannot free it; "
                    f"clone it into a torch-owned tensor before adding the role"
                )
            self.entries[key] = StateEntry(storage, key, nbytes, kind, tname)


def collect_module_state(
    modules: Iterable[torch.nn.Module],
    device: torch.device,
    *,
    extra_params: Iterable[torch.Tensor] = (),
    grads: GradPolicy = "offload",
    min_offload_bytes: int = 0,
) -> list[StateEntry]:
    """Entries for the parameters, buffers and (if ``grads == "offload"``) gradients of
    ``modules`` and of ``extra_params`` (parameters an optimizer holds outside the modules),
    in registration order, each storage once."""
    col = _Collector(device, min_offload_bytes)
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


def _check_state_value(value: object, where: str) -> None:
    if isinstance(value, (list, tuple, set, dict)):
        inner = value.values() if isinstance(value, dict) else value
        if any(isinstance(v, torch.Tensor) for v in inner):
            raise TypeError(
                f"{where} holds a {type(value).__name__} of tensors; tidal moves tensors stored "
                f"directly as values of optimizer.state[param], not inside containers. Store each "
                f"tensor under its own key, or keep this optimizer out of the role"
            )


def collect_optimizer_state(
    optimizers: Iterable[torch.optim.Optimizer],
    device: torch.device,
    *,
    names: dict[int, str] | None = None,
    min_offload_bytes: int = 0,
) -> list[StateEntry]:
    """Entries for every tensor value of ``optimizer.state`` on ``device``. Raises
    ``TypeError`` for state tidal cannot move (tensors inside containers, sparse tensors)
    before anything is moved. Non-tensor values (ints, floats) stay untouched."""
    names = names or {}
    col = _Collector(device, min_offload_bytes)
    for i, opt in enumerate(optimizers):
        for param, state in opt.state.items():
            pname = names.get(id(param), f"param@{id(param):x}")
            if not isinstance(state, dict):
                raise TypeError(f"optimizer{i}.state[{pname}] is a {type(state).__name__}, expected a dict")
            for key, value in state.items():
                where = f"optimizer{i}.state[{pname}][{key!r}]"
                if isinstance(value, torch.Tensor):
                    col.add(value, "optim", where)
                else:
                    _check_state_value(value, where)
    return list(col.entries.values())
