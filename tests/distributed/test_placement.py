"""Placement on a fake 3-node Ray cluster (``ray.cluster_utils.Cluster`` on this machine): a
custom resource ``fake_gpu`` stands in for GPUs, each node's ``memory`` resource is set to
1 GiB so host-memory accounting can be exercised. Also the lease served by a Ray actor, with
roles as actors colocated on one (fake) GPU bundle. The planner's rules are tested without
Ray first."""

from __future__ import annotations

import dataclasses
import os
import time

import pytest

from tidal.distributed.lease import GPULease, start_lease_actor
from tidal.distributed.placement import CPUWorker, GPURole, PlacementError, PlacementSpec, place
from tidal.distributed.placement_plan import _Node, _plan_groups

GIB = 1 << 30
MIB = 1 << 20
NODE_ARGS = dict(num_cpus=2, resources={"fake_gpu": 2}, object_store_memory=80 * MIB, memory=GIB)


# ---- spec and planner, no Ray -----------------------------------------------------------------
def test_spec_validation():
    with pytest.raises(ValueError, match="repeated: \\['a'\\]"):
        PlacementSpec(roles=[GPURole(name="a")], workers=[CPUWorker(name="a")])
    with pytest.raises(ValueError, match="nothing to place"):
        PlacementSpec()
    with pytest.raises(ValueError, match="gpus must be an int >= 1"):
        GPURole(name="a", gpus=0)
    with pytest.raises(ValueError, match="reserves nothing"):
        CPUWorker(name="w", cpus=0)
    with pytest.raises(TypeError, match="expected a GPURole"):
        PlacementSpec(roles=[CPUWorker(name="w")])
    with pytest.raises(ValueError, match="pack must be"):
        PlacementSpec(roles=[GPURole(name="a")], pack="SPREAD")
    with pytest.raises(TypeError):
        GPURole("a")  # keyword-only


def _nodes(n: int, *, gpus: float = 2, cpus: float = 2, memory: float = GIB) -> list[_Node]:
    return [
        _Node(f"{i:08x}" * 7, f"10.0.0.{i}", {"GPU": gpus, "CPU": cpus, "memory": memory}, memory) for i in range(n)
    ]


def test_plan_colocation_bundles_and_even_rounds():
    spec = PlacementSpec(
        roles=[
            GPURole(name="train", gpus=2, colocate="actor", cpus=0.25, host_memory_bytes=100 * MIB),
            GPURole(name="rollout", gpus=2, colocate="actor", cpus=0.25),
            GPURole(name="ref", gpus=1, colocate="actor", cpus=0.25),
        ],
        workers=[CPUWorker(name="reward", count=5, cpus=0.5)],
    )
    groups = _plan_groups(spec, _nodes(3))
    actor = groups[0]
    assert actor.strategy == "STRICT_PACK"
    assert actor.bundles == (
        {"GPU": 1.0, "CPU": 0.75, "memory": float(100 * MIB)},
        {"GPU": 1.0, "CPU": 0.5, "memory": float(100 * MIB)},
    )
    rounds = groups[1:]
    assert [len(g.bundles) for g in rounds] == [3, 2]
    assert [g.strategy for g in rounds] == ["STRICT_SPREAD", "STRICT_SPREAD"]
    assert [m for g in rounds for m in g.members] == [("reward", i) for i in range(5)]
    # a node the colocation group filled (2 of 2 CPUs) is not eligible: rounds over the other two
    spec = dataclasses.replace(
        spec,
        workers=[CPUWorker(name="reward", count=5, cpus=0.5)],
        roles=[dataclasses.replace(r, cpus=2 * r.cpus) for r in spec.roles[:2]],
    )
    assert [len(g.bundles) for g in _plan_groups(spec, _nodes(3))[1:]] == [2, 2, 1]
    # spread="SPREAD": one best-effort group
    spec = dataclasses.replace(spec, spread="SPREAD")
    [spread] = _plan_groups(spec, _nodes(3))[1:]
    assert (spread.strategy, len(spread.bundles)) == ("SPREAD", 5)


