import pytest
import torch

from tidal_recipes.grpo import DigitTask, LossConfig, action_logprobs, group_advantages, grpo_loss, kl_k3
from tidal_recipes.grpo.tasks import DIGIT0, SEP


def test_group_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 0.5, 0.5, 0.2, 0.2])
    adv = group_advantages(r, 2, eps=0.0 + 1e-12)
    # group 1: mean .5, std .5 -> +1, -1; group 2: all equal -> 0; group 3 equal -> 0
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0, 0.0, 0.0, 0.0, 0.0]))
    with pytest.raises(ValueError, match="groups of 4"):
        group_advantages(r, 4)


def test_action_logprobs_restricts_to_action_ids():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 20, generator=g)
    tokens = torch.randint(DIGIT0, DIGIT0 + 10, (2, 3), generator=g)
    logp, ent = action_logprobs(logits, tokens, (DIGIT0, DIGIT0 + 10), with_entropy=True)
    manual = torch.log_softmax(logits[..., DIGIT0 : DIGIT0 + 10], -1)
    want = manual.gather(-1, (tokens - DIGIT0).unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(logp, want)
    torch.testing.assert_close(ent, -(manual.exp() * manual).sum(-1))
    with pytest.raises(ValueError, match="outside the action ids"):
        action_logprobs(logits, torch.full((2, 3), SEP), (DIGIT0, DIGIT0 + 10))


def test_kl_k3_is_zero_at_equality_and_positive_otherwise():
    a = torch.tensor([-1.0, -2.0, -0.5])
    assert torch.equal(kl_k3(a, a), torch.zeros(3))
    assert (kl_k3(a, a + torch.tensor([0.3, -0.4, 1.0])) > 0).all()


def test_grpo_loss_clips_the_ratio():
    cfg = LossConfig(clip_eps=0.2, kl_coef=0.0)
    old = torch.zeros(1, 2)
    adv = torch.tensor([1.0])
    # ratio e^1 > 1.2 with positive advantage: clipped objective 1.2, no gradient through it
    logp = torch.ones(1, 2, requires_grad=True)
    loss, stats = grpo_loss(logp, old, adv, cfg)
    assert loss.item() == pytest.approx(-1.2)
    assert stats["clip_frac"] == 1.0
    loss.backward()
    assert torch.equal(logp.grad, torch.zeros(1, 2))
    # ratio 1: unclipped, gradient -adv/T per token
    logp = torch.zeros(1, 2, requires_grad=True)
    loss, stats = grpo_loss(logp, old, adv, cfg)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.full((1, 2), -0.5))
    assert stats["clip_frac"] == 0.0


def test_grpo_loss_adds_kl_and_entropy_terms():
    cfg = LossConfig(kl_coef=0.5, entropy_coef=0.1)
    logp = torch.tensor([[-1.0, -1.0]])
    ref = torch.tensor([[-1.5, -0.5]])
    ent = torch.tensor([[2.0, 1.0]])
    loss, stats = grpo_loss(logp, logp, torch.tensor([0.0]), cfg, ref_logp=ref, entropy=ent)
    want = 0.5 * kl_k3(logp, ref).mean() - 0.1 * 1.5
    assert loss.item() == pytest.approx(want.item())
    assert stats["entropy"] == pytest.approx(1.5)


@pytest.mark.parametrize("kw", [{"clip_eps": 0.0}, {"clip_eps": 1.5}, {"kl_coef": -1.0}])
def test_loss_config_rejects_bad_values(kw):
    with pytest.raises(ValueError):
        LossConfig(**kw)


def test_tasks_answers_and_rewards():
    g = torch.Generator().manual_seed(0)
    p = DigitTask(name="reverse", num_digits=3).prompts(4, g)
    assert p.shape == (4, 5)
    digits = p[:, 1:4] - DIGIT0
    assert torch.equal(DigitTask(name="reverse", num_digits=3).answers(p), digits.flip(1))
    assert torch.equal(DigitTask(name="copy", num_digits=3).answers(p), digits)
    assert torch.equal(DigitTask(name="sort", num_digits=3).answers(p), digits.sort(1).values)
    task = DigitTask(name="reverse", num_digits=3)
    right = task.answers(p) + DIGIT0
    assert torch.equal(task.rewards(p, right), torch.ones(4))
    half = right.clone()
    half[:, 0] = DIGIT0 + (half[:, 0] - DIGIT0 + 1) % 10
    torch.testing.assert_close(task.rewards(p, half), torch.full((4,), 2 / 3))


def test_add_task_by_hand():
    task = DigitTask(name="add", num_digits=4)
    # 47 + 85 written least significant digit first: "7 4" and "5 8" -> 132 -> "2 3" (mod 100)
    p = torch.tensor([[0, DIGIT0 + 7, DIGIT0 + 4, DIGIT0 + 5, DIGIT0 + 8, SEP]])
    assert task.answers(p).tolist() == [[2, 3]]
    with pytest.raises(ValueError, match="even"):
        DigitTask(name="add", num_digits=3)
    with pytest.raises(ValueError, match="unknown task"):
        DigitTask(name="nope")
