"""TRL's GRPOTrainer with tidal (tidal.integrations.trl) against the same TRL run without
it: a real client nobody here wrote. Tiny Qwen2-shape model saved locally, a character-level
tokenizer, a reward in Python; CPU, a few steps."""

from __future__ import annotations

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from transformers import AutoModelForCausalLM, Qwen2Config  # noqa: E402

import tidal  # noqa: E402
from tests.helpers import FakeAllocator  # noqa: E402
from tidal.integrations.trl import TidalConfig, TidalGRPOTrainer  # noqa: E402
from tidal_recipes.grpo.char_task import EOS_ID, PAD_ID, char_tokenizer, reward_sevens  # noqa: E402

CHARS = list("0123456789+= abcdefghij")


def save_char_models(policy_path, reward_path=None, *, hidden=32, intermediate=64, layers=4, heads=2, kv_heads=1):
    """A character-level tokenizer and a Qwen2-shape causal LM with random weights saved at
    ``policy_path`` (what a user points TRL at); with ``reward_path``, a sequence classifier of
    the same shape with one label there too (a reward model TRL loads from a path)."""
    from transformers import AutoModelForSequenceClassification

    hf = char_tokenizer(CHARS)
    cfg = Qwen2Config(
        vocab_size=len(hf),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=64,
        pad_token_id=PAD_ID,
        eos_token_id=EOS_ID,
        bos_token_id=EOS_ID,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(policy_path)
    hf.save_pretrained(policy_path)
    if reward_path is not None:
        cfg.num_labels = 1
        torch.manual_seed(1)
        AutoModelForSequenceClassification.from_config(cfg).save_pretrained(reward_path)
        hf.save_pretrained(reward_path)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    save_char_models(path)
    return str(path)


@pytest.fixture(scope="module")
def tiny_reward(tmp_path_factory):
    path, unused = tmp_path_factory.mktemp("tiny_reward"), tmp_path_factory.mktemp("unused")
    save_char_models(unused, path)
    return str(path)


def _args(out, config=None, **kw):
    base = dict(
        output_dir=str(out),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=6,
        max_steps=3,
        beta=0.1,
        learning_rate=1e-2,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        seed=0,
        save_strategy="no",
        bf16=False,
    )
    base.update(kw)
    return (config or trl.GRPOConfig)(**base)


def _data():
    return datasets.Dataset.from_dict({"prompt": [f"{i}+{i}=" for i in range(16)]})


def _run(
    cls, tiny, out, *, model=None, optimizers=(None, None), tidal_config=None, peft_config=None, rewards=None, **kw
):
    extra = {"tidal": tidal_config} if tidal_config is not None else {}
    if peft_config is not None:
        extra["peft_config"] = peft_config
    trainer = cls(
        model=model if model is not None else tiny,
        reward_funcs=rewards if rewards is not None else reward_sevens,
        args=_args(out, **kw),
        train_dataset=_data(),
        optimizers=optimizers,
        **extra,
    )
    trainer.train()
    return trainer


def _history(trainer):
    keys = ("loss", "reward", "kl", "grad_norm")
    return [tuple(h.get(k) for k in keys) for h in trainer.state.log_history if "loss" in h]


def _weights(trainer):
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


@pytest.mark.slow
def test_grpo_with_tidal_is_bit_identical_to_trl_alone(tiny, tmp_path):
    plain = _run(trl.GRPOTrainer, tiny, tmp_path / "plain")
    ours = _run(TidalGRPOTrainer, tiny, tmp_path / "tidal")
    assert _history(ours) == _history(plain) and len(_history(ours)) == 3
    want, got = _weights(plain), _weights(ours)
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)
    # Not a no-op: the reference and the policy took turns, and the optimizer state went
    # to the host around each step.
    kinds = [(r.kind, r.roles_out, r.role_in) for r in ours.timeshare.records]
    assert kinds.count(("switch", ("policy",), "reference")) == 3
    assert kinds.count(("switch", ("reference",), "policy")) == 3
    assert sum(k[0] == "optim-out" for k in kinds) == 3
    assert ours.timeshare.is_resident("policy") and not ours.timeshare.is_resident("reference")


@pytest.mark.slow
def test_prefetch_is_bit_identical_and_the_switches_find_the_roles_arrived(tiny, tmp_path):
    """TidalConfig(prefetch=True): generation brings the reference in ahead and writes the
    policy back, reference scoring brings the policy back; TRL's results do not change, and
    the switches claim what arrived (the reference's reload copies nothing of it again)."""
    plain = _run(trl.GRPOTrainer, tiny, tmp_path / "plain")
    ours = _run(TidalGRPOTrainer, tiny, tmp_path / "tidal", tidal_config=TidalConfig(prefetch=True))
    assert _history(ours) == _history(plain)
    want, got = _weights(plain), _weights(ours)
    assert all(torch.equal(want[k], got[k]) for k in want)
    recs = ours.timeshare.records
    prefetches = [r for r in recs if r.kind == "prefetch"]
    assert {r.role_in for r in prefetches} == {"reference", "policy"} and all(r.bytes_in > 0 for r in prefetches)
    to_ref = [r for r in recs if r.kind == "switch" and r.role_in == "reference"]
    assert len(to_ref) == 3 and all(r.bytes_prefetched > 0 and r.bytes_in == 0 for r in to_ref)
    # The optimizer state comes in as each backward starts (from the second step: the first
    # creates it), and the step finds all of it arrived.
    ahead = [r for r in recs if r.kind == "optim-prefetch"]
    assert len(ahead) == 2 and all(r.bytes_in > 0 for r in ahead)
    stepped = [r for r in recs if r.kind == "optim-in" and r.index > ahead[0].index]
    assert stepped and all(r.bytes_in == 0 and r.bytes_prefetched > 0 for r in stepped)


@pytest.mark.parametrize("room", ["budget", "as_needed"])
@pytest.mark.slow
def test_a_budget_for_both_keeps_the_policy_in_while_the_reference_scores(tiny, tmp_path, room):
    """TimeshareConfig(budget_bytes=...) with room for the policy (weights and gradients) and
    the reference: the reference comes in beside the policy instead of switching it out, and
    TRL's results do not change. The policy's AdamW moments, on the host between steps (step
    residency), do not count against the budget (they did: the policy was switched out).
    evict="as_needed" (no budget; the CPU has room for both) does the same."""
    model = AutoModelForCausalLM.from_pretrained(tiny)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    del model
    if room == "budget":
        cfg = TidalConfig(timeshare=tidal.TimeshareConfig(budget_bytes=3 * weights + (64 << 10)))
    else:
        cfg = TidalConfig(timeshare=tidal.TimeshareConfig(evict="as_needed"))
    plain = _run(trl.GRPOTrainer, tiny, tmp_path / "plain")
    ours = _run(TidalGRPOTrainer, tiny, tmp_path / "tidal", tidal_config=cfg)
    assert _history(ours) == _history(plain)
    want, got = _weights(plain), _weights(ours)
    assert all(torch.equal(want[k], got[k]) for k in want)
    recs = ours.timeshare.records
    # The policy's weights never leave (its optimizer state goes to the host around each step).
    assert not any("policy" in r.roles_out and r.kind in ("switch", "offload") for r in recs), [
        (r.kind, r.roles_out, r.role_in) for r in recs
    ]
    # The reference came in once, beside the policy, and stayed: no bytes move for it after.
    assert sum(r.role_in == "reference" for r in recs) == 1 and ours.timeshare.is_resident("reference")


