"""Per-phase pieces of the memory model: each role's persistent state and each phase's
largest transient, for a :class:`~tidal.plan.config.PlanConfig` (see that module for the
contract and :mod:`tidal.plan.activations` for the per-token formulas).

All functions return bytes per GPU; dicts map a component name (shown in reports) to bytes.
"""

from __future__ import annotations


from tidal.plan import activations as act

from tidal.plan.config import VLLM_BLOCK_TOKENS, PlanConfig

__all__ = [
    "role_state",
    "gathered_params",
    "rollout_transient",
    "reference_transient",
    "train_transient",
    "cpu_adam_step_transient",
    "grads_arrive_with_the_backward",
    "engine_weights_bytes",
    "engine_kv_cache_bytes",
    "engine_generation_transient",
    "trl_vllm_kv_cache_bytes",
    "CPU_ADAM_CHUNK",
]

CPU_ADAM_CHUNK = 64 << 20  # tidal.optim.cpu_adam: fp32 master bytes per update call (a larger param is alone)
# TRL's fused LM head (trl.kernels.chunked_logprob, TRL 1.16): logits in tiles of this many
# tokens by this many vocabulary ids
FUSED_TOKENS, FUSED_VOCAB = 4096, 32768


def _div(n: int, d: int) -> int:
    return -(-n // d)


def role_state(c: PlanConfig) -> dict[str, int]:
    """Per-GPU bytes of each role's persistent state, after ZeRO sharding."""
    s, e = c.shape, act.dtype_bytes(c.param_dtype)
    le = act.dtype_bytes(c.lora_dtype) if c.lora_rank else e  # the trainable params' dtype
    ge = act.dtype_bytes(c.grad_dtype) if c.grad_dtype else le
    se = act.dtype_bytes(c.optim_state_dtype) if c.optim_state_dtype else le
    lora = s.lora_params(c.lora_rank, c.lora_targets)
    trainable = lora if c.lora_rank else s.param_count()
    p_div = c.dp if c.zero_stage >= 3 else 1
    base = _div(s.param_count() * e, p_div)
    adapters = _div(lora * le, p_div)
    return {
        "base": base,
        "adapters": adapters,
        "reference": 0 if c.lora_rank else base,
        "rollout_copy": 0 if c.rollout_shares_weights else base + adapters,
        "grads": 0 if c.optimizer == "cpu_adam" else _div(trainable * ge, c.dp if c.zero_stage >= 2 else 1),
        "optim": 0
        if c.optimizer == "cpu_adam"
        else _div(trainable * (2 * se + (4 if c.master_weights else 0)), c.dp if c.zero_stage >= 1 else 1),
        "step_temp": _div(trainable * se, c.dp if c.zero_stage >= 1 else 1)
        if c.optimizer != "cpu_adam" and c.adamw_foreach
        else 0,
        "trainable": trainable,
        "ge": ge,
        "le": le,
    }


def gathered_params(c: PlanConfig, *, rollout: bool = False) -> dict[str, int]:
    """ZeRO 3's unsharded parameters during a phase (``rollout``: with ``zero3_rollout``
    ``"whole"`` or ``"lent"`` every parameter, gathered once for the generation)."""
    if c.zero_stage < 3 or c.dp == 1:
        return {}
    s, e = c.shape, act.dtype_bytes(c.param_dtype)
    if rollout and c.zero3_rollout in ("whole", "lent"):
        return {"zero3 whole policy gathered": s.param_count() * e}
    layers = min(c.zero3_gathered_layers, s.layers)
    return {"zero3 gathered params": (s.root_params() + layers * s.layer_params()) * e}


def rollout_transient(c: PlanConfig) -> dict[str, int]:
    """Rollout transient: the larger of prefill, the last decode forward, the last sampling."""
    if c.sampling == "own":
        return _own_sampling_transient(c)
    s, e = c.shape, act.dtype_bytes(c.param_dtype)
    kv_e = act.dtype_bytes(c.kv_dtype or c.param_dtype)
    b, per_tok = c.rollout_batch, act.kv_cache_bytes_per_token(s, kv_e=kv_e)
    kv = b * c.seq_len * per_tok
    vocab_row = b * s.vocab
    forward = {
        "kv cache": kv,
        # generate's loop still references the previous step's fp32 logits, scores, probs
        "previous sampling buffers": vocab_row * 12,
        # DynamicCache appends with torch.cat: one layer's keys exist twice for a moment
        "kv append copy": b * c.seq_len * s.kv_dim * kv_e,
        "decode repeat_kv": (
            2 * b * c.seq_len * s.q_dim * e if c.repeat_kv_in_decode and c.padding_mask and s.kv_heads != s.heads else 0
        ),
        "last-position logits": vocab_row * e,
    }
    sample = {"kv cache": kv, "sampling logits": vocab_row * (e + 4 * c.sampling_fp32_buffers)}
    return max((forward, sample, _prefill(c)), key=lambda d: sum(d.values()))


def engine_weights_bytes(c: PlanConfig) -> int:
    """The vLLM engine's copy of the policy's weights: every parameter in the param dtype
    (with LoRA, the adapters merged into the base, as TRL pushes them)."""
    return c.shape.param_count() * act.dtype_bytes(c.param_dtype)


def engine_kv_cache_bytes(c: PlanConfig) -> int:
    """The engine's KV cache: ``vllm_kv_cache_bytes``, or (None) the rollout batch at once, each
    sequence of ``engine_max_len`` tokens in whole blocks, beside vLLM's null block (what
    :func:`tidal.integrations.vllm.kv_cache_bytes_for` sizes for ``vllm_kv_cache_bytes="auto"``)."""
    if c.vllm_kv_cache_bytes is not None:
        return c.vllm_kv_cache_bytes
    per_token = act.kv_cache_bytes_per_token(c.shape, kv_e=act.dtype_bytes(c.kv_dtype or c.param_dtype))
    blocks = _div(c.engine_max_len, VLLM_BLOCK_TOKENS)
    return (c.rollout_batch * blocks + 1) * VLLM_BLOCK_TOKENS * per_token


def engine_generation_transient(c: PlanConfig) -> dict[str, int]:
    """What the engine's generation allocates beside its weights and cache (through torch's
    allocator): the larger of the prompts' prefill (one layer's no-grad workspace for every
    prompt token at once) and the sampler's fp32 ``(batch x vocab)`` buffers (logits, the
    processed logits, the probabilities)."""
    s, e = c.shape, act.dtype_bytes(c.param_dtype)
    prefill = c.rollout_batch * c.prompt_len * act.forward_workspace_bytes_per_token(s, e=e, padding_mask=False)
    return {"engine generation workspace": max(prefill, c.rollout_batch * s.vocab * 4 * 3)}


def trl_vllm_kv_cache_bytes(c: PlanConfig, device_bytes: int) -> int:
    """The KV cache vLLM gives itself where TRL builds the engine (``vllm_gpu_memory_utilization``
    of the device's ``device_bytes``, less the engine's weights and its own memory: vLLM 0.25
    sizes the cache from its share alone, whatever else is on the device); 0 where the share
    does not hold the weights."""
    share = int(c.vllm_gpu_memory_utilization * device_bytes)
    return max(0, share - engine_weights_bytes(c) - c.vllm_own_bytes)


def _prefill(c: PlanConfig) -> dict[str, int]:
    """The prompt forward: prompt KV + one layer's no-grad workspace (+ the prompt mask)."""
    s, e = c.shape, act.dtype_bytes(c.param_dtype)
    kv_e = act.dtype_bytes(c.kv_dtype or c.param_dtype)
    b, t = c.rollout_batch, c.rollout_batch * c.prompt_len
    return {
        "kv cache": t * act.kv_cache_bytes_per_token(s, kv_e=kv_e),
        "prefill workspace": t * act.forward_workspace_bytes_per_token(s, e=e, padding_mask=c.padding_mask),
        "prefill mask": b * c.prompt_len**2 * (1 + e) if c.padding_mask else 0,
    }


def _own_sampling_transient(c: PlanConfig) -> dict[str, int]:
    """A sampling loop of one's own (tidal_recipes.grpo.rollout.sample_answers): prefill keeps the
    last position's logits only (``logits_to_keep=1``); each decode step feeds one token
    through a DynamicCache and the caller holds the previous step's model-dtype
    ``(batch, vocab)`` logits while the next ones are computed; the last token is sampled,
    never fed, so the cache ends at ``seq_len - 1`` tokens. Sampling takes a softmax over
    ``action_vocab`` ids (or the vocabulary) in fp32: ``sampling_fp32_buffers`` of that width."""
    s, e = c.shape, act.dtype_bytes(c.param_dtype)
    kv_e = act.dtype_bytes(c.kv_dtype or c.param_dtype)
    b, per_tok = c.rollout_batch, act.kv_cache_bytes_per_token(s, kv_e=kv_e)
    tokens = c.seq_len - 1
    kv = b * tokens * per_tok
    row = b * s.vocab * e
    width = c.action_vocab or s.vocab
    at_head = {"kv cache": kv, "previous step's logits": row, "last-position logits": row}
    at_cat = {
        "kv cache": kv,
        "previous step's logits": row,
        # DynamicCache appends with torch.cat: one layer's keys exist twice for a moment
        "kv append copy": b * tokens * s.kv_dim * kv_e,
        "decode repeat_kv": (
            2 * b * tokens * s.q_dim * e if c.repeat_kv_in_decode and c.padding_mask and s.kv_heads != s.heads else 0
        ),
    }
    sample = {"kv cache": kv, "sampling logits": row + b * width * 4 * c.sampling_fp32_buffers}
    prefill_head = {"kv cache": b * c.prompt_len * per_tok, "last-position logits": row}
    return max((at_head, at_cat, sample, _prefill(c), prefill_head), key=lambda d: sum(d.values()))


def _logit_positions(c: PlanConfig) -> int:
    """Positions per sequence whose logits the forward computes: all, or the completion and
    the position before it (transformers' ``logits_to_keep=gen_len + 1``)."""
    return c.gen_len + 1 if c.completion_logits else c.seq_len


def _fused_forward(c: PlanConfig, mb: int) -> dict[str, int]:
    """TRL's fused LM head scoring ``mb`` sequences: the backbone's last hidden states, the
    completion's positions gathered from them, one logit tile and the per-token statistics
    (running max, sums, target logit: seven fp32 values a token)."""
    s, e = c.shape, act.dtype_bytes(c.param_dtype)
    n = mb * c.gen_len
    return {
        "final hidden": mb * c.seq_len * s.hidden * e,
        "fused head: completion hidden states": n * s.hidden * e,
        "fused head: logit tile": min(n, FUSED_TOKENS) * FUSED_VOCAB * e,  # its full width, whatever the vocabulary
        "fused head: per-token statistics": n * 4 * 7,
    }


def _fused_backward(c: PlanConfig, st: dict[str, int]) -> dict[str, int]:
    """The end of the fused LM head's backward, one micro-batch: its saved completion hidden
    states; the hidden states' gradient and (unless LoRA freezes the head) the head weight's,
    each accumulated in fp32 and cast to its dtype while the fp32 one is alive (no cast for an
    fp32 one); the logit tile (32768 ids wide whatever the vocabulary: TRL's buffer).
    The head weight's gradient in its dtype becomes the head's ``.grad`` (counted here, not
    among the gradients, for the first micro-batch)."""
    s, e = c.shape, act.dtype_bytes(c.param_dtype)
    n = c.micro_batch * c.gen_len
    head = 0 if c.lora_rank else s.vocab * s.hidden
    cast = lambda b: b if b < 4 else 0  # noqa: E731  (an fp32 tensor's .to(fp32) is itself: no copy)
    return {
        "fused head: completion hidden states": n * s.hidden * e,
        "fused head: hidden-state gradient (fp32 + cast)": n * s.hidden * (4 + cast(e)),
        "fused head: weight gradient (fp32 + cast)": head * (4 + cast(st["ge"])),
        "fused head: logit tile": min(n, FUSED_TOKENS) * FUSED_VOCAB * e,
    }


def reference_transient(c: PlanConfig) -> dict[str, int]:
    s, e = c.shape, act.dtype_bytes(c.param_dtype)
    mb = c.reference_micro_batch or c.micro_batch
    t = mb * c.seq_len
    span = mb * (c.seq_len if c.logprob_span == "sequence" else c.gen_len)
    mask = mb * c.seq_len**2 * (1 + e) if c.padding_mask else 0
    layer = t * act.forward_workspace_bytes_per_token(s, e=e, padding_mask=c.padding_mask) + mask
    if c.lm_head == "fused":
        head = _fused_forward(c, mb)
        return head if sum(head.values()) >= layer else {"layer workspace": layer}
    # logits (model dtype), then in fp32 a copy and the log-softmax output over the vocabulary
    # or, with action_vocab, over that slice only
    logits = mb * _logit_positions(c) * s.vocab * e + span * (c.action_vocab or s.vocab) * 4 * 2
    if logits >= layer:
        return {"logits + log-softmax": logits, "final hidden": t * s.hidden * e}
    return {"layer workspace": layer}


def _train_logits(c: PlanConfig, st: dict[str, int]) -> int:
    """Largest logits-related transient of one micro-batch (forward end or backward start)."""
    s, e = c.shape, act.dtype_bytes(c.param_dtype)
    mb = c.micro_batch
    span = mb * (c.seq_len if c.logprob_span == "sequence" else c.gen_len)
    full = mb * _logit_positions(c) * s.vocab * e  # the model-dtype logits (or their gradient)
    if c.action_vocab is None:
        # Forward: model-dtype logits, fp32 copy, log-softmax output. Backward (log-softmax's):
        # its output, incoming and outgoing gradients (+ the logits if the caller still holds them).
        return max(
            full + span * s.vocab * 8, span * s.vocab * 4 * c.logit_fp32_buffers + (full if c.keep_logits else 0)
        )
    # Log-probs over action_vocab ids: the fp32 buffers are that narrow (copy, log-softmax,
    # its exp for the entropy). Backward through the slices makes model-dtype vocab-wide
    # gradients: the action slice's input (span positions) and, when the log-probs take fewer
    # positions than the logits, the positions slice's input; then the LM head's backward
    # makes its weight gradient next to the logits' gradient.
    narrow = span * c.action_vocab * 4 * 3
    held = full if c.keep_logits else 0
    slices = span * s.vocab * e + (full if span < full // (s.vocab * e) else 0)
    head = 0 if c.lora_rank else s.vocab * s.hidden * st["ge"]
    return max(full, held + max(slices, full + head)) + narrow


def _cpu_adam_inflight(c: PlanConfig, st: dict[str, int]) -> dict[str, int]:
    """Device bytes of CPU Adam's gradient copies in flight (tidal.CPUAdam's
    ``max_inflight_bytes`` bound): each pending gradient holds its model-dtype tensor and its
    fp32 cast (first micro-batch; later ones copy the gradient as is). Past the bound a hook
    waits for the oldest copies, so at most ``bound + one gradient`` exist at once (all the
    trainable gradients if fewer), and after a backward at most ``bound`` remain until the
    next backward's first hook (``leftover``)."""
    s = c.shape
    per = st["ge"] + (4 if st["ge"] < 4 else 0)  # bytes per element in flight: grad + fp32 cast
    every = st["trainable"] * per
    bound = c.cpu_adam_inflight_bytes
    if c.lora_rank:
        largest = layer_max = max(c.lora_rank * max(a, b) for a, b in s.linear_shapes().values())
        head = 0
    else:
        largest, layer_max = s.largest_param(), max(a * b for a, b in s.linear_shapes().values())
        head = s.vocab * s.hidden
    leftover = min(every, bound) if c.micro_batches > 1 else 0
    return {
        "largest": min(every, bound + largest * per),
        # during a decoder layer's backward the embedding's gradient is not produced yet
        "layer": min(every - (0 if c.lora_rank else s.embedding_params() * per), bound + layer_max * per),
        # An untied head's gradient is the first of a backward: after the first micro-batch
        # (nothing pending then; gradient + fp32 cast) only the previous one's leftover
        # waits beside it, and it is copied as is.
        "head": max(head * per, min(every, leftover + head * st["ge"])) if head else 0,
        "leftover": leftover,
    }


def accumulates_unsharded(c: PlanConfig) -> bool:
    """Whether sharded gradients (ZeRO >= 2 over several GPUs) are held unsharded, whole,
    through the step's micro-batches (see ``PlanConfig.sync_each_micro_batch``)."""
    return c.zero_stage >= 2 and c.dp > 1 and c.micro_batches > 1 and not c.sync_each_micro_batch


def train_transient(c: PlanConfig, st: dict[str, int]) -> tuple[dict[str, int], int]:
    """Train transient components at the peak, and the gradient bytes resident then."""
    s, e = c.shape, act.dtype_bytes(c.param_dtype)
    t = c.micro_batch * c.seq_len
    lora_targets = c.lora_targets if c.lora_rank else ()
    layer = t * act.layer_saved_bytes_per_token(
        s,
        e=e,
        seq=c.seq_len,
        attn=c.attn,
        padding_mask=c.padding_mask,
        lora_rank=c.lora_rank,
        lora_targets=lora_targets,
        lora_e=st["le"],
    )
    ckpt_in = t * s.hidden * e
    held = min(2, s.layers) if c.act_offload else s.layers
    saved = held * (ckpt_in if c.grad_ckpt else layer)
    extra = t * act.model_extra_saved_bytes_per_token(s, e=e, grad_ckpt=c.grad_ckpt)
    grads = st["trainable"] * st["ge"] if accumulates_unsharded(c) else st["grads"]
    if c.lm_head == "fused":
        # The head's backward comes first: in the first micro-batch no gradient exists before
        # it (its own is among its components), from the 2nd on every one does.
        head = _fused_backward(c, st)
        logits_part = head
        first_grads = 0 if c.micro_batches == 1 else grads
    else:
        logits_part = {"logits + log-softmax": _train_logits(c, st)}
        if c.micro_batches == 1 and not c.lora_rank:
            # One micro-batch: at the logits backward only the LM head's gradient exists yet.
            first_grads = _div(s.vocab * s.hidden * st["ge"], c.dp if c.zero_stage >= 2 else 1)
        else:
            first_grads = grads  # from the 2nd micro-batch on, every gradient exists
    bucket = (
        {"zero2 grad bucket": s.layer_params() * st["ge"]}
        if c.zero_stage >= 2 and c.dp > 1 and not c.lora_rank and not accumulates_unsharded(c)
        else {}
    )
    at_layer_base = {
        "saved activations": saved,
        "model-level saved": extra,
        "recompute (one layer)": layer if c.grad_ckpt else 0,
        "backward workspace": t * act.backward_workspace_bytes_per_token(s, e=e),
    }
    if c.optimizer != "cpu_adam":
        at_logits = {"saved activations": saved, "model-level saved": extra, **logits_part}
        at_layer = {**at_layer_base, **bucket}
        if c.zero_stage >= 3 and c.dp > 1 and c.micro_batches == 1 and not c.lora_rank:
            # One micro-batch, sharded gradients: each unit's arrives (reduce-scattered) as the
            # backward frees that unit's saved activations, so the two trade places and the
            # backward holds the larger of them, not their sum (DDP's buckets, and the
            # gradients of earlier micro-batches, exist whole from the backward's start).
            at_layer["saved activations"] = max(0, saved - grads)
        elif grads_arrive_with_the_backward(c):
            at_layer, layer_grads = _one_pass_layer_moment(c, st, at_layer_base, saved, ckpt_in, layer)
            a, b = sum(at_logits.values()) + first_grads, sum(at_layer.values()) + layer_grads
            return (at_logits, first_grads) if a >= b else (at_layer, layer_grads)
        a, b = sum(at_logits.values()) + first_grads, sum(at_layer.values()) + grads
        return (at_logits, first_grads) if a >= b else (at_layer, grads)
    fl = _cpu_adam_inflight(c, st)
    if c.cpu_adam_grad_accumulation == "device" and c.micro_batches > 1:
        # Summed on the device (CPUAdam.accumulate()): from the 2nd micro-batch on every gradient
        # exists, as with AdamW; in the last backward each leaves with its fp32 cast, at most the
        # in-flight bound of casts at once (the gradients themselves are counted in full).
        every = _div(st["trainable"] * st["ge"], 1)
        casts = min(st["trainable"] * 4, c.cpu_adam_inflight_bytes + _largest_trainable(c) * 4)
        at_logits = {"saved activations": saved, "model-level saved": extra, **logits_part}
        at_layer = {**at_layer_base, "cpu adam fp32 casts in flight (last micro-batch)": casts}
        a, b = sum(at_logits.values()), sum(at_layer.values())
        return (at_logits, every) if a >= b else (at_layer, every)
    # CPU Adam: no gradient stays; the copies in flight are the transient (see _cpu_adam_inflight).
    tied = s.tied_embeddings and not c.lora_rank
    # A tied LM head's gradient waits in autograd's input buffer for the embedding's, through
    # the whole backward; it leaves (with its fp32 cast) at the end, when the activations are gone.
    head_wait = {"tied lm_head grad (autograd buffer)": s.vocab * s.hidden * st["ge"]} if tied else {}
    moments = [
        {
            "saved activations": saved,
            "model-level saved": extra,
            **logits_part,
            "cpu adam grads in flight (previous micro-batch)": fl["leftover"],
        },
        {**at_layer_base, **head_wait, "cpu adam grads in flight": fl["layer"]},
        {"cpu adam grads in flight (incl. the largest)": fl["largest"]},
    ]
    if fl["head"] and not tied:  # an untied head's gradient leaves first, the activations all alive
        moments.append(
            {
                "saved activations": saved,
                "model-level saved": extra,
                "cpu adam grads in flight (incl. lm_head)": fl["head"],
            }
        )
    return max(moments, key=lambda d: sum(d.values())), 0


def grads_arrive_with_the_backward(c: PlanConfig) -> bool:
    """Whether the train backward's gradients come into existence one parameter at a time as
    it walks down the layers: full-parameter, one micro-batch, one GPU (no DDP buckets, no
    gradients of an earlier micro-batch), AdamW, every layer's saved activations on the GPU."""
    return c.micro_batches == 1 and c.dp == 1 and not c.lora_rank and not c.act_offload


def _one_pass_layer_moment(
    c: PlanConfig, st: dict[str, int], base: dict[str, int], saved: int, ckpt_in: int, layer: int
) -> tuple[dict[str, int], int]:
    """The train backward's highest moment inside the decoder layers when the gradients arrive
    with it (:func:`grads_arrive_with_the_backward`), and the gradient bytes held then.

    At layer ``k`` (the backward runs from the last layer to the first) the LM head's and the
    final norm's gradients exist, and those of layers ``k`` (counted whole) to the last; the
    saved activations of layers ``0..k`` are still held (each layer's input with checkpointing,
    its whole saved set without). Both are linear in ``k``, so the highest is at the first
    layer the backward reaches (every activation, the head's, the norm's and one layer's
    gradients) or at the last (one layer's activations beside every gradient). The
    embedding's gradient is made after that last layer's backward, beside what is left of
    it; the plan counts it with the last layer's activations, a bound on both moments (it
    is over by the smaller of the embedding's gradient and the layer's transient).
    ``base``: the components of :func:`train_transient` at a layer's backward, every layer's
    activations saved."""
    s, ge = c.shape, st["ge"]
    top = (s.vocab * s.hidden + s.hidden) * ge  # the head's gradient (a tied one: the embedding's) and the norm's
    own = ckpt_in if c.grad_ckpt else layer
    first = ({**base, "saved activations": saved}, top + s.layer_params() * ge)
    last = ({**base, "saved activations": own}, st["grads"])
    return max(first, last, key=lambda m: sum(m[0].values()) + m[1])


def _largest_trainable(c: PlanConfig) -> int:
    s = c.shape
    if c.lora_rank:
        return max(c.lora_rank * max(a, b) for a, b in s.linear_shapes().values())
    return s.largest_param()


def cpu_adam_step_transient(c: PlanConfig) -> dict[str, int]:
    """CPU Adam's ``step()``: the fp32 masters return to the device one parameter at a time
    (``master.to(device)`` then a cast into the parameter); the previous one is still
    referenced when the next is allocated, within an update call of >= 64 MiB of masters (a
    parameter that big is alone in its call)."""
    s = c.shape
    if c.lora_rank:
        big = max(c.lora_rank * max(a, b) for a, b in s.linear_shapes().values())
        return {"cpu adam fp32 weights (H2D)": 2 * big * 4}
    layer_max = max(a * b for a, b in s.linear_shapes().values())
    largest = s.largest_param()
    pair = largest + layer_max if largest * 4 < CPU_ADAM_CHUNK else max(largest, 2 * layer_max)
    return {"cpu adam fp32 weights (H2D)": pair * 4}
