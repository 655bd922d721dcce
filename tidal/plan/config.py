"""What one colocated RL (GRPO) step is, for the planner: :class:`PlanConfig` (the model's
shape, the batch, the levers) and the names its fields accept. The phases' memory
(:mod:`tidal.plan.phases`) and the plan (:mod:`tidal.plan.model`) are computed from it."""

from __future__ import annotations

import dataclasses
from typing import Any

from tidal.plan import activations as act
from tidal.plan.shapes import LORA_TARGETS, ModelShape, load_shape

__all__ = [
    "GIB",
    "LM_HEADS",
    "MIB",
    "OPTIMIZERS",
    "PHASES",
    "ROLLOUT_ENGINES",
    "SAMPLING",
    "VLLM_BLOCK_TOKENS",
    "ZERO3_ROLLOUTS",
    "PlanConfig",
]

MIB, GIB = 1 << 20, 1 << 30
PHASES = ("rollout", "reference", "train", "optimizer_step")
OPTIMIZERS = ("adamw", "adamw_offload", "cpu_adam")
SAMPLING = ("generate", "own")
LM_HEADS = ("logits", "fused")
ZERO3_ROLLOUTS = ("layers", "whole", "lent")
ROLLOUT_ENGINES = ("hf", "vllm")
VLLM_BLOCK_TOKENS = 16  # tokens per block of vLLM's paged KV cache (its default block_size)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanConfig:
    """Everything the model depends on. Sizes are per GPU unless the name says otherwise.

    Model and precision: ``shape``; ``param_dtype`` (``bf16``/``fp16``/``fp32``, also the
    activation dtype: no autocast); ``grad_dtype`` and ``optim_state_dtype`` default to the
    param dtype (what ``torch.optim.AdamW`` allocates: ``zeros_like(param)``); set
    ``optim_state_dtype="fp32"`` and ``master_weights=True`` for mixed-precision AdamW with
    fp32 master weights. With ``optimizer="cpu_adam"`` it is the dtype of CPU Adam's moments on
    the host (``CPUAdam(state_dtype=...)``): ``"fp32"`` (default) or ``"bf16"``.
    ``kv_dtype`` defaults to the param dtype.

    Optimizer: ``"adamw"`` (states on the GPU; ``adamw_foreach``: torch's foreach step makes
    one state-sized temporary, the fused one none), ``"adamw_offload"`` (states on the host
    except during ``optimizer_step``), ``"cpu_adam"`` (:class:`tidal.CPUAdam`: no optimizer
    bytes and no gradients kept on the GPU; each gradient is cast to fp32 on the GPU and copied
    to the host as it is produced, at most ``cpu_adam_inflight_bytes`` of copies pending, as
    ``CPUAdam(max_inflight_bytes=...)``, default 512 MiB). ``cpu_adam_grad_accumulation``: where
    CPU Adam sums the micro-batches' gradients: ``"device"`` (every micro-batch but the last in
    ``CPUAdam.accumulate()``: one gradient per parameter stays on the GPU through training, one
    fp32 copy per step crosses PCIe, no host staging) or ``"host"`` (each micro-batch's
    gradient crosses as it is produced and is summed on the host, in a pinned staging buffer of
    the parameters' size: ``CPUAdam(host_accumulation=True)``). ``step_in_train``: ``step()`` runs
    inside the measured train phase (tidal's GRPO trainer), so the train peak is the larger of
    the forward/backward and the optimizer step (``optimizer_step`` is still reported alone).
    ``optim_stream_chunk_bytes`` (``adamw_offload`` only): the states come in a chunk of
    parameters at a time during ``step()`` (the timeshare's ``optimizer_residency="stream"``,
    ``TimeshareConfig.optimizer_chunk_bytes``, 256 MiB there); ``None``: all at once.

    Sharding: ``zero_stage`` 0-3 over ``dp`` data-parallel GPUs: 1 shards optimizer states,
    2 also gradients (one layer's unsharded gradients exist before its reduce-scatter), 3
    also parameters (FSDP2: the root module's parameters stay gathered, and
    ``zero3_gathered_layers`` layers are unsharded at once: the running one and the
    prefetched one). ``zero3_rollout``: how ZeRO 3's rollout holds the policy's parameters:
    ``"layers"`` (unsharded unit by unit for every token, as above), ``"whole"`` (every
    parameter gathered once for the whole generation, as tidal's TRL trainer does under FSDP2
    where each GPU has the room, :func:`tidal.integrations.trl.launch.gathered_for_generation`:
    the whole model in the param dtype beside the shards) or ``"lent"`` (gathered whole, the
    shards lent to the host for the generation, as the trainer does where the room is there
    only without them: :func:`tidal.plan.gathered_rollout` chooses as it does).
    ``sync_each_micro_batch``: with ZeRO >= 2 over several GPUs and more than one micro-batch,
    the gradients are reduce-scattered after every micro-batch (accelerate's
    ``GradientAccumulationPlugin(sync_each_batch=True)``; in TRL,
    ``accelerator_config={"gradient_accumulation_kwargs": {"sync_each_batch": True}}``); by
    default (False) they are not: FSDP2 under accelerate's ``no_sync``
    (``set_requires_gradient_sync(False)``), what Trainer does between optimizer steps, keeps
    every gradient unsharded until the last micro-batch reduce-scatters the sum. ``prompts`` is global; each GPU rolls out ``ceil(prompts*group/dp)``.

    LoRA: ``lora_rank > 0`` trains adapters on ``lora_targets`` (``lora_dtype``, fp32 as peft
    casts them); the reference is the same base with adapters off (no second copy).

    ``misc_bytes``: allocated bytes present in every phase besides the modelled ones (cuBLAS
    workspace, small tensors; 40-100 MiB measured on an H200), outside the CUDA context.

    RL step: ``prompts`` x ``group`` samples of ``prompt_len`` + ``gen_len`` tokens (every
    sequence padded to the full length); ``micro_batch`` sequences per train forward/backward,
    ``reference_micro_batch`` (default ``micro_batch``) per reference forward; ``padding_mask``:
    batches carry an attention mask (left-padded prompts), see :mod:`tidal.plan.activations`.
    ``logprob_span``: log-probs over every position (``"sequence"``) or the completion only.
    ``logit_fp32_buffers``: fp32 ``(tokens x vocab)`` buffers alive at the train peak (the
    log-softmax output, its incoming and its outgoing gradient: 3); ``keep_logits``: the caller
    holds the model-dtype logits through backward (default: only log-probs are kept).
    ``completion_logits``: the forward computes logits only for the completion and the position
    before it (transformers' ``logits_to_keep=gen_len + 1``; needs ``logprob_span="completion"``),
    in reference and train. ``action_vocab``: log-probs (and own-loop sampling) over that many
    token ids only, a slice of the model-dtype logits: its fp32 buffers are that narrow, and
    backward through the slice makes model-dtype vocab-wide gradients (see
    :mod:`tidal.plan.phases`); ``logit_fp32_buffers`` then does not apply.
    ``lm_head``: ``"logits"`` (the model's LM head makes the logits, as above) or ``"fused"``
    (TRL 1.x's GRPOTrainer and RLOOTrainer score through ``add_fused_lm_head``: the log-probs
    and entropy of the completion's positions from ``4096 x 32768`` logit tiles in the param
    dtype, never the whole logits; its backward accumulates the LM head's weight gradient and
    the hidden states' gradient in fp32, then casts both. Needs ``logprob_span="completion"``;
    ``completion_logits``, ``logit_fp32_buffers`` and ``keep_logits`` then do not apply).
    ``sampling``: ``"generate"`` (HF ``generate``) or ``"own"`` (a loop like
    :func:`tidal_recipes.grpo.rollout.sample_answers`: prefill with ``logits_to_keep=1``, one token per
    step through a DynamicCache, the previous step's logits held while the next are computed,
    no vocab-wide fp32 buffer when ``action_vocab`` is set).
    Rollout (HF ``generate``): ``sampling_fp32_buffers`` fp32 ``(batch x vocab)`` buffers at the
    sampling step (with ``sampling="own"``: of width ``action_vocab`` or the vocabulary) (fp32 logits, processed scores, probabilities, multinomial's exponential
    draw and quotient: 5; ``min_new_tokens`` or top-k/top-p add one or two);
    ``repeat_kv_in_decode``: each decode step repeats one layer's K/V to all heads (transformers
    5.17 with a padding mask, measured; 5.23 packs GQA queries instead: set False).

    Rollout engine: ``rollout_engine="hf"`` generates with the policy itself (HF ``generate``
    or ``sampling="own"``, above); ``"vllm"`` with a vLLM engine in the same process (TRL's
    ``use_vllm=True, vllm_mode="colocate"``, sleep mode on; tidal's
    :class:`~tidal.integrations.vllm.VllmEngine`), one GPU. The engine holds a copy of the
    weights in the param dtype (``engine weights``) and a paged KV cache of
    ``vllm_kv_cache_bytes`` (None: sized for the rollout batch, every sequence of
    ``vllm_max_model_len`` tokens, default ``seq_len``, in whole blocks of
    :data:`VLLM_BLOCK_TOKENS` beside vLLM's null block: ``TidalConfig(vllm_kv_cache_bytes="auto")``);
    ``vllm_own_bytes`` besides (its CUDA graphs' pool and non-torch allocations, which stay
    taken while it sleeps: a driver-level constant, like the CUDA context). Between generations
    it sleeps (level 2: weights and cache back with the driver). TRL alone sizes the cache from
    ``vllm_gpu_memory_utilization`` of the device (see
    :func:`tidal.plan.phases.trl_vllm_kv_cache_bytes`). The sampling fields above do not apply.

    Memory levers: ``timeshare``, ``grad_ckpt``, ``act_offload`` (tidal: at most two layers'
    activations on the GPU), plus the optimizer and sharding choices above.
    """

    shape: ModelShape
    param_dtype: str = "bf16"
    grad_dtype: str | None = None
    optim_state_dtype: str | None = None
    master_weights: bool = False
    kv_dtype: str | None = None
    optimizer: str = "adamw"
    adamw_foreach: bool = True
    cpu_adam_inflight_bytes: int = 512 * MIB
    cpu_adam_grad_accumulation: str = "device"
    optim_stream_chunk_bytes: int | None = None
    step_in_train: bool = False
    zero_stage: int = 0
    dp: int = 1
    zero3_gathered_layers: int = 2
    zero3_rollout: str = "layers"
    sync_each_micro_batch: bool = False
    lora_rank: int = 0
    lora_targets: tuple[str, ...] = LORA_TARGETS
    lora_dtype: str = "fp32"
    prompts: int = 8
    group: int = 4
    prompt_len: int = 128
    gen_len: int = 256
    micro_batch: int = 4
    reference_micro_batch: int | None = None
    padding_mask: bool = True
    attn: str = "sdpa"
    logprob_span: str = "sequence"
    completion_logits: bool = False
    lm_head: str = "logits"
    action_vocab: int | None = None
    logit_fp32_buffers: int = 3
    keep_logits: bool = False
    sampling: str = "generate"
    sampling_fp32_buffers: int = 5
    repeat_kv_in_decode: bool = True
    grad_ckpt: bool = False
    act_offload: bool = False
    timeshare: bool = True
    rollout_shares_weights: bool = True
    rollout_engine: str = "hf"
    vllm_kv_cache_bytes: int | None = None
    vllm_max_model_len: int | None = None
    vllm_gpu_memory_utilization: float = 0.3
    vllm_own_bytes: int = int(1.35 * GIB)
    cuda_context_bytes: int = 500 * MIB
    misc_bytes: int = 48 * MIB

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", load_shape(self.shape))
        object.__setattr__(self, "lora_targets", tuple(self.lora_targets))
        for name in ("param_dtype", "grad_dtype", "optim_state_dtype", "kv_dtype", "lora_dtype"):
            if getattr(self, name) is not None:
                act.dtype_bytes(getattr(self, name))
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if self.optimizer == "cpu_adam" and self.optim_state_dtype not in (None, "fp32", "bf16"):
            raise ValueError(
                f"optim_state_dtype={self.optim_state_dtype!r} with optimizer='cpu_adam': CPUAdam keeps its moments "
                f"in fp32 or bf16 (its state_dtype); use one of those"
            )
        if self.cpu_adam_grad_accumulation not in ("device", "host"):
            raise ValueError(
                f"cpu_adam_grad_accumulation must be 'device' or 'host', got {self.cpu_adam_grad_accumulation!r}"
            )
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0-3, got {self.zero_stage}")
        if self.attn not in act.ATTN_IMPLEMENTATIONS:
            raise ValueError(f"attn must be one of {act.ATTN_IMPLEMENTATIONS}, got {self.attn!r}")
        if self.logprob_span not in ("sequence", "completion"):
            raise ValueError(f"logprob_span must be 'sequence' or 'completion', got {self.logprob_span!r}")
        if self.completion_logits and self.logprob_span != "completion":
            raise ValueError(
                "completion_logits=True computes logits of the completion only: it needs logprob_span='completion'"
            )
        if self.lm_head not in LM_HEADS:
            raise ValueError(f"lm_head must be one of {LM_HEADS}, got {self.lm_head!r}")
        if self.lm_head == "fused" and (self.logprob_span != "completion" or self.action_vocab is not None):
            raise ValueError(
                "lm_head='fused' (TRL's fused LM head) scores the completion's positions over the whole vocabulary: "
                "it needs logprob_span='completion' and no action_vocab"
            )
        if self.zero3_rollout not in ZERO3_ROLLOUTS:
            raise ValueError(f"zero3_rollout must be one of {ZERO3_ROLLOUTS}, got {self.zero3_rollout!r}")
        if self.optim_stream_chunk_bytes is not None and (
            self.optimizer != "adamw_offload" or self.optim_stream_chunk_bytes < 1
        ):
            raise ValueError("optim_stream_chunk_bytes needs optimizer='adamw_offload' and a size >= 1")
        if self.rollout_engine not in ROLLOUT_ENGINES:
            raise ValueError(f"rollout_engine must be one of {ROLLOUT_ENGINES}, got {self.rollout_engine!r}")
        if self.rollout_engine == "vllm":
            if self.dp > 1 or self.zero_stage:
                raise ValueError(
                    "rollout_engine='vllm' is planned on one GPU without ZeRO (the engine beside one process's roles); "
                    "plan several GPUs with rollout_engine='hf'"
                )
            if not self.rollout_shares_weights:
                raise ValueError("rollout_engine='vllm': the engine holds its own copy; leave rollout_shares_weights")
            if self.vllm_kv_cache_bytes is not None and (
                isinstance(self.vllm_kv_cache_bytes, bool)
                or not isinstance(self.vllm_kv_cache_bytes, int)
                or self.vllm_kv_cache_bytes < 1
            ):
                raise ValueError(f"vllm_kv_cache_bytes must be an int >= 1 or None, got {self.vllm_kv_cache_bytes!r}")
            if self.vllm_max_model_len is not None and self.vllm_max_model_len < self.seq_len:
                raise ValueError(
                    f"vllm_max_model_len={self.vllm_max_model_len} is below a sequence of the step "
                    f"(prompt_len + gen_len = {self.seq_len}); vLLM would refuse the requests"
                )
            if not 0 < self.vllm_gpu_memory_utilization <= 1:
                raise ValueError(
                    f"vllm_gpu_memory_utilization must be in (0, 1], got {self.vllm_gpu_memory_utilization!r}"
                )
            if self.vllm_own_bytes < 0:
                raise ValueError(f"vllm_own_bytes must be >= 0, got {self.vllm_own_bytes}")
        if self.sampling not in SAMPLING:
            raise ValueError(f"sampling must be one of {SAMPLING}, got {self.sampling!r}")
        if self.action_vocab is not None and not 1 <= self.action_vocab <= self.shape.vocab:
            raise ValueError(f"action_vocab must be in [1, vocab={self.shape.vocab}], got {self.action_vocab}")
        for name in ("dp", "prompts", "group", "prompt_len", "gen_len", "micro_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in (
            "lora_rank",
            "logit_fp32_buffers",
            "sampling_fp32_buffers",
            "cuda_context_bytes",
            "misc_bytes",
            "cpu_adam_inflight_bytes",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        self.shape.lora_params(self.lora_rank, self.lora_targets)  # validates target names

    def replace(self, **changes: Any) -> "PlanConfig":
        return dataclasses.replace(self, **changes)

    # ---- derived sizes --------------------------------------------------------------------
    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.gen_len

    @property
    def rollout_batch(self) -> int:
        """Sequences generated on each GPU per step: ``ceil(prompts * group / dp)``."""
        return -(-self.prompts * self.group // self.dp)

    @property
    def engine_max_len(self) -> int:
        """Tokens of the longest sequence the vLLM engine takes (``vllm_max_model_len`` or ``seq_len``)."""
        return self.vllm_max_model_len or self.seq_len

    @property
    def micro_batches(self) -> int:
        """Train micro-batches per GPU per step (gradient accumulation steps)."""
        return -(-self.rollout_batch // self.micro_batch)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["shape"] = self.shape.to_dict()
        d["lora_targets"] = list(self.lora_targets)
        return d