def test_prefetch_without_a_reference_says_it_only_brings_the_optimizer_state(tiny, tmp_path):
    with pytest.warns(UserWarning, match=r"prefetch=True\) only brings the policy's optimizer state in ahead"):
        trainer = TidalGRPOTrainer(
            model=tiny,
            reward_funcs=reward_sevens,
            args=_args(tmp_path / "tidal", beta=0.0),
            train_dataset=_data(),
            tidal=TidalConfig(prefetch=True),
        )
    assert "reference" not in trainer.timeshare.roles


def test_transitions_reach_the_trainers_log(tiny, tmp_path):
    ours = _run(TidalGRPOTrainer, tiny, tmp_path / "tidal", max_steps=2)
    logged = [h for h in ours.state.log_history if "loss" in h]
    assert all(h["tidal/transitions"] >= 2 for h in logged)
    assert all(h["tidal/moved_gb"] > 0 and h["tidal/transition_s"] > 0 and h["tidal/gbps"] > 0 for h in logged)
    # on the CPU nothing queues: what the step waited on is the host's time in the transitions
    assert all(0 < h["tidal/exposed_s"] for h in logged)
    assert sum(h["tidal/transitions"] for h in logged) == len(ours.timeshare.records)


@pytest.mark.slow
def test_stream_and_role_residency_give_the_same_run(tiny, tmp_path):
    plain = _weights(_run(trl.GRPOTrainer, tiny, tmp_path / "plain", max_steps=2))
    for residency in ("stream", "role"):
        ours = _run(
            TidalGRPOTrainer,
            tiny,
            tmp_path / residency,
            max_steps=2,
            tidal_config=TidalConfig(optimizer_residency=residency),
        )
        got = _weights(ours)
        assert all(torch.equal(plain[k], got[k]) for k in plain), residency


@pytest.mark.parametrize(
    "setting",
    [
        dict(num_iterations=2),  # the policy also scores the samples before the first update
        dict(steps_per_generation=2, per_device_train_batch_size=4),  # one generation, two steps
        dict(loss_type="dr_grpo"),
        dict(loss_type="dapo", mask_truncated_completions=True),
        dict(gradient_checkpointing=True),
        dict(cast_lm_head_to_fp32=True),
        dict(eval_strategy="steps", eval_steps=1, num_generations_eval=2, per_device_eval_batch_size=8),
    ],
    ids=lambda d: ",".join(d),
)
@pytest.mark.slow
def test_trl_settings_that_change_the_phases_stay_bit_identical(tiny, tmp_path, setting):
    kw = dict(setting, max_steps=2)
    extra = {"eval_dataset": _data()} if "eval_strategy" in setting else {}
    runs = {}
    for name, cls in (("plain", trl.GRPOTrainer), ("ours", TidalGRPOTrainer)):
        trainer = cls(
            model=tiny, reward_funcs=reward_sevens, args=_args(tmp_path / name, **kw), train_dataset=_data(), **extra
        )
        trainer.train()
        runs[name] = trainer
    plain, ours = runs["plain"], runs["ours"]
    assert _history(ours) == _history(plain)
    evals = [[h["eval_loss"] for h in t.state.log_history if "eval_loss" in h] for t in (plain, ours)]
    assert evals[0] == evals[1] and (len(evals[0]) == 2) == ("eval_strategy" in setting)
    want, got = _weights(plain), _weights(ours)
    assert all(torch.equal(want[k], got[k]) for k in want)
    assert any(r.role_in == "reference" for r in ours.timeshare.records)


@pytest.mark.slow
def test_gradient_accumulation_and_activation_offload_stay_bit_identical(tiny, tmp_path):
    """Two micro-batches per step (the policy's partial gradients go to the host and back
    while the reference scores) and the loss's saved activations offloaded."""
    plain = _run(
        trl.GRPOTrainer,
        tiny,
        tmp_path / "plain",
        max_steps=2,
        gradient_accumulation_steps=2,
        per_device_train_batch_size=4,
    )
    cfg = TidalConfig(activation_offload=True, activation_min_offload_bytes=0)
    ours = _run(
        TidalGRPOTrainer,
        tiny,
        tmp_path / "ours",
        max_steps=2,
        gradient_accumulation_steps=2,
        per_device_train_batch_size=4,
        tidal_config=cfg,
    )
    assert _history(ours) == _history(plain)
    want, got = _weights(plain), _weights(ours)
    assert all(torch.equal(want[k], got[k]) for k in want)
    policy = ours.accelerator.unwrap_model(ours.model)
    assert tidal.TransferContext.of("cpu").owner_of(policy).report().bytes_offloaded > 0
    # each log line carries what the loss's activations moved since the previous one
    logged = [h for h in ours.state.log_history if "loss" in h]
    assert len(logged) == 2
    assert all(h["tidal/act_offloaded_gb"] > 0 for h in logged)
    assert all(h["tidal/act_reloaded_gb"] == pytest.approx(h["tidal/act_offloaded_gb"]) for h in logged)


@pytest.mark.parametrize("mode", ["out", "prefetch", "budget"])
@pytest.mark.slow
def test_sync_ref_model_mixes_the_policy_into_the_reference_where_it_is(tiny, tmp_path, mode):
    """TRL's SyncRefModelCallback writes the reference's .data in place after a step, while the
    reference is out on the host (a null-pointer write without tidal's own sync: a segfault).
    "budget": room for both, so the reference stays on the device and is mixed there."""
    kw = dict(sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=0.5, max_steps=3)
    start = AutoModelForCausalLM.from_pretrained(tiny)
    weights = sum(p.numel() * p.element_size() for p in start.parameters())
    cfg = {
        "out": TidalConfig(),
        "prefetch": TidalConfig(prefetch=True),
        "budget": TidalConfig(timeshare=tidal.TimeshareConfig(budget_bytes=3 * weights + (64 << 10))),
    }[mode]
    plain = _run(trl.GRPOTrainer, tiny, tmp_path / "plain", **kw)
    ours = _run(TidalGRPOTrainer, tiny, tmp_path / "ours", tidal_config=cfg, **kw)
    assert ours.timeshare.is_resident("reference") == (mode == "budget")
    assert _history(ours) == _history(plain)
    want, got = _weights(plain), _weights(ours)
    assert all(torch.equal(want[k], got[k]) for k in want)
    ref_want, ref_got = plain.ref_model.state_dict(), ours.ref_model.state_dict()
    assert all(torch.equal(ref_want[k], ref_got[k]) for k in ref_want)
    # the mix changed the reference (it is not the initial model any more)
    assert any(not torch.equal(v, ref_got[k]) for k, v in start.state_dict().items())


