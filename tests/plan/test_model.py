"""The memory model: hand-computed small cases and the effect of every lever."""

import dataclasses
import json

import pytest

from tidal.plan import Bandwidth, ModelShape, PlanConfig, build_plan, predict_phases, preset
from tidal.plan.activations import kv_cache_bytes_per_token, layer_saved_bytes_per_token

# A Llama-style toy: per layer 7 linears (4096+2048+2048+4096+3*8192) + 2 norms (128).
TOY = ModelShape(
    name="toy",
    layers=2,
    hidden=64,
    intermediate=128,
    heads=4,
    kv_heads=2,
    head_dim=16,
    vocab=100,
    tied_embeddings=False,
)
N_TOY = 100 * 64 + 64 + 100 * 64 + 2 * 36992


def _toy(**kw) -> PlanConfig:
    base = dict(shape=TOY, prompts=2, group=2, prompt_len=8, gen_len=8, micro_batch=2, padding_mask=False, misc_bytes=0)
    return PlanConfig(**{**base, **kw})


def test_toy_by_hand():
    assert TOY.param_count() == N_TOY == 86848
    # norms 8h+4eh+8, q and attention output e*q each, k+v 2e*kv, lse 4H, MLP 4ei
    assert layer_saved_bytes_per_token(TOY, e=2, seq=16, padding_mask=False) == 1032 + 128 + 128 + 128 + 16 + 1024
    assert kv_cache_bytes_per_token(TOY, kv_e=2) == 2 * 2 * 32 * 2
    plan = build_plan(_toy())
    p = N_TOY * 2
    train = plan.timeshared["train"]
    assert train.resident == {"actor params": p, "grads": p, "optimizer states": 2 * p}  # 2 micro-batches
    step = plan.timeshared["optimizer_step"]
    assert step.transient == {"adamw step temporary": p}
    assert plan.timeshared["rollout"].resident == {"actor params": p}
    # Rollout peak here is the prefill of 4 x 8 prompt tokens: prompt KV + the MLP moment of one
    # layer (4eh + 3ei) + rotary cos/sin (2 e head_dim) per token.
    assert plan.timeshared["rollout"].transient == {
        "kv cache": 4 * 8 * 256,
        "prefill workspace": 4 * 8 * (4 * 2 * 64 + 3 * 2 * 128 + 2 * 2 * 16),
    }
    assert plan.timeshared["reference"].resident == {"reference params": p}
    # all resident: actor + reference + optimizer states in every phase, grads in train
    assert plan.all_resident["train"].resident == {
        "actor params": p,
        "reference params": p,
        "optimizer states": 2 * p,
        "grads": p,
    }
    assert plan.all_resident["train"].transient == train.transient
    first = plan.transitions[0]
    assert (first.before, first.after, first.bytes_out, first.bytes_in) == ("rollout", "reference", p, p)
    assert first.seconds == pytest.approx(max(p / 55e9, 2 * p / 100e9))
    moved = {(t.before, t.after): (t.bytes_out, t.bytes_in) for t in plan.transitions}
    assert moved[("reference", "train")] == (p, 3 * p)
    assert moved[("optimizer_step", "rollout")] == (2 * p, 0)


def test_train_activations_by_formula_and_checkpointing():
    tokens = 2 * 16
    per_layer = layer_saved_bytes_per_token(TOY, e=2, seq=16, padding_mask=False)
    plain = build_plan(_toy(logprob_span="completion")).timeshared["train"].transient
    assert plain["saved activations"] == 2 * tokens * per_layer
    ckpt = build_plan(_toy(grad_ckpt=True)).timeshared["train"].transient
    assert ckpt["saved activations"] == 2 * tokens * 64 * 2  # the layer inputs only
    big = dict(shape=preset("qwen2-1.5b"), micro_batch=8, prompt_len=512, gen_len=1536)
    a = build_plan(PlanConfig(**big)).timeshared["train"]
    b = build_plan(PlanConfig(**big, grad_ckpt=True)).timeshared["train"]
    c = build_plan(PlanConfig(**big, grad_ckpt=True, act_offload=True)).timeshared["train"]
    assert a.transient["saved activations"] > 10 * b.transient["saved activations"]
    assert a.peak_bytes > b.peak_bytes > c.peak_bytes


