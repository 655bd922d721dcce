"""A compact GRPO trainer whose three roles take turns on one device through a Timeshare.

Roles (each registered with :class:`tidal.Timeshare`):

- ``rollout``: the policy generating answers with its KV cache (``use_cache=True``, eval
  mode). The cache dies with the rollout; the driver-level memory after it is recorded.
- ``reference``: the frozen reference policy, log-probabilities only (no grad). With a
  LoRA policy (peft) it is the same module with its adapters disabled, so no second copy of
  the weights exists anywhere.
- ``actor_train``: the policy with its optimizer (``use_cache=False``, gradient
  checkpointing optional; ``torch.optim.AdamW`` or :class:`tidal.CPUAdam`).

``rollout`` and ``actor_train`` hold the same module, so their weights exist once and stay
on the device across that switch; only the reference weights and the optimizer state move
(with ``prefetch``, only what the device has no room to keep).
With ``timeshare=False`` the same loop runs with every role resident (the baseline).

Memory of a step, with the timeshare: the largest of (rollout weights + KV cache),
(reference weights + one micro-batch's logits), (actor weights + grads + one micro-batch's
activations), (actor weights + grads + optimizer state during ``step()``).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import gc
import time
import warnings
import weakref

import torch

from tidal.device import DeviceOps
from tidal.distributed.lease import GPULease
from tidal.memory import phase_need_bytes
from tidal.optim import CPUAdam
from tidal_recipes.grpo.graph_rollout import GraphDecoder
from tidal_recipes.grpo.grpo import LossConfig, action_logprobs, group_advantages, grpo_loss
from tidal_recipes.grpo.modes import role_mode, set_checkpointing
from tidal_recipes.grpo.phases import RoleTurns
from tidal_recipes.grpo.rollout import logits_kwargs, sample_answers
from tidal_recipes.grpo.vllm_rollout import VllmDecoder
from tidal_recipes.grpo.tasks import DIGIT0, TASK_VOCAB, DigitTask
from tidal.state import storage_key, unique_storage_bytes
from tidal.state.digest import digest_many
from tidal.timeline import MemoryTimeline
from tidal.timeshare import Timeshare, TimeshareConfig
from tidal.timeshare.schedule import PhaseSchedule, ScheduleConfig, StepPhases
from tidal.vmm import Region

__all__ = ["GRPOConfig", "GRPOTrainer", "StepResult", "answer_logprobs", "draw_prompts", "prompt_generator"]

WEIGHTS_TAG = "weights"  # the policy's weights in the rollout region (rollout_graph with a timeshare)
ACTION_IDS = (DIGIT0, TASK_VOCAB)  # the policy's action space: the ten digit tokens
OPTIMIZERS = ("adamw", "cpu_adam")
ROLE_OF_PHASE = {"rollout": "rollout", "reference": "reference", "train": "actor_train"}
#: The step as the phase schedule reads it: the rollout (the decoding phase), the reference's
#: scoring, the training (its reading holds the backward and the optimizer step).
GRPO_PHASES = StepPhases(
    order=("rollout", "reference", "actor_train"),
    turn_phase={"actor_train": "train"},
    generation="rollout",
    loss="train",
    backward=None,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GRPOConfig:
    """
    Attributes:
        task: the verifiable task the policy learns.
        prompts_per_step: distinct prompts per step; each is sampled ``group_size`` times.
        group_size: samples per prompt (GRPO's group).
        micro_batch: sequences per forward/backward (memory knob; the result is the same).
        mini_batches: optimizer steps per rollout batch (>1 makes the PPO ratio and its clip
            matter, and costs one extra no-grad forward for the old log-probs).
        lr, weight_decay, max_grad_norm: the optimizer (AdamW semantics; norm clip over all
            params, 0 disables it).
        optimizer: ``"adamw"`` (torch's; with the timeshare its state stays on the host and
            comes in a chunk at a time during ``step()``) or ``"cpu_adam"`` (tidal.CPUAdam: state
            and update on the host, overlapped with backward).
        optimizer_residency: with the timeshare and ``"adamw"``, where the optimizer state lives
            between steps (:class:`tidal.Timeshare` roles): ``"stream"`` (default: on the host,
            brought in a chunk at a time during ``step()``: the step's peak holds weights +
            gradients + one chunk), ``"step"`` (on the host, all of it in for ``step()``) or
            ``"role"`` (moves with the training role: resident from the training phase's switch
            until the next phase's, which a prefetch can hide). CPU Adam's state is on the host
            whatever this says.
        grad_accumulation: with ``"cpu_adam"``, where the micro-batches' gradients are summed:
            ``"device"`` (every micro-batch but the last in ``CPUAdam.accumulate()``: one
            gradient per parameter on the GPU through training, one copy per step, no pinned
            staging on the host) or ``"host"`` (each micro-batch's gradient leaves as it is
            produced and is summed on the host: no gradient stays on the GPU, a staging buffer
            of the parameters' size is pinned). Ignored, with a warning, by ``"adamw"``.
        cpu_adam_state_dtype: with ``"cpu_adam"``, the dtype of its moments on the host:
            ``"fp32"`` (AdamW exactly) or ``"bf16"`` (``CPUAdam(state_dtype=torch.bfloat16)``:
            4 instead of 8 host bytes per parameter; fp32 masters stay). Ignored, with a
            warning, by ``"adamw"``.
        grad_ckpt: gradient checkpointing in training (non-reentrant); rollout keeps its cache.
        temperature: sampling temperature of the rollout.
        loss: clip, KL and entropy coefficients. ``kl_coef=0`` skips the reference role.
        rollout_graph: decode with the step captured in a CUDA graph over a static KV cache
            (:class:`~tidal_recipes.grpo.graph_rollout.GraphDecoder`): the cache and the
            graph's workspace live in a :class:`tidal.Region` and go back to the driver between
            rollouts; with the timeshare the policy's weights live there too (a role with
            ``region=``), so the graph survives their offloads. CUDA only; not with LoRA.
        rollout_engine: ``"hf"`` (the policy's own forward, as above; the default, and the CPU's)
            or ``"vllm"``: an in-process vLLM engine built from the policy as the trainer
            starts, a turn of the timeshare (:class:`tidal_recipes.grpo.vllm_rollout.VllmDecoder`):
            the policy's weights pushed into it before each rollout, its memory back with the
            driver after. Needs vLLM installed and ``timeshare=True``; not with
            ``rollout_graph`` or LoRA.
        timeshare: run the roles through a Timeshare (False: all roles stay resident).
        timeshare_config: its settings (default: only the role in use is resident).
        prefetch: with the timeshare, each phase starts bringing the next phase's role in
            behind its own compute and writes its role's state back to the host ahead of the
            switch (:meth:`tidal.Timeshare.prefetch`), so the switches that follow move next to
            nothing. It trades peak memory for time: the next role is brought in as far as
            free device memory allows once what the phase itself allocated in the step before
            (plus 10% and 256 MiB) is left to it; the first step prefetches nothing on an
            accelerator (it measures those needs). Each turn then moves out only what it takes
            to leave its phase's measured need free (least recently used first): the policy's
            weights stay through the scoring, AdamW's state (``optimizer_residency="role"``)
            through the rollout and the scoring, the frozen reference through the training,
            wherever the device has the room; what does not fit goes as before, written back
            by the prefetch behind the phase before.
        seed: seeds prompts, sampling and dropout, so a run is reproducible.
    """

    task: DigitTask = dataclasses.field(default_factory=DigitTask)
    prompts_per_step: int = 16
    group_size: int = 8
    micro_batch: int = 64
    mini_batches: int = 1
    lr: float = 1e-3
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    optimizer: str = "adamw"
    optimizer_residency: str = "stream"
    grad_accumulation: str = "device"
    cpu_adam_state_dtype: str = "fp32"
    grad_ckpt: bool = False
    temperature: float = 1.0
    rollout_graph: bool = False
    rollout_engine: str = "hf"
    loss: LossConfig = dataclasses.field(default_factory=LossConfig)
    timeshare: bool = True
    timeshare_config: TimeshareConfig | None = None
    prefetch: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("prompts_per_step", "group_size", "micro_batch", "mini_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if self.optimizer_residency not in ("stream", "step", "role"):
            raise ValueError(
                f"optimizer_residency must be 'stream', 'step' or 'role', got {self.optimizer_residency!r}"
            )
        if self.grad_accumulation not in ("device", "host"):
            raise ValueError(f"grad_accumulation must be 'device' or 'host', got {self.grad_accumulation!r}")
        if self.grad_accumulation == "host" and self.optimizer != "cpu_adam":
            warnings.warn(
                f"grad_accumulation='host' is ignored with optimizer={self.optimizer!r}: only cpu_adam sums "
                f"gradients on the host",
                stacklevel=3,
            )
        if self.cpu_adam_state_dtype not in ("fp32", "bf16"):
            raise ValueError(f"cpu_adam_state_dtype must be 'fp32' or 'bf16', got {self.cpu_adam_state_dtype!r}")
        if self.cpu_adam_state_dtype != "fp32" and self.optimizer != "cpu_adam":
            warnings.warn(
                f"cpu_adam_state_dtype={self.cpu_adam_state_dtype!r} is ignored with optimizer={self.optimizer!r}",
                stacklevel=3,
            )
        if self.batch_size % self.mini_batches:
            raise ValueError(
                f"prompts_per_step * group_size = {self.batch_size} does not split into "
                f"mini_batches={self.mini_batches} equal parts"
            )
        if self.lr <= 0 or self.max_grad_norm < 0 or self.temperature <= 0:
            raise ValueError("lr and temperature must be > 0 and max_grad_norm >= 0")
        if self.prefetch and not self.timeshare:
            raise ValueError("prefetch=True brings the next role in through the timeshare; it needs timeshare=True")
        if self.rollout_engine not in ("hf", "vllm"):
            raise ValueError(f"rollout_engine must be 'hf' or 'vllm', got {self.rollout_engine!r}")
        if self.rollout_engine == "vllm" and (self.rollout_graph or not self.timeshare):
            raise ValueError(
                "rollout_engine='vllm' rolls out with vLLM's own engine, a turn of the timeshare: it needs "
                "timeshare=True and no rollout_graph (the generate path's CUDA graph)"
            )

    @property
    def batch_size(self) -> int:
        return self.prompts_per_step * self.group_size


@dataclasses.dataclass(kw_only=True)
class StepResult:
    """What one step did: reward, loss statistics, and per phase its seconds, peak memory
    and the transitions (bytes, seconds) that brought its role in."""

    step: int
    reward_mean: float
    reward_std: float
    stats: dict[str, float]
    phases: dict[str, dict] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return {"type": "step", **dataclasses.asdict(self)}


def _move_into(model: torch.nn.Module, region: Region | None, tag: str | None) -> None:
    """Copy ``model``'s parameters and buffers into ``region``'s ``tag`` (a ``discard`` tag: the
    timeshare's store holds their host copy), or back to ordinary memory (``region=None``).
    The tensor objects stay; their storages change. Costs one copy of the weights (device)."""
    ctx = region.allocate(tag, policy="discard") if region is not None else contextlib.nullcontext()
    with ctx, torch.no_grad():
        for p in model.parameters():
            p.data = p.data.clone()
        for mod in model.modules():
            for name, b in mod._buffers.items():
                if b is not None and b.device.type != "cpu":
                    mod._buffers[name] = b.clone()


def _is_lora(model: torch.nn.Module) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "get_base_model")


def prompt_generator(config: GRPOConfig) -> torch.Generator:
    """The host generator prompts are drawn from (seeded from ``config.seed``)."""
    return torch.Generator().manual_seed(config.seed + 1)


def draw_prompts(config: GRPOConfig, generator: torch.Generator) -> torch.Tensor:
    """One step's prompts on the host, each repeated ``group_size`` times (its group)."""
    prompts = config.task.prompts(config.prompts_per_step, generator)
    return prompts.repeat_interleave(config.group_size, dim=0)


def answer_logprobs(
    model: torch.nn.Module, seqs: torch.Tensor, answer_len: int, *, micro_batch: int, on_chunk=None
) -> torch.Tensor:
    """No-grad log-probs of the last ``answer_len`` tokens of ``seqs`` over the action ids,
    ``micro_batch`` sequences per forward (only one micro-batch's logits exist at a time)."""
    out = []
    kw = logits_kwargs(model, answer_len + 1)
    with torch.no_grad():
        for i in range(0, seqs.shape[0], micro_batch):
            chunk = seqs[i : i + micro_batch]
            logits = model(input_ids=chunk, use_cache=False, **kw).logits[:, -answer_len - 1 : -1]
            out.append(action_logprobs(logits, chunk[:, -answer_len:], ACTION_IDS)[0])
            del logits
            if on_chunk is not None:
                on_chunk()
    return torch.cat(out)


class GRPOTrainer:
    """GRPO on a Hugging Face causal LM, roles colocated on ``policy``'s device.

    Args:
        policy: the model to train (a ``PreTrainedModel``, or a peft LoRA model: then only
            the adapters train and the reference is the base with adapters off). Its first
            :data:`TASK_VOCAB` token ids are the task's tokens.
        config: see :class:`GRPOConfig`.
        reference: the frozen reference; default a deep copy of ``policy`` made here (for a
            LoRA policy none is made). Ignored when ``config.loss.kl_coef == 0``.
        timeline: where memory samples go (one is made if None).
        remote_reference: the reference runs in another process (:mod:`tidal_recipes.grpo.workers`);
            this trainer then has no reference role and ``train_phase`` takes its log-probs.
        lease: a cross-process :class:`~tidal.distributed.GPULease` of the device: every
            phase's role comes in on a turn of the lease, and every role here is offloaded
            when the turn ends, so roles in other processes can use the device in between.
    """

    def __init__(
        self,
        policy: torch.nn.Module,
        *,
        config: GRPOConfig | None = None,
        reference: torch.nn.Module | None = None,
        timeline: MemoryTimeline | None = None,
        remote_reference: bool = False,
        lease: GPULease | None = None,
    ) -> None:
        self.config = cfg = config or GRPOConfig()
        if lease is not None and not cfg.timeshare:
            raise ValueError(
                "lease= takes turns with other processes by offloading this trainer's roles "
                "through its Timeshare; it needs GRPOConfig(timeshare=True)"
            )
        if lease is not None and cfg.prefetch:
            raise ValueError(
                "prefetch=True brings the next role in while this process holds the device; with lease= the "
                "roles of other processes use it in between: drop prefetch"
            )
        if lease is not None and not isinstance(lease, GPULease):
            raise TypeError(f"lease must be a tidal.distributed.GPULease, got {type(lease).__name__}")
        if remote_reference and reference is not None:
            raise ValueError(
                "remote_reference=True: the reference lives in another process, so reference= must be None"
            )
        vocab = policy.get_output_embeddings().weight.shape[0]
        if vocab < TASK_VOCAB:
            raise ValueError(f"the policy's vocabulary has {vocab} tokens; the task needs at least {TASK_VOCAB}")
        self.policy = policy
        self.device = next(policy.parameters()).device
        self.ops = DeviceOps(self.device)
        self.lora = _is_lora(policy)
        self.use_reference = cfg.loss.kl_coef > 0
        # With the reference in another process this trainer holds no reference role: its
        # log-probs arrive as an argument of train_phase().
        self.local_reference = self.use_reference and not remote_reference
        if reference is not None and (self.lora or not self.use_reference):
            raise ValueError(
                "reference= is not used here: a LoRA policy is its own reference (adapters "
                "off), and kl_coef=0 needs none; pass reference=None"
            )
        if self.local_reference and not self.lora:
            reference = reference if reference is not None else copy.deepcopy(policy)
            reference.requires_grad_(False).eval()
        self.reference = reference
        self.region: Region | None = None
        self.decoder: GraphDecoder | None = None
        if cfg.rollout_graph:
            if self.device.type != "cuda" or self.lora:
                raise ValueError(
                    f"rollout_graph=True captures the decode step in a CUDA graph: it needs the policy on a "
                    f"CUDA device and not a LoRA model (got {self.device}{', LoRA' if self.lora else ''}); "
                    f"drop rollout_graph"
                )
            self.region = Region("rollout", device=self.device)
            try:
                self.decoder = GraphDecoder(policy, self.region)
            except ValueError:
                self.region.close()
                raise
            if cfg.timeshare:
                # The graph reads the weights at fixed addresses: they move in place from now on.
                _move_into(policy, self.region, WEIGHTS_TAG)
        if cfg.grad_ckpt:
            # On for good: HF layers checkpoint only in train mode, which only the training
            # phase sets (role_mode); the rollout and reference run in eval mode.
            set_checkpointing(policy, True)
        params = [p for p in policy.parameters() if p.requires_grad]
        if cfg.optimizer == "cpu_adam":
            self.optimizer = CPUAdam(
                params,
                lr=cfg.lr,
                weight_decay=cfg.weight_decay,
                host_accumulation=cfg.grad_accumulation == "host",
                state_dtype=torch.bfloat16 if cfg.cpu_adam_state_dtype == "bf16" else torch.float32,
            )
        else:
            fused = self.ops.is_accelerator
            self.optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=fused or None)
        # A weak reference: the timeline outlives the trainer (it is written out after close())
        # and must not keep the models alive.
        me = weakref.ref(self)
        self.timeline = timeline or MemoryTimeline(
            self.ops, state_bytes=lambda: me().state_bytes_on_device() if me() is not None else 0
        )
        self.ts: Timeshare | None = None
        if cfg.timeshare:
            self.ts = Timeshare(self.device, config=cfg.timeshare_config)
            # grads="drop": they are zeroed after every step, so a switch never has any to move.
            # With "stream" AdamW's state comes in a chunk at a time during step(), so the step's
            # peak holds weights + grads + one chunk, not the whole state.
            # CPU Adam's state is on the host already: it has no residency to choose (the
            # timeshare's default is asked for, not one it would warn that it ignores).
            residency = cfg.optimizer_residency if cfg.optimizer != "cpu_adam" else "step"
            roles = [
                (
                    "actor_train",
                    dict(optimizer=self.optimizer, grads="drop", optimizer_residency=residency),
                ),
                ("rollout", dict(region=self.region.tag(WEIGHTS_TAG) if self.region is not None else None)),
            ]
            if self.region is not None:
                roles.reverse()  # the region's tag is served before any role collects its storages
            for name, kw in roles:
                self.ts.add_role(name, model=policy, **kw)
            if self.local_reference:
                # Never written (a LoRA policy's base is the trained module's: not declared so).
                self.ts.add_role("reference", model=self.reference if not self.lora else policy, frozen=not self.lora)
        # What each turn keeps free beside its role and what comes in behind it (the library's
        # phase schedule): with prefetch, what each phase allocated in the last step, +10% and
        # 256 MiB (on the CPU, which has no allocator counters: 256 MiB).
        self.schedule: PhaseSchedule | None = None
        if self.ts is not None:
            self.schedule = PhaseSchedule(
                self.ts,
                GRPO_PHASES,
                config=ScheduleConfig(prefetch=cfg.prefetch, unmeasured_keep_free_bytes=phase_need_bytes(0)),
            )
        self.turns = RoleTurns(self.ops, self.timeline, self.ts, lease, schedule=self.schedule)
        self.engine_decoder: VllmDecoder | None = None
        if cfg.rollout_engine == "vllm":
            if self.lora:
                raise ValueError(
                    "rollout_engine='vllm' pushes the whole policy into the engine: not with a LoRA policy"
                )
            self.engine_decoder = VllmDecoder(
                policy,
                self.ts,
                role="rollout",
                sequences=cfg.batch_size,
                max_len=cfg.task.prompt_len + cfg.task.answer_len,
                seed=cfg.seed,
            )
        if cfg.prefetch:
            # The digest kernel that write-backs use is compiled on its first call (about 1-2 s
            # on a GPU): here, at start-up, not in the middle of the first prefetching step.
            digest_many([torch.zeros(8, dtype=torch.uint8, device=self.device)])
        self.step_index = 0
        self._gen_device = torch.Generator(device=self.device).manual_seed(cfg.seed)
        self._gen_prompts = prompt_generator(cfg)

    # ---- memory accounting ------------------------------------------------------------------
    def _modules(self) -> list[torch.nn.Module]:
        return [m for m in (self.policy, self.reference) if m is not None]

    def state_bytes_on_device(self) -> int:
        """Bytes of role state (params, grads, optimizer state) held in storages on the
        device now; each storage counted once."""
        tensors: list = []
        for m in self._modules():
            for p in m.parameters():
                tensors += [p, p.grad]
            tensors += list(m.buffers())
        for st in self.optimizer.state.values():
            tensors += list(st.values())
        return unique_storage_bytes(tensors, self.device)

    def all_resident_state_bytes(self) -> int:
        """Bytes the roles' state would take with every role resident at once: weights (the
        shared ones once), one grad per trainable param, and the optimizer state (0 for
        CPUAdam, whose state lives on the host)."""
        weights: dict[int, int] = {}
        for m in self._modules():
            for t in list(m.parameters()) + list(m.buffers()):
                weights[storage_key(t.untyped_storage())] = t.numel() * t.element_size()
        trainable = [p for p in self.policy.parameters() if p.requires_grad]
        grads = sum(p.numel() * p.element_size() for p in trainable)
        optim = 0 if isinstance(self.optimizer, CPUAdam) else 2 * grads  # exp_avg + exp_avg_sq
        return sum(weights.values()) + grads + optim

    # ---- the step ---------------------------------------------------------------------------
    def _logprobs(self, model: torch.nn.Module, seqs: torch.Tensor, answer_len: int) -> torch.Tensor:
        return answer_logprobs(
            model, seqs, answer_len, micro_batch=self.config.micro_batch, on_chunk=self.timeline.sample
        )

    def _phase(self, phase: str, res: StepResult):
        """``phase``'s turn of its role, measured into ``res.phases``, keeping free what the
        phase needs and prefetching the next phase's role (:attr:`schedule`, :meth:`_then`)."""
        return self.turns.phase(
            phase,
            role=ROLE_OF_PHASE[phase],
            into=res.phases,
            step=self.step_index,
            then=self._then(phase),
        )

    def _then(self, phase: str) -> str | None:
        """The role ``phase`` prefetches behind its compute: the next phase's (the schedule's
        choice of room and keep); the training phase prefetches nothing, since the rollout
        role holds the same weights."""
        if phase == "train" or self.schedule is None:
            return None
        return self.schedule.after(ROLE_OF_PHASE[phase])

    def next_prompts(self) -> torch.Tensor:
        """The next step's prompts on the host (see :func:`draw_prompts`), drawn from the
        trainer's own generator, so a run is reproducible."""
        return draw_prompts(self.config, self._gen_prompts)

    def rollout_phase(self, prompts: torch.Tensor, res: StepResult) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Sample answers to ``prompts``; returns ``(seqs, old_logp)`` on the device (old
        log-probs only with ``mini_batches > 1``)."""
        cfg, n_ans = self.config, self.config.task.answer_len
        prompts = prompts.to(self.device)
        with (
            self._phase("rollout", res),
            role_mode(self.policy, "rollout"),
        ):
            if self.engine_decoder is not None:
                sample = self.engine_decoder.sample
            elif self.decoder is not None:
                sample = self.decoder.sample
            else:
                sample = functools.partial(sample_answers, self.policy)
            answers = sample(
                prompts,
                n_ans,
                ACTION_IDS,
                generator=self._gen_device,
                temperature=cfg.temperature,
                on_step=lambda _i: self.timeline.sample(),
            )
            seqs = torch.cat([prompts, answers], dim=1)
            old_logp = self._logprobs(self.policy, seqs, n_ans) if cfg.mini_batches > 1 else None
        return seqs, old_logp

    def reference_phase(self, seqs: torch.Tensor, res: StepResult) -> torch.Tensor:
        """The reference's log-probs of the answers in ``seqs``."""
        if not self.local_reference:
            raise ValueError("this trainer has no reference role (kl_coef=0 or remote_reference=True)")
        model = self.reference if not self.lora else self.policy
        with (
            self._phase("reference", res),
            role_mode(model, "reference"),
        ):
            ctx = self.policy.disable_adapter() if self.lora else contextlib.nullcontext()
            with ctx:
                return self._logprobs(model, seqs, self.config.task.answer_len)

    def train_phase(
        self,
        seqs: torch.Tensor,
        adv: torch.Tensor,
        old_logp: torch.Tensor | None,
        ref_logp: torch.Tensor | None,
        res: StepResult,
    ) -> None:
        """``mini_batches`` updates on the sampled ``seqs``; fills ``res.stats``."""
        if self.use_reference and ref_logp is None:
            raise ValueError("kl_coef > 0: train_phase needs the reference log-probs (ref_logp)")

        def put(t):
            return t.to(self.device) if t is not None else None

        with (
            self._phase("train", res),
            role_mode(self.policy, "actor_train"),
        ):
            res.stats = self._train(put(seqs), self.config.task.answer_len, put(adv), put(old_logp), put(ref_logp))
        self.step_index += 1

    def step(self) -> StepResult:
        """One GRPO step: rollout, reference log-probs, then ``mini_batches`` updates."""
        cfg = self.config
        t0 = time.perf_counter()
        res = StepResult(step=self.step_index, reward_mean=0.0, reward_std=0.0, stats={})
        prompts = self.next_prompts()
        seqs, old_logp = self.rollout_phase(prompts, res)
        rewards = cfg.task.rewards(prompts.to(self.device), seqs[:, prompts.shape[1] :])
        res.reward_mean, res.reward_std = float(rewards.mean()), float(rewards.std())
        adv = group_advantages(rewards, cfg.group_size).to(self.device)
        ref_logp = self.reference_phase(seqs, res) if self.use_reference else None
        self.train_phase(seqs, adv, old_logp, ref_logp, res)
        res.seconds = time.perf_counter() - t0
        return res

    def _train(
        self,
        seqs: torch.Tensor,
        n_ans: int,
        adv: torch.Tensor,
        old_logp: torch.Tensor | None,
        ref_logp: torch.Tensor | None,
    ) -> dict[str, float]:
        cfg = self.config
        kw = logits_kwargs(self.policy, n_ans + 1)
        mini = cfg.batch_size // cfg.mini_batches
        totals: dict[str, float] = {}
        norms: list[float] = []
        count = 0
        on_device = isinstance(self.optimizer, CPUAdam) and cfg.grad_accumulation == "device"
        for m0 in range(0, cfg.batch_size, mini):
            for i in range(m0, m0 + mini, cfg.micro_batch):
                j = min(i + cfg.micro_batch, m0 + mini)
                chunk = seqs[i:j]
                logits = self.policy(input_ids=chunk, use_cache=False, **kw).logits[:, -n_ans - 1 : -1]
                logp, ent = action_logprobs(logits, chunk[:, -n_ans:], ACTION_IDS, with_entropy=True)
                del logits  # autograd keeps no reference: the (B, T, vocab) logits die before backward
                old = old_logp[i:j] if old_logp is not None else logp.detach()
                loss, st = grpo_loss(
                    logp, old, adv[i:j], cfg.loss, ref_logp=ref_logp[i:j] if ref_logp is not None else None, entropy=ent
                )
                scaled = loss * ((j - i) / mini)
                if on_device and j < m0 + mini:
                    with self.optimizer.accumulate():  # summed in p.grad; the last backward sends the sums
                        scaled.backward()
                else:
                    scaled.backward()
                del scaled
                del logp, ent, loss
                self.timeline.sample()
                for k, v in st.items():
                    totals[k] = totals.get(k, 0.0) + v
                count += 1
            if cfg.max_grad_norm > 0:
                if isinstance(self.optimizer, CPUAdam):
                    norm = self.optimizer.clip_grad_norm_(cfg.max_grad_norm)
                else:
                    norm = torch.nn.utils.clip_grad_norm_(
                        [p for p in self.policy.parameters() if p.requires_grad], cfg.max_grad_norm
                    )
                norms.append(float(norm))
            self.optimizer.step()
            self.timeline.sample("optimizer step")
            self.optimizer.zero_grad(set_to_none=True)
        stats = {k: v / count for k, v in totals.items()}
        if norms:
            stats["grad_norm"] = sum(norms) / len(norms)
        return stats

    def close(self) -> None:
        """Bring every role back to the device and release tidal's host memory."""
        if self.engine_decoder is not None:
            self.engine_decoder.close()
        if self.ts is not None:
            self.ts.close()
        if self.region is not None:
            self.decoder.close()
            if self.config.timeshare:
                _move_into(self.policy, None, None)  # the weights back to ordinary memory
            gc.collect()
            self.region.close()
            self.region = None
        if isinstance(self.optimizer, CPUAdam):
            self.optimizer.close()
