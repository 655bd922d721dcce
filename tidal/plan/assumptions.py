"""The assumptions behind a plan, in words, for the configuration at hand.

Every number :mod:`tidal.plan.model` produces rests on the statements listed here; ``tidal
plan`` prints them and the JSON output carries them, so a prediction can be checked against
what a run actually does (and the model corrected where the run differs).
"""

from __future__ import annotations

from tidal.plan.phases import grads_arrive_with_the_backward

__all__ = ["assumptions"]


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.0f} MiB"


def assumptions(c, bw) -> list[str]:
    """The list of assumptions for :class:`~tidal.plan.model.PlanConfig` ``c`` and
    :class:`~tidal.plan.model.Bandwidth` ``bw``."""
    s = c.shape
    grad = c.grad_dtype or (c.lora_dtype if c.lora_rank else c.param_dtype)
    state = c.optim_state_dtype or (c.lora_dtype if c.lora_rank else c.param_dtype)
    if c.optimizer == "cpu_adam":
        state = f"{c.optim_state_dtype or 'fp32'} on the host (CPU Adam's moments; its master weights fp32)"
    out = [
        f"Model: {s.name} ({s.family}), {s.param_count() / 1e9:.3f} B parameters, {s.layers} layers, "
        f"hidden {s.hidden}, MLP {s.intermediate}, {s.heads} heads / {s.kv_heads} KV heads of {s.head_dim}, "
        f"vocab {s.vocab}, {'tied' if s.tied_embeddings else 'untied'} embeddings.",
        f"Bytes are what torch's caching allocator hands out (torch.cuda.max_memory_allocated); the CUDA context "
        f"({_mib(c.cuda_context_bytes)}, a constant to replace with a measured figure) is added only to "
        "driver-level totals; allocator caching and fragmentation on top are not modelled.",
        f"Params and activations in {c.param_dtype} (no autocast); grads in {grad}; optimizer states in {state}"
        + (", plus fp32 master weights" if c.master_weights else "")
        + ".",
        f"Per GPU: {c.rollout_batch} sequences per step (prompts {c.prompts} x group {c.group} / dp {c.dp}, rounded up), "
        f"each padded to {c.prompt_len} + {c.gen_len} = {c.seq_len} tokens; {c.micro_batches} train micro-batch(es) "
        f"of {c.micro_batch}; reference micro-batch {c.reference_micro_batch or c.micro_batch}.",
        f"Attention: transformers attn_implementation={c.attn!r}"
        + (
            " (flash / memory-efficient SDPA kernels: no seq^2 score matrix is kept)"
            if c.attn == "sdpa"
            else " (the seq^2 scores and probabilities are kept per layer)"
        )
        + (
            "; batches carry a padding mask, so K/V are repeated to all heads and SDPA keeps the mask per layer."
            if c.padding_mask
            else "; no padding mask (SDPA's GQA path, causal flag)."
        ),
        "Saved activations per decoder layer follow tidal.plan.activations (measured exactly against "
        "Qwen2DecoderLayer's saved tensors on CPU, sdpa and eager, bf16 and fp32, with and without LoRA).",
        _engine_rollout(c)
        if c.rollout_engine == "vllm"
        else (
            "Rollout: HF generate with a DynamicCache, every sequence reaching the full length; peak = the largest of "
            "prefill (prompt KV + one layer's no-grad workspace), the last decode forward (full KV cache + the previous "
            "step's sampling buffers + one layer's keys copied by torch.cat"
            + (" + one layer's K/V repeated to all heads" if c.repeat_kv_in_decode and c.padding_mask else "")
            + f") and the last sampling step (logits + {c.sampling_fp32_buffers} fp32 vocab-sized buffers per sequence)."
            if c.sampling == "generate"
            else "Rollout: its own sampling loop (prefill with logits_to_keep=1, then one token per step through a "
            "DynamicCache; the last token is sampled, not fed: the cache ends at prompt + gen - 1 tokens); peak = the "
            "largest of prefill (prompt KV + one layer's no-grad workspace), the last decode forward (KV cache + the "
            "previous step's model-dtype (batch x vocab) logits, still referenced, + the new ones) and the sampling step "
            f"({c.sampling_fp32_buffers} fp32 buffers of width "
            + (f"{c.action_vocab}: the action ids only)." if c.action_vocab else "vocab).")
        ),
        (
            "Reference: one no-grad forward micro-batch through TRL's fused LM head: the last hidden states, the "
            "completion's positions gathered from them, one 4096 x 32768 logit tile and seven fp32 statistics a token "
            "(or one layer's workspace if larger)."
            if c.lm_head == "fused"
            else "Reference: one no-grad forward micro-batch; its largest transient is the logits"
            + (" of the completion + 1 positions only (logits_to_keep)" if c.completion_logits else "")
            + (
                f" plus fp32 log-softmax buffers over {c.action_vocab} action ids"
                if c.action_vocab
                else " plus the fp32 copy and log-softmax output"
            )
            + " (or one layer's workspace if larger)."
        ),
        (
            "Train: log-probs through TRL's fused LM head; its backward holds the saved completion hidden states, the "
            "hidden states' and (unless LoRA) the head weight's gradients accumulated in fp32 and cast to their dtype "
            "while the fp32 ones live, and one logit tile"
            if c.lm_head == "fused"
            else f"Train: log-probs from logits (micro-batch x {'sequence' if c.logprob_span == 'sequence' else 'completion'} "
            f"x vocab) with {c.logit_fp32_buffers} fp32 vocab-sized buffers alive at the backward peak (log-softmax "
            "output, its incoming and outgoing gradient)"
            + (" next to the model-dtype logits" if c.keep_logits else ", the model-dtype logits no longer referenced")
            if c.action_vocab is None
            else f"Train: log-probs over {c.action_vocab} action ids, a slice of the model-dtype logits"
            + (" of the completion + 1 positions (logits_to_keep)" if c.completion_logits else "")
            + " (fp32 buffers that narrow); backward through the slices makes model-dtype vocab-wide gradients (the "
            "action slice's input, the positions slice's input), and the LM head's weight gradient is made next to the "
            "logits' gradient"
            + (
                "; the caller holds the logits through backward"
                if c.keep_logits
                else "; the logits are dropped before backward"
            )
        )
        + "; the peak is the larger of that moment "
        "(start of backward) and a decoder layer's backward (its recompute under checkpointing + gradients in flight)"
        + (
            "; step() runs inside the train phase, whose peak includes the optimizer step's."
            if c.step_in_train
            else "."
        ),
        "Gradients are None outside train/optimizer_step (zero_grad(set_to_none=True)); from the second micro-batch "
        "on all gradients exist during the next forward/backward"
        + (
            "; with one micro-batch only the LM head's gradient exists at the logits peak"
            + (
                "; on one GPU the rest arrive as the backward walks down the layers: the peak there is the first "
                "layer's (every saved activation) or the last's (every gradient, the embedding's counted as a bound)."
                if grads_arrive_with_the_backward(c)
                else "."
            )
            if c.micro_batches == 1
            else "."
        )
        if c.optimizer != "cpu_adam"
        else "Gradients summed over the micro-batches on the GPU (CPUAdam.accumulate()), as AdamW's, then sent "
        "once (CPU Adam, below)."
        if c.cpu_adam_grad_accumulation == "device" and c.micro_batches > 1
        else "Gradients never stay on the GPU (CPU Adam, below).",
    ]
    if c.grad_ckpt:
        out.append(
            "Gradient checkpointing: each decoder layer keeps only its input; backward re-runs one layer at a time."
        )
    if c.act_offload:
        out.append(
            "Activation offload: at most two layers' saved activations on the GPU (tidal.activations); the "
            "others stream to the host and back, overlapped with compute."
        )
    if c.optimizer == "adamw":
        out.append(
            "AdamW states on the GPU"
            + (" (foreach step: one state-sized temporary)." if c.adamw_foreach else " (fused step: no temporary).")
        )
    elif c.optimizer == "adamw_offload":
        out.append(
            "AdamW states on the host except during optimizer_step (moved in before it, out after it)."
            if c.optim_stream_chunk_bytes is None
            else f"AdamW states on the host; step() brings them in {_mib(c.optim_stream_chunk_bytes)} chunks of "
            "parameters (the next chunk in while this one goes out: two chunks, each up to one parameter's "
            "state over the size, the embedding's alone)."
        )
    else:
        if c.cpu_adam_grad_accumulation == "device" and c.micro_batches > 1:
            out.append(
                "CPU Adam (tidal.CPUAdam, host_accumulation=False): no optimizer state on the GPU; every micro-batch "
                "but the last runs its backward in accumulate(), so autograd sums the gradients in p.grad on the "
                "GPU; in the last backward each sum is cast to fp32 and copied to the host as it is produced, at "
                f"most max_inflight_bytes = {_mib(c.cpu_adam_inflight_bytes)} of casts pending (+ the newest), "
                "and freed once copied; no pinned staging on the host. step() returns the fp32 masters one "
                "parameter at a time (cast on the GPU)."
            )
        else:
            out.append(
                "CPU Adam (tidal.CPUAdam): no optimizer state or gradient kept on the GPU; each gradient is cast "
                "to fp32 on the GPU and copied to the host as backward produces it; gradient + cast of copies not "
                f"yet done stay on the GPU up to max_inflight_bytes = {_mib(c.cpu_adam_inflight_bytes)} (+ the "
                "newest one; later micro-batches copy the gradient without a cast, into pinned staging on the "
                "host), and that many may still wait when the next micro-batch's backward starts. A tied LM "
                "head's gradient waits in autograd's buffer for the embedding's until the end of backward. "
                "step() returns the fp32 masters one parameter at a time (cast on the GPU)."
            )
    if c.zero_stage and c.dp > 1:
        parts = {
            1: "optimizer states",
            2: "optimizer states and gradients",
            3: "optimizer states, gradients and params",
        }
        out.append(
            f"ZeRO stage {c.zero_stage} over {c.dp} GPUs shards {parts[c.zero_stage]}"
            + (
                f"; FSDP2 keeps the root module (embeddings, LM head) gathered and {c.zero3_gathered_layers} "
                "layers unsharded at once (running + prefetched)"
                + (
                    "; the rollout gathers the whole policy once beside the shards (tidal's TRL trainer, where each "
                    "GPU has the room)."
                    if c.zero3_rollout == "whole"
                    else "; the rollout gathers the whole policy once and lends the shards to the host meanwhile "
                    "(tidal's TRL trainer, where the room is there only without them): out unit by unit as each is "
                    "gathered, back after, not overlapped with compute."
                    if c.zero3_rollout == "lent"
                    else "."
                )
                + (
                    " Every role resident is TRL alone under FSDP2: its generation gathers per unit, and its "
                    "reference, sharded as one unit, is gathered whole for its forward."
                    if not c.timeshare
                    else ""
                )
                + (
                    " In one micro-batch the backward holds the larger of the saved activations and the sharded "
                    "gradients, not both: each unit's gradient arrives as its activations are freed."
                    if c.micro_batches == 1 and not c.lora_rank
                    else " Through the micro-batches every gradient is held unsharded (accelerate's no_sync), "
                    "reduce-scattered at the last."
                    if c.micro_batches > 1 and not c.sync_each_micro_batch
                    else ""
                )
                if c.zero_stage == 3
                else "; one layer's unsharded gradients exist before its reduce-scatter."
                if c.zero_stage == 2
                else "."
            )
        )
    if c.lora_rank:
        out.append(
            f"LoRA rank {c.lora_rank} on {', '.join(c.lora_targets)} ({c.lora_dtype} adapters, peft casts inputs "
            "to the adapter dtype); the reference is the same base with adapters disabled: no second copy."
        )
    if c.timeshare:
        out.append(
            "Timeshare: only the active role's state is resident per phase; rollout "
            + (
                "shares the actor's weights (no second copy)."
                if c.rollout_shares_weights
                else "has its own weight copy."
            )
            + " A switch's own peak (out-going and in-coming both allocated) is not in the phase peaks: "
            "tidal's switch overlaps them only while both fit and otherwise frees out-going buckets first."
        )
    out.append(
        f"Transition time = bytes / bandwidth, D2H {bw.d2h_gbps:g} GB/s and H2D {bw.h2d_gbps:g} GB/s on separate "
        f"copy engines, both at once at most {bw.bidir_gbps:g} GB/s (pinned host memory)."
    )
    return out


def _engine_rollout(c) -> str:
    cache = (
        f"{c.vllm_kv_cache_bytes / (1 << 30):.2f} GiB"
        if c.vllm_kv_cache_bytes is not None
        else f"sized for the rollout batch ({c.rollout_batch} sequences of {c.engine_max_len} tokens in blocks of 16, "
        "beside vLLM's null block)"
    )
    return (
        "Rollout: TRL's colocated vLLM engine (sleep mode): its weights woken and pushed from the policy's on the "
        "device (both copies at once), the policy out before its KV cache wakes (" + cache + "), the generation's "
        "own workspace the larger of the prompts' prefill and the sampler's fp32 (batch x vocab) buffers; asleep "
        f"(level 2) the rest of the step, nothing allocated, {c.vllm_own_bytes / (1 << 30):.2f} GiB of its own "
        "(CUDA graphs, non-torch) counted at driver level in every phase. Without the timeshare (TRL alone) its "
        f"cache is what vLLM takes from {c.vllm_gpu_memory_utilization:g} of the device less its weights and own "
        "memory, and the gradients' memory stays in torch's cache beside it after the optimizer step (vLLM maps "
        "from the driver)."
    )
