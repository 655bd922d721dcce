"""The fields that describe tidal's own GRPO trainer (tidal_recipes.grpo): each one moves the prediction
in the direction, and by the amount, that hand arithmetic gives.

Shape: qwen2-0.5b (24 layers, hidden 896, MLP 4864, 14 heads / 2 KV heads of 64, vocab
151936, tied). The demo's GPU default: 64 prompts x 16 samples, prompt 10 + answer 8 tokens,
micro-batch 64, bf16, no padding mask.
"""

import pytest

from tidal.plan import MIB, PlanConfig, build_plan, preset

S = preset("qwen2-0.5b")
V, H, E = 151936, 896, 2
KV_PER_TOKEN = 2 * 24 * 128 * 2  # K and V, 24 layers, 2 KV heads x 64, bf16
PARAMS = S.param_count() * E
DEMO = dict(
    shape=S,
    prompts=64,
    group=16,
    prompt_len=10,
    gen_len=8,
    micro_batch=64,
    padding_mask=False,
    logprob_span="completion",
    misc_bytes=0,
)
MISC = 48 * MIB  # the default misc_bytes, in the GiB figures of benchmarks/bench_demo.py


def _phase(name, **kw):
    return build_plan(PlanConfig(**{**DEMO, **kw})).timeshared[name]


def test_own_sampling_loop_holds_two_logit_rows_and_no_fp32_vocab_buffers():
    own = _phase("rollout", sampling="own", action_vocab=10, sampling_fp32_buffers=3, repeat_kv_in_decode=False)
    b = 1024
    row = b * V * E  # one step's (batch, vocab) bf16 logits
    # Last decode step: the cache holds 17 tokens (the 18th is sampled, never fed), the
    # previous step's logits are still referenced while the new ones are computed.
    assert own.transient == {
        "kv cache": b * 17 * KV_PER_TOKEN,
        "previous step's logits": row,
        "last-position logits": row,
    }
    assert own.peak_bytes == PARAMS + b * 17 * KV_PER_TOKEN + 2 * row
    assert (own.peak_bytes + MISC) / 2**30 == pytest.approx(1.746, abs=0.001)  # H200 measured 1.779
    # HF generate: vocab-wide fp32 buffers make it far bigger.
    gen = _phase("rollout", sampling="generate")
    assert gen.peak_bytes - own.peak_bytes > 4 * row
    # Sampling over the full vocabulary in one's own loop: 3 fp32 vocab rows at the sampling step.
    full = _phase("rollout", sampling="own", sampling_fp32_buffers=3, repeat_kv_in_decode=False)
    assert full.transient == {"kv cache": b * 17 * KV_PER_TOKEN, "sampling logits": row + 3 * b * V * 4}


def test_reference_with_completion_logits_and_action_vocab():
    base = _phase("reference")
    keep = _phase("reference", completion_logits=True)
    act = _phase("reference", completion_logits=True, action_vocab=10)
    mb, span = 64, 64 * 8
    # logits_to_keep = answer + 1: 9 positions of logits instead of 18
    assert base.peak_bytes - keep.peak_bytes == mb * (18 - 9) * V * E
    # log-softmax over 10 ids: fp32 copy + output of width 10 instead of the vocabulary
    assert keep.peak_bytes - act.peak_bytes == span * (V - 10) * 4 * 2
    assert act.transient == {"logits + log-softmax": mb * 9 * V * E + span * 10 * 8, "final hidden": mb * 18 * H * E}
    assert (act.peak_bytes + MISC) / 2**30 == pytest.approx(1.132, abs=0.001)  # H200 measured 1.164


def test_completion_logits_needs_completion_logprobs():
    with pytest.raises(ValueError, match="logprob_span"):
        PlanConfig(**{**DEMO, "logprob_span": "sequence"}, completion_logits=True)
    with pytest.raises(ValueError, match="action_vocab"):
        PlanConfig(**DEMO, action_vocab=V + 1)
    with pytest.raises(ValueError, match="sampling"):
        PlanConfig(**DEMO, sampling="vllm")


def test_train_logits_with_action_vocab():
    # AdamW (grads resident from the 2nd micro-batch on), the logits moment of one micro-batch.
    kw = dict(completion_logits=True, optimizer="adamw_offload", adamw_foreach=False)
    act = _phase("train", action_vocab=10, **kw).transient["logits + log-softmax"]
    mb = 64
    full = mb * 9 * V * E  # the (64, 9, vocab) bf16 logits, or their gradient
    # Backward: the LM head's weight gradient (vocab x hidden, bf16) next to the logits'
    # gradient is larger than the two slice gradients (64x8 and 64x9 positions).
    assert mb * 8 * V * E + full < full + V * H * E
    assert act == full + V * H * E + mb * 8 * 10 * 4 * 3
    vocab_wide = _phase("train", **kw).transient["logits + log-softmax"]
    assert vocab_wide == max(full + mb * 8 * V * 8, mb * 8 * V * 4 * 3)  # fp32 copy/output/grads
    assert vocab_wide > 2 * act


