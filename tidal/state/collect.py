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
from typing import Any, Iterable, Iterator, Literal, Sequence

import torch
from torch.nn.modules import module as nn_module
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from tidal.state.backends import counted_nbytes, releasable_in_place

__all__ = [
    "GradPolicy",
    "Kind",
    "ModuleSlots",
    "StateEntry",
    "collect_module_state",
    "collect_optimizer_state",
    "collect_tensors",
    "storage_key",
    "unique_storage_bytes",
]

GradPolicy = Literal["offload", "keep", "drop"]
Kind = Literal["param", "grad", "buffer", "optim"]


def storage_key(storage: torch.UntypedStorage) -> int:
    """A key that is stable for a storage's lifetime, across ``resize_`` (its C++ address)."""
    return storage._cdata


@dataclasses.dataclass
class StateEntry:
    """One storage of a role. ``nbytes`` is its size when resident; ``owner`` names the role
    (or other holder) it was collected for, for messages ("" when none was given)."""

    storage: torch.UntypedStorage
    key: int
    nbytes: int
    kind: Kind
    name: str
    owner: str = ""


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
    def __init__(
        self, device: torch.device | str, min_offload_bytes: int, include_empty: bool = False, owner: str = ""
    ) -> None:
        # Normalise: a str never equals a torch.device, and CPU tensors report "cpu" with no
        # index, so "cpu" or "cpu:0" as given would silently match nothing.
        dev = torch.device(device)
        self.device = torch.device("cpu") if dev.type == "cpu" else dev
        self.min_offload_bytes = min_offload_bytes
        # Empty storages are either offloaded already (the store knows them by key) or
        # freed by someone else (FSDP's unsharded params); callers that need to recognise the
        # former ask for them.
        self.include_empty = include_empty
        self.owner = owner
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
        nbytes = counted_nbytes(storage)  # 0 for a released storage (it keeps its size while guarded)
        if nbytes == 0 and not self.include_empty:
            return
        if 0 < nbytes < self.min_offload_bytes:
            return
        if not storage.resizable() and not releasable_in_place(storage):
            raise TypeError(
                f"{name}: its storage is not resizable (it wraps memory torch does not own, "
                f"e.g. from numpy, DLPack or a CUDA IPC handle), so tidal cannot free it; "
                f"clone it into a torch-owned tensor before adding the role"
            )
        self.entries[key] = StateEntry(storage, key, nbytes, kind, name, self.owner)


_STRUCTURE = [0]  # bumped whenever any module registers a module, parameter or buffer
_HOOKED: list = []


def _structure_changed(*args) -> None:
    _STRUCTURE[0] += 1


def _watch_structure() -> None:
    # torch's global registration hooks fire for every module of the process; they only
    # count, so a cached layout (ModuleSlots) knows when to look again. Installed once.
    if not _HOOKED:
        _HOOKED.extend(
            register(_structure_changed)
            for register in (
                nn_module.register_module_module_registration_hook,
                nn_module.register_module_parameter_registration_hook,
                nn_module.register_module_buffer_registration_hook,
            )
        )


