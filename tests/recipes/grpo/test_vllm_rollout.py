"""The GRPO recipe rolling out with vLLM (``GRPOConfig(rollout_engine="vllm")``), against the test
double of vLLM's ``LLM`` (tests/integrations/fake_vllm.py; the GPU runs use vLLM itself)."""

import pytest
import torch

pytest.importorskip("transformers")

from tests.integrations import fake_vllm  # noqa: E402
from tests.recipes.grpo.test_trainer import tiny_policy  # noqa: E402
from tidal_recipes.grpo import DigitTask, GRPOConfig, GRPOTrainer  # noqa: E402
from tidal_recipes.grpo.tasks import TASK_VOCAB  # noqa: E402


def _config(**kw) -> GRPOConfig:
    return GRPOConfig(task=DigitTask(name="copy", num_digits=3), prompts_per_step=4, group_size=4, micro_batch=6, **kw)


def _run(monkeypatch, steps: int = 3):
    fake_vllm.install_module(monkeypatch)
    seen: list = []
    tr = GRPOTrainer(tiny_policy(), config=_config(rollout_engine="vllm"))
    fake_vllm.FakeLLM.on_generate = lambda llm: seen.append(
        (
            list(tr.ts.resident_roles),
            {n: p.clone() for n, p in llm.model.named_parameters()},
            {n: p.detach().clone() for n, p in tr.policy.named_parameters()},
        )
    )
    try:
        results = [tr.step() for _ in range(steps)]
    finally:
        fake_vllm.FakeLLM.on_generate = None
    weights = {n: p.detach().clone() for n, p in tr.policy.named_parameters()}
    llm = tr.engine_decoder.llm
    tr.close()
    return results, seen, weights, llm


def test_the_recipe_rolls_out_with_the_engine_holding_the_policys_weights_of_each_step(monkeypatch):
    results, seen, weights, llm = _run(monkeypatch)
    assert len(seen) == 3
    for resident, engine_w, policy_w in seen:
        # The engine generates with the policy's weights of that step, bit for bit.
        assert engine_w.keys() == policy_w.keys() and all(torch.equal(engine_w[n], policy_w[n]) for n in policy_w)
        assert "reference" not in resident  # out of the engine's way
    assert not all(torch.equal(seen[0][2][n], weights[n]) for n in weights)  # it trained
    assert llm.held_bytes() == 0  # asleep after each rollout: its memory the driver's
    # Every answer is as long as the task's (min_tokens): each sequence reaches its longest, and
    # the cache sized for that held them all at once, vLLM's null block beside them (one block
    # short, vLLM 0.25 preempted the last request and crashed on an H200, 2026-12-03).
    assert llm.preemptions == 0
    assert all(r.stats and all(torch.isfinite(torch.tensor(v)) for v in r.stats.values()) for r in results)


def test_a_seeded_run_with_the_engine_is_reproducible(monkeypatch):
    a = _run(monkeypatch)
    b = _run(monkeypatch)
    assert [r.reward_mean for r in a[0]] == [r.reward_mean for r in b[0]]
    assert all(torch.equal(a[2][n], b[2][n]) for n in a[2])


def test_the_engine_samples_only_the_tasks_action_tokens(monkeypatch):
    from tidal_recipes.grpo.trainer import ACTION_IDS

    fake_vllm.install_module(monkeypatch)
    tr = GRPOTrainer(tiny_policy(), config=_config(rollout_engine="vllm"))
    prompts = tr.next_prompts()
    answers = tr.engine_decoder.sample(
        prompts, 3, ACTION_IDS, generator=torch.Generator().manual_seed(0), temperature=1.0
    )
    tr.close()
    assert answers.shape == (prompts.shape[0], 3)
    assert bool(((answers >= ACTION_IDS[0]) & (answers < ACTION_IDS[1])).all())
    assert ACTION_IDS[1] <= TASK_VOCAB


def test_bad_engine_settings_are_refused_before_any_work(monkeypatch):
    with pytest.raises(ValueError, match="rollout_engine must be 'hf' or 'vllm'"):
        _config(rollout_engine="sglang")
    with pytest.raises(ValueError, match="needs timeshare=True and no rollout_graph"):
        _config(rollout_engine="vllm", timeshare=False)
    monkeypatch.setitem(__import__("sys").modules, "vllm", None)  # not installed
    with pytest.raises(ValueError, match="needs vLLM installed"):
        GRPOTrainer(tiny_policy(), config=_config(rollout_engine="vllm"))


def test_the_demo_rolling_out_with_the_engine_reports_its_cache_not_what_torch_counts_across_the_turn(
    monkeypatch, tmp_path
):
    """``tidal demo --rollout-engine vllm``: the engine's KV cache is its own pool's; what torch
    counts across its turn (the roles moving around it) is not a cache left allocated (the GPU
    demo printed -2.81 GiB there, 2026-12-03)."""
    from tidal_recipes.cli.demo import DemoSettings, defaults_for, run_demo

    fake_vllm.install_module(monkeypatch)
    settings = DemoSettings(
        **{**defaults_for("cpu"), "steps": 2, "prompts": 4, "group": 4, "micro_batch": 16},
        rollout_engine="vllm",
        baseline_steps=0,
        out_dir=str(tmp_path / "demo"),
    )
    lines: list[str] = []
    summary = run_demo(settings, log=lines.append)
    assert summary["rollout_engine_kv_cache_bytes"] > 0 and summary["rollout_left_allocated_bytes"] is None
    said = "\n".join(lines)
    assert "rollout: vLLM's engine, its KV cache" in said and "left allocated after a rollout" not in said