def test_cpu_adam_inflight_bound():
    n = S.param_count()
    emb = V * H
    per = 2 + 4  # bf16 gradient + its fp32 cast
    demo = dict(optimizer="cpu_adam", completion_logits=True, action_vocab=10, cpu_adam_grad_accumulation="host")
    train = _phase("train", **demo)
    # Demo: 16 micro-batches of 1152 tokens without checkpointing; the logits-backward moment
    # carries every saved activation, the logits' and the head's gradient, and up to 512 MiB
    # of the previous micro-batch's copies still pending.
    assert train.transient["cpu adam grads in flight (previous micro-batch)"] == 512 * MIB
    assert train.transient["logits + log-softmax"] == 64 * 9 * V * E + emb * E + 64 * 8 * 10 * 12
    assert train.resident == {"actor params": PARAMS}
    assert (train.peak_bytes + MISC) / 2**30 == pytest.approx(3.370, abs=0.001)
    # Each MiB of bound is a MiB of peak at that moment.
    wider = _phase("train", cpu_adam_inflight_bytes=1024 * MIB, **demo)
    assert wider.peak_bytes - train.peak_bytes == 512 * MIB
    # Checkpointed, one micro-batch of a few tokens: the peak is the end of backward, when the
    # tied embedding's gradient and its fp32 cast join up to `bound` bytes of earlier copies.
    short = dict(optimizer="cpu_adam", grad_ckpt=True, prompts=1, group=1, micro_batch=1)
    for bound in (0, 256 * MIB, 512 * MIB):
        t = _phase("train", cpu_adam_inflight_bytes=bound, **short)
        assert t.transient == {"cpu adam grads in flight (incl. the largest)": bound + emb * per}
    # A bound above every gradient: all of them at once, no more.
    t = _phase("train", cpu_adam_inflight_bytes=100 << 30, **short)
    assert t.transient == {"cpu adam grads in flight (incl. the largest)": n * per}


def test_step_in_train_takes_the_optimizer_step_peak():
    kw = dict(optimizer="adamw_offload", adamw_foreach=False, completion_logits=True, action_vocab=10)
    small = dict(DEMO, micro_batch=16)
    plain = build_plan(PlanConfig(**small, **kw)).timeshared
    inside = build_plan(PlanConfig(**small, **kw, step_in_train=True)).timeshared
    # fused AdamW during step(): params + grads + bf16 exp_avg and exp_avg_sq on the GPU
    assert inside["optimizer_step"].peak_bytes == 4 * PARAMS
    assert plain["train"].peak_bytes < 4 * PARAMS
    assert inside["train"].peak_bytes == 4 * PARAMS
    # When the forward/backward is bigger than the step, the train phase stays as it was.
    big = dict(DEMO, micro_batch=1024)
    a = build_plan(PlanConfig(**big, **kw)).timeshared["train"]
    b = build_plan(PlanConfig(**big, **kw, step_in_train=True)).timeshared["train"]
    assert a.peak_bytes > 4 * PARAMS and a == b


def test_cpu_adam_step_returns_fp32_masters_param_by_param():
    step = _phase("optimizer_step", optimizer="cpu_adam")
    # The embedding's fp32 master (>= 64 MiB) crosses alone; two MLP matrices (4864 x 896,
    # 17 MB each) together are smaller.
    assert step.transient == {"cpu adam fp32 weights (H2D)": V * H * 4}
    assert step.peak_bytes == PARAMS + V * H * 4


def test_streamed_adamw_step_holds_two_chunks_of_state():
    kw = dict(optimizer="adamw_offload", adamw_foreach=False)
    whole = _phase("optimizer_step", **kw)
    streamed = _phase("optimizer_step", optim_stream_chunk_bytes=256 * MIB, **kw)
    assert whole.resident["optimizer states"] == 2 * PARAMS  # bf16 exp_avg + exp_avg_sq
    # The embedding's state (2 x bf16 of vocab x hidden, > 256 MiB) is a chunk alone; the next
    # chunk closes at >= 256 MiB, overshooting by at most one MLP matrix's state.
    assert streamed.resident["optimizer states"] == V * H * 4 + 256 * MIB + 4864 * 896 * 4
    assert whole.peak_bytes - streamed.peak_bytes == 2 * PARAMS - (V * H * 4 + 256 * MIB + 4864 * 896 * 4)
    with pytest.raises(ValueError, match="optim_stream_chunk_bytes"):
        PlanConfig(**DEMO, optimizer="cpu_adam", optim_stream_chunk_bytes=256 * MIB)