def test_zero_stages_shard_what_they_should():
    s = preset("qwen2-7b")

    def res(stage):
        r = build_plan(PlanConfig(shape=s, zero_stage=stage, dp=4, micro_batch=1, prompts=4, group=1)).timeshared
        return r["optimizer_step"].resident, r["train"].transient

    full_p, full_g, full_o = s.param_count() * 2, s.param_count() * 2, s.param_count() * 4
    r0, t0 = res(0)
    assert (r0["actor params"], r0["grads"], r0["optimizer states"]) == (full_p, full_g, full_o)
    r1, _ = res(1)
    assert (r1["actor params"], r1["grads"], r1["optimizer states"]) == (full_p, full_g, full_o // 4)
    r2, _ = res(2)
    assert (r2["actor params"], r2["grads"], r2["optimizer states"]) == (full_p, full_g // 4, full_o // 4)
    r3, t3 = res(3)
    assert (r3["actor params"], r3["grads"], r3["optimizer states"]) == (full_p // 4, full_g // 4, full_o // 4)
    assert t3["zero3 gathered params"] == (s.root_params() + 2 * s.layer_params()) * 2
    assert "zero3 gathered params" not in t0


def test_lora_shrinks_trainable_state_and_shares_the_reference():
    s = preset("qwen2-1.5b")
    full = build_plan(PlanConfig(shape=s))
    lora = build_plan(PlanConfig(shape=s, lora_rank=16))
    lr = lora.timeshared["optimizer_step"].resident
    assert lr["optimizer states"] == s.lora_params(16) * 2 * 4  # fp32 adapters, two moments
    assert lr["grads"] == s.lora_params(16) * 4 < full.timeshared["optimizer_step"].resident["grads"] / 20
    assert "reference params" not in lora.timeshared["reference"].resident
    assert lora.all_resident_peak_bytes < full.all_resident_peak_bytes
    assert all(t.bytes_out + t.bytes_in < 1 << 30 for t in lora.transitions)  # only adapter state moves


def test_optimizer_choices():
    s = preset("qwen2-1.5b")
    gpu = build_plan(PlanConfig(shape=s)).timeshared
    off = build_plan(PlanConfig(shape=s, optimizer="adamw_offload")).timeshared
    cpu = build_plan(PlanConfig(shape=s, optimizer="cpu_adam", cpu_adam_grad_accumulation="host"))
    assert "optimizer states" not in off["train"].resident
    assert off["optimizer_step"].resident["optimizer states"] == gpu["optimizer_step"].resident["optimizer states"]
    for ph in cpu.timeshared.values():
        assert "optimizer states" not in ph.resident and "grads" not in ph.resident
    assert cpu.streamed["cpu adam weights H2D (fp32)"] == s.param_count() * 4
    # Tied embedding: its gradient (bf16 + fp32 cast) leaves last, next to at most 512 MiB of
    # earlier copies still pending (CPUAdam(max_inflight_bytes=512 MiB)).
    short = (
        build_plan(
            PlanConfig(
                shape=s,
                optimizer="cpu_adam",
                grad_ckpt=True,
                micro_batch=1,
                prompt_len=16,
                gen_len=16,
                cpu_adam_grad_accumulation="host",
            )
        )
        .timeshared["train"]
        .transient
    )
    assert short == {"cpu adam grads in flight (incl. the largest)": (512 << 20) + s.largest_param() * (2 + 4)}


def test_cpu_adam_gradient_accumulation_on_the_device_or_the_host():
    """Summed on the device: the train phase holds every gradient (as AdamW does), only the
    fp32 sums cross, and the host has no staging; summed on the host: the reverse."""
    s = preset("qwen2-1.5b")
    kw = dict(shape=s, optimizer="cpu_adam", prompts=8, group=8, micro_batch=16, grad_ckpt=True)
    dev = build_plan(PlanConfig(**kw))  # the default: "device"
    host = build_plan(PlanConfig(**kw, cpu_adam_grad_accumulation="host"))
    n, mb = s.param_count(), 4
    assert PlanConfig(**kw).micro_batches == mb
    assert dev.timeshared["train"].resident["grads"] == n * 2
    assert "grads" not in host.timeshared["train"].resident
    assert dev.streamed["cpu adam grads D2H"] == n * 4
    assert host.streamed["cpu adam grads D2H"] == n * (4 + 2 * (mb - 1))
    assert host.host["CPU Adam gradient staging (trainable dtype)"] == n * 2
    assert "CPU Adam gradient staging (trainable dtype)" not in dev.host
    assert host.host_bytes - dev.host_bytes == n * 2
    assert dev.timeshared["train"].peak_bytes > host.timeshared["train"].peak_bytes
    # One micro-batch: nothing to sum, both the same on the device.
    one = dict(kw, micro_batch=64)
    assert (
        build_plan(PlanConfig(**one)).timeshared["train"]
        == build_plan(PlanConfig(**one, cpu_adam_grad_accumulation="host")).timeshared["train"]
    )
    with pytest.raises(ValueError, match="cpu_adam_grad_accumulation must be"):
        PlanConfig(shape=s, cpu_adam_grad_accumulation="gpu")


def test_timeshare_beats_all_resident_and_modes_agree():
    plan = build_plan(PlanConfig(shape="qwen2-1.5b"))
    assert plan.timeshare_peak_bytes < plan.all_resident_peak_bytes
    off = build_plan(PlanConfig(shape="qwen2-1.5b", timeshare=False))
    assert off.peak_bytes == plan.all_resident_peak_bytes and not off.transitions
    assert plan.device_peak_bytes == plan.peak_bytes + plan.config.cuda_context_bytes


def test_predict_phases_hook():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen2Config(
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        vocab_size=151936,
        tie_word_embeddings=True,
    )
    got = predict_phases(ModelShape.from_hf_config(cfg), prompts=4, group=4, micro_batch=2, grad_ckpt=True)
    assert set(got) == {"rollout", "reference", "train", "optimizer_step", "cuda_context"}
    plan = build_plan(PlanConfig(shape="qwen2-0.5b", prompts=4, group=4, micro_batch=2, grad_ckpt=True))
    assert all(got[p] == plan.timeshared[p].peak_bytes for p in plan.timeshared)
    assert got["cuda_context"] == 500 << 20
    assert predict_phases(cfg, prompts=4, group=4, micro_batch=2, grad_ckpt=True)["train"] == got["train"]


def test_bandwidth_from_bench_json(tmp_path):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"line_rate": {"d2h_gbps": 50.0, "h2d_gbps": 40.0, "bidir_gbps": 80.0}}))
    bw = Bandwidth.from_bench_json(str(path))
    assert bw.seconds(0, 40_000_000_000) == pytest.approx(1.0)
    assert bw.seconds(40e9, 40e9) == pytest.approx(1.0)  # both ways: 80e9 bytes at 80 GB/s
    with pytest.raises(ValueError, match="line_rate"):
        Bandwidth.from_bench_json({"other": 1})