@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.slow
def test_a_reward_model_takes_its_turn_too(tiny, tiny_reward, tmp_path, prefetch):
    """reward_funcs with a model (TRL loads it from a path): a frozen third role, on the device
    only while TRL scores the completions; the same run as TRL alone."""
    rewards = [reward_sevens, tiny_reward]
    plain = _run(trl.GRPOTrainer, tiny, tmp_path / "plain", rewards=rewards)
    ours = _run(TidalGRPOTrainer, tiny, tmp_path / "ours", rewards=rewards, tidal_config=TidalConfig(prefetch=prefetch))
    assert _history(ours) == _history(plain)
    want, got = _weights(plain), _weights(ours)
    assert all(torch.equal(want[k], got[k]) for k in want)
    ts = ours.timeshare
    assert sorted(ts.roles) == ["policy", "reference", "reward"] and not ts.is_resident("reward")
    came_in = [r for r in ts.records if r.role_in == "reward" and r.kind == "switch"]
    assert len(came_in) == 3  # once per step (max_steps=3), for its scoring only
    if prefetch:  # all of it arrived behind the reference's scoring: the switch moved nothing
        assert all(r.bytes_prefetched > 0 and r.bytes_in == 0 for r in came_in)
    else:
        assert all(r.bytes_in > 0 and r.bytes_prefetched == 0 for r in came_in)
    # frozen: after its first trip out, it goes out without a copy
    out = [r for r in ts.records if "reward" in r.roles_out]
    assert out and all(r.bytes_out == 0 for r in out[1:])


@pytest.mark.slow
def test_a_lora_policy_is_bit_identical_with_its_activations_offloaded(tiny, tmp_path):
    """PEFT: TRL scores the reference with the policy's adapters disabled (no second model, so
    no reference role); the adapters' optimizer state and the loss's activations still move,
    found inside the PeftModel's base model."""
    peft = pytest.importorskip("peft")

    def lora():
        return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])

    plain = _run(trl.GRPOTrainer, tiny, tmp_path / "plain", peft_config=lora())
    cfg = TidalConfig(activation_offload=True, activation_min_offload_bytes=0)
    ours = _run(TidalGRPOTrainer, tiny, tmp_path / "ours", peft_config=lora(), tidal_config=cfg)
    assert "reference" not in ours.timeshare.roles
    assert _history(ours) == _history(plain)
    want, got = _weights(plain), _weights(ours)
    assert any("lora_" in k for k in want)
    assert all(torch.equal(want[k], got[k]) for k in want)
    policy = ours.accelerator.unwrap_model(ours.model)
    assert tidal.TransferContext.of("cpu").owner_of(policy).report().bytes_offloaded > 0
    # the adapters' optimizer state went out between steps (step residency)
    assert any(r.bytes_out > 0 for r in ours.timeshare.records)


@pytest.mark.slow
def test_cpu_adam_as_the_optimizer_matches_adamw(tiny, tmp_path):
    """CPUAdam (state on the host by design) in place of TRL's AdamW: the same run up to the
    float rounding of a different (fused) kernel."""
    plain = _run(trl.GRPOTrainer, tiny, tmp_path / "plain", max_steps=2)
    model = AutoModelForCausalLM.from_pretrained(tiny)
    opt = tidal.CPUAdam(model.parameters(), lr=1e-2, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8)
    ours = _run(TidalGRPOTrainer, tiny, tmp_path / "cpuadam", model=model, optimizers=(opt, None), max_steps=2)
    want, got = _weights(plain), _weights(ours)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)
    assert [h[1] for h in _history(ours)] == [h[1] for h in _history(plain)]  # same samples, same rewards


@pytest.mark.slow
def test_save_model_writes_the_real_weights_while_roles_are_out(tiny, tmp_path):
    ours = _run(TidalGRPOTrainer, tiny, tmp_path / "tidal", max_steps=2)
    ours.timeshare.offload("policy")  # everything on the host now
    ours.save_model(str(tmp_path / "saved"))
    saved = AutoModelForCausalLM.from_pretrained(str(tmp_path / "saved"))
    ours.timeshare.load("policy")
    got = _weights(ours)
    for n, p in saved.named_parameters():
        assert torch.equal(p.detach(), got[n]), n


@pytest.mark.slow
def test_resume_from_a_checkpoint_equals_the_uninterrupted_run(tiny, tmp_path):
    full = _run(TidalGRPOTrainer, tiny, tmp_path / "full", max_steps=4, save_strategy="steps", save_steps=2)
    first = TidalGRPOTrainer(
        model=tiny,
        reward_funcs=reward_sevens,
        args=_args(tmp_path / "resumed", max_steps=4, save_strategy="steps", save_steps=2),
        train_dataset=_data(),
    )
    first.train()
    again = TidalGRPOTrainer(
        model=tiny,
        reward_funcs=reward_sevens,
        args=_args(tmp_path / "resumed", max_steps=4, save_strategy="steps", save_steps=2),
        train_dataset=_data(),
    )
    again.train(resume_from_checkpoint=str(tmp_path / "resumed" / "checkpoint-2"))
    want, got = _weights(full), _weights(again)
    assert all(torch.equal(want[k], got[k]) for k in want)


@pytest.mark.parametrize(
    "setting, match",
    [({"use_vllm": True, "vllm_mode": "remote"}, "vllm_mode='colocate'"), ({"torch_compile": True}, "torch_compile")],
)
def test_settings_tidal_cannot_work_with_are_refused_before_any_work(tiny, tmp_path, setting, match):
    with pytest.raises(ValueError, match=match):
        TidalGRPOTrainer(model=tiny, reward_funcs=reward_sevens, args=_args(tmp_path, **setting), train_dataset=_data())


def test_a_wrong_tidal_argument_is_a_type_error(tiny, tmp_path):
    with pytest.raises(TypeError, match="TidalConfig"):
        TidalGRPOTrainer(model=tiny, reward_funcs=reward_sevens, args=_args(tmp_path), train_dataset=_data(), tidal={})


@pytest.mark.parametrize(
    "bad, error, match",
    [
        (dict(optimizer_residency="gpu"), ValueError, "optimizer_residency"),
        (dict(timeshare={"budget_bytes": 1}), TypeError, "TimeshareConfig"),
        (dict(activation_min_offload_bytes=-1), ValueError, "activation_min_offload_bytes"),
        # A non-empty string is truthy: these switched the feature on before (issue 27).
        (dict(prefetch="no"), TypeError, r"TidalConfig.prefetch must be True or False, got 'no'"),
        (dict(activation_offload="no"), TypeError, r"TidalConfig.activation_offload must be True or False"),
        (dict(activation_offload=1), TypeError, r"TidalConfig.activation_offload must be True or False"),
    ],
)
def test_a_bad_tidal_config_is_refused_when_it_is_made(bad, error, match):
    with pytest.raises(error, match=match):
        TidalConfig(**bad)


