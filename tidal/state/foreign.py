"""What code that does not know tidal sees of state tidal has moved out.

Trainers, loggers and checkpointers call ``module.state_dict()``, ``optimizer.state_dict()``
and their ``load_state_dict`` at any time. Without help, an offloaded tensor (its storage
resized to 0 bytes) would be pickled as an empty storage (``torch.save`` then writes a file
that does not load) or read through a null pointer (a segfault on the CPU, an illegal-address
fault that poisons the CUDA context on a GPU).

The hooks installed here make both directions right wherever the state lives:

* ``state_dict()``: every value whose storage is offloaded is replaced by the same view of its
  host copy (a CPU tensor; a ``DTensor`` keeps its spec). No reload, no device memory, no copy:
  like any ``state_dict`` value, it aliases the live state (here, its host copy), so read it or
  save it before the next transition of that state.
* ``load_state_dict()``: a value for an offloaded tensor is written into its host copy (cast as
  ``copy_`` would), and the live tensor keeps its identity; the next reload brings the loaded
  bytes in. Values for resident tensors load as torch loads them.

Every other access to a moved-out tensor's bytes (``w.sum()``, ``print(w)``, ``w.numpy()``,
``model.double()``, ``copy.deepcopy(model)``, an optimizer moment, a gradient) raises
``RuntimeError`` with a message naming the role and the fix: the storage is guarded
(:mod:`tidal.guard`), and :class:`MovedOutMessages` writes what it says.

A *locator* is anything with ``host_tensor(t) -> Tensor | None`` (the host view of ``t`` if
its storage is offloaded there): an :class:`~tidal.state.store.OffloadStore`. The hooks take
the locator's lock (:func:`lock_of`) while they read it, so a ``state_dict()`` from another
thread never reads the store in the middle of a timeshare's transition.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any, Callable, Iterable, Protocol

import torch

from tidal.state.backends import holds_memory

__all__ = [
    "Locator",
    "MovedOutMessages",
    "install_module_hooks",
    "install_optimizer_hooks",
    "lock_of",
    "moved_out",
    "readable",
]

_LOCKS: "weakref.WeakKeyDictionary[Any, threading.RLock]" = weakref.WeakKeyDictionary()
_LOCKS_LOCK = threading.Lock()


def lock_of(locator: Any) -> threading.RLock:
    """The one re-entrant lock of ``locator`` (a store): held by the timeshare that owns it
    around every transition and by the state-dict hooks while they read it."""
    with _LOCKS_LOCK:
        lock = _LOCKS.get(locator)
        if lock is None:
            lock = _LOCKS[locator] = threading.RLock()
        return lock


class Locator(Protocol):
    def host_tensor(self, t: torch.Tensor) -> torch.Tensor | None: ...

    def will_write(self, t: torch.Tensor) -> None:
        """``t``'s device bytes are about to be written: a host copy kept valid is stale."""
        ...


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _local(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding ``t``'s bytes (a DTensor's local shard)."""
    return t if type(t) in _PLAIN else getattr(t, "_local_tensor", t)


def moved_out(t: torch.Tensor) -> bool:
    """``t`` has elements but its storage holds none of its bytes (offloaded, released in place
    by an address-stable backend, or freed by its owner)."""
    local = _local(t)
    return local.numel() > 0 and not holds_memory(local.untyped_storage())


def readable(store: Locator, t: torch.Tensor) -> torch.Tensor:
    """``t`` if its bytes are on the device; else the same view of its host copy (a
    ``DTensor`` rewrapped with its spec). An empty storage that the store does not hold (not
    tidal's) is returned as it is."""
    if not moved_out(t):
        return t
    local = _local(t)
    host = store.host_tensor(local)
    if host is None:
        return t
    if local is t:
        return host
    from torch.distributed.tensor import DTensor  # noqa: PLC0415 (only sharded state gets here)

    # Built directly: DTensor.from_local would move the host view to the mesh's device.
    return DTensor(host, t._spec, requires_grad=False)


def _write_host(store: Locator, live: torch.Tensor, value: Any, where: str) -> bool:
    """Write ``value`` into the host copy of ``live`` if ``live`` is offloaded; returns whether
    it did. Raises ``ValueError`` for a value that cannot be written there."""
    if not isinstance(value, torch.Tensor) or not moved_out(live):
        return False
    local = _local(live)
    host = store.host_tensor(local)
    if host is None:
        return False
    src = _local(value) if type(value) not in _PLAIN else value
    if (local is not live) != (src is not value):
        raise ValueError(
            f"{where}: the value and the offloaded tensor are not both plain or both sharded "
            f"(DTensor); load it while the role is resident (ts.load(name)), or pass a state dict "
            f"of the same kind as state_dict() returns"
        )
    if tuple(src.shape) != tuple(host.shape):
        return False  # torch reports the size mismatch itself
    host.copy_(src)
    return True


# ---- modules ----------------------------------------------------------------------------------
def _direct(module: torch.nn.Module):
    return itertools.chain(module._parameters.items(), module._buffers.items())


def _module_state_dict_hook(store: Locator, module, state_dict, prefix, local_metadata) -> None:
    for name, t in _direct(module):
        key = prefix + name
        value = state_dict.get(key)
        if t is not None and isinstance(value, torch.Tensor):
            state_dict[key] = readable(store, value)


def _module_load_hook(
    store: Locator, module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors
) -> None:
    for name, t in _direct(module):
        key = prefix + name
        if t is None or key not in state_dict:
            continue
        if _write_host(store, t, state_dict[key], key):
            # The bytes are in the host copy; torch's copy_ of a tensor into itself is a no-op,
            # so the offloaded tensor is neither read nor written, and keeps its identity.
            state_dict[key] = t
        else:
            store.will_write(t)  # torch copies into the resident tensor next


def install_module_hooks(store: Locator, modules: Iterable[torch.nn.Module]) -> list:
    """Make ``state_dict``/``load_state_dict`` of every module (and submodule) of ``modules``
    right while their tensors are offloaded in ``store``. Returns the hook handles."""
    handles = []
    seen: set[int] = set()
    for top in modules:
        for m in top.modules():
            if id(m) in seen:
                continue
            seen.add(id(m))
            handles.append(m.register_state_dict_post_hook(_bind(_module_state_dict_hook, store)))
            handles.append(m.register_load_state_dict_pre_hook(_bind(_module_load_hook, store)))
    return handles


class _Bound:
    """A hook calling ``fn(store, *args)`` under the store's lock. A module holding it can still
    be pickled (``torch.save(model)``) or deep-copied: the copy gets an inert hook, since it is
    no role's state (tidal does not move it)."""

    def __init__(self, fn: Callable, store: Locator) -> None:
        self.fn, self.store = fn, store

    def __call__(self, *args: Any) -> Any:
        with lock_of(self.store):
            return self.fn(self.store, *args)

    def __reduce__(self) -> tuple:
        return (_inert_hook, ())

    def __deepcopy__(self, memo: dict) -> Callable:
        return _inert_hook()


def _inert(*args: Any, **kwargs: Any) -> None:
    """What a tidal hook becomes in a pickled or deep-copied module: nothing."""
    return None


def _inert_hook() -> Callable:
    return _inert


def _bind(fn: Callable, store: Locator) -> Callable:
    return _Bound(fn, store)


# ---- optimizers -------------------------------------------------------------------------------
def _optimizer_state_dict_hook(store: Locator, optimizer, state_dict: dict) -> dict:
    state = state_dict.get("state", {})
    out: dict = {}
    for k, per_param in state.items():
        if isinstance(per_param, dict) and any(
            isinstance(v, torch.Tensor) and moved_out(v) for v in per_param.values()
        ):
            # A new dict: torch's state_dict() hands out the optimizer's own per-param dicts.
            per_param = {n: readable(store, v) if isinstance(v, torch.Tensor) else v for n, v in per_param.items()}
        out[k] = per_param
    return {**state_dict, "state": out}


def _optimizer_load_hook(store: Locator, optimizer, state_dict: dict) -> dict:
    saved_ids = [i for g in state_dict.get("param_groups", []) for i in g["params"]]
    params = [p for g in optimizer.param_groups for p in g["params"]]
    by_id = dict(zip(saved_ids, params))  # torch maps saved state to params in this order
    out: dict = {}
    for k, per_param in state_dict.get("state", {}).items():
        p = by_id.get(k)
        live = optimizer.state.get(p) if p is not None else None
        if isinstance(per_param, dict) and live:
            new = dict(per_param)
            for n, v in per_param.items():
                cur = live.get(n)
                # Handed back only where torch's load keeps it as it is (same dtype and device
                # as the param): a cast would read the offloaded tensor.
                keeps = (
                    isinstance(cur, torch.Tensor)
                    and cur.device == p.device
                    and (cur.dtype == p.dtype or not p.is_floating_point())
                )
                if keeps and _write_host(store, cur, v, f"optimizer state {k}.{n}"):
                    new[n] = cur
            per_param = new
        out[k] = per_param
    return {**state_dict, "state": out}


def install_optimizer_hooks(
    store: Locator, optimizer: torch.optim.Optimizer, after_load: Callable[[torch.optim.Optimizer], None] | None = None
) -> list:
    """Make ``optimizer.state_dict()``/``load_state_dict()`` right while its state is offloaded
    in ``store``. ``after_load(optimizer)`` runs after every load (the owner then settles state
    the load created on the device). Returns the hook handles."""
    handles = [
        optimizer.register_state_dict_post_hook(_bind(_optimizer_state_dict_hook, store)),
        optimizer.register_load_state_dict_pre_hook(_bind(_optimizer_load_hook, store)),
    ]
    if after_load is not None:
        handles.append(optimizer.register_load_state_dict_post_hook(after_load))
    return handles


# ---- what a guarded storage says --------------------------------------------------------------
class MovedOutMessages:
    """The ``describe`` of a timeshare's residency backend (:data:`tidal.state.backends.Describe`):
    the message every access to a moved-out storage raises, naming its role, the tensor, where
    its bytes are and what to do. Built once per (role, tensor, reason) and kept.

    ``timeshare`` is held weakly (the backend it serves belongs to it)."""

    def __init__(self, timeshare: Any) -> None:
        self._ts = weakref.ref(timeshare)
        self._cache: dict[tuple, bytes] = {}

    def __call__(self, storage: torch.UntypedStorage, why: str) -> bytes:
        ts = self._ts()
        entries = ts.store.offloaded_entries([storage._cdata]) if ts is not None else []
        entry = entries[0] if entries else None
        role = None
        if ts is not None and entry is not None and entry.owner:
            role = ts._roles.get(entry.owner)
        key = (
            entry.owner if entry is not None else "",
            entry.kind if entry is not None else "",
            entry.name if entry is not None else "",
            why,
            getattr(role, "optimizer_residency", None),
            bool(getattr(role, "optimizer_locked", False)),
            ts is not None and storage._cdata in ts.lent_keys,
        )
        msg = self._cache.get(key)
        if msg is None:
            msg = self._cache[key] = _message(*key).encode()
        return msg


def _message(owner: str, kind: str, name: str, why: str, residency: str | None, locked: bool, lent: bool) -> str:
    if not owner:
        return (
            "tidal: this tensor's bytes were moved to host memory by tidal, and its device storage holds none "
            "of them now. Make its role resident first (`with ts.use(role):`), or read its values through "
            "state_dict()"
        )
    what = {"param": "parameter", "buffer": "buffer", "grad": "gradient", "optim": "optimizer state"}.get(kind, kind)
    tensor = f"{what} {name}" if name else what
    use = f"`with ts.use({owner!r}):` (or after ts.load({owner!r}))"
    if why in ("arriving", "loading"):
        how = "prefetched" if why == "arriving" else "loaded"
        return (
            f"tidal: role {owner!r} is being {how}: the bytes of its {tensor} are still on their way to the "
            f"device. Use it inside {use}, which waits for them; or read its values through state_dict()"
        )
    if kind == "optim":
        read = "Read it through optimizer.state_dict() (the host copies, no reload)"
        if locked:
            return (
                f"tidal: the {tensor} of role {owner!r} is in host memory for the offload_optimizer() block; "
                f"it comes back when the block ends. {read}"
            )
        if residency in ("step", "stream"):
            return (
                f"tidal: the {tensor} of role {owner!r} is in host memory: with optimizer_residency={residency!r} "
                f"it stays there between optimizer.step() calls, and while the role is offloaded. {read}, or add "
                f"the role with optimizer_residency='role' to keep it on the device while the role is resident"
            )
        return f"tidal: role {owner!r} is offloaded: its {tensor} is in host memory. Use the role inside {use}. {read}"
    if lent:  # out while its role is resident: lent to a block (Timeshare.lending)
        return (
            f"tidal: the {tensor} of role {owner!r} is lent to host memory for a Timeshare.lending() block, "
            f"where the role's own code does not read it (an FSDP2 shard while the full parameters are gathered); "
            f"it comes back when the block ends. Read it after the block, or its values through state_dict()"
        )
    return (
        f"tidal: role {owner!r} is offloaded: its {tensor} has no device memory now (its bytes are in host "
        f"memory). Use the role inside {use}; to read its values without loading it, use state_dict()"
    )