def test_plan_refusals_name_what_is_missing():
    spec = PlacementSpec(roles=[GPURole(name="actor", gpus=3)])
    with pytest.raises(PlacementError, match="'actor' needs 3 GPUs on one node; the largest node has 2 free"):
        _plan_groups(spec, _nodes(3))
    # PACK lets the group span nodes
    assert _plan_groups(PlacementSpec(roles=[GPURole(name="actor", gpus=3)], pack="PACK"), _nodes(3))
    spec = PlacementSpec(roles=[GPURole(name="actor", gpus=1)])
    with pytest.raises(PlacementError, match="'actor' needs 1 GPU on one node; the largest node has 0 free"):
        _plan_groups(spec, _nodes(2, gpus=0))
    spec = PlacementSpec(roles=[GPURole(name="actor", gpus=1, host_memory_bytes=2 * GIB)])
    with pytest.raises(PlacementError, match="host memory: needs 2.00 GiB, 1.00 GiB left of 1.00 GiB"):
        _plan_groups(spec, _nodes(2))


# ---- a fake cluster ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster():
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={**NODE_ARGS, "include_dashboard": False})
    try:
        for _ in range(2):
            c.add_node(**NODE_ARGS)
        c.wait_for_nodes()
        ray.init(address=c.address, log_to_driver=False)
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


def _live_groups() -> int:
    from ray.util.placement_group import placement_group_table

    return sum(1 for g in placement_group_table().values() if g["state"] != "REMOVED")


def _where(ray):
    @ray.remote
    class Probe:
        def node(self) -> str:
            return ray.get_runtime_context().get_node_id()

        def assigned(self) -> dict:
            return ray.get_runtime_context().get_assigned_resources()

    return Probe


@pytest.mark.slow
def test_colocated_roles_pack_into_the_same_bundles(cluster):
    import ray

    spec = PlacementSpec(
        roles=[
            GPURole(name="train", gpus=2, colocate="actor", cpus=0.25, host_memory_bytes=200 * MIB),
            GPURole(name="rollout", gpus=2, colocate="actor", cpus=0.25, host_memory_bytes=100 * MIB),
            GPURole(name="ref", gpus=1, colocate="actor", cpus=0.25),
            GPURole(name="critic", gpus=1, cpus=0.25),
        ],
        gpu_resource="fake_gpu",
        timeout_s=30,
    )
    with place(spec) as placement:
        opts = {
            (n, i): placement.options_for(n, i)
            for n in ("train", "rollout", "ref", "critic")
            for i in range(placement.count(n))
        }
        assert opts[("train", 0)]["resources"] == {"fake_gpu": 0.3333}  # 3 roles on GPU 0
        assert opts[("train", 1)]["resources"] == {"fake_gpu": 0.5}  # 2 roles on GPU 1
        assert opts[("critic", 0)]["resources"] == {"fake_gpu": 1.0}
        assert opts[("train", 0)]["memory"] == 200 * MIB and "memory" not in opts[("ref", 0)]
        bundle = {
            k: (o["scheduling_strategy"].placement_group.id, o["scheduling_strategy"].placement_group_bundle_index)
            for k, o in opts.items()
        }
        assert bundle[("train", 0)] == bundle[("rollout", 0)] == bundle[("ref", 0)]
        assert bundle[("train", 1)] == bundle[("rollout", 1)] != bundle[("train", 0)]
        assert placement.lease_name("train", 0) == placement.lease_name("ref", 0) != placement.lease_name("train", 1)
        with pytest.raises(ValueError, match="no worker 'ref'\\[1\\]: 'ref' has 1"):
            placement.options_for("ref", 1)
        with pytest.raises(ValueError, match="no role or worker named 'nope'"):
            placement.options_for("nope")

        Probe = _where(ray)
        actors = {k: Probe.options(**o).remote() for k, o in opts.items()}
        landed = dict(zip(actors, ray.get([a.node.remote() for a in actors.values()])))
        # STRICT_PACK: the whole colocation group on one node, as planned
        assert len({landed[k] for k in landed if k[0] != "critic"}) == 1
        assert all(landed[k] == placement.node_of(*k) for k in landed)
        got = ray.get(actors[("rollout", 1)].assigned.remote())
        assert got.get("fake_gpu") == pytest.approx(0.5)
        for a in actors.values():
            ray.kill(a)
        assert "host memory 600.00 MiB of 1.00 GiB" in placement.report()
    assert _live_groups() == 0


