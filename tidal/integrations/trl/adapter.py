"""The tidal side of one TRL trainer: :class:`TrlAdapter`, which the trainers of
:mod:`tidal.integrations.trl.trainer` own (``trainer.tidal``) and delegate each phase to."""

from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import Any, Callable, Iterator

import torch
import trl.generation.vllm_generation as trl_vllm
from trl.trainer.callbacks import SyncRefModelCallback

from tidal.activations import offload_activations
from tidal.distributed.ddp import GradientBuckets
from tidal.distributed.fsdp import reshard_after_no_grad_forward
from tidal.integrations.hf import ActivationFigures, find_layers
from tidal.integrations.seams import check_trl_engine, instead
from tidal.integrations.trl.checks import (
    colocated_vllm,
    own_storages,
    refuse_host_optimizer,
    refuse_vllm_launch,
)
from tidal.integrations.trl.config import TidalConfig
from tidal.integrations.trl.launch import (
    Launch,
    check_launch,
    gathered_for_generation,
    reference_sharded_per_block,
    runs_collectives,
    use_bucket_views,
    wraps_in_ddp,
)
from tidal.integrations.trl.phases import at_first_forward
from tidal.integrations.trl.reference import SyncReference
from tidal.integrations.trl.retry import OutOfMemoryRetry
from tidal.integrations.trl.schedule import TRL_PHASES
from tidal.integrations.vllm import VllmEngine, kv_cache_bytes_for
from tidal.memory import host_rss_bytes
from tidal.timeshare import Timeshare
from tidal.timeshare.schedule import PhaseSchedule, ScheduleConfig

__all__ = ["TrlAdapter", "VLLM_GENERATION_BYTES"]

#: What a generation of TRL's colocated vLLM engine takes beside the engine's weights and KV
#: cache (its activations, the sampler's logits), kept free by its turns with ``prefetch``.
VLLM_GENERATION_BYTES = 1 << 30


