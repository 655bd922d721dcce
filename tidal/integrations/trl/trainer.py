"""The trainers: :class:`TidalRLTrainer`, the tidal side of a TRL trainer with GRPOTrainer's
phases, and :class:`TidalGRPOTrainer` / :class:`TidalRLOOTrainer` (see the package docstring)."""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import torch
import trl.generation.vllm_generation as trl_vllm
from trl import GRPOTrainer, RLOOTrainer
from trl.trainer.callbacks import SyncRefModelCallback

from tidal.activations import offload_activations
from tidal.distributed.ddp import GradientBuckets
from tidal.integrations.hf import ActivationFigures, CPUAdamClipping, find_layers
from tidal.distributed.fsdp import reshard_after_no_grad_forward
from tidal.integrations.seams import check_trainer, check_trainer_class, check_trl_engine, instead
from tidal.integrations.trl.checks import (
    colocated_vllm,
    own_storages,
    place_models_whole,
    refuse_host_optimizer,
    refuse_settings,
    refuse_vllm_launch,
)
from tidal.integrations.trl.config import TidalConfig
from tidal.integrations.trl.launch import (
    check_launch,
    gathered_for_generation,
    reference_sharded_per_block,
    runs_collectives,
    use_bucket_views,
    wraps_in_ddp,
)
from tidal.integrations.trl.phases import at_first_forward
from tidal.integrations.trl.reference import SyncReference
from tidal.integrations.trl.retry import AgainIfOutOfMemory
from tidal.integrations.trl.schedule import TRL_PHASES
from tidal.integrations.vllm import VllmEngine, kv_cache_bytes_for
from tidal.memory import host_rss_bytes
from tidal.timeshare import Timeshare
from tidal.timeshare.schedule import PhaseSchedule, ScheduleConfig

__all__ = ["TidalGRPOTrainer", "TidalRLOOTrainer", "TidalRLTrainer"]

#: What a generation of TRL's colocated vLLM engine takes beside the engine's weights and KV
#: cache (its activations, the sampler's logits), kept free by its turns with ``prefetch``.
VLLM_GENERATION_BYTES = 1 << 30