def test_invalid_configs_are_refused():
    for bad in (
        dict(optimizer="sgd"),
        dict(zero_stage=4),
        dict(param_dtype="int8"),
        dict(micro_batch=0),
        dict(lora_rank=4, lora_targets=("nope",)),
    ):
        with pytest.raises(ValueError):
            PlanConfig(shape="qwen2-0.5b", **bad)


def test_trls_fused_lm_head_holds_one_logit_tile_and_its_backward_the_head_gradient_in_fp32_and_cast():
    # TRL's fused LM head (trl.kernels.chunked_logprob): tiles of 4096 tokens x 32768 ids.
    shape = preset("qwen2-7b")
    base = dict(
        shape=shape,
        prompts=8,
        group=8,
        prompt_len=8,
        gen_len=256,
        micro_batch=64,
        grad_ckpt=True,
        logprob_span="completion",
        misc_bytes=0,
    )
    fused = build_plan(PlanConfig(**base, lm_head="fused"))
    logits = build_plan(PlanConfig(**base, completion_logits=True))
    v, h, n = shape.vocab, shape.hidden, 64 * 256
    # Scoring: a decoder layer's workspace outweighs the head's tile, far below the logits of
    # the completion (model dtype) and their fp32 log-softmax.
    assert set(fused.timeshared["reference"].transient) == {"layer workspace"}
    assert fused.timeshared["reference"].transient_bytes < logits.timeshared["reference"].transient_bytes / 5
    from tidal.plan.phases import _fused_forward

    head = _fused_forward(PlanConfig(**base, lm_head="fused"), 64)
    assert head["fused head: logit tile"] == 4096 * 32768 * 2
    assert head["fused head: completion hidden states"] == n * h * 2
    assert head["final hidden"] == 64 * 264 * h * 2
    # Where the head's share is the larger (a wide vocabulary, a narrow model), it is the transient.
    wide = dataclasses.replace(TOY, vocab=200_000)
    c = _toy(shape=wide, lm_head="fused", logprob_span="completion")
    assert build_plan(c).timeshared["reference"].transient == _fused_forward(c, c.micro_batch)
    from tidal.plan.phases import _fused_backward, role_state, train_transient

    cfg = PlanConfig(**base, lm_head="fused")
    back = _fused_backward(cfg, role_state(cfg))
    assert back["fused head: weight gradient (fp32 + cast)"] == v * h * (4 + 2)
    assert back["fused head: hidden-state gradient (fp32 + cast)"] == n * h * (4 + 2)
    assert back["fused head: logit tile"] == 4096 * 32768 * 2
    # 7B: the peak is the last layers' backward with every gradient made, not the head's.
    assert "saved activations" in fused.timeshared["train"].transient
    assert fused.timeshared["train"].resident["grads"] == shape.param_count() * 2
    # A wide head on a narrow model: the head's backward is the peak. In the first (here only)
    # micro-batch no gradient exists before it (its own is counted once, among its parts).
    c1 = _toy(shape=wide, lm_head="fused", logprob_span="completion", micro_batch=4)
    parts, grads = train_transient(c1, role_state(c1))
    assert "fused head: weight gradient (fp32 + cast)" in parts and grads == 0
    c2 = _toy(shape=wide, lm_head="fused", logprob_span="completion", micro_batch=1)
    parts, grads = train_transient(c2, role_state(c2))
    assert "fused head: weight gradient (fp32 + cast)" in parts and grads == role_state(c2)["grads"]
    # LoRA freezes the head: no weight gradient.
    lora = _fused_backward(c1.replace(lora_rank=4), role_state(c1.replace(lora_rank=4)))
    assert lora["fused head: weight gradient (fp32 + cast)"] == 0
    # fp32 gradients are their own cast (.to(fp32) returns the tensor): 4 bytes, not 8; the tile
    # is TRL's full 32768 ids even where the vocabulary is narrower (the toy's 200,000 is wider).
    f32 = _toy(shape=wide, lm_head="fused", logprob_span="completion", micro_batch=4, param_dtype="fp32")
    back32 = _fused_backward(f32, role_state(f32))
    assert back32["fused head: weight gradient (fp32 + cast)"] == wide.vocab * wide.hidden * 4
    assert back32["fused head: hidden-state gradient (fp32 + cast)"] == 4 * 8 * wide.hidden * 4
    narrow = dataclasses.replace(TOY, vocab=1000)
    cn = _toy(shape=narrow, lm_head="fused", logprob_span="completion")
    assert _fused_backward(cn, role_state(cn))["fused head: logit tile"] == min(2 * 8, 4096) * 32768 * 2