class TrlAdapter:
    """What tidal does around the phases of one TRL trainer (GRPOTrainer's: ``_generate``,
    ``_get_per_token_logps_and_entropies``, ``_calculate_rewards``, ``compute_loss``,
    ``training_step``, ``log``): the trainer's override of each calls the method of the same
    concept here with TRL's own work as a callable.

    Made before TRL builds the trainer (:meth:`building` wraps that), then :meth:`attach`-ed to
    the built trainer, which it reads (its accelerator, models, optimizer, arguments) through a
    weak reference: the trainer owns it. Owns the :attr:`timeshare` (the policy, the reference
    and reward models as roles), the :attr:`schedule` (what each turn keeps and what comes in
    ahead), the :attr:`retry` (a phase run again after running out of memory beside kept
    roles), the colocated vLLM :attr:`engine` (once the policy is a role), and the figures
    each log line gets.

    Memory cost: host RAM for the state of each role while it is out (pinned once, when the
    role is registered: the reference and reward models at :meth:`attach`, the policy when its
    optimizer exists); on the device, the role in use plus one staging bucket per direction
    during a switch.

    Raises:
        ValueError: (at :meth:`attach`) a launch, an optimizer or a vLLM setting tidal cannot
            work with, before any work.
    """

    def __init__(self, config: TidalConfig, *, who: str) -> None:
        self.config, self.who = config, who
        self.kv_cache_bytes: int | None = None  # what the engine's KV cache was built with, where tidal sized it
        self._trainer: Callable[[], Any] = lambda: None
        self.launch: Launch = "single"
        self.timeshare: Timeshare | None = None
        self.schedule: PhaseSchedule | None = None
        self.retry: OutOfMemoryRetry | None = None
        self.engine: VllmEngine | None = None  # TRL's colocated vLLM, once the policy is a role
        self.buckets: GradientBuckets | None = None  # DDP's, once the wrapper exists
        self.figures: dict[str, float] = {}  # activation offload since the last log
        self.activations = ActivationFigures(self.figures)
        self._logged = 0  # transitions already reported in a log line
        self._retries_logged = 0
        self._engine_retries_logged = 0  # the engine's wakes run again after OOM, as far as logged

    @property
    def trainer(self) -> Any:
        trainer = self._trainer()
        if trainer is None:
            raise RuntimeError(f"{self.who}'s tidal adapter outlived its trainer (or was never attached to one)")
        return trainer

    # ---- construction -------------------------------------------------------------------------
    @contextlib.contextmanager
    def building(self, trainer: Any, targs: Any) -> Iterator[None]:
        """While TRL builds ``trainer`` (its ``__init__``) from the training arguments ``targs``:
        with FSDP2, the reference sharded per block as the policy; the colocated vLLM engine's
        KV cache of ``TidalConfig.vllm_kv_cache_bytes`` (vLLM's ``kv_cache_memory_bytes``) where
        set (with ``"auto"``: :func:`~tidal.integrations.vllm.kv_cache_bytes_for` the policy's
        shape and dtype, the engine's ``max_num_seqs`` and ``max_model_len``); else as TRL sizes
        it (``vllm_gpu_memory_utilization``)."""
        with reference_sharded_per_block(type(trainer)), self._engine_sized(trainer, targs):
            yield

    @contextlib.contextmanager
    def _engine_sized(self, trainer: Any, targs: Any) -> Iterator[None]:
        nbytes = self.config.vllm_kv_cache_bytes
        if not colocated_vllm(targs) or nbytes is None:
            yield
            return
        build = trl_vllm.LLM

        def sized(*args: Any, **kwargs: Any) -> Any:
            size = nbytes
            if size == "auto":
                policy = trainer.accelerator.unwrap_model(trainer.model)  # TRL built both before the engine
                size = kv_cache_bytes_for(
                    policy.config,
                    next(policy.parameters()).dtype,
                    # TRL's engine runs its generation batch at once (its max_num_seqs).
                    sequences=int(kwargs.get("max_num_seqs") or targs.per_device_train_batch_size),
                    max_len=int(kwargs["max_model_len"]),
                )
            kwargs["kv_cache_memory_bytes"] = self.kv_cache_bytes = size
            return build(*args, **kwargs)

        with instead(trl_vllm, "LLM", sized):
            yield

    def attach(self, trainer: Any) -> None:
        """Take the built ``trainer`` on: its launch checked, the reference and reward models
        registered as roles (and moved out: the policy computes first), the phase schedule and
        the retries made. The policy becomes a role once its optimizer exists
        (:meth:`policy_ready`)."""
        # Weak: the trainer holds its adapter; the trainer (and the pinned host memory of its
        # roles) must go when the user drops it, not at the next cyclic collection.
        self._trainer = weakref.ref(trainer)
        cfg, who = self.config, self.who
        self.launch = check_launch(trainer.accelerator, who)
        refuse_vllm_launch(trainer.args, self.launch, who)
        refuse_host_optimizer(trainer.optimizer, self.launch, who)
        if self.launch == "ddp" or wraps_in_ddp(trainer.accelerator):
            use_bucket_views(trainer.accelerator)  # before train() prepares (wraps) the policy
        if self.launch == "fsdp2":
            # A role holds only its shards between turns: FSDP2 keeps the root's (and the
            # unresharded units') parameters gathered after a forward no backward follows.
            for m in [trainer.ref_model, *trainer.reward_funcs]:
                if isinstance(m, torch.nn.Module) and runs_collectives(m):
                    reshard_after_no_grad_forward(m)
        if cfg.activation_offload:  # refused now, not at the first loss after a generation
            find_layers(trainer.accelerator.unwrap_model(trainer.model), cfg.activation_layers)
        ts = self.timeshare = Timeshare(trainer.accelerator.device, config=cfg.timeshare)
        if trainer.ref_model is not None:
            own_storages(trainer.ref_model)
            # Frozen (its host copy stays valid: it goes out without a copy) unless TRL
            # writes it: sync_ref_model mixes the policy into it every few steps.
            frozen = not getattr(trainer.args, "sync_ref_model", False)
            ts.add_role("reference", model=trainer.ref_model, grads="drop", frozen=frozen)
            ts.offload("reference")  # the policy computes first (generation)
            if not frozen:
                # TRL's SyncRefModelCallback writes the reference's .data in place, which is
                # out on the host between its turns: ours writes the same values where they are.
                for cb in list(trainer.callback_handler.callbacks):
                    if isinstance(cb, SyncRefModelCallback):
                        trainer.callback_handler.remove_callback(cb)
                trainer.add_callback(SyncReference(trainer))
        # Reward models (reward_funcs given as a model or a path): one frozen role, on the
        # device only while TRL scores the completions with them.
        reward_models = [f for f in trainer.reward_funcs if isinstance(f, torch.nn.Module)]
        if reward_models:
            for m in reward_models:
                own_storages(m)
            ts.add_role("reward", model=reward_models, grads="drop", frozen=True)
            ts.offload("reward")
        if cfg.prefetch and not ts.roles:
            warnings.warn(
                "TidalConfig(prefetch=True) only brings the policy's optimizer state in ahead of its step: TRL built "
                "no reference model (beta=0, or a PEFT policy whose reference is itself with the adapters disabled) "
                "and no reward model, so the policy is the only role and nothing else takes turns with it",
                stacklevel=3,
            )
        # What each turn keeps free and what comes in behind it (the phases' memory readings
        # on an accelerator; off one, nothing is measured and every other role goes).
        self.schedule = PhaseSchedule(
            ts,
            TRL_PHASES,
            config=ScheduleConfig(prefetch=cfg.prefetch, prefetch_peak_bytes=cfg.prefetch_peak_bytes),
        )
        self.retry = OutOfMemoryRetry(
            ts,
            self.schedule,
            prefetch=cfg.prefetch,
            launch=self.launch,
            optimizer_residency=cfg.optimizer_residency,
            activation_offload=cfg.activation_offload,
        )

    # ---- roles --------------------------------------------------------------------------------
    def policy_ready(self) -> bool:
        """Register the policy once its optimizer exists (Trainer makes it in ``train()``)."""
        ts = self.timeshare
        if "policy" in ts.roles:
            return True
        trainer = self.trainer
        optimizer = trainer.optimizer
        if optimizer is None:
            return False
        optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper holds the torch one
        policy = trainer.accelerator.unwrap_model(trainer.model)
        own_storages(policy, optimizer)
        ts.add_role("policy", model=policy, optimizer=optimizer, optimizer_residency=self.config.optimizer_residency)
        if self.colocated_engine():
            generation = trainer.vllm_generation
            check_trl_engine(generation, who=self.who)
            self.engine = VllmEngine(
                generation.llm,
                ts,
                policy="policy",
                kv_cache_bytes=self.kv_cache_bytes or 0,
                # With prefetch, the engine's turns keep what fits beside its memory and this
                # much for the generation's own (vLLM's activations and sampler).
                keep_free_bytes=VLLM_GENERATION_BYTES if self.config.prefetch else None,
                peak_bytes=self.config.prefetch_peak_bytes,
                # TRL puts the engine to sleep as it builds it, with sleep mode; it stays so until
                # the first generation.
                asleep=bool(generation.enable_sleep_mode),
            )
            # prefetch_peak_bytes bounds what is on the device: the sleeping engine's pool,
            # still counted by torch's allocator, is not.
            self.schedule.outside_bytes = self.engine.asleep_bytes
        if self.launch == "fsdp2":
            reshard_after_no_grad_forward(policy)
        self.retry.wrap_step(optimizer, scaled=getattr(trainer.optimizer, "scaler", None) is not None)
        if isinstance(trainer.model_wrapped, torch.nn.parallel.DistributedDataParallel):
            # DDP's buckets (the gradients' memory) are freed between steps, as the gradients
            # of one process are: see tidal.distributed.GradientBuckets.
            self.buckets = GradientBuckets(trainer.model_wrapped)
            self.buckets.watch(optimizer)
        return True

    def turn(self, role: str, phase: str | None = None):
        """The role on the device for a phase (a no-op before the policy is registered).
        ``phase`` names it (the policy's: ``"generate"``, ``"loss"``; default: the role's
        name for the reference and a reward model, ``"score"`` for the policy)."""
        if role == "policy" and not self.policy_ready():
            return self.schedule.phase(None, phase or "generate")
        if self.buckets is not None:
            self.buckets.release()  # the gradients are None between steps: their buckets go
        if role != "policy" and "policy" not in self.timeshare.roles:
            self.policy_ready()
        phase = phase or (role if role in ("reference", "reward") else "score")
        return self.schedule.phase(role, phase)

    def colocated_engine(self) -> bool:
        """TRL generates with vLLM in this process (``vllm_mode="colocate"``): the engine takes
        turns with the roles. In server mode the engine is on other GPUs: the policy is on the
        device while TRL sends its weights and generation asks the server, as with HF generate."""
        return colocated_vllm(self.trainer)  # TRL keeps use_vllm and vllm_mode on the trainer

    # ---- the phases ---------------------------------------------------------------------------
    def generate(self, generate: Callable[[], Any]) -> Any:
        """TRL's generation (``generate()``: its ``_generate`` of the step's prompts)."""
        if self.colocated_engine() and self.policy_ready():
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
            engine, schedule = self.engine, self.schedule
            ahead = lambda: schedule.prefetch(  # noqa: E731
                "generate", schedule.after("policy"), growth=VLLM_GENERATION_BYTES, write_back=False
            )
            with (
                schedule.phase(None, "generate"),
                engine.driven(before_generate=ahead),
                instead(trl_vllm, "empty_cache", engine.release_for_wake),
            ):
                engine.room_for_weights()
                return generate()
        with (
            self.turn("policy", "generate"),
            self._gathered_for_generation() as gathered,
            self.retry.generating(self.trainer.accelerator.unwrap_model(self.trainer.model)),
        ):
            self.schedule.gathered(gathered or 0)
            # Queued once the generation's first forward starts, not before: a small
            # host-to-device copy (the prompts, what generate() builds from them) queued behind
            # gigabytes of prefetch waits for all of them (0.30 s of a Qwen2-7B step's generation
            # on an H200, the compute stream idle; benchmarks/RESULTS.md, 2026-11-26).
            schedule = self.schedule
            with at_first_forward(lambda: schedule.prefetch("generate", schedule.after("policy"))):
                return generate()

    def _gathered_for_generation(self):
        """With FSDP2: :func:`~tidal.integrations.trl.launch.gathered_for_generation` of the
        policy (gathered once where every rank has the room, its shards lent to the host where
        the room is there only without them); else nothing."""
        if self.launch != "fsdp2" or "policy" not in self.timeshare.roles:
            return contextlib.nullcontext()
        trainer = self.trainer
        return gathered_for_generation(trainer.accelerator.unwrap_model(trainer.model), self.timeshare, "policy")

    def score(self, model: torch.nn.Module, compute: Callable[[], Any]) -> Any:
        """A scoring's forward (``compute()``: TRL's ``_get_per_token_logps_and_entropies`` of
        ``model``, the reference or the policy)."""
        trainer = self.trainer
        role = "reference" if trainer.ref_model is not None and model is trainer.ref_model else "policy"
        with self.turn(role):
            if role == "reference":
                self.schedule.prefetch("reference", self.schedule.after("reference"))
            if torch.is_grad_enabled() and self.config.activation_offload:
                return compute()  # a failed forward's offloaded activations are not its to run again
            if runs_collectives(model):
                return compute()  # run again on one rank alone, it would meet the others in another collective
            return self.retry.again(role, compute)

    def rewards(self, compute: Callable[[], Any]) -> Any:
        """TRL's ``_calculate_rewards`` (``compute()``): the reward models' turn, where any."""
        if "reward" not in self.timeshare.roles:
            return compute()
        with self.turn("reward"):
            self.schedule.prefetch("reward", self.schedule.after("reward"))
            return compute()

    def loss(self, model: torch.nn.Module, compute: Callable[[], Any]) -> Any:
        """The loss's forward (``compute()``: TRL's ``compute_loss`` of ``model``), then, at the
        accumulation's last micro-batch, the backward's room and the optimizer state behind it."""
        cfg, trainer = self.config, self.trainer
        with self.turn("policy", "loss"):
            if not cfg.activation_offload:
                out = compute()
            else:
                policy = trainer.accelerator.unwrap_model(model)
                with offload_activations(
                    policy,
                    layers=find_layers(policy, cfg.activation_layers),
                    min_offload_bytes=cfg.activation_min_offload_bytes,
                ) as off:
                    self.activations.offloader = off
                    out = compute()
        if model.training and torch.is_grad_enabled() and trainer.accelerator.sync_gradients:
            # The backward (and the optimizer step after it: this is the accumulation's last
            # micro-batch) is a phase of its own: what it allocates decides how much optimizer
            # state can come in ahead of the step.
            schedule, need = self.schedule, None
            if schedule.memory is not None:
                need = schedule.memory.backward_need()
                schedule.room_for_backward("policy", need)
                schedule.memory.start("backward")
            if not self.retry.plain_backward:
                schedule.prefetch_optimizer("backward", "policy", growth=need)
        return out

    def training_step(self, step: Callable[[], Any]) -> Any:
        """One micro-batch (``step()``: Trainer's ``training_step``: the loss's forward and its
        backward), run again where it runs out of memory beside what tidal kept or prefetched
        (:meth:`OutOfMemoryRetry.backward_again`); what its activation offload moved is added to
        the next log line."""

        def counted() -> Any:
            loss = step()
            self.activations.step_ended()
            return loss

        return self.retry.backward_again(self.trainer, counted)

    # ---- logging ------------------------------------------------------------------------------
    def add_figures(self, logs: dict[str, float]) -> None:
        """tidal's figures since the last log line, added to ``logs`` (see the package
        docstring for each)."""
        memory = self.schedule.memory
        peaks = memory.take_peaks() if memory is not None else {}
        if self.engine is not None:
            # Torch's counters keep counting the engine's pool while it sleeps (its memory back
            # with the driver): the phases it slept through read less it, the generation (its
            # peak with the engine awake) as it is.
            asleep = self.engine.asleep_bytes()
            peaks = {p: v if p == TRL_PHASES.generation else max(0, v - asleep) for p, v in peaks.items()}
        # The log comes after the step's loss was read on the host: the compute stream's events
        # around the transitions have run, so reading them waits for nothing.
        ts = self.timeshare
        ts.settle_stalls(wait=True)
        records = ts.records[self._logged :]
        self._logged = len(ts.records)
        moved = sum(r.bytes_out + r.bytes_in for r in records)
        seconds = sum(r.seconds for r in records)
        logs["tidal/transitions"] = len(records)
        logs["tidal/moved_gb"] = moved / 1e9
        logs["tidal/transition_s"] = seconds
        logs["tidal/gbps"] = moved / seconds / 1e9 if seconds > 0 else 0.0
        logs["tidal/exposed_s"] = sum(r.exposed_seconds for r in records)
        if self.config.prefetch:
            logs["tidal/oom_retries"] = self.retry.retries - self._retries_logged
            self._retries_logged = self.retry.retries
        if self.engine is not None:
            logs["tidal/engine_oom_retries"] = self.engine.oom_retries - self._engine_retries_logged
            self._engine_retries_logged = self.engine.oom_retries
        logs.update(self.figures)
        self.figures.clear()
        for phase, peak in peaks.items():
            logs[f"tidal/peak_gib/{phase}"] = peak / 2**30
        if memory is not None:
            # What the prefetches and keeps leave free for each phase's fragments reads these.
            for phase, nbytes in memory.fragments.items():
                logs[f"tidal/fragments_gib/{phase}"] = nbytes / 2**30
        logs.update(self._host_figures())
        if self.engine is not None:
            # What the engine's last wakes took at driver level (its pool, which torch's counters
            # keep counting while it sleeps): the room its turns make.
            for tag, nbytes in self.engine.woken.items():
                logs[f"tidal/engine_gib/{tag}"] = nbytes / 2**30

    def _host_figures(self) -> dict[str, float]:
        """What tidal holds in host memory (``host_held_gib``, of it page-locked:
        ``host_pinned_gib``) and the process's resident set (``host_rss_gib``); with several
        processes, each rank's (``.../rank<r>``: a gather, which every rank's log makes)."""
        context = self.timeshare.store.context
        mine = [sum(context.host_bytes().values()), context.pinned_bytes(), host_rss_bytes()]
        names = ("host_held_gib", "host_pinned_gib", "host_rss_gib")
        accelerator = self.trainer.accelerator
        if accelerator.num_processes <= 1:
            return {f"tidal/{n}": v / 2**30 for n, v in zip(names, mine)}
        ranks = accelerator.gather(torch.tensor([mine], dtype=torch.float64, device=accelerator.device))
        return {
            f"tidal/{n}/rank{r}": float(v) / 2**30 for r, row in enumerate(ranks.tolist()) for n, v in zip(names, row)
        }