def test_activation_settings_without_activation_offload_warn_that_they_are_ignored():
    with pytest.warns(UserWarning, match="activation_layers ignored: activation_offload is off"):
        TidalConfig(activation_layers="model.layers")


def test_wrong_activation_layers_are_refused_when_the_trainer_is_built(tiny, tmp_path):
    """As TidalTrainer does: at construction, not at the first loss after a whole generation,
    the reference and the reward scoring (issue 27)."""
    cfg = TidalConfig(activation_offload=True, activation_layers="model.nope")
    with pytest.raises(ValueError, match=r"no list of transformer blocks .* at 'model.nope'"):
        TidalGRPOTrainer(model=tiny, reward_funcs=reward_sevens, args=_args(tmp_path), train_dataset=_data(), tidal=cfg)
    # "auto" finds the blocks of the char-level Qwen2 policy, also at construction.
    trainer = TidalGRPOTrainer(
        model=tiny,
        reward_funcs=reward_sevens,
        args=_args(tmp_path),
        train_dataset=_data(),
        tidal=TidalConfig(activation_offload=True),
    )
    trainer.timeshare.close()


def _rloo(cls, tiny, out, *, tidal_config=None, rewards=None, **kw):
    args = _args(out, config=trl.RLOOConfig, **kw)
    extra = {"tidal": tidal_config} if tidal_config is not None else {}
    trainer = cls(
        model=tiny,
        reward_funcs=rewards if rewards is not None else reward_sevens,
        args=args,
        train_dataset=_data(),
        **extra,
    )
    trainer.train()
    return trainer


@pytest.mark.parametrize("with_reward_model", [False, True])
@pytest.mark.slow
def test_rloo_with_tidal_is_bit_identical_to_trl_alone(tiny, tiny_reward, tmp_path, with_reward_model):
    """TRL's RLOOTrainer (a reference by default) through the same mixin: the reference (and a
    reward model) take turns with the policy; the same run as RLOOTrainer alone."""
    from tidal.integrations.trl import TidalRLOOTrainer

    rewards = [reward_sevens, tiny_reward] if with_reward_model else None
    plain = _rloo(trl.RLOOTrainer, tiny, tmp_path / "plain", rewards=rewards)
    ours = _rloo(TidalRLOOTrainer, tiny, tmp_path / "ours", rewards=rewards, tidal_config=TidalConfig(prefetch=True))
    assert _history(ours) == _history(plain) and len(_history(ours)) == 3
    want, got = _weights(plain), _weights(ours)
    assert all(torch.equal(want[k], got[k]) for k in want)
    roles = ["policy", "reference"] + (["reward"] if with_reward_model else [])
    assert sorted(ours.timeshare.roles) == roles
    switches = [r for r in ours.timeshare.records if r.kind == "switch"]
    assert sum(r.role_in == "reference" for r in switches) == 3  # once per step
    assert all(r.bytes_prefetched > 0 for r in switches if r.role_in == "reference")


def test_rloo_refusals_name_the_rloo_trainer(tiny, tmp_path):
    from tidal.integrations.trl import TidalRLOOTrainer

    args = trl.RLOOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], use_vllm=True, vllm_mode="remote")
    with pytest.raises(ValueError, match="TidalRLOOTrainer supports use_vllm=True with vllm_mode='colocate'"):
        TidalRLOOTrainer(model=tiny, reward_funcs=reward_sevens, args=args, train_dataset=_data())


@pytest.mark.slow
def test_a_role_the_loss_kept_goes_before_a_backward_it_has_no_room_beside(tiny, tmp_path):
    """The loss's turn keeps the reference on the last step's reading of the loss and backward;
    a longer batch makes larger activations. Right before the backward, with them allocated,
    the room is read again: here the loss's turn is made to keep everything and the backward
    reads as needing more than the device has, so the reference goes before every backward
    (dropped, frozen: nothing copied) and comes back behind the next generation. TRL's results
    do not change."""
    plain = _run(trl.GRPOTrainer, tiny, tmp_path / "plain")

    class LossKeepsAll(_with_counters({"backward": 1 << 60})):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            schedule = self.tidal.schedule
            keep_free = schedule.keep_free
            schedule.keep_free = lambda role, phase: 0 if phase == "loss" else keep_free(role, phase)

    ours = _run(LossKeepsAll, tiny, tmp_path / "ours", tidal_config=TidalConfig(prefetch=True))
    assert _history(ours) == _history(plain)
    want, got = _weights(plain), _weights(ours)
    assert all(torch.equal(want[k], got[k]) for k in want)
    # From the second step (the backward measured), the reference leaves before each backward
    # by a load of the policy, never by the loss's switch (which keeps it); the first step's
    # backward, not measured yet, keeps it, and its optimizer step (not measured either: every
    # other role goes before it) drops it.
    drops = [r for r in ours.timeshare.records if r.roles_out == ("reference",) and r.index > 0]
    assert [(r.kind, r.role_in) for r in drops] == 3 * [("offload", None)], [
        (r.index, r.kind, r.roles_out, r.role_in) for r in ours.timeshare.records
    ]
    assert all(r.bytes_out == 0 for r in drops)
    loss_switches = [r for r in ours.timeshare.records if r.role_in == "policy" and r.index > drops[0].index]
    assert all("reference" not in r.roles_out for r in loss_switches)


@pytest.mark.slow
def test_generations_prefetch_is_queued_once_its_first_forward_runs(tiny, tmp_path):
    """The reference's prefetch behind generation is queued after generate() has put its inputs
    on the device (at the first module forward), not before: a small host-to-device copy queued
    behind gigabytes of prefetch waits for all of them. Still bit-identical to TRL alone."""
    events: list[tuple] = []
    built: list = []

    class Recording(PolicyReadyHook, TidalGRPOTrainer):
        def _policy_ready(self, own):
            ready = own()
            if ready and not built:
                built.append(True)
                ts, model = self.timeshare, self.accelerator.unwrap_model(self.model)
                prefetch, generate = ts.prefetch, model.generate

                def recorded_prefetch(name, **kw):
                    events.append(("prefetch", name))
                    return prefetch(name, **kw)

                def recorded_generate(*a, **kw):
                    events.append(("generate",))
                    return generate(*a, **kw)

                ts.prefetch, model.generate = recorded_prefetch, recorded_generate
            return ready

    plain = _run(trl.GRPOTrainer, tiny, tmp_path / "plain")
    ours = _run(Recording, tiny, tmp_path / "ours", tidal_config=TidalConfig(prefetch=True))
    assert _history(ours) == _history(plain)
    to_ref = [i for i, e in enumerate(events) if e == ("prefetch", "reference")]
    assert len(to_ref) >= 2, events  # every step after the first measured the generation's growth
    assert all(i > 0 and events[i - 1] == ("generate",) for i in to_ref), events
    switches = [r for r in ours.timeshare.records if r.kind == "switch" and r.role_in == "reference"]
    assert sum(r.bytes_prefetched > 0 for r in switches) == len(to_ref)


