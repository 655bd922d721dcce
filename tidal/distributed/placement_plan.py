"""Placement planning without Ray: the spec (:class:`PlacementSpec` of :class:`GPURole` and
:class:`CPUWorker`), the bundles each colocation group and worker kind becomes, and the
per-node ledger of GPUs, CPUs and host memory that refuses a plan the cluster cannot hold.
:func:`tidal.distributed.placement.place` feeds it the live nodes and creates what it
decides; the rules are described there.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal, Sequence

from tidal.units import format_bytes

__all__ = ["CPUWorker", "GPURole", "PlacementError", "PlacementSpec"]

_FRACTION_STEP = 10_000  # Ray keeps resource amounts to 1e-4


class PlacementError(RuntimeError):
    """The cluster cannot hold the placement (now). ``missing`` lists each shortfall."""

    def __init__(self, message: str, *, missing: Sequence[str] = ()) -> None:
        self.missing = list(missing)
        super().__init__(message)


def _check_name(name: object, what: str) -> None:
    if not isinstance(name, str) or not name:
        raise ValueError(f"{what} name must be a non-empty string, got {name!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPURole:
    """A role that computes on GPUs: one worker per GPU.

    Attributes:
        name: unique among roles and workers.
        gpus: GPUs (= workers) of the role.
        colocate: colocation group; roles of one group share the same GPUs. ``None``: a group
            of its own, named after the role.
        cpus: CPUs each worker reserves.
        host_memory_bytes: host RAM each worker needs (its offloaded state, pinned).
    """

    name: str
    gpus: int = 1
    colocate: str | None = None
    cpus: float = 1.0
    host_memory_bytes: int = 0

    def __post_init__(self) -> None:
        _check_name(self.name, "GPURole")
        if self.colocate is not None:
            _check_name(self.colocate, "colocation group")
        if not isinstance(self.gpus, int) or self.gpus < 1:
            raise ValueError(f"GPURole {self.name!r}: gpus must be an int >= 1, got {self.gpus!r}")
        if self.cpus < 0 or self.host_memory_bytes < 0:
            raise ValueError(f"GPURole {self.name!r}: cpus and host_memory_bytes must be >= 0")

    @property
    def group(self) -> str:
        return self.colocate or self.name


@dataclasses.dataclass(frozen=True, kw_only=True)
class CPUWorker:
    """``count`` CPU-only workers of one kind (reward model on CPU, data loaders, ...)."""

    name: str
    count: int = 1
    cpus: float = 1.0
    memory_bytes: int = 0

    def __post_init__(self) -> None:
        _check_name(self.name, "CPUWorker")
        if not isinstance(self.count, int) or self.count < 1:
            raise ValueError(f"CPUWorker {self.name!r}: count must be an int >= 1, got {self.count!r}")
        if self.cpus < 0 or self.memory_bytes < 0:
            raise ValueError(f"CPUWorker {self.name!r}: cpus and memory_bytes must be >= 0")
        if self.cpus == 0 and self.memory_bytes == 0:
            raise ValueError(
                f"CPUWorker {self.name!r} reserves nothing (cpus=0, memory_bytes=0): "
                f"Ray cannot place an empty bundle; give it cpus or memory_bytes"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlacementSpec:
    """
    Attributes:
        roles, workers: what to place.
        gpu_resource: the Ray resource that counts GPUs (``"GPU"``; a custom resource on
            clusters that label accelerators differently, or in CPU tests).
        pack: ``"STRICT_PACK"`` keeps each colocation group on one node; ``"PACK"`` lets a
            group larger than a node span nodes.
        spread: ``"even"`` or ``"SPREAD"`` for CPU workers (see the module docstring).
        timeout_s: the most :func:`place` waits for Ray to place everything.
        name: prefix of the placement groups' names (visible in the Ray dashboard).
    """

    roles: Sequence[GPURole] = ()
    workers: Sequence[CPUWorker] = ()
    gpu_resource: str = "GPU"
    pack: Literal["STRICT_PACK", "PACK"] = "STRICT_PACK"
    spread: Literal["even", "SPREAD"] = "even"
    timeout_s: float = 60.0
    name: str = "tidal"

    def __post_init__(self) -> None:
        object.__setattr__(self, "roles", tuple(self.roles))
        object.__setattr__(self, "workers", tuple(self.workers))
        for x, cls in [(r, GPURole) for r in self.roles] + [(w, CPUWorker) for w in self.workers]:
            if not isinstance(x, cls):
                raise TypeError(f"expected a {cls.__name__}, got {type(x).__name__}: {x!r}")
        names = [r.name for r in self.roles] + [w.name for w in self.workers]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"names must be unique across roles and workers; repeated: {dupes}")
        if not names:
            raise ValueError("PlacementSpec has nothing to place: give roles and/or workers")
        if self.pack not in ("STRICT_PACK", "PACK"):
            raise ValueError(f"pack must be 'STRICT_PACK' or 'PACK', got {self.pack!r}")
        if self.spread not in ("even", "SPREAD"):
            raise ValueError(f"spread must be 'even' or 'SPREAD', got {self.spread!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        _check_name(self.gpu_resource, "gpu_resource")

    def groups(self) -> dict[str, list[GPURole]]:
        """Colocation groups in order of first appearance."""
        out: dict[str, list[GPURole]] = {}
        for r in self.roles:
            out.setdefault(r.group, []).append(r)
        return out


# ---- planning (pure: testable without Ray) ------------------------------------------------------
@dataclasses.dataclass
class _Node:
    node_id: str
    address: str
    free: dict[str, float]
    memory_total: float
    planned: list[str] = dataclasses.field(default_factory=list)

    @property
    def label(self) -> str:
        return f"node {self.node_id[:8]} ({self.address})"

    def shortfall(self, need: dict[str, float], gpu_resource: str) -> str | None:
        for key, amount in need.items():
            have = self.free.get(key, 0.0)
            if amount > have + 1e-9:
                if key == "memory":
                    return (
                        f"host memory: needs {format_bytes(amount)}, {format_bytes(have)} left of "
                        f"{format_bytes(self.memory_total)}"
                        + (f" (already planned there: {', '.join(self.planned)})" if self.planned else "")
                    )
                what = "GPUs" if key == gpu_resource else key
                return f"{what}: needs {amount:g}, {have:g} free"
        return None

    def take(self, need: dict[str, float], label: str) -> None:
        for key, amount in need.items():
            self.free[key] = self.free.get(key, 0.0) - amount
        self.planned.append(label)


@dataclasses.dataclass(frozen=True)
class _Group:
    """One Ray placement group to create."""

    key: str  # colocation group or "worker#round"
    bundles: tuple[dict[str, float], ...]
    strategy: str
    members: tuple[tuple[str, int], ...]  # (role or worker name, index) per bundle slot


def _bundle(gpu: float, cpus: float, memory: float, gpu_resource: str) -> dict[str, float]:
    b = {gpu_resource: gpu, "CPU": cpus, "memory": memory}
    return {k: float(v) for k, v in b.items() if v > 0}


def _plan_groups(spec: PlacementSpec, nodes: list[_Node]) -> list[_Group]:
    """Decide the placement groups and check them against ``nodes`` (mutated as a ledger).
    Raises PlacementError naming the shortfall."""
    out: list[_Group] = []
    groups = spec.groups()
    for gname, roles in sorted(groups.items(), key=lambda kv: -max(r.gpus for r in kv[1])):
        size = max(r.gpus for r in roles)
        bundles = []
        for i in range(size):
            on = [r for r in roles if r.gpus > i]
            bundles.append(_bundle(1, sum(r.cpus for r in on), sum(r.host_memory_bytes for r in on), spec.gpu_resource))
        _plan_pack(spec, gname, bundles, nodes)
        out.append(_Group(gname, tuple(bundles), spec.pack, ()))
    for w in spec.workers:
        out.extend(_plan_spread(spec, w, nodes))
    return out


def _plan_pack(spec: PlacementSpec, gname: str, bundles: list[dict], nodes: list[_Node]) -> None:
    what = f"colocation group {gname!r}"
    if spec.pack == "STRICT_PACK":
        need: dict[str, float] = {}
        for b in bundles:
            for k, v in b.items():
                need[k] = need.get(k, 0.0) + v
        fits = [n for n in nodes if n.shortfall(need, spec.gpu_resource) is None]
        if fits:
            best = max(fits, key=lambda n: n.free.get(spec.gpu_resource, 0.0))
            best.take(need, f"{gname!r} x{len(bundles)} GPU")
            return
        largest = max((n.free.get(spec.gpu_resource, 0.0) for n in nodes), default=0.0)
        if largest < len(bundles):
            msg = (
                f"{what} needs {len(bundles)} {_gpus(spec, len(bundles))} on one node; the largest node has "
                f"{largest:g} free"
            )
        else:
            reasons = "; ".join(f"{n.label}: {n.shortfall(need, spec.gpu_resource)}" for n in nodes)
            msg = f"{what} (needs {_fmt(need, spec)} on one node) fits on no node: {reasons}"
        raise PlacementError(msg + _hint(spec), missing=[msg])
    for i, b in enumerate(bundles):  # PACK: greedy, fullest-fitting node first
        fits = [n for n in nodes if n.shortfall(b, spec.gpu_resource) is None]
        if not fits:
            reasons = "; ".join(f"{n.label}: {n.shortfall(b, spec.gpu_resource)}" for n in nodes)
            msg = f"{what}: GPU {i} of {len(bundles)} (needs {_fmt(b, spec)}) fits on no node: {reasons}"
            raise PlacementError(msg + _hint(spec), missing=[msg])
        max(fits, key=lambda n: n.free.get(spec.gpu_resource, 0.0)).take(b, f"{gname!r} GPU {i}")


def _plan_spread(spec: PlacementSpec, w: CPUWorker, nodes: list[_Node]) -> list[_Group]:
    b = _bundle(0, w.cpus, w.memory_bytes, spec.gpu_resource)
    placed = {n.node_id: 0 for n in nodes}
    rounds: list[int] = []
    left = w.count
    while left:
        fits = [n for n in nodes if n.shortfall(b, spec.gpu_resource) is None]
        if not fits:
            reasons = "; ".join(f"{n.label}: {n.shortfall(b, spec.gpu_resource)}" for n in nodes)
            msg = (
                f"CPU workers {w.name!r}: {w.count - left} of {w.count} fit, the next "
                f"(needs {_fmt(b, spec)}) fits on no node: {reasons}"
            )
            raise PlacementError(msg + _hint(spec), missing=[msg])
        # Least-loaded first: the same order Ray's STRICT_SPREAD round has to honour anyway.
        fits.sort(key=lambda n: (placed[n.node_id], -n.free.get("CPU", 0.0)))
        take = fits[:left]
        for n in take:
            n.take(b, f"{w.name!r} worker")
            placed[n.node_id] += 1
        rounds.append(len(take))
        left -= len(take)
    if spec.spread == "SPREAD":
        return [_Group(w.name, tuple([b] * w.count), "SPREAD", tuple((w.name, i) for i in range(w.count)))]
    out, index = [], 0
    for r, size in enumerate(rounds):
        members = tuple((w.name, index + j) for j in range(size))
        strategy = "STRICT_SPREAD" if size > 1 else "PACK"
        out.append(_Group(f"{w.name}#{r}", tuple([b] * size), strategy, members))
        index += size
    return out


def _gpus(spec: PlacementSpec, n: float = 2) -> str:
    word = "GPU" if n == 1 else "GPUs"
    return word if spec.gpu_resource == "GPU" else f"{spec.gpu_resource!r} {word}"


def _fmt(need: dict[str, float], spec: PlacementSpec) -> str:
    parts = []
    for k, v in need.items():
        parts.append(
            f"{format_bytes(v)} host memory"
            if k == "memory"
            else f"{v:g} {_gpus(spec, v) if k == spec.gpu_resource else k}"
        )
    return ", ".join(parts)


def _hint(spec: PlacementSpec) -> str:
    return (
        ". Add nodes, lower the request, or use pack='PACK' to let a group span nodes"
        if spec.pack == "STRICT_PACK"
        else ". Add nodes or lower the request"
    )


def _fraction(k: int) -> float:
    return math.floor(_FRACTION_STEP / k) / _FRACTION_STEP


@dataclasses.dataclass(frozen=True)
class _Slot:
    group: str  # key of the _Group
    bundle: int
    gpu_fraction: float
    cpus: float
    memory_bytes: int


def _slots_for(spec: PlacementSpec, groups: list[_Group]) -> dict[tuple[str, int], _Slot]:
    slots: dict[tuple[str, int], _Slot] = {}
    for gname, roles in spec.groups().items():
        for r in roles:
            for i in range(r.gpus):
                k = sum(1 for o in roles if o.gpus > i)
                slots[(r.name, i)] = _Slot(gname, i, _fraction(k), r.cpus, r.host_memory_bytes)
    by_name = {w.name: w for w in spec.workers}
    for g in groups:
        for b, (name, index) in enumerate(g.members):
            w = by_name[name]
            slots[(name, index)] = _Slot(g.key, b, 0.0, w.cpus, w.memory_bytes)
    return slots


def _not_ready(spec: PlacementSpec, g: _Group, available: dict) -> PlacementError:
    need: dict[str, float] = {}
    for b in g.bundles:
        for k, v in b.items():
            need[k] = need.get(k, 0.0) + v
    avail = {k: v for k, v in available.items() if k in need}
    what = f"colocation group {g.key!r}" if not g.members else f"CPU workers {g.key!r}"
    msg = (
        f"{what} ({len(g.bundles)} bundles, {g.strategy}, {_fmt(need, spec)} in all) was not "
        f"placed within timeout_s={spec.timeout_s} s although the cluster's totals hold the "
        f"plan: other jobs or placement groups hold resources (available now: "
        f"{_fmt(avail, spec) or 'none of them'}), or a node left. Nothing was kept"
    )
    return PlacementError(msg, missing=[msg])
