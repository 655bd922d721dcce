"""GRPO trainer on CUDA: the timeshare changes no result, and roles really leave the device
(driver-level memory), the KV cache included."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tidal_recipes.grpo import DigitTask, GRPOConfig, GRPOTrainer  # noqa: E402
from tidal.timeshare import TimeshareConfig  # noqa: E402

pytestmark = pytest.mark.gpu
MiB = 1 << 20


def policy(seed=0, hidden=1024, layers=4, vocab=32000):
    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )  # deterministic backward
    with torch.device("cuda"):
        return transformers.Qwen2ForCausalLM(cfg)


def run(timeshare, steps=4, **kw):
    cfg = GRPOConfig(
        task=DigitTask(name="copy", num_digits=8),
        prompts_per_step=8,
        group_size=4,
        micro_batch=16,
        timeshare=timeshare,
        lr=1e-4,
        **kw,
    )
    tr = GRPOTrainer(policy(hidden=256, layers=2, vocab=512), config=cfg)
    res = [tr.step() for _ in range(steps)]
    tr.close()
    return tr, res


# tidal demo --prefetch --async-transitions: AdamW's state with the training role, each turn
# keeping what fits
PREFETCHING = {
    "prefetch": True,
    "optimizer_residency": "role",
    "timeshare_config": TimeshareConfig(wait_for_copies=False, release_to_driver=False),
}


@pytest.mark.parametrize(
    "kw", [{}, {"optimizer": "cpu_adam"}, {"timeshare_config": TimeshareConfig(switch_extra_bytes=0)}, PREFETCHING]
)
def test_timeshare_does_not_change_training_on_cuda(kw):
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        a, ra = run(True, **kw)
        b, rb = run(False, **{k: v for k, v in kw.items() if k not in ("timeshare_config", "prefetch")})
    finally:
        torch.use_deterministic_algorithms(False)
    assert [r.stats for r in ra] == [r.stats for r in rb]
    for (n, pa), pb in zip(a.policy.named_parameters(), b.policy.parameters()):
        assert torch.equal(pa.cpu(), pb.cpu()), n
    if kw is PREFETCHING:
        # The first step moves roles out (no phase's need measured yet), the second brings back
        # what it moved out (the reference, prefetched behind the rollout); after them every turn
        # has the room to keep every role: nothing moves.
        assert sum(ph["moved_bytes"] for ph in ra[0].phases.values()) > 0
        assert all(ph["moved_bytes"] == 0 for r in ra[2:] for ph in r.phases.values())


def test_roles_leave_the_device_at_driver_level():
    """During the reference forward the driver sees the reference weights, not the policy's
    nor the rollout's KV cache; during training, the policy's, not the reference's."""
    torch.cuda.empty_cache()
    free0, _ = torch.cuda.mem_get_info()
    cfg = GRPOConfig(
        task=DigitTask(name="copy", num_digits=16),
        prompts_per_step=16,
        group_size=8,
        micro_batch=32,
        optimizer="cpu_adam",
        timeshare_config=TimeshareConfig(switch_extra_bytes=0),
    )
    tr = GRPOTrainer(policy(), config=cfg)
    weights = sum(p.numel() * p.element_size() for p in tr.policy.parameters())
    assert weights > 350 * MiB
    used = {}

    def probe(name):
        def hook(module, args):
            free, _ = torch.cuda.mem_get_info()
            used.setdefault(name, []).append(free0 - free)

        return hook

    tr.reference.register_forward_pre_hook(probe("reference"))
    tr.policy.register_forward_pre_hook(probe("policy"))
    for _ in range(2):
        tr.step()
    rollout_alloc = [(p.name, p.peak_allocated_bytes) for p in tr.timeline.phases if p.name == "rollout"]
    ref_used = max(used["reference"])
    # reference weights + one micro-batch's forward; the policy's weights (same size) would
    # double it.
    assert ref_used < weights + 300 * MiB, (ref_used, weights)
    assert min(used["policy"]) > weights - 64 * MiB
    # the rollout's KV cache and logits are gone when it ends (allocator level): what stays
    # is its output, the sampled token ids and the sequences (int64, well under 1 MiB here)
    samples = tr.timeline.samples
    starts = [s["allocated"] for s in samples if s["label"] == "rollout start"]
    ends = [s["allocated"] for s in samples if s["label"] == "rollout end"]
    assert 0 <= ends[-1] - starts[-1] < MiB, (starts, ends, rollout_alloc)
    tr.close()


def test_capped_switch_peak_on_cuda():
    """switch_extra_bytes=0: a switch between two equal roles never holds both at once."""
    cfg = GRPOConfig(
        task=DigitTask(name="copy", num_digits=8),
        prompts_per_step=4,
        group_size=4,
        micro_batch=16,
        optimizer="cpu_adam",
        timeshare_config=TimeshareConfig(switch_extra_bytes=0),
    )
    tr = GRPOTrainer(policy(), config=cfg)
    weights = sum(p.numel() * p.element_size() for p in tr.policy.parameters())
    res = [tr.step() for _ in range(2)]
    base = torch.cuda.memory_allocated() - weights  # what is not role state (train resident now)
    for name in ("reference", "train"):
        sw = res[-1].phases[name]["switch_peak_allocated_bytes"]
        assert sw < base + weights + 160 * MiB, (name, sw, weights)  # staging buckets: 2 x 64 MiB at most
    tr.close()
