"""Strict access: any op that reads or writes a moved-out tensor raises a clear error.

Outside it, touching the bytes of a tensor whose storage tidal has offloaded (``w.sum()``,
``w.add_(1)``, ``w.numpy()``) raises ``RuntimeError`` with the same kind of message already,
at no cost per op, wherever tidal's storage guard could be built (:mod:`tidal.guard`);
without it such a read is undefined (a segfault on the CPU; on a GPU an illegal-address fault
that leaves the CUDA context unusable). Module forwards, ``state_dict()`` and
``load_state_dict()`` are guarded always (see ``tidal.state.foreign``); strict access checks
every op in Python, for debugging code that holds references to a role's tensors where there
is no storage guard, or to get :class:`StrictAccessError` (with the tensor's name) instead::

    with tidal.strict_access(ts):
        train_step()        # RuntimeError naming the role and the tensor, instead of a crash

How: a ``TorchDispatchMode`` that looks at every tensor argument of every aten op and refuses
one with elements whose storage has no memory. Metadata-only ops (views, ``detach``, ``set_``,
``resize_``, ...) pass, as does ``t.copy_(t)`` (a no-op torch skips). Cost: one Python call
per op plus a few attribute reads per tensor argument (measured in benchmarks/RESULTS.md);
use it to find the offending code, not in production.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from tidal.state.foreign import moved_out

__all__ = ["strict_access", "StrictAccessError"]

_aten = torch.ops.aten


class StrictAccessError(RuntimeError):
    """An op read or wrote a tensor whose storage tidal moved out (see :func:`strict_access`)."""


def _metadata_ops() -> frozenset:
    names = [
        "detach",
        "view",
        "_unsafe_view",
        "alias",
        "as_strided",
        "t",
        "transpose",
        "permute",
        "expand",
        "slice",
        "select",
        "unsqueeze",
        "squeeze",
        "split",
        "split_with_sizes",
        "chunk",
        "unbind",
        "narrow",
        "set_",
        "resize_",
        "_reshape_alias",
        "view_as_real",
        "view_as_complex",
        "lift_fresh",
        "empty_like",
        "new_empty",
        "new_empty_strided",
        "is_same_size",
        "sym_size",
        "sym_stride",
        "sym_numel",
        "sym_storage_offset",
        "_has_compatible_shallow_copy_type",
        "record_stream",
        "unfold",
        "diagonal",
        "movedim",
        "expand_as",
        "view_as",
        "real",
        "imag",
    ]
    ops = set()
    for n in names:
        packet = getattr(_aten, n, None)
        if packet is not None:
            ops.update(getattr(packet, o) for o in packet.overloads())
    return frozenset(ops)


_METADATA = _metadata_ops()


class _StrictMode(TorchDispatchMode):
    def __init__(self, timeshare: Any) -> None:
        super().__init__()
        self.timeshare = timeshare

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _METADATA and not (func in (_aten.copy_.default,) and args[0] is args[1]):
            leaves, _ = tree_flatten((args, kwargs))
            for t in leaves:
                if isinstance(t, torch.Tensor) and moved_out(t):
                    raise StrictAccessError(self._message(func, t))
            return func(*args, **kwargs)
        try:
            return func(*args, **kwargs)
        except RuntimeError as e:
            # A view of a storage released to size 0 (no storage guard) fails torch's bounds
            # check ("setStorage: ... out of bounds"): say what it is instead.
            leaves, _ = tree_flatten((args, kwargs))
            moved = next((t for t in leaves if isinstance(t, torch.Tensor) and moved_out(t)), None)
            if moved is None:
                raise
            raise StrictAccessError(self._message(func, moved)) from e

    def _message(self, func, t: torch.Tensor) -> str:
        what = f"a tensor of shape {tuple(t.shape)} ({t.dtype}, {t.device})"
        owner = _owner(self.timeshare, t)
        if owner is not None:
            role, name = owner
            return (
                f"{func} touches {name} of role {role!r}, which is offloaded (its bytes are on the "
                f"host; the device storage has no memory). Use the role inside "
                f"`with ts.use({role!r}):`, or read its values with state_dict()"
            )
        return (
            f"{func} touches {what} whose storage has no memory: it is offloaded (by tidal) or was "
            f"freed by its owner. Make its role resident first, or read it through state_dict()"
        )


def _owner(ts: Any, t: torch.Tensor) -> tuple[str, str] | None:
    if ts is None:
        return None
    key = t.untyped_storage()._cdata
    for name in ts.roles:
        role = ts.role(name)
        for i, m in enumerate(role.modules):
            for n, x in list(m.named_parameters()) + list(m.named_buffers()):
                if x.untyped_storage()._cdata == key:
                    return name, n
                if x.grad is not None and x.grad.untyped_storage()._cdata == key:
                    return name, n + ".grad"
        for o in role.optimizers:
            for st in o.state.values():
                for k, v in st.items():
                    if isinstance(v, torch.Tensor) and v.untyped_storage()._cdata == key:
                        return name, f"optimizer state {k!r}"
    return None


@contextlib.contextmanager
def strict_access(timeshare: Any = None) -> Iterator[None]:
    """Within the block, an op that touches a moved-out tensor raises
    :class:`StrictAccessError` (a ``RuntimeError``) instead of reading freed memory. Pass the
    :class:`~tidal.Timeshare` to have the error name the role and tensor. Thread-local (as
    torch's dispatch modes are): it covers the calling thread."""
    with _StrictMode(timeshare):
        yield
