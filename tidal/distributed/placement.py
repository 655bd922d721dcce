"""Placement on a Ray cluster: colocated GPU roles packed onto the same GPUs, CPU workers spread
across nodes, host memory accounted per node by tidal itself.

Describe what runs, then place it::

    spec = PlacementSpec(
        roles=[GPURole(name="actor_train", gpus=2, colocate="actor", host_memory_bytes=8 << 30),
               GPURole(name="rollout", gpus=2, colocate="actor", host_memory_bytes=8 << 30)],
        workers=[CPUWorker(name="reward", count=4, cpus=1, memory_bytes=2 << 30)],
        timeout_s=60)
    with place(spec) as placement:
        a = TrainActor.options(**placement.options_for("actor_train", index=0)).remote()

Contract:

- **Colocation.** The roles of one colocation group share its GPUs: one placement group per
  group, one bundle per GPU (``{GPU: 1}`` plus the CPUs and host memory of the roles on it),
  ``STRICT_PACK`` (one node) by default. Role ``r`` runs one worker per GPU (``index`` 0 to
  ``r.gpus - 1`` on bundles 0 to ``r.gpus - 1``) asking ``1 / k`` of the GPU where ``k`` roles
  share the bundle. Ray's fractions isolate nothing: taking turns on the GPU is the job of the
  timeshare or the cross-process lease (:mod:`tidal.distributed.lease`);
  :meth:`Placement.lease_name` names one arbiter per GPU.
- **Spread.** ``spread="even"`` (default) places a worker type in rounds of ``STRICT_SPREAD``
  placement groups (one bundle per eligible node each round), so per-node counts differ by at
  most one whatever Ray's heuristics; ``"SPREAD"`` is one best-effort Ray ``SPREAD`` group.
- **Host memory.** Ray's resources are logical; tidal plans where every bundle goes against
  each node's ``memory`` resource (what Ray measured at node start, or what the node was
  started with), refuses a plan that oversubscribes a node before creating anything, reserves
  the bytes in the bundles (so Ray's own packing respects them), and checks the real layout
  again once the groups are placed.
- **Errors, never a hang.** What the cluster cannot hold raises :class:`PlacementError` at
  once, naming what is missing ("colocation group 'actor' needs 2 GPUs on one node; the
  largest node has 1"). Anything the pre-check cannot see (resources held by other jobs) is
  caught by waiting at most ``timeout_s``: the groups are removed and the error says which
  group was not placed and what the cluster has available.

Errors: a malformed spec raises ``ValueError``/``TypeError`` when built; a cluster that cannot
hold a valid spec raises :class:`PlacementError`, a ``RuntimeError`` (the same spec can succeed
on a larger or less busy cluster, so it is a condition of the cluster, not a user bug).

The planning (spec, bundles, the per-node ledger) is pure Python in
:mod:`tidal.distributed.placement_plan`, testable without Ray; this module talks to Ray. Ray is
imported on first use (extra ``tidal[ray]``); importing tidal never imports it.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

from tidal.distributed.placement_plan import (
    CPUWorker,
    GPURole,
    PlacementError,
    PlacementSpec,
    _Node,
    _not_ready,
    _plan_groups,
    _Slot,
    _slots_for,
)
from tidal.units import format_bytes

if TYPE_CHECKING:  # pragma: no cover
    from ray.util.placement_group import PlacementGroup

__all__ = ["CPUWorker", "GPURole", "Placement", "PlacementError", "PlacementSpec", "place"]


def _cluster_nodes() -> list[_Node]:
    import ray  # noqa: PLC0415  (optional dependency: tidal[ray])

    if not ray.is_initialized():
        raise PlacementError(
            "Ray is not initialised in this process: call ray.init(address=...) "
            "(or ray.init() for a local cluster) before place()"
        )
    nodes = []
    for n in ray.nodes():
        if not n.get("Alive"):
            continue
        res = {k: float(v) for k, v in n.get("Resources", {}).items() if not k.startswith("node:")}
        nodes.append(_Node(n["NodeID"], n.get("NodeManagerAddress", "?"), res, res.get("memory", 0.0)))
    return nodes


class Placement:
    """Placement groups created by :func:`place`, and how to launch actors into them.

    Removing it (:meth:`remove`, or leaving ``with``) frees the reservations; actors still
    running in them are killed by Ray.
    """

    def __init__(
        self,
        spec: PlacementSpec,
        pgs: dict[str, "PlacementGroup"],
        slots: dict[tuple[str, int], _Slot],
        bundle_nodes: dict[str, dict[int, str]],
        nodes: list[_Node],
    ) -> None:
        self.spec = spec
        self.placement_groups = pgs
        self._slots = slots
        self._bundle_nodes = bundle_nodes
        self._nodes = {n.node_id: n for n in nodes}
        self.removed = False

    def count(self, name: str) -> int:
        """Workers of a role (its GPUs) or of a CPU worker kind."""
        n = sum(1 for (nm, _) in self._slots if nm == name)
        if not n:
            raise ValueError(f"no role or worker named {name!r}; placed: {self.names}")
        return n

    @property
    def names(self) -> list[str]:
        return list(dict.fromkeys(nm for nm, _ in self._slots))

    def _slot(self, name: str, index: int) -> _Slot:
        if self.removed:
            raise ValueError("this placement was removed; place the spec again")
        slot = self._slots.get((name, index))
        if slot is None:
            raise ValueError(
                f"no worker {name!r}[{index}]: {name!r} has {self.count(name)} (indices 0 to {self.count(name) - 1})"
            )
        return slot

    def options_for(self, name: str, index: int = 0) -> dict:
        """Keyword arguments for ``ActorClass.options(**...)`` (or a task's) that run worker
        ``index`` of role or worker ``name`` in its bundle, with its share of the GPU, its CPUs
        and its host memory reserved. (Child tasks are not captured into the group: a child
        asking for a CPU the bundle does not have would wait forever.)"""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # noqa: PLC0415

        slot = self._slot(name, index)
        opts: dict = {
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.placement_groups[slot.group], placement_group_bundle_index=slot.bundle
            ),
            "num_cpus": slot.cpus,
        }
        if slot.gpu_fraction:
            if self.spec.gpu_resource == "GPU":
                opts["num_gpus"] = slot.gpu_fraction
            else:
                opts["resources"] = {self.spec.gpu_resource: slot.gpu_fraction}
        if slot.memory_bytes:
            opts["memory"] = slot.memory_bytes
        return opts

    def node_of(self, name: str, index: int = 0) -> str:
        """The Ray node id worker ``index`` of ``name`` will run on."""
        slot = self._slot(name, index)
        return self._bundle_nodes[slot.group][slot.bundle]

    def lease_name(self, name: str, index: int = 0) -> str:
        """A name shared by every worker on the same GPU bundle: the Ray actor name of that
        GPU's lease arbiter (:func:`tidal.distributed.lease.start_lease_actor`)."""
        slot = self._slot(name, index)
        if not slot.gpu_fraction:
            raise ValueError(f"{name!r} is a CPU worker: it takes no turns on a GPU")
        return f"{self.spec.name}-lease:{slot.group}:{slot.bundle}"

    def layout(self) -> dict[str, list[str]]:
        """Node id -> the workers placed there (``"name[index]"``)."""
        out: dict[str, list[str]] = {}
        for (name, index), slot in self._slots.items():
            out.setdefault(self._bundle_nodes[slot.group][slot.bundle], []).append(f"{name}[{index}]")
        return out

    def host_memory_by_node(self) -> dict[str, int]:
        """Node id -> host memory bytes reserved there by this placement."""
        out: dict[str, int] = {}
        for slot in self._slots.values():
            node = self._bundle_nodes[slot.group][slot.bundle]
            out[node] = out.get(node, 0) + slot.memory_bytes
        return out

    def report(self) -> str:
        mem = self.host_memory_by_node()
        lines = []
        for node, workers in sorted(self.layout().items()):
            n = self._nodes.get(node)
            label = n.label if n else f"node {node[:8]}"
            total = format_bytes(n.memory_total) if n else "?"
            lines.append(
                f"{label}: host memory {format_bytes(mem.get(node, 0))} of {total}; {', '.join(sorted(workers))}"
            )
        return "\n".join(lines)

    def remove(self) -> None:
        if self.removed:
            return
        _remove_all(self.placement_groups.values())
        self.removed = True

    def __enter__(self) -> "Placement":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def _remove_all(pgs) -> None:
    from ray.util.placement_group import remove_placement_group  # noqa: PLC0415

    for pg in pgs:
        try:
            remove_placement_group(pg)
        except Exception:  # already gone (cluster shutting down): nothing left to free
            pass


def place(spec: PlacementSpec) -> Placement:
    """Create the placement groups of ``spec`` on the connected Ray cluster.

    Checks the plan against every alive node first (GPUs, CPUs, host memory) and raises
    :class:`PlacementError` naming the shortfall before creating anything; then waits at most
    ``spec.timeout_s`` for Ray to place every group, and on a timeout removes what it created
    and raises :class:`PlacementError`. Finally checks the host memory of the real layout.
    """
    import ray  # noqa: PLC0415
    from ray.util.placement_group import placement_group, placement_group_table  # noqa: PLC0415

    if not isinstance(spec, PlacementSpec):
        raise TypeError(f"place() takes a PlacementSpec, got {type(spec).__name__}")
    nodes = _cluster_nodes()
    if not nodes:
        raise PlacementError("the Ray cluster has no alive node")
    groups = _plan_groups(spec, [dataclasses.replace(n, free=dict(n.free), planned=[]) for n in nodes])
    deadline = time.monotonic() + spec.timeout_s
    pgs: dict[str, PlacementGroup] = {}
    try:
        for g in groups:
            pgs[g.key] = placement_group(list(g.bundles), strategy=g.strategy, name=f"{spec.name}:{g.key}")
        for g in groups:  # all were submitted at once; wait for each within the one deadline
            if not _wait_ready(pgs[g.key], deadline):
                raise _not_ready(spec, g, ray.available_resources())
        bundle_nodes = {key: dict(placement_group_table(pg)["bundles_to_node_id"]) for key, pg in pgs.items()}
        placement = Placement(spec, pgs, _slots_for(spec, groups), bundle_nodes, nodes)
        _check_memory(placement, nodes)
    except BaseException:
        _remove_all(pgs.values())
        raise
    return placement


def _wait_ready(pg: "PlacementGroup", deadline: float) -> bool:
    # PlacementGroup.wait() truncates its timeout to whole seconds (Ray 2.x): wait whole
    # seconds there, then poll the fraction, so timeout_s is kept to ~50 ms.
    while True:
        left = deadline - time.monotonic()
        if left >= 1:
            if pg.wait(timeout_seconds=int(left)):
                return True
        elif pg.wait(timeout_seconds=0):
            return True
        elif left <= 0:
            return False
        else:
            time.sleep(min(0.05, left))


def _check_memory(placement: Placement, nodes: list[_Node]) -> None:
    by_id = {n.node_id: n for n in nodes}
    missing = []
    for node, used in placement.host_memory_by_node().items():
        n = by_id.get(node)
        if n is not None and used > n.memory_total:
            missing.append(
                f"{n.label}: {format_bytes(used)} of host memory placed there, {format_bytes(n.memory_total)} available"
            )
    if missing:
        raise PlacementError("host memory oversubscribed after placement: " + "; ".join(missing), missing=missing)