class ModuleSlots:
    """Where ``modules`` keep their tensors: for every parameter and buffer, the module that
    holds it and its attribute name, found once (a module walk costs milliseconds for a large
    model) and found again only after some module, parameter or buffer is registered anywhere
    in the process. Reading a slot gives whatever tensor is there now, so a tensor replaced
    under the same name (``module.weight = ...``) is seen at once; a slot FSDP2 manages reads
    its shard, whether FSDP2 holds the sharded or the unsharded parameter there now. Modules whose ``named_parameters``/``named_buffers`` are
    their own (adapters that expose state held elsewhere) are walked every time."""

    def __init__(self, modules: Sequence[torch.nn.Module], *, verify: bool = False) -> None:
        _watch_structure()
        self.modules = list(modules)
        self.verify = verify  # debug: compare every read with a fresh walk (see named())
        self._generation = -1
        self._params: list[tuple[torch.nn.Module, str, str]] = []
        self._buffers: list[tuple[torch.nn.Module, str, str]] = []
        self._sharded: dict[tuple[int, str], Any] = {}  # (id(module), name) -> FSDP2's FSDPParam

    def _refresh(self) -> None:
        if self._generation == _STRUCTURE[0]:
            return
        params, buffers = [], []
        sharded: dict[tuple[int, str], Any] = {}
        for i, top in enumerate(self.modules):
            prefix = f"model{i}." if i else ""
            if _walks_itself(top):
                continue
            sharded.update(fsdp_param_slots(top))
            # The order of named_parameters / named_buffers(remove_duplicate=False).
            for mname, m in top.named_modules(remove_duplicate=False):
                dot = f"{prefix}{mname}." if mname else prefix
                params.extend((m, n, dot + n) for n in m._parameters)
                buffers.extend((m, n, dot + n) for n in m._buffers)
        self._params, self._buffers, self._sharded = params, buffers, sharded
        self._generation = _STRUCTURE[0]

    def _param(self, m: torch.nn.Module, n: str) -> torch.Tensor | None:
        """The parameter in slot ``n`` of ``m``: an FSDP2 one's shard (its ``DTensor``) also while
        FSDP2 has the unsharded one there (inside a forward, or a whole gather): what a role
        holds between turns, whatever FSDP2 is doing with the module now."""
        fp = self._sharded.get((id(m), n))
        return fp.sharded_param if fp is not None else m._parameters.get(n)

    def named(self) -> tuple[list[tuple[str, torch.Tensor]], list[tuple[str, torch.Tensor]]]:
        """(parameters, buffers) as (name, tensor), in registration order, duplicates kept;
        an FSDP2-managed parameter is always its shard (see :meth:`_param`)."""
        self._refresh()
        params = [(name, t) for m, n, name in self._params if (t := self._param(m, n)) is not None]
        buffers = [(name, t) for m, n, name in self._buffers if (t := m._buffers.get(n)) is not None]
        for i, top in enumerate(self.modules):
            if _walks_itself(top):
                prefix = f"model{i}." if i else ""
                params += [(prefix + n, p) for n, p in top.named_parameters(remove_duplicate=False)]
                buffers += [(prefix + n, b) for n, b in top.named_buffers(remove_duplicate=False)]
        if self.verify:
            self._check(params, buffers)
        return params, buffers

    def _check(self, params: list, buffers: list) -> None:
        """Raise RuntimeError if the cached slots list other tensors than a module walk."""

        def fresh_params(top: torch.nn.Module):
            if _walks_itself(top):
                return top.named_parameters(remove_duplicate=False)
            sharded = fsdp_param_slots(top)  # found again, as the walk is
            return [
                (f"{mname}." + n if mname else n, fp.sharded_param if (fp := sharded.get((id(m), n))) else p)
                for mname, m in top.named_modules(remove_duplicate=False)
                for n, p in m._parameters.items()
                if p is not None
            ]

        for what, cached, walk in (
            ("parameters", params, fresh_params),
            ("buffers", buffers, lambda m: m.named_buffers(remove_duplicate=False)),
        ):
            fresh = [((f"model{i}." if i else "") + n, t) for i, top in enumerate(self.modules) for n, t in walk(top)]
            got = [(n, id(t)) for n, t in cached]
            want = [(n, id(t)) for n, t in fresh]
            if got != want:
                diff = sorted({n for n, _ in set(got) ^ set(want)})
                raise RuntimeError(
                    f"the cached storage set is stale: its {what} differ from a module walk at "
                    f"{diff[:5]}. A tensor was registered without torch's registration hooks (e.g. "
                    f"written into module._parameters directly); register it with "
                    f"register_parameter / register_buffer / setattr instead"
                )


def fsdp_param_groups(module: torch.nn.Module) -> list:
    """An FSDP2 module's parameter groups (a list since torch 2.12, one or None before); none
    for any other module."""
    get_state = getattr(module, "_get_fsdp_state", None)
    if get_state is None:
        return []
    state = get_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [group] if group is not None else []