def testat_first_forward_runs_once_at_the_first_forward_or_at_the_end_and_never_after_a_raise():
    import threading

    from tidal.integrations.trl.phases import at_first_forward

    calls: list[str] = []
    lin = torch.nn.Linear(2, 2)
    with at_first_forward(lambda: calls.append("fn")):
        calls.append("before")
        lin(torch.zeros(1, 2))
        calls.append("after")
        lin(torch.zeros(1, 2))
    assert calls == ["before", "fn", "after"]

    calls.clear()
    with at_first_forward(lambda: calls.append("fn")):
        calls.append("no forward")
    assert calls == ["no forward", "fn"]  # at the end, late but not lost

    calls.clear()
    with pytest.raises(KeyError):
        with at_first_forward(lambda: calls.append("fn")):
            raise KeyError("boom")
    lin(torch.zeros(1, 2))  # the hook is gone
    assert calls == []

    calls.clear()
    with at_first_forward(lambda: calls.append("fn")):
        other = threading.Thread(target=lambda: lin(torch.zeros(1, 2)))
        other.start()
        other.join()
        calls.append("other thread ran")
    assert calls == ["other thread ran", "fn"]  # another thread's module did not fire it


class PolicyReadyHook:
    """Put in front of a tidal trainer in a test: its ``_policy_ready(own)`` runs each time the
    trainer's adapter asks whether the policy is a role yet (``own()``: the adapter's answer,
    which registers the policy once its optimizer exists)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        own = self.tidal.policy_ready
        self.tidal.policy_ready = lambda: self._policy_ready(own)


def _with_counters(growth: dict[str, int] | None = None):
    """tidal's trainer with the device memory counters a GPU has, on the CPU: every phase
    allocates nothing beyond what it starts with (a fake allocator), or, for the phases in
    ``growth``, reads as allocating that many bytes."""
    from tidal.timeshare.phase_memory import PhaseMemory

    class Memory(PhaseMemory):
        rebased: list[str] = []  # the phases counted from after their switch, in order

        def _read(self) -> None:
            super()._read()
            for phase, nbytes in (growth or {}).items():
                if phase in self.growth:
                    self.growth[phase] = nbytes

        def rebase(self, grown_bytes: int = 0) -> None:
            self.rebased.append(self._phase)
            super().rebase(grown_bytes)

    class Counted(TidalGRPOTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            dev = FakeAllocator()
            self.tidal.schedule.memory = Memory(lambda: dev.now, lambda: dev.high, dev.reset)

    return Counted


@pytest.mark.slow
def test_prefetch_keeps_on_the_device_what_each_turn_has_room_for(tiny, tmp_path, monkeypatch):
    """Issue 26: with prefetch, each turn keeps free what its phase allocated the last time
    (from the second step, once measured) and moves out only what that takes. Three devices,
    faked by the phases' readings, TRL's results the same on each:

    * room for everything (TRL alone fits: the 16 x 32 stress case): after the first step
      nothing moves;
    * no room for the reference beside the loss and its backward (7B, 64 x 256 on an H100): the policy stays
      through the scoring, the loss's turn drops the frozen reference without a copy, the
      generation's prefetch brings it back writing nothing out;
    * no room beside the scoring either: the policy takes turns with the reference;
    * room only in the free pieces of the allocator's partly used segments (the driver's free
      memory one byte short of the backward's need): the loss's turn drops the reference too
      (run i5: they could not hold the backward's blocks);
    * room in the allocator's whole free segments (the same, but none of the cached memory
      fragmented): as with room for everything, nothing moves from the second step (run j1
      dropped the reference every step counting only the driver's free memory)."""
    plain = _run(trl.GRPOTrainer, tiny, tmp_path / "plain")
    cfg = TidalConfig(prefetch=True)
    room = _run(_with_counters(), tiny, tmp_path / "room", tidal_config=cfg)
    # The loss's forward allocates little; its backward (a phase of its own) more than the
    # device has: the loss's turn must count both (run i4 ran out of memory where it did not).
    no_ref = _run(_with_counters({"backward": 1 << 60}), tiny, tmp_path / "no_ref", tidal_config=cfg)
    short = _run(
        _with_counters({"backward": 1 << 60, "reference": 1 << 60}), tiny, tmp_path / "short", tidal_config=cfg
    )
    from tidal.device import DeviceOps

    need = int(1.1 * (1 << 30)) + (256 << 20)  # the backward read as allocating 1 GiB
    monkeypatch.setattr(DeviceOps, "driver_free_bytes", lambda self: (need - 1, 1 << 40))
    monkeypatch.setattr(DeviceOps, "cached_free_bytes", lambda self: 1 << 40)
    monkeypatch.setattr(DeviceOps, "fragmented_free_bytes", lambda self: 1 << 40)
    cached = _run(_with_counters({"backward": 1 << 30}), tiny, tmp_path / "cached", tidal_config=cfg)
    monkeypatch.setattr(DeviceOps, "fragmented_free_bytes", lambda self: 0)
    whole = _run(_with_counters({"backward": 1 << 30}), tiny, tmp_path / "whole", tidal_config=cfg)
    monkeypatch.undo()
    for ours in (room, no_ref, short, cached, whole):
        assert _history(ours) == _history(plain)
        want, got = _weights(plain), _weights(ours)
        assert all(torch.equal(want[k], got[k]) for k in want)
    moves = lambda t: [(r.kind, r.roles_out, r.role_in) for r in t.timeshare.records]  # noqa: E731
    # Every turn's need is counted from after its switch (run i5): generation, the reference's
    # scoring and the loss, in each of the three steps.
    assert room.tidal.schedule.memory.rebased == 3 * ["generate", "reference", "loss"], (
        room.tidal.schedule.memory.rebased
    )

    # Room: the first step (nothing measured) moves the policy out for the reference and the
    # reference out for the loss; the second's generation brings the reference back behind
    # it (prefetch), and from then on no role moves at all.
    first_loss = max(r.index for r in room.timeshare.records if r.role_in == "policy" and r.roles_out == ("reference",))
    later = [r for r in room.timeshare.records if r.index > first_loss and not r.kind.startswith("optim")]
    assert [(r.kind, r.roles_out, r.role_in) for r in later] == [
        ("prefetch", (), "reference"),
        ("reload", (), "reference"),
    ], moves(room)
    assert later[0].bytes_out == 0 and later[1].bytes_in == 0  # (the optimizer state moves around step(), "step")

    # No room for the reference beside the loss: the policy goes out once (the first step),
    # never after; the reference comes in by the generation's prefetch, writing nothing back.
    assert sum("policy" in out for kind, out, _ in moves(no_ref) if kind != "optim-out") == 1, moves(no_ref)
    to_ref = [r for r in no_ref.timeshare.records if r.kind in ("switch", "reload") and r.role_in == "reference"]
    assert [r.roles_out for r in to_ref] == [("policy",), (), ()]
    assert all(r.bytes_prefetched > 0 and r.bytes_in == 0 for r in to_ref[1:])
    ahead = [r for r in no_ref.timeshare.records if r.kind == "prefetch" and r.role_in == "reference"]
    assert len(ahead) == 2 and all(r.bytes_in > 0 and r.bytes_out == 0 for r in ahead)
    # The loss's turn drops the reference, frozen: nothing copied out (after its first
    # offload at construction).
    dropped = [r for r in no_ref.timeshare.records if r.roles_out == ("reference",) and r.index > 0]
    assert len(dropped) == 3 and all(r.bytes_out == 0 for r in dropped)
    # Room only in the fragments: the loss drops the reference as where there is none; in
    # whole free segments: it keeps it, as where the driver has the room.
    assert moves(cached) == moves(no_ref), moves(cached)
    roles_only = lambda t: [m for m in moves(t) if not m[0].startswith("optim")]  # noqa: E731
    assert roles_only(whole) == roles_only(room), moves(whole)  # (less room for the optimizer state ahead)
    # No room beside the scoring either: the policy takes turns with the reference every step.
    assert sum(k == ("switch", ("policy",), "reference") for k in moves(short)) == 3, moves(short)


def _out_of_memory_when_crowded(base):
    """``base`` on a device with no room for any phase beside another role: from the second
    forward of a generation (the first sampled a token), and at once for the scorings and the
    loss, a forward of the policy or the reference raises ``torch.OutOfMemoryError`` while
    another role's state (resident, or brought in by a prefetch) is on the device with it."""

    class Crowded(PolicyReadyHook, base):
        raised = 0

        def _policy_ready(self, own):
            ready = own()
            if ready and not getattr(self, "_crowding", False):
                self._crowding = True
                ts, policy = self.timeshare, self.accelerator.unwrap_model(self.model)
                seen = {"generate": 0}

                def crowded() -> bool:
                    return len(ts.resident_roles) > 1 or bool(ts.store.prefetched_keys())

                def check(module, args):
                    if not crowded():
                        seen["generate"] = 0
                        return
                    generating = module is policy and not torch.is_grad_enabled() and self.tidal.schedule.depth == 1
                    seen["generate"] += generating
                    if not generating or seen["generate"] >= 2:
                        type(self).raised += 1
                        raise torch.OutOfMemoryError("CUDA out of memory (faked by the test)")

                policy.register_forward_pre_hook(check)
                self.ref_model.register_forward_pre_hook(check)
            return ready

    return Crowded


@pytest.mark.slow
def test_a_phase_out_of_memory_beside_the_roles_its_turn_kept_runs_again_with_the_same_results(tiny, tmp_path):
    """A phase that needs more than its last reading (a batch of longer prompts or completions)
    runs out of memory beside the roles its turn kept: they go, the random generators are set
    back, and it runs again. Here every phase runs out of memory with another role on the device
    (the device has room for what the last step measured, nothing more): the generation after a
    sampled token (the reference prefetched behind it), the reference's scoring (the policy
    kept), the loss's forward (the reference kept). TRL's results do not change, and the log
    counts the runs again."""
    plain = _run(trl.GRPOTrainer, tiny, tmp_path / "plain", temperature=1.0)
    cls = _out_of_memory_when_crowded(_with_counters())
    with pytest.warns(UserWarning, match="ran out of device memory beside the roles its turn kept"):
        ours = _run(cls, tiny, tmp_path / "ours", tidal_config=TidalConfig(prefetch=True), temperature=1.0)
    assert _history(ours) == _history(plain)
    want, got = _weights(plain), _weights(ours)
    assert all(torch.equal(want[k], got[k]) for k in want)
    # The first step measures (nothing kept, nothing raised); the second and third run the
    # generation, the reference's scoring and the loss's forward again, once each.
    retries = [h["tidal/oom_retries"] for h in ours.state.log_history if "loss" in h]
    assert retries == [0, 3, 3] and cls.raised == 6, (retries, cls.raised)


@pytest.mark.slow
def test_out_of_memory_with_nothing_beside_the_role_goes_on_as_it_came(tiny, tmp_path):
    """Where the turn kept nothing (no prefetch: every other role is out), an out-of-memory
    error is the run's own: it is raised, not hidden by a second run."""

    class Short(TidalGRPOTrainer):
        def _generate(self, prompts):
            policy = self.accelerator.unwrap_model(self.model)

            def fail(*a, **kw):
                raise torch.OutOfMemoryError("CUDA out of memory (faked by the test)")

            policy.generate = fail
            return super()._generate(prompts)

    for cfg in (TidalConfig(), TidalConfig(prefetch=True)):
        with pytest.raises(torch.OutOfMemoryError, match="faked by the test"):
            _run(Short, tiny, tmp_path / f"short{cfg.prefetch}", tidal_config=cfg, max_steps=1)


@pytest.mark.slow
def test_the_optimizer_states_prefetch_leaves_the_backward_room_outside_the_allocators_fragments(
    tiny, tmp_path, monkeypatch
):
    """The optimizer state comes in as the backward starts, as much as leaves the backward's
    need free. The free pieces of the allocator's partly used segments cannot hold the
    backward's large blocks: they do not count as its room (the loss's keep already left them
    out; the prefetch counted them. A 7B stream+prefetch step ran out of memory at its second
    step, the first with this prefetch: a likely cause, not confirmed on a GPU). Here the free
    memory read is the backward's need less a byte plus 1 GiB of fragments: nothing may come in
    ahead (before: all of it)."""
    from tidal.device import DeviceOps

    plain = _run(trl.GRPOTrainer, tiny, tmp_path / "plain")
    need = int(1.1 * (1 << 30)) + (256 << 20)  # the backward read as allocating 1 GiB
    # The free memory read: the backward's need less a byte, and 1 GiB more that lies in the
    # allocator's fragments (the store reads free memory as the driver's plus the cache's).
    monkeypatch.setattr(DeviceOps, "driver_free_bytes", lambda self: (need - 1 + (1 << 30), 1 << 40))
    monkeypatch.setattr(DeviceOps, "fragmented_free_bytes", lambda self: 1 << 30)
    cfg = TidalConfig(prefetch=True)
    frag = _run(_with_counters({"backward": 1 << 30}), tiny, tmp_path / "frag", tidal_config=cfg)
    monkeypatch.setattr(DeviceOps, "fragmented_free_bytes", lambda self: 0)
    whole = _run(_with_counters({"backward": 1 << 30}), tiny, tmp_path / "whole", tidal_config=cfg)
    monkeypatch.undo()
    for ours in (frag, whole):
        assert _history(ours) == _history(plain)
        want, got = _weights(plain), _weights(ours)
        assert all(torch.equal(want[k], got[k]) for k in want)
    ahead = lambda t: [r.bytes_in for r in t.timeshare.records if r.kind == "optim-prefetch"]  # noqa: E731
    assert len(ahead(whole)) == 2 and all(n > 0 for n in ahead(whole)), ahead(whole)
    assert all(n == 0 for n in ahead(frag)), ahead(frag)


def _crowded(ts) -> bool:
    """Another role, or a prefetch (the optimizer state's included), is on the device beside the
    policy."""
    return len(ts.resident_roles) > 1 or bool(ts.store.prefetched_keys())


@pytest.mark.slow
@pytest.mark.parametrize("residency", ["step", "stream"])
def test_a_backward_out_of_memory_beside_what_tidal_kept_runs_again_with_the_same_results(
    tiny, tmp_path, monkeypatch, residency
):
    """The loss's backward runs out of memory while the reference kept through the loss (the
    device read as having room for it) and the optimizer state brought in behind the backward
    are on the device: they go, the gradients the failed backward left are dropped, and the
    micro-batch's forward and backward run again from the same inputs (no second generation).
    TRL's results do not change; the log counts the runs again."""
    from tidal.device import DeviceOps

    plain = _run(trl.GRPOTrainer, tiny, tmp_path / "plain")
    monkeypatch.setattr(DeviceOps, "driver_free_bytes", lambda self: (1 << 40, 1 << 41))
    monkeypatch.setattr(DeviceOps, "fragmented_free_bytes", lambda self: 0)
    seen = {"raised": 0, "generations": 0}

    class Crowded(PolicyReadyHook, _with_counters({"backward": 1 << 30})):
        def _generate(self, prompts):
            seen["generations"] += 1
            return super()._generate(prompts)

        def _policy_ready(self, own):
            ready = own()
            if ready and not getattr(self, "_crowding", False):
                self._crowding = True

                def check(grad):  # the backward's last gradient: the others are in by now
                    if _crowded(self.timeshare):
                        seen["raised"] += 1
                        raise torch.OutOfMemoryError("CUDA out of memory (faked by the test)")

                self.accelerator.unwrap_model(self.model).model.embed_tokens.weight.register_hook(check)
            return ready

    cfg = TidalConfig(prefetch=True, optimizer_residency=residency)
    with pytest.warns(UserWarning, match="loss forward and backward ran out of device memory"):
        ours = _run(Crowded, tiny, tmp_path / "ours", tidal_config=cfg)
    assert _history(ours) == _history(plain)
    want, got = _weights(plain), _weights(ours)
    assert all(torch.equal(want[k], got[k]) for k in want)
    # The first step measures (nothing kept or prefetched beside its backward); the second and
    # third run their backward again once each, generating once per step all the same.
    retries = [h["tidal/oom_retries"] for h in ours.state.log_history if "loss" in h]
    assert retries == [0, 1, 1] and seen["raised"] == 2, (retries, seen)
    assert seen["generations"] == 3


@pytest.mark.slow
def test_a_backward_after_accumulated_gradients_is_not_run_again(tiny, tmp_path, monkeypatch):
    """With gradients accumulated over two micro-batches, the second's backward adds to the
    first's: a failed one cannot be taken back bit for bit, so its out-of-memory error goes on
    as it came."""
    from tidal.device import DeviceOps

    monkeypatch.setattr(DeviceOps, "driver_free_bytes", lambda self: (1 << 40, 1 << 41))
    monkeypatch.setattr(DeviceOps, "fragmented_free_bytes", lambda self: 0)

    class Crowded(PolicyReadyHook, _with_counters({"backward": 1 << 30})):
        def _policy_ready(self, own):
            ready = own()
            if ready and not getattr(self, "_crowding", False):
                self._crowding = True
                policy = self.accelerator.unwrap_model(self.model)

                def check(grad):
                    if _crowded(self.timeshare) and policy.model.embed_tokens.weight.grad is not None:
                        raise torch.OutOfMemoryError("CUDA out of memory (faked by the test)")

                policy.model.embed_tokens.weight.register_hook(check)
            return ready

    cfg = TidalConfig(prefetch=True)
    with pytest.raises(torch.OutOfMemoryError, match="faked by the test"):
        _run(
            Crowded,
            tiny,
            tmp_path / "acc",
            tidal_config=cfg,
            per_device_train_batch_size=4,
            gradient_accumulation_steps=2,
        )


def _marking_the_step(base, box):
    """``base`` that holds ``box["in_step"]`` True from the room made before the policy's
    optimizer step to the step's measure after it, and puts itself in ``box["trainer"]``."""

    class Marked(base):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            box["trainer"] = self
            retry = self.tidal.retry
            room, measured = retry.room_for_step, retry.step_measured

            def room_for_step():
                room()
                box["in_step"] = True

            def step_measured():
                box["in_step"] = False
                measured()

            retry.room_for_step, retry.step_measured = room_for_step, step_measured

    return Marked


def _in_step_beside_another_role(box) -> bool:
    t = box.get("trainer")
    return bool(box.get("in_step")) and t is not None and len(t.timeshare.resident_roles) > 1


class _RaiseWhere(tidal.device.SyncPolicy):
    """Raises ``torch.OutOfMemoryError`` at the named point of a transition while ``when()``."""

    def __init__(self, name, when):
        self.name, self.when, self.raised = name, when, 0

    def point(self, name):
        if name == self.name and self.when():
            self.raised += 1
            raise torch.OutOfMemoryError("CUDA out of memory (faked by the test)")


@pytest.mark.slow
def test_an_optimizer_step_out_of_memory_bringing_its_state_in_runs_again_with_the_same_results(
    tiny, tmp_path, monkeypatch
):
    """The optimizer step runs out of memory while tidal brings its state in beside the
    reference the loss's turn kept (before the update touches anything): the reference goes and
    the step runs again, completing exactly this step. TRL's results do not change. (The device
    is read as having room for the backward's need and 100 kB: the reference stays through the
    loss, a part of the optimizer state comes in behind the backward, the step brings the rest.)"""
    from tidal.device import DeviceOps, use_sync_policy

    plain = _run(trl.GRPOTrainer, tiny, tmp_path / "plain")
    need = int(1.1 * (1 << 30)) + (256 << 20)  # the backward read as allocating 1 GiB
    monkeypatch.setattr(DeviceOps, "driver_free_bytes", lambda self: (need + 100_000, 1 << 41))
    monkeypatch.setattr(DeviceOps, "fragmented_free_bytes", lambda self: 0)
    box = {}
    Kept = _marking_the_step(_with_counters({"backward": 1 << 30}), box)
    with use_sync_policy(_RaiseWhere("reload_allocated", lambda: _in_step_beside_another_role(box))) as policy:
        with pytest.warns(UserWarning, match="optimizer step ran out of device memory"):
            ours = _run(Kept, tiny, tmp_path / "ours", tidal_config=TidalConfig(prefetch=True))
    assert _history(ours) == _history(plain)
    want, got = _weights(plain), _weights(ours)
    assert all(torch.equal(want[k], got[k]) for k in want)
    retries = [h["tidal/oom_retries"] for h in ours.state.log_history if "loss" in h]
    # The first step creates the state (nothing to bring in); the second and third bring it in
    # beside the kept reference, run out, and step again.
    assert retries == [0, 1, 1] and policy.raised == 2, (retries, policy.raised)


@pytest.mark.slow
def test_an_optimizer_step_out_of_memory_in_its_update_goes_on_as_it_came(tiny, tmp_path, monkeypatch):
    """Where the update's own arithmetic runs out of memory, some of the state has changed: the
    step is not run again, its error goes on as it came."""
    from tidal.device import DeviceOps

    monkeypatch.setattr(DeviceOps, "driver_free_bytes", lambda self: (1 << 40, 1 << 41))
    monkeypatch.setattr(DeviceOps, "fragmented_free_bytes", lambda self: 0)

    class Crowded(PolicyReadyHook, _with_counters()):
        def _policy_ready(self, own):
            ready = own()
            if ready and not getattr(self, "_crowding", False):
                self._crowding = True

                def update(opt, args, kwargs):  # after tidal's hooks: the update's first work
                    if len(self.timeshare.resident_roles) > 1:
                        raise torch.OutOfMemoryError("CUDA out of memory (faked by the test)")

                self.optimizer.optimizer.register_step_pre_hook(update)
            return ready

    with pytest.raises(torch.OutOfMemoryError, match="faked by the test"):
        _run(Crowded, tiny, tmp_path / "math", tidal_config=TidalConfig(prefetch=True))


def test_a_phase_keeps_the_most_the_allocators_fragments_reached_while_it_ran():
    from tidal.timeshare.phase_memory import PhaseMemory

    gib = 1 << 30
    dev = FakeAllocator()
    frags = {"now": 0, "high": 0}

    def reset():
        dev.reset()
        frags["high"] = frags["now"]

    def split(nbytes):
        frags["now"] = nbytes
        frags["high"] = max(frags["high"], nbytes)

    memory = PhaseMemory(lambda: dev.now, lambda: dev.high, reset, lambda: frags["high"])
    memory.start("loss")
    split(1 * gib)
    memory.start("backward")
    split(3 * gib)  # the backward's gathers and reductions split segments as it goes
    split(2 * gib)
    memory.take_peaks()  # a log line inside the phase keeps its reading
    split(1 * gib)
    memory.start("generate")
    assert memory.fragments == {"loss": 1 * gib, "backward": 3 * gib}


def test_each_log_line_carries_the_fragments_each_phase_reached_the_last_time_it_ran(tiny, tmp_path):
    """On a GPU the log says, per phase, the most the allocator's fragments reached the last
    time it ran (``tidal/fragments_gib/<phase>``): what the prefetches and keeps leave free
    for them, so that a prefetch that brought less than the room seemed to allow can be read
    from the log. Faked here: each reading 1 GiB below the one before, so that the last run's
    most differs from the most ever reached."""
    from tidal.timeshare.phase_memory import PhaseMemory

    gib = 1 << 30
    start = 1000

    class Fragmented(TidalGRPOTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            dev = FakeAllocator()
            readings = iter(range(start, 0, -1))
            self.tidal.schedule.memory = PhaseMemory(
                lambda: dev.now, lambda: dev.high, dev.reset, lambda: next(readings) * gib
            )

    trainer = _run(Fragmented, tiny, tmp_path / "frag", tidal_config=TidalConfig(prefetch=True))
    lines = [h for h in trainer.state.log_history if "loss" in h]
    assert len(lines) == 3
    memory = trainer.tidal.schedule.memory
    logged = [{k.rsplit("/", 1)[-1]: v for k, v in h.items() if k.startswith("tidal/fragments_gib/")} for h in lines]
    for got in logged:
        assert {"generate", "reference", "loss", "backward"} <= set(got), got
        assert all(0 < v <= start and v == int(v) for v in got.values()), got  # whole GiB, as read
    # The last run's most, not the most ever: each generation reads less than the one before.
    assert logged[0]["generate"] > logged[1]["generate"] > logged[2]["generate"], logged
    # The last line's figures are the memory's own (the backward, which holds the log line, read
    # on after it, but lower: its most stayed the one logged).
    assert logged[-1] == {phase: nbytes / gib for phase, nbytes in memory.fragments.items()}


@pytest.mark.slow
def test_the_optimizer_states_prefetch_leaves_room_for_the_fragments_the_backward_made(tiny, tmp_path, monkeypatch):
    """FSDP2's backward splits the allocator's segments as it goes (per-unit gathers and
    reductions): a 14B-shape step ran out of memory on an H100 with 2.92 GiB of fragments, the
    optimizer state having come in as far as the backward's own growth allowed. The fragments'
    peak in the last backward counts as room the backward takes: here the free memory read is
    the backward's need less a byte plus 1 GiB, and the last backward's fragments reached 1 GiB
    (none now): nothing may come in ahead (before: all of it)."""
    from tidal.device import DeviceOps
    from tidal.timeshare.phase_memory import PhaseMemory

    plain = _run(trl.GRPOTrainer, tiny, tmp_path / "plain")
    need = int(1.1 * (1 << 30)) + (256 << 20)  # the backward read as allocating 1 GiB
    monkeypatch.setattr(DeviceOps, "driver_free_bytes", lambda self: (need - 1 + (1 << 30), 1 << 40))
    monkeypatch.setattr(DeviceOps, "fragmented_free_bytes", lambda self: 0)

    def fragmented(nbytes):
        class Split(_with_counters({"backward": 1 << 30})):
            def __init__(self, *a, **kw):
                super().__init__(*a, **kw)
                read = type(self.tidal.schedule.memory)._read

                def _read(memory):
                    read(memory)
                    if "backward" in memory.fragments or "backward" in memory.growth:
                        memory.fragments["backward"] = nbytes

                self.tidal.schedule.memory._read = lambda: _read(self.tidal.schedule.memory)
                assert isinstance(self.tidal.schedule.memory, PhaseMemory)

        return Split

    cfg = TidalConfig(prefetch=True)
    split = _run(fragmented(1 << 30), tiny, tmp_path / "split", tidal_config=cfg)
    whole = _run(fragmented(0), tiny, tmp_path / "whole", tidal_config=cfg)
    monkeypatch.undo()
    for ours in (split, whole):
        assert _history(ours) == _history(plain)
        want, got = _weights(plain), _weights(ours)
        assert all(torch.equal(want[k], got[k]) for k in want)
    ahead = lambda t: [r.bytes_in for r in t.timeshare.records if r.kind == "optim-prefetch"]  # noqa: E731
    assert len(ahead(whole)) == 2 and all(n > 0 for n in ahead(whole)), ahead(whole)
    assert all(n == 0 for n in ahead(split)), ahead(split)


@pytest.mark.slow
def test_the_optimizer_step_wrapper_keeps_torch_lr_schedulers_working(tiny, tmp_path):
    """With prefetch the policy's ``optimizer.step`` is tidal's (it makes room and runs again):
    still a method of the optimizer, so Trainer's LR scheduler counts its steps without a
    warning and a scheduler built on it later wraps it as it would the optimizer's own."""
    import warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ours = _run(TidalGRPOTrainer, tiny, tmp_path / "ours", tidal_config=TidalConfig(prefetch=True), max_steps=2)
    assert not [w for w in seen if "lr_scheduler" in str(w.message) or "overridden" in str(w.message)]
    opt = ours.optimizer.optimizer
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    lr = opt.param_groups[0]["lr"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()
        scheduler.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(lr * 0.5)