def test_fsdp2_rollout_gathers_the_whole_policy_once_or_two_units_per_token():
    shape = preset("qwen2.5-14b")
    base = dict(shape=shape, prompts=16, group=8, prompt_len=8, gen_len=256, micro_batch=16, zero_stage=3, dp=2)
    per_unit = build_plan(PlanConfig(**base)).timeshared["rollout"].transient
    whole = build_plan(PlanConfig(**base, zero3_rollout="whole")).timeshared
    assert "zero3 whole policy gathered" not in per_unit and per_unit["zero3 gathered params"] > 0
    assert whole["rollout"].transient["zero3 whole policy gathered"] == shape.param_count() * 2
    # The other phases gather per unit as before.
    assert whole["train"].transient["zero3 gathered params"] == per_unit["zero3 gathered params"]
    # One GPU: nothing is sharded, nothing gathered.
    one = build_plan(PlanConfig(**{**base, "dp": 1, "prompts": 8}, zero3_rollout="whole")).timeshared["rollout"]
    assert not any("gathered" in k for k in one.transient)


def test_fsdp2_gradients_unsharded_through_micro_batches_and_traded_with_activations_in_one():
    """Under accumulation FSDP2 (accelerate's no_sync) holds every gradient unsharded until the
    last micro-batch; reduce-scattered each micro-batch (sync_each_micro_batch) only the shards.
    In one micro-batch the sharded gradients arrive as the activations go: the larger counts."""
    shape = preset("qwen2.5-32b")
    base = dict(shape=shape, prompts=32, group=8, prompt_len=8, gen_len=256, zero_stage=3, dp=4, grad_ckpt=True)
    base.update(lm_head="fused", logprob_span="completion")  # the peak in the layers' backward, not the head's
    acc = build_plan(PlanConfig(**base, micro_batch=16)).timeshared["train"]
    assert acc.resident["grads (unsharded through the micro-batches)"] == shape.param_count() * 2
    synced = build_plan(PlanConfig(**base, micro_batch=16, sync_each_micro_batch=True)).timeshared["train"]
    assert synced.resident["grads"] == -(-shape.param_count() * 2 // 4)
    assert acc.peak_bytes - synced.peak_bytes >= shape.param_count() * 2 * 3 // 4 - (1 << 30)
    one = build_plan(PlanConfig(**base, micro_batch=64)).timeshared["train"]
    grads = one.resident["grads"]
    ddp = build_plan(PlanConfig(**{**base, "zero_stage": 0}, micro_batch=64)).timeshared["train"]
    saved = ddp.transient["saved activations"]  # what one micro-batch of 64 saves, unsharded or not
    assert grads > saved and "saved activations" not in one.transient  # the larger: the gradients
    one_small = build_plan(PlanConfig(**{**base, "gen_len": 8192}, micro_batch=64)).timeshared["train"]
    assert one_small.transient["saved activations"] > 0  # activations larger than the gradients: the excess


def test_fused_head_and_rollout_settings_are_checked():
    with pytest.raises(ValueError, match="logprob_span='completion'"):
        _toy(lm_head="fused")
    with pytest.raises(ValueError, match="no action_vocab"):
        _toy(lm_head="fused", logprob_span="completion", action_vocab=10)
    with pytest.raises(ValueError, match="lm_head must be one of"):
        _toy(lm_head="chunked")
    with pytest.raises(ValueError, match="zero3_rollout must be one of"):
        _toy(zero3_rollout="all")


def test_in_one_micro_batch_on_one_gpu_the_backward_holds_the_gradients_made_so_far():
    """One micro-batch on one GPU: the gradients arrive as the backward walks down the layers,
    so its highest moment is the first layer it reaches (every saved activation, the head's,
    the norm's and that layer's gradients) or the last (one layer's activations beside every
    gradient, the embedding's counted as a bound), never every activation beside every
    gradient. From a second micro-batch on, every gradient exists throughout."""
    from tidal.plan.phases import role_state, train_transient

    shape = preset("qwen2-7b")
    base = dict(
        shape=shape,
        prompts=8,
        group=8,
        prompt_len=8,
        gen_len=256,
        logprob_span="completion",
        lm_head="fused",
        misc_bytes=0,
    )
    seq, e = 264, 2

    def saved_layer(mb: int) -> int:
        return mb * seq * layer_saved_bytes_per_token(shape, e=e, seq=seq)

    ckpt = PlanConfig(**base, micro_batch=64, grad_ckpt=True)  # a layer's input is less than its gradients
    comps, grads = train_transient(ckpt, role_state(ckpt))
    assert grads == shape.param_count() * e
    assert comps["saved activations"] == 64 * seq * shape.hidden * e  # the last layer's input only
    plain = PlanConfig(**base, micro_batch=64)  # a layer's saved set outweighs its gradients: the top is higher
    comps, grads = train_transient(plain, role_state(plain))
    assert grads <= (shape.vocab * shape.hidden + shape.hidden + shape.layer_params()) * e  # the head's moment: none
    assert comps["saved activations"] == shape.layers * saved_layer(64)
    two = PlanConfig(**base, micro_batch=32)
    comps, grads = train_transient(two, role_state(two))
    assert grads == shape.param_count() * e and comps["saved activations"] == shape.layers * saved_layer(32)
    ddp = PlanConfig(**{**base, "prompts": 32}, micro_batch=64, dp=4)  # DDP: its buckets exist from the start
    comps, grads = train_transient(ddp, role_state(ddp))
    assert grads == shape.param_count() * e and comps["saved activations"] == shape.layers * saved_layer(64)


def test_every_role_resident_under_fsdp2_is_trl_alone():
    """Without the timeshare (TRL + FSDP2 alone) the generation gathers per unit, whatever
    ``zero3_rollout`` asks of tidal's trainer, and the reference, which TRL shards as one unit,
    is gathered whole at its forward; the timeshared phases (tidal's trainer, the reference
    sharded per block) are as before. One GPU: nothing gathered."""
    shape = preset("qwen2.5-32b")
    base = dict(shape=shape, prompts=32, group=8, prompt_len=8, gen_len=256, micro_batch=64, zero_stage=3, dp=4)
    base.update(grad_ckpt=True, lm_head="fused", logprob_span="completion")  # the 32B run's workload
    plan = build_plan(PlanConfig(**base, zero3_rollout="lent", timeshare=False))
    resident = plan.all_resident
    assert resident["reference"].transient["zero3 reference gathered whole (TRL: one unit)"] == shape.param_count() * 2
    assert "zero3 whole policy gathered" not in resident["rollout"].transient
    assert resident["rollout"].transient["zero3 gathered params"] > 0
    assert not any(t.before == t.after for t in plan.transitions)  # nothing lent without tidal
    assert plan.peak_phase == "reference"
    shared = build_plan(PlanConfig(**base, zero3_rollout="lent"))
    assert "zero3 reference gathered whole (TRL: one unit)" not in shared.timeshared["reference"].transient
    assert "zero3 whole policy gathered" in shared.timeshared["rollout"].transient
    assert [t for t in shared.transitions if t.before == t.after == "rollout"]
    one = build_plan(PlanConfig(**{**base, "dp": 1, "prompts": 8}, timeshare=False)).all_resident
    assert not any("gathered" in k for p in one.values() for k in p.transient)


# ---- the vLLM engine's rollout --------------------------------------------------------------
def test_with_a_vllm_engine_the_rollout_holds_its_weights_then_its_cache_the_policy_out_after_the_push():
    c = PlanConfig(shape="qwen2-7b", prompts=8, group=8, prompt_len=8, gen_len=256, rollout_engine="vllm")
    plan = build_plan(c)
    rollout = plan.timeshared["rollout"]
    weights = c.shape.param_count() * 2
    assert rollout.resident["engine weights"] == weights and "actor params" not in rollout.resident
    cache = rollout.transient["engine kv cache"]
    generation = cache + rollout.transient["engine generation workspace"]
    # the push: both weights at once, more than the cache beside the engine's weights
    assert rollout.peak_bytes == weights + max(weights, generation) + c.misc_bytes
    # every role resident (TRL + vLLM alone): the engine beside them, the gradients' memory still cached
    alone = plan.all_resident["rollout"]
    assert alone.resident["engine weights"] == weights and alone.resident["optimizer states"] > 0
    assert (
        alone.transient["gradients' memory left in torch's cache"]
        == plan.timeshared["optimizer_step"].resident["grads"]
    )
    # asleep the rest of the step: nothing allocated, its own memory at driver level only
    assert all("engine" not in k for p in ("reference", "train", "optimizer_step") for k in plan.phases[p].resident)
    assert plan.device_peak_bytes == plan.peak_bytes + c.cuda_context_bytes + c.vllm_own_bytes
    hf = build_plan(c.replace(rollout_engine="hf"))
    assert hf.device_peak_bytes == hf.peak_bytes + c.cuda_context_bytes


def test_the_engine_cache_for_the_batch_is_the_one_tidal_sizes():
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from tidal.integrations.vllm import kv_cache_bytes_for
    from tidal.plan.phases import engine_kv_cache_bytes

    hf = transformers.Qwen2Config(
        hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, vocab_size=152064,
    )  # fmt: skip
    for sequences, max_len in ((64, 320), (64, 2112), (3, 17)):
        c = PlanConfig(
            shape=ModelShape.from_hf_config(hf), prompts=sequences, group=1, prompt_len=8, gen_len=8,
            rollout_engine="vllm", vllm_max_model_len=max_len,
        )  # fmt: skip
        assert engine_kv_cache_bytes(c) == kv_cache_bytes_for(hf, torch.bfloat16, sequences=sequences, max_len=max_len)
    assert engine_kv_cache_bytes(c.replace(vllm_kv_cache_bytes=4 << 30)) == 4 << 30


@pytest.mark.parametrize(
    "bad, why",
    [
        (dict(dp=2), "one GPU"),
        (dict(zero_stage=1), "one GPU"),
        (dict(vllm_max_model_len=100), "below a sequence"),
        (dict(vllm_kv_cache_bytes=0), "vllm_kv_cache_bytes"),
        (dict(vllm_kv_cache_bytes=1.5), "vllm_kv_cache_bytes"),
        (dict(vllm_gpu_memory_utilization=0), "utilization"),
        (dict(vllm_gpu_memory_utilization=1.2), "utilization"),
        (dict(rollout_shares_weights=False), "own copy"),
    ],
)
def test_a_vllm_plan_refuses_what_it_cannot_plan(bad, why):
    with pytest.raises(ValueError, match=why):
        PlanConfig(shape="qwen2-7b", prompt_len=64, gen_len=64, rollout_engine="vllm", **bad)
    with pytest.raises(ValueError, match="rollout_engine"):
        PlanConfig(shape="qwen2-7b", rollout_engine="sglang")
