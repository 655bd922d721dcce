"""The GRPO roles as workers of separate processes (spawned, and Ray actors) sharing one device
through the GPU lease: the same numbers as the in-process trainer, turns really taken, and
clear errors."""

import dataclasses
import functools

import pytest
import torch

pytest.importorskip("transformers")

from tidal_recipes.cli.demo import DemoSettings, _grpo_config, build_policy  # noqa: E402
from tidal_recipes.cli.demo_remote import run_remote_demo  # noqa: E402
from tidal_recipes.grpo import GRPOTrainer, RemoteConfig, RemoteGRPO, WorkerError  # noqa: E402

SETTINGS = DemoSettings(
    preset="nano", device="cpu", steps=3, digits=3, prompts=4, group=4, micro_batch=8, switch_extra_mib=None
)


def _config(**kw):
    return dataclasses.replace(_grpo_config(SETTINGS, timeshare=True), **kw)


def _local(cfg, steps):
    tr = GRPOTrainer(build_policy(SETTINGS), config=cfg)
    results = [tr.step() for _ in range(steps)]
    weights = {k: v.detach().clone() for k, v in tr.policy.state_dict().items()}
    tr.close()
    return results, weights


def _policy_bytes() -> int:
    return sum(p.numel() * p.element_size() for p in build_policy(SETTINGS).parameters())


def _check_same(local, remote, remote_weights, local_weights):
    assert [r.reward_mean for r in local] == [r.reward_mean for r in remote]
    assert [r.stats for r in local] == [r.stats for r in remote]
    assert remote_weights.keys() == local_weights.keys()
    for k in local_weights:
        assert torch.equal(local_weights[k], remote_weights[k]), k


def _check_turns(results, policy_bytes: int):
    """Each hand-over was to the other process, after a release that offloaded its state."""
    for r in results[1:]:
        ref_prev = r.phases["reference"]["previous_holder"]
        train_prev = r.phases["train"]["previous_holder"]
        assert (ref_prev["holder"], ref_prev["role"], ref_prev["how"]) == ("policy", "rollout", "released")
        assert (train_prev["holder"], train_prev["role"], train_prev["how"]) == ("reference", "reference", "released")
        # the policy's release moved its weights out of the device before the reference came in
        assert ref_prev["confirmation"]["bytes_out"] >= policy_bytes
        assert train_prev["confirmation"]["bytes_out"] >= policy_bytes  # the reference: same shape


@pytest.mark.slow
def test_processes_match_the_in_process_trainer():
    """Spawned processes: rewards, loss statistics and final weights bit-identical to
    GRPOTrainer with the same config (mini-batches, so the old log-probs cross too)."""
    cfg = _config(mini_batches=2)
    local, local_w = _local(cfg, 3)
    with RemoteGRPO(
        functools.partial(build_policy, SETTINGS),
        config=cfg,
        remote=RemoteConfig(backend="processes", device="cpu", reward_workers=2),
    ) as run:
        remote = [run.step() for _ in range(3)]
        remote_w = run.policy_state_dict()
        timelines = run.timelines()
    _check_same(local, remote, remote_w, local_w)
    _check_turns(remote, _policy_bytes())
    assert set(timelines) == {"policy", "reference"}
    assert all(timelines[n]["phases"] for n in timelines)


@pytest.mark.slow
def test_ray_actors_match_the_in_process_trainer():
    """Ray actors placed by tidal.distributed.place on one (stand-in) GPU, the lease a Ray
    actor: the same numbers as in one process."""
    ray = pytest.importorskip("ray")
    cfg = _config()
    local, local_w = _local(cfg, 2)
    ray.init(num_cpus=4, resources={"fake_gpu": 1}, include_dashboard=False, log_to_driver=False)
    try:
        with RemoteGRPO(
            functools.partial(build_policy, SETTINGS),
            config=cfg,
            remote=RemoteConfig(backend="ray", device="cpu", gpu_resource="fake_gpu"),
        ) as run:
            layout = run.placement.layout()
            remote = [run.step() for _ in range(2)]
            remote_w = run.policy_state_dict()
    finally:
        ray.shutdown()
    _check_same(local, remote, remote_w, local_w)
    _check_turns(remote, _policy_bytes())
    (workers,) = layout.values()  # one node: policy and reference colocated, the verifier beside
    assert sorted(workers) == ["policy[0]", "reference[0]", "reward[0]"]


@pytest.mark.slow
def test_demo_with_role_processes(tmp_path):
    """`tidal demo --roles processes`: runs, reports hand-overs, writes the JSONL and PNG."""
    pytest.importorskip("matplotlib")
    s = dataclasses.replace(SETTINGS, steps=3, roles="processes", out_dir=str(tmp_path))
    lines = []
    summary = run_remote_demo(s, log=lines.append)
    assert summary["handovers"] >= 4  # rollout -> reference -> train, twice after the first step
    assert set(summary["phases"]) == {"rollout", "reference", "train"}
    assert (tmp_path / "demo.jsonl").stat().st_size > 0 and (tmp_path / "timeline.png").stat().st_size > 0
    assert any("hand-overs" in line for line in lines)


def _broken_factory(device: str):
    raise RuntimeError("no such checkpoint: /nowhere")


def test_errors():
    with pytest.raises(ValueError, match="timeshare=True"):
        RemoteGRPO(
            functools.partial(build_policy, SETTINGS),
            config=_config(timeshare=False),
            remote=RemoteConfig(backend="processes", device="cpu"),
        )
    with pytest.raises(ValueError, match="backend"):
        RemoteConfig(backend="threads")
    with pytest.raises(ValueError, match="roles must be one of"):
        dataclasses.replace(SETTINGS, roles="cluster")
    with pytest.raises(ValueError, match="LoRA"):
        run_remote_demo(dataclasses.replace(SETTINGS, roles="processes", lora_rank=4))
    # A worker that fails to build: the driver raises with the worker's traceback, and no
    # process is left behind.
    with pytest.raises(WorkerError, match="no such checkpoint"):
        RemoteGRPO(_broken_factory, config=_config(), remote=RemoteConfig(backend="processes", device="cpu"))


def test_ray_backend_needs_ray_initialised():
    ray = pytest.importorskip("ray")
    assert not ray.is_initialized()
    with pytest.raises(ValueError, match="ray.init"):
        RemoteGRPO(
            functools.partial(build_policy, SETTINGS),
            config=_config(),
            remote=RemoteConfig(backend="ray", device="cpu"),
        )
