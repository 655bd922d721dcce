"""The GRPO roles as separate processes on one GPU (spawned workers, TCP lease): the same
numbers as the in-process trainer on the same GPU, and the driver confirming that the
releasing process really gave its memory back before the other came in."""

import dataclasses
import functools

import pytest
import torch

pytest.importorskip("transformers")

from tidal_recipes.cli.demo import DemoSettings, _grpo_config, build_policy  # noqa: E402
from tidal_recipes.grpo import GRPOTrainer, RemoteConfig, RemoteGRPO  # noqa: E402

pytestmark = pytest.mark.gpu

# Qwen2-0.5B shape in bf16 with AdamW: the policy's weights alone are ~1 GB, far above the
# CUDA contexts and allocator slack the checks allow for.
SETTINGS = DemoSettings(
    preset="qwen2-0.5b",
    device="cuda",
    steps=2,
    digits=4,
    prompts=8,
    group=8,
    micro_batch=32,
    dtype="bfloat16",
    optimizer="adamw",
    switch_extra_mib=None,
)


def test_role_processes_on_one_gpu():
    cfg = _grpo_config(SETTINGS, timeshare=True)
    cfg = dataclasses.replace(cfg, mini_batches=2)
    tr = GRPOTrainer(build_policy(SETTINGS), config=cfg)
    local = [tr.step() for _ in range(2)]
    local_w = {k: v.detach().cpu() for k, v in tr.policy.state_dict().items()}
    policy_bytes = sum(p.numel() * p.element_size() for p in tr.policy.parameters())
    tr.close()
    del tr
    torch.cuda.synchronize()
    torch.cuda.empty_cache()

    with RemoteGRPO(
        functools.partial(build_policy, SETTINGS), config=cfg, remote=RemoteConfig(backend="processes", device="cuda")
    ) as run:
        remote = [run.step() for _ in range(2)]
        remote_w = run.policy_state_dict()

    assert [r.reward_mean for r in local] == [r.reward_mean for r in remote]
    assert [r.stats for r in local] == [r.stats for r in remote]
    for k in local_w:
        assert torch.equal(local_w[k], remote_w[k]), k

    for r in remote[1:]:
        ph = r.phases
        rel = ph["reference"]["previous_holder"]
        assert (rel["holder"], rel["how"]) == ("policy", "released")
        conf = rel["confirmation"]
        # The policy process kept (almost) nothing allocated after its release ...
        assert conf["allocated_bytes"] < 64 << 20, conf
        # ... and the driver saw its weights (and optimizer state) go: the GPU's used memory at
        # the release is below the rollout's peak by at least the policy's weights.
        used_at_release = conf["driver_total_bytes"] - conf["driver_free_bytes"]
        assert ph["rollout"]["peak_driver_used_bytes"] - used_at_release >= 0.9 * policy_bytes, (ph, conf)
        # During the reference's turn the GPU never held the policy's weights beside it.
        assert ph["reference"]["peak_driver_used_bytes"] < used_at_release + policy_bytes + (512 << 20)