class TidalRLTrainer(AgainIfOutOfMemory, ActivationFigures, CPUAdamClipping):
    """The tidal side of :class:`TidalGRPOTrainer` and :class:`TidalRLOOTrainer`: a mixin put in
    front of a TRL trainer with GRPOTrainer's phases (``_generate``,
    ``_get_per_token_logps_and_entropies``, ``_calculate_rewards``, ``compute_loss``, ``log``).
    Takes the trainer's arguments, plus ``tidal=TidalConfig(...)``.

    Memory cost: host RAM for the state of each role while it is out (pinned once, when the
    role is registered: the reference and reward models at construction, the policy when its
    optimizer exists); on the device, the role in use plus one staging bucket per direction
    during a switch.

    Raises:
        ValueError: a setting tidal cannot work with (see the module docstring), before any
            work.
        TypeError: ``tidal`` is not a :class:`TidalConfig`.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Every private surface of TRL, transformers and accelerate used here, checked as the
        # class is built: a renamed one is an error, not a lever silently gone.
        after = cls.__mro__[cls.__mro__.index(TidalRLTrainer) + 1 :]
        base = next((c for c in after if not c.__module__.startswith("tidal.")), None)
        if base is not None and base is not object:
            check_trainer_class(base, who=cls.__name__)

    def __init__(self, *args: Any, tidal: TidalConfig | None = None, **kwargs: Any) -> None:
        if tidal is not None and not isinstance(tidal, TidalConfig):
            raise TypeError(f"tidal must be a tidal.integrations.trl.TidalConfig, got {type(tidal).__name__}")
        targs = kwargs.get("args") if "args" in kwargs else (args[2] if len(args) > 2 else None)
        refuse_settings(targs, type(self).__name__, tidal)
        place_models_whole(targs)
        self.tidal_config = tidal or TidalConfig()
        self._tidal_kv_cache_bytes: int | None = None  # what the engine's KV cache was built with, where tidal sized it
        with (
            reference_sharded_per_block(type(self)),  # with FSDP2: per block, as the policy
            self._engine_sized(targs),
        ):
            super().__init__(*args, **kwargs)
        check_trainer(self, who=type(self).__name__)
        self._tidal_launch = check_launch(self.accelerator, type(self).__name__)
        refuse_vllm_launch(self.args, self._tidal_launch, type(self).__name__)
        self._tidal_engine: VllmEngine | None = None  # TRL's colocated vLLM, once the policy is a role
        self._tidal_engine_retries_logged = 0  # the engine's wakes run again after OOM, as far as logged
        refuse_host_optimizer(self.optimizer, self._tidal_launch, type(self).__name__)
        if self._tidal_launch == "ddp" or wraps_in_ddp(self.accelerator):
            use_bucket_views(self.accelerator)  # before train() prepares (wraps) the policy
        self._tidal_buckets: GradientBuckets | None = None  # DDP's, once the wrapper exists
        if self._tidal_launch == "fsdp2":
            # A role holds only its shards between turns: FSDP2 keeps the root's (and the
            # unresharded units') parameters gathered after a forward no backward follows.
            for m in [self.ref_model, *self.reward_funcs]:
                if isinstance(m, torch.nn.Module) and runs_collectives(m):
                    reshard_after_no_grad_forward(m)
        if self.tidal_config.activation_offload:  # refused now, not at the first loss after a generation
            find_layers(self.accelerator.unwrap_model(self.model), self.tidal_config.activation_layers)
        self.timeshare = Timeshare(self.accelerator.device, config=self.tidal_config.timeshare)
        if self.ref_model is not None:
            own_storages(self.ref_model)
            # Frozen (its host copy stays valid: it goes out without a copy) unless TRL
            # writes it: sync_ref_model mixes the policy into it every few steps.
            frozen = not getattr(self.args, "sync_ref_model", False)
            self.timeshare.add_role("reference", model=self.ref_model, grads="drop", frozen=frozen)
            self.timeshare.offload("reference")  # the policy computes first (generation)
            if not frozen:
                # TRL's SyncRefModelCallback writes the reference's .data in place, which is
                # out on the host between its turns: ours writes the same values where they are.
                for cb in list(self.callback_handler.callbacks):
                    if isinstance(cb, SyncRefModelCallback):
                        self.callback_handler.remove_callback(cb)
                self.add_callback(SyncReference(self))
        # Reward models (reward_funcs given as a model or a path): one frozen role, on the
        # device only while TRL scores the completions with them.
        reward_models = [f for f in self.reward_funcs if isinstance(f, torch.nn.Module)]
        if reward_models:
            for m in reward_models:
                own_storages(m)
            self.timeshare.add_role("reward", model=reward_models, grads="drop", frozen=True)
            self.timeshare.offload("reward")
        if self.tidal_config.prefetch and not self.timeshare.roles:
            warnings.warn(
                "TidalConfig(prefetch=True) only brings the policy's optimizer state in ahead of its step: TRL built "
                "no reference model (beta=0, or a PEFT policy whose reference is itself with the adapters disabled) "
                "and no reward model, so the policy is the only role and nothing else takes turns with it",
                stacklevel=2,
            )
        self._tidal_logged = 0  # transitions already reported in a log line
        self._tidal_figures: dict[str, float] = {}  # activation offload since the last log
        # What each turn keeps free and what comes in behind it (the phases' memory readings
        # on an accelerator; off one, nothing is measured and every other role goes).
        self._tidal_schedule = PhaseSchedule(
            self.timeshare,
            TRL_PHASES,
            config=ScheduleConfig(
                prefetch=self.tidal_config.prefetch, prefetch_peak_bytes=self.tidal_config.prefetch_peak_bytes
            ),
        )
        self._tidal_retries = 0  # phases run again after running out of memory beside kept roles
        self._tidal_retries_logged = 0

    # ---- roles --------------------------------------------------------------------------------
    def _policy_ready(self) -> bool:
        """Register the policy once its optimizer exists (Trainer makes it in ``train()``)."""
        if "policy" in self.timeshare.roles:
            return True
        optimizer = self.optimizer
        if optimizer is None:
            return False
        optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper holds the torch one
        own_storages(self.accelerator.unwrap_model(self.model), optimizer)
        self.timeshare.add_role(
            "policy",
            model=self.accelerator.unwrap_model(self.model),
            optimizer=optimizer,
            optimizer_residency=self.tidal_config.optimizer_residency,
        )
        if self._colocated_engine():
            generation = self.vllm_generation
            check_trl_engine(generation, who=type(self).__name__)
            self._tidal_engine = VllmEngine(
                generation.llm,
                self.timeshare,
                policy="policy",
                kv_cache_bytes=self._tidal_kv_cache_bytes or 0,
                # With prefetch, the engine's turns keep what fits beside its memory and this
                # much for the generation's own (vLLM's activations and sampler).
                keep_free_bytes=VLLM_GENERATION_BYTES if self.tidal_config.prefetch else None,
                peak_bytes=self.tidal_config.prefetch_peak_bytes,
                # TRL puts the engine to sleep as it builds it, with sleep mode; it stays so until
                # the first generation.
                asleep=bool(generation.enable_sleep_mode),
            )
            # prefetch_peak_bytes bounds what is on the device: the sleeping engine's pool,
            # still counted by torch's allocator, is not.
            self._tidal_schedule.outside_bytes = self._tidal_engine.asleep_bytes
        if self._tidal_launch == "fsdp2":
            reshard_after_no_grad_forward(self.accelerator.unwrap_model(self.model))
        self._step_again_if_out_of_memory(optimizer)
        if isinstance(self.model_wrapped, torch.nn.parallel.DistributedDataParallel):
            # DDP's buckets (the gradients' memory) are freed between steps, as the gradients
            # of one process are: see tidal.distributed.GradientBuckets.
            self._tidal_buckets = GradientBuckets(self.model_wrapped)
            self._tidal_buckets.watch(optimizer)
        return True

    def _turn(self, role: str, phase: str | None = None):
        """The role on the device for a phase (a no-op before the policy is registered).
        ``phase`` names it (the policy's: ``"generate"``, ``"loss"``; default: the role's
        name for the reference and a reward model, ``"score"`` for the policy)."""
        if role == "policy" and not self._policy_ready():
            return self._tidal_schedule.phase(None, phase or "generate")
        if self._tidal_buckets is not None:
            self._tidal_buckets.release()  # the gradients are None between steps: their buckets go
        if role != "policy" and "policy" not in self.timeshare.roles:
            self._policy_ready()
        phase = phase or (role if role in ("reference", "reward") else "score")
        return self._tidal_schedule.phase(role, phase)

    def _colocated_engine(self) -> bool:
        """TRL generates with vLLM in this process (``vllm_mode="colocate"``): the engine takes
        turns with the roles. In server mode the engine is on other GPUs: the policy is on the
        device while TRL sends its weights and generation asks the server, as with HF generate."""
        return colocated_vllm(self)  # TRL keeps use_vllm and vllm_mode on the trainer

    @contextlib.contextmanager
    def _engine_sized(self, targs: Any):
        """While TRL builds its colocated vLLM engine: its KV cache of
        ``TidalConfig.vllm_kv_cache_bytes`` (vLLM's ``kv_cache_memory_bytes``) where set (with
        ``"auto"``: :func:`~tidal.integrations.vllm.kv_cache_bytes_for` the policy's shape and
        dtype, the engine's ``max_num_seqs`` and ``max_model_len``); else as TRL sizes it
        (``vllm_gpu_memory_utilization``)."""
        nbytes = self.tidal_config.vllm_kv_cache_bytes
        if not colocated_vllm(targs) or nbytes is None:
            yield
            return
        import trl.generation.vllm_generation as backend

        build = backend.LLM

        def sized(*args: Any, **kwargs: Any) -> Any:
            size = nbytes
            if size == "auto":
                policy = self.accelerator.unwrap_model(self.model)
                size = kv_cache_bytes_for(
                    policy.config,
                    next(policy.parameters()).dtype,
                    # TRL's engine runs its generation batch at once (its max_num_seqs).
                    sequences=int(kwargs.get("max_num_seqs") or targs.per_device_train_batch_size),
                    max_len=int(kwargs["max_model_len"]),
                )
            kwargs["kv_cache_memory_bytes"] = self._tidal_kv_cache_bytes = size
            return build(*args, **kwargs)

        with instead(backend, "LLM", sized):
            yield

    # ---- the phases ---------------------------------------------------------------------------
    def _generate(self, prompts: list):
        if self._colocated_engine() and self._policy_ready():
            # The engine generates: the policy is its weights' source, then goes (with the other
            # roles, or, with prefetch, those that do not fit beside the engine) to leave the
            # engine the room, and comes back for its next phase.
            # TRL empties the device's cache before it wakes the weights, which waits for every
            # queued copy out (the optimizer state going to the host behind the step): the
            # engine releases it only where the driver lacks the room. Once the KV cache's room
            # is made, the role that computes next comes in behind the generation, leaving the
            # generation's own need free (the engine's memory is allocated by then), and nothing
            # is written back ahead: vLLM reads each decode step's tokens back to the host, and
            # those small copies would queue behind it (the policy with its AdamW state written
            # back there slowed a 7B generation by half: benchmarks/RESULTS.md, vLLM section).
            engine, schedule = self._tidal_engine, self._tidal_schedule
            ahead = lambda: schedule.prefetch(  # noqa: E731
                "generate", schedule.after("policy"), growth=VLLM_GENERATION_BYTES, write_back=False
            )
            with (
                schedule.phase(None, "generate"),
                engine.driven(before_generate=ahead),
                instead(trl_vllm, "empty_cache", engine.release_for_wake),
            ):
                engine.room_for_weights()
                return super()._generate(prompts)
        with (
            self._turn("policy", "generate"),
            self._gathered_for_generation() as gathered,
            self._generate_again_if_out_of_memory(),
        ):
            self._tidal_schedule.gathered(gathered or 0)
            # Queued once the generation's first forward starts, not before: a small
            # host-to-device copy (the prompts, what generate() builds from them) queued behind
            # gigabytes of prefetch waits for all of them (0.30 s of a Qwen2-7B step's generation
            # on an H200, the compute stream idle; benchmarks/RESULTS.md, 2026-11-26).
            schedule = self._tidal_schedule
            with at_first_forward(lambda: schedule.prefetch("generate", schedule.after("policy"))):
                return super()._generate(prompts)

    def _gathered_for_generation(self):
        """With FSDP2: :func:`~tidal.integrations.trl.launch.gathered_for_generation` of the
        policy (gathered once where every rank has the room, its shards lent to the host where
        the room is there only without them); else nothing."""
        if self._tidal_launch != "fsdp2" or "policy" not in self.timeshare.roles:
            return contextlib.nullcontext()
        return gathered_for_generation(self.accelerator.unwrap_model(self.model), self.timeshare, "policy")

    def _get_per_token_logps_and_entropies(self, model, *args: Any, **kwargs: Any):
        role = "reference" if self.ref_model is not None and model is self.ref_model else "policy"
        with self._turn(role):
            if role == "reference":
                self._tidal_schedule.prefetch("reference", self._tidal_schedule.after("reference"))
            compute = lambda: super(TidalRLTrainer, self)._get_per_token_logps_and_entropies(model, *args, **kwargs)  # noqa: E731
            if torch.is_grad_enabled() and self.tidal_config.activation_offload:
                return compute()  # a failed forward's offloaded activations are not its to run again
            if runs_collectives(model):
                return compute()  # run again on one rank alone, it would meet the others in another collective
            return self._again_if_out_of_memory(role, compute)

    def _calculate_rewards(self, *args: Any, **kwargs: Any):
        if "reward" not in self.timeshare.roles:
            return super()._calculate_rewards(*args, **kwargs)
        with self._turn("reward"):
            self._tidal_schedule.prefetch("reward", self._tidal_schedule.after("reward"))
            return super()._calculate_rewards(*args, **kwargs)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        cfg = self.tidal_config
        with self._turn("policy", "loss"):
            if not cfg.activation_offload:
                out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            else:
                policy = self.accelerator.unwrap_model(model)
                with offload_activations(
                    policy,
                    layers=find_layers(policy, cfg.activation_layers),
                    min_offload_bytes=cfg.activation_min_offload_bytes,
                ) as off:
                    self._tidal_offloader = off
                    out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if model.training and torch.is_grad_enabled() and self.accelerator.sync_gradients:
            # The backward (and the optimizer step after it: this is the accumulation's last
            # micro-batch) is a phase of its own: what it allocates decides how much optimizer
            # state can come in ahead of the step.
            schedule, need = self._tidal_schedule, None
            if schedule.memory is not None:
                need = schedule.memory.backward_need()
                schedule.room_for_backward("policy", need)
                schedule.memory.start("backward")
            if not self._tidal_plain_backward:
                schedule.prefetch_optimizer("backward", "policy", growth=need)
        return out

    def training_step(self, model, inputs, num_items_in_batch=None):
        # A micro-batch whose backward runs out of memory beside what tidal kept or prefetched
        # runs again without them (see AgainIfOutOfMemory._backward_again_if_out_of_memory).
        return self._backward_again_if_out_of_memory(
            lambda: super(TidalRLTrainer, self).training_step(model, inputs, num_items_in_batch)
        )

    # ---- logging ------------------------------------------------------------------------------
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        memory = self._tidal_schedule.memory
        peaks = memory.take_peaks() if memory is not None else {}
        if self._tidal_engine is not None:
            # Torch's counters keep counting the engine's pool while it sleeps (its memory back
            # with the driver): the phases it slept through read less it, the generation (its
            # peak with the engine awake) as it is.
            asleep = self._tidal_engine.asleep_bytes()
            peaks = {p: v if p == TRL_PHASES.generation else max(0, v - asleep) for p, v in peaks.items()}
        # The log comes after the step's loss was read on the host: the compute stream's events
        # around the transitions have run, so reading them waits for nothing.
        self.timeshare.settle_stalls(wait=True)
        records = self.timeshare.records[self._tidal_logged :]
        self._tidal_logged = len(self.timeshare.records)
        moved = sum(r.bytes_out + r.bytes_in for r in records)
        seconds = sum(r.seconds for r in records)
        logs["tidal/transitions"] = len(records)
        logs["tidal/moved_gb"] = moved / 1e9
        logs["tidal/transition_s"] = seconds
        logs["tidal/gbps"] = moved / seconds / 1e9 if seconds > 0 else 0.0
        logs["tidal/exposed_s"] = sum(r.exposed_seconds for r in records)
        if self.tidal_config.prefetch:
            logs["tidal/oom_retries"] = self._tidal_retries - self._tidal_retries_logged
            self._tidal_retries_logged = self._tidal_retries
        if self._tidal_engine is not None:
            logs["tidal/engine_oom_retries"] = self._tidal_engine.oom_retries - self._tidal_engine_retries_logged
            self._tidal_engine_retries_logged = self._tidal_engine.oom_retries
        logs.update(self._tidal_figures)
        self._tidal_figures.clear()
        for phase, peak in peaks.items():
            logs[f"tidal/peak_gib/{phase}"] = peak / 2**30
        if memory is not None:
            # What the prefetches and keeps leave free for each phase's fragments reads these.
            for phase, nbytes in memory.fragments.items():
                logs[f"tidal/fragments_gib/{phase}"] = nbytes / 2**30
        logs.update(self._host_figures())
        if self._tidal_engine is not None:
            # What the engine's last wakes took at driver level (its pool, which torch's counters
            # keep counting while it sleeps): the room its turns make.
            for tag, nbytes in self._tidal_engine.woken.items():
                logs[f"tidal/engine_gib/{tag}"] = nbytes / 2**30
        super().log(logs, start_time)

    def _host_figures(self) -> dict[str, float]:
        """What tidal holds in host memory (``host_held_gib``, of it page-locked:
        ``host_pinned_gib``) and the process's resident set (``host_rss_gib``); with several
        processes, each rank's (``.../rank<r>``: a gather, which every rank's log makes)."""
        context = self.timeshare.store.context
        mine = [sum(context.host_bytes().values()), context.pinned_bytes(), host_rss_bytes()]
        names = ("host_held_gib", "host_pinned_gib", "host_rss_gib")
        if self.accelerator.num_processes <= 1:
            return {f"tidal/{n}": v / 2**30 for n, v in zip(names, mine)}
        ranks = self.accelerator.gather(torch.tensor([mine], dtype=torch.float64, device=self.accelerator.device))
        return {
            f"tidal/{n}/rank{r}": float(v) / 2**30 for r, row in enumerate(ranks.tolist()) for n, v in zip(names, row)
        }


class TidalGRPOTrainer(TidalRLTrainer, GRPOTrainer):
    """``trl.GRPOTrainer`` whose policy, reference and reward models take turns on the device
    (see the module docstring). Takes GRPOTrainer's arguments, plus ``tidal=TidalConfig(...)``."""


class TidalRLOOTrainer(TidalRLTrainer, RLOOTrainer):
    """``trl.RLOOTrainer`` (REINFORCE leave-one-out; a reference by default, ``beta=0.05``)
    whose policy, reference and reward models take turns on the device, as
    :class:`TidalGRPOTrainer`. Takes RLOOTrainer's arguments, plus ``tidal=TidalConfig(...)``."""