def test_cpu_workers_spread_evenly(cluster):
    import ray

    spec = PlacementSpec(workers=[CPUWorker(name="reward", count=5, cpus=0.5, memory_bytes=64 * MIB)], timeout_s=30)
    with place(spec) as placement:
        Probe = _where(ray)
        actors = [Probe.options(**placement.options_for("reward", i)).remote() for i in range(5)]
        nodes = ray.get([a.node.remote() for a in actors])
        assert nodes == [placement.node_of("reward", i) for i in range(5)]
        counts = sorted(nodes.count(n) for n in set(nodes))
        assert counts == [1, 2, 2]  # 5 workers on 3 nodes: at most one apart
        with pytest.raises(ValueError, match="CPU worker: it takes no turns"):
            placement.lease_name("reward")
        for a in actors:
            ray.kill(a)


def test_host_memory_oversubscription_is_refused_at_once(cluster):
    spec = PlacementSpec(workers=[CPUWorker(name="reward", count=4, cpus=0.1, memory_bytes=600 * MIB)], timeout_s=30)
    t0 = time.monotonic()
    with pytest.raises(PlacementError) as info:
        place(spec)
    assert time.monotonic() - t0 < 5
    msg = str(info.value)
    assert "CPU workers 'reward': 3 of 4 fit" in msg
    assert "host memory: needs 600.00 MiB, 424.00 MiB left of 1.00 GiB" in msg
    assert "node " in msg and "already planned there: 'reward' worker" in msg
    assert _live_groups() == 0


def test_unsatisfiable_is_an_error_not_a_hang(cluster):
    from ray.util.placement_group import placement_group, remove_placement_group

    # the pre-check sees it: no node has 3 fake GPUs
    t0 = time.monotonic()
    with pytest.raises(PlacementError, match="'actor' needs 3 'fake_gpu' GPUs on one node; the largest node has 2"):
        place(PlacementSpec(roles=[GPURole(name="actor", gpus=3, cpus=0.1)], gpu_resource="fake_gpu"))
    assert time.monotonic() - t0 < 5
    # only Ray sees it: another job holds every fake GPU; place() gives up after timeout_s
    hog = placement_group([{"fake_gpu": 2}] * 3, strategy="STRICT_SPREAD")
    assert hog.wait(timeout_seconds=30)
    try:
        timeout_s = 1.5
        t0 = time.monotonic()
        with pytest.raises(PlacementError, match="was not placed within timeout_s=1.5 s") as info:
            place(
                PlacementSpec(
                    roles=[GPURole(name="actor", gpus=1, cpus=0.1)], gpu_resource="fake_gpu", timeout_s=timeout_s
                )
            )
        assert timeout_s <= time.monotonic() - t0 < timeout_s + 3
        assert "colocation group 'actor'" in str(info.value)
    finally:
        remove_placement_group(hog)
    assert _live_groups() == 0


def _colocated_train_and_rollout() -> PlacementSpec:
    return PlacementSpec(
        roles=[GPURole(name="train", colocate="gpu", cpus=0.25), GPURole(name="rollout", colocate="gpu", cpus=0.25)],
        gpu_resource="fake_gpu",
        timeout_s=30,
    )