def fsdp_param_slots(top: torch.nn.Module) -> dict[tuple[int, str], Any]:
    """(id(module), attribute name) -> FSDP2's ``FSDPParam`` for every parameter FSDP2 manages
    under ``top``, tied ones under each of their names."""
    out: dict[tuple[int, str], Any] = {}
    for m in top.modules():
        for group in fsdp_param_groups(m):
            for fp in group.fsdp_params:
                info = fp._module_info
                out[(id(info.module), info.param_name)] = fp
                for shared, name in zip(info.shared_modules, info.shared_param_names):
                    out[(id(shared), name)] = fp
    return out


def _walks_itself(m: torch.nn.Module) -> bool:
    cls = type(m)
    return (
        cls.named_parameters is not torch.nn.Module.named_parameters
        or cls.named_buffers is not torch.nn.Module.named_buffers
    )


def unique_storage_bytes(tensors: Iterable[torch.Tensor | None], device: torch.device | None = None) -> int:
    """Bytes of the storages under ``tensors`` (on ``device`` only, when given), each storage
    once however many tensors view it; a DTensor counts its local shard; None entries are
    skipped. Offloaded storages count 0 (their device bytes are gone)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        local = t._local_tensor if hasattr(t, "_local_tensor") else t
        if device is not None and local.device != device:
            continue
        st = local.untyped_storage()
        seen[storage_key(st)] = counted_nbytes(st)
    return sum(seen.values())


def collect_tensors(
    tensors: Iterable[tuple[str, torch.Tensor, Kind]],
    device: torch.device,
    *,
    min_offload_bytes: int = 0,
    include_empty: bool = False,
    owner: str = "",
) -> list[StateEntry]:
    """Entries for (name, tensor, kind) as listed (a role's sources), each storage once, with
    the same rules as :func:`collect_module_state`; ``owner`` is recorded in each entry."""
    col = _Collector(device, min_offload_bytes, include_empty, owner)
    for name, t, kind in tensors:
        col.add(t, kind, name)
    return list(col.entries.values())


def collect_module_state(
    modules: Iterable[torch.nn.Module] | ModuleSlots,
    device: torch.device,
    *,
    extra_params: Iterable[torch.Tensor] = (),
    grads: GradPolicy = "offload",
    min_offload_bytes: int = 0,
    include_empty: bool = False,
) -> list[StateEntry]:
    """Entries for the parameters, buffers and (if ``grads == "offload"``) gradients of
    ``modules`` (or the modules of a :class:`ModuleSlots`, without walking them again) and of
    ``extra_params`` (parameters an optimizer holds outside the modules), in registration
    order, each storage once. ``include_empty`` also lists 0-byte storages (with
    ``nbytes == 0``), so offloaded ones can be recognised by key."""
    col = _Collector(device, min_offload_bytes, include_empty)
    slots = modules if isinstance(modules, ModuleSlots) else ModuleSlots(list(modules))
    params, buffers = slots.named()
    named: list[tuple[str, torch.Tensor]] = []
    for name, p in params:
        col.add(p, "param", name)
        named.append((name, p))
    for name, b in buffers:
        col.add(b, "buffer", name)
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
    params: Iterable[torch.Tensor] | None = None,
    owner: str = "",
) -> list[StateEntry]:
    """Entries for every tensor of ``optimizer.state`` on ``device`` (only the state of
    ``params``, when given), also inside lists and dicts. Raises ``TypeError`` for state tidal
    cannot move (sparse tensors, non-resizable storages, sets of tensors) before anything is
    moved. Non-tensor values stay untouched. ``owner`` is recorded in each entry."""
    names = names or {}
    col = _Collector(device, min_offload_bytes, include_empty, owner)
    for i, opt in enumerate(optimizers):
        items = opt.state.items() if params is None else ((p, opt.state[p]) for p in params if p in opt.state)
        for param, state in items:
            pname = names.get(id(param), f"param@{id(param):x}")
            if not isinstance(state, dict):
                raise TypeError(f"optimizer{i}.state[{pname}] is a {type(state).__name__}, expected a dict")
            for key, value in state.items():
                for t, where in _state_tensors(value, f"optimizer{i}.state[{pname}][{key!r}]"):
                    col.add(t, "optim", where)
    return list(col.entries.values())
