"""step_flops: each phase's matmul FLOPs by hand for a small shape."""

import pytest

from tests.plan.test_model import TOY
from tidal.plan import PlanConfig, step_flops

SHAPE = TOY  # hidden 64, 2 layers, 4 heads of 16 (2 KV heads), MLP 128, vocab 100, untied
LINEAR = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128  # q, k, v, o, gate, up, down
HEAD = 2 * 64 * 100


def _layers(tokens, context):
    return tokens * (2 * LINEAR + 4 * context * 64) * 2


def test_each_phase_by_hand():
    c = PlanConfig(
        shape=SHAPE,
        prompts=2,
        group=3,
        prompt_len=5,
        gen_len=4,
        micro_batch=6,
        completion_logits=True,
        logprob_span="completion",
    )
    f = step_flops(c)
    b = 6
    rollout = _layers(b * 5, 3) + b * HEAD + _layers(b * 3, 5 + 2) + b * 3 * HEAD
    forward = _layers(b * 9, 5) + b * 5 * HEAD  # logits for the 4 completion positions + 1
    assert f["rollout"] == pytest.approx(rollout)
    assert f["reference"] == pytest.approx(forward)
    assert f["train"] == pytest.approx(3 * forward)
    assert f["total"] == pytest.approx(rollout + 4 * forward)
    # checkpointing runs the layers' forward once more; logits of every position cost more
    ckpt = step_flops(c.replace(grad_ckpt=True))
    assert ckpt["train"] - f["train"] == pytest.approx(_layers(b * 9, 5))
    full = step_flops(c.replace(completion_logits=False))
    assert full["reference"] - f["reference"] == pytest.approx(b * (9 - 5) * HEAD)


def test_seven_b_demo_step_is_about_six_times_params_times_tokens():
    """The usual estimate (6 N per trained token, 2 N per inferred one) within 15%: the check
    that nothing is off by a factor."""
    c = PlanConfig(shape="qwen2-7b", prompts=64, group=16, prompt_len=10, gen_len=8, micro_batch=64)
    n = c.shape.param_count() - c.shape.embedding_params()
    tokens = 64 * 16 * 18
    estimate = 2 * n * (64 * 16 * 17) + 2 * n * tokens + 6 * n * tokens
    assert step_flops(c)["total"] == pytest.approx(estimate, rel=0.15)