def _role_worker():
    """A Ray actor taking turns on a lease, plainly or with overlapped hand-overs."""
    import ray

    @ray.remote
    class RoleWorker:
        def __init__(self, lease_actor, role: str) -> None:
            self.lease = GPULease(lease_actor, holder=role)
            self.role = role

        def turns(self, n: int) -> list:
            out = []
            for _ in range(n):
                with self.lease.hold(role=self.role, release_fn=lambda: {"by": self.role}) as grant:
                    enter = time.monotonic()
                    time.sleep(0.02)
                    out.append((enter, time.monotonic(), grant.previous and grant.previous["how"]))
            return out

        def overlapped_turns(self, n: int, marks: str) -> list:
            """``marks``: a folder both workers share. A worker that starts loading early leaves
            a file there; a holder with a waiter queued keeps releasing until the waiter has
            started loading, so the overlap does not depend on the machine's speed."""
            out = []
            for i in range(n):
                row: dict = {}

                def loading_marks() -> int:
                    return sum(1 for f in os.listdir(marks) if not f.startswith(self.role + "-"))

                def release_fn():
                    waiter = bool(self.lease.snapshot()["waiting"])
                    before = loading_marks()
                    for k in range(1, 4):
                        self.lease.report_released(k, 3)
                        deadline = time.monotonic() + 10
                        while k == 1 and waiter and loading_marks() == before and time.monotonic() < deadline:
                            time.sleep(0.005)
                    row["released"] = time.monotonic()

                def acquire_fn(i=i):
                    row["load_start"] = time.monotonic()
                    if self.lease.room_source is not None:  # loading before the grant
                        open(os.path.join(marks, f"{self.role}-{i}"), "w").close()
                    room = self.lease.room_source
                    while room is not None and room.wait():
                        pass

                with self.lease.hold(role=self.role, acquire_fn=acquire_fn, release_fn=release_fn, overlap=True) as g:
                    row.update(enter=time.monotonic(), overlapped=g.overlapped)
                    # the other worker has queued (if it has turns left) before this one releases
                    deadline = time.monotonic() + 2
                    while not self.lease.snapshot()["waiting"] and time.monotonic() < deadline:
                        time.sleep(0.005)
                out.append(row)
            return out

        def grab(self) -> None:
            self.lease.acquire(self.role)

    return RoleWorker


@pytest.mark.slow
def test_roles_as_actors_take_turns_through_a_ray_lease(cluster):
    import ray

    RoleWorker = _role_worker()
    with place(_colocated_train_and_rollout()) as placement:
        assert placement.lease_name("train") == placement.lease_name("rollout")
        arbiter = start_lease_actor(placement.lease_name("train"), ttl_s=1.0)
        train = RoleWorker.options(**placement.options_for("train")).remote(arbiter, "train")
        rollout = RoleWorker.options(**placement.options_for("rollout")).remote(arbiter, "rollout")
        spans = sorted(s for part in ray.get([train.turns.remote(4), rollout.turns.remote(4)]) for s in part)
        assert len(spans) == 8
        for (_, exit_, _), (enter, _, _) in zip(spans, spans[1:]):
            assert enter >= exit_  # never two holders at once
        # a holder killed mid-turn: the other proceeds after ttl_s
        ray.get(train.grab.remote())
        pending = rollout.turns.remote(1)
        time.sleep(0.3)
        t_kill = time.monotonic()
        ray.kill(train)
        [(_, _, how)] = ray.get(pending, timeout=30)
        assert how == "expired" and time.monotonic() - t_kill < 1.0 + 3
        ray.kill(rollout)
        ray.kill(arbiter)


@pytest.mark.slow
def test_overlapped_hand_overs_through_a_ray_lease(cluster, tmp_path):
    """The Ray arbiter serves the overlapped hand-over too: the holder reports its release in
    chunks, the waiter loads on that credit before its grant, never two turns at once."""
    import ray

    RoleWorker = _role_worker()
    with place(_colocated_train_and_rollout()) as placement:
        arbiter = start_lease_actor(placement.lease_name("train") + "-overlap", ttl_s=2.0)
        train = RoleWorker.options(**placement.options_for("train")).remote(arbiter, "train")
        rollout = RoleWorker.options(**placement.options_for("rollout")).remote(arbiter, "rollout")
        rows = sorted(
            (
                r
                for part in ray.get(
                    [
                        train.overlapped_turns.remote(3, str(tmp_path)),
                        rollout.overlapped_turns.remote(3, str(tmp_path)),
                    ],
                    timeout=60,
                )
                for r in part
            ),
            key=lambda r: r["enter"],
        )
        assert len(rows) == 6
        for prev, nxt in zip(rows, rows[1:]):
            assert nxt["enter"] >= prev["released"]  # never two turns at once
        # every hand-over had its waiter queued before the release: each one overlapped
        early = [nxt for prev, nxt in zip(rows, rows[1:]) if nxt["overlapped"]]
        assert len(early) == 5, rows
        for prev, nxt in zip(rows, rows[1:]):
            if nxt["overlapped"]:
                assert nxt["load_start"] < prev["released"]
        for actor in (train, rollout, arbiter):
            ray.kill(actor)
