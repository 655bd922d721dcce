"""TRL's ``GRPOTrainer`` and ``RLOOTrainer`` with tidal (extra ``tidal[trl]``).

Replace ``GRPOTrainer`` by :class:`TidalGRPOTrainer` (``RLOOTrainer`` by
:class:`TidalRLOOTrainer`); nothing else in the training script changes::

    from tidal.integrations.trl import TidalGRPOTrainer

    trainer = TidalGRPOTrainer(model=path, reward_funcs=reward, args=GRPOConfig(beta=0.04, ...),
                               train_dataset=ds)
    trainer.train()

What it does, on the trainer's one device:

* The policy (its weights, gradients and optimizer) and, with ``beta > 0``, the reference
  model TRL builds are roles of a :class:`~tidal.Timeshare`: the reference is on the device
  only while it scores, the policy only while it generates, computes the loss and steps. Each
  hand-over is one overlapped switch at PCIe line rate. The reference is a frozen role: after
  its first trip out, it goes out without a copy (only its reload moves bytes), unless
  ``sync_ref_model=True`` makes TRL write it. That mix (TRL's ``SyncRefModelCallback``, which
  would write the offloaded tensors through null pointers) is replaced by one that computes the
  same values with the same device ops where each tensor is: on the device if resident, else
  one tensor at a time into its host copy.
* Reward models (``reward_funcs`` given as a model or a path) are one more frozen role, on the
  device only while TRL scores the completions with them (after the reference).
* The policy's optimizer state stays on the host except inside ``optimizer.step()`` (step
  residency; ``TidalConfig.optimizer_residency``), so generation, reference scoring and the
  loss's forward/backward never hold it. A :class:`tidal.CPUAdam` passed as
  ``optimizers=(CPUAdam(...), None)`` keeps it on the host for good; gradient clipping and the
  logged ``grad_norm`` then use its host gradients.
* With ``TidalConfig(activation_offload=True)`` the activations the loss forward saves wait
  on the host until its backward.
* Every log line (console, TensorBoard, W&B: whatever ``report_to`` says) carries
  ``tidal/transitions``, ``tidal/moved_gb``, ``tidal/transition_s``, ``tidal/gbps`` and
  ``tidal/exposed_s`` (what the steps waited on them: on a GPU the compute stream's time
  inside the transitions, from device events; see ``TransitionRecord.exposed_seconds``) for
  the transitions since the previous log; with ``prefetch``, ``tidal/oom_retries`` (phases
  run again after running out of memory beside the roles their turn kept); with activation
  offload, ``tidal/act_offloaded_gb`` and ``tidal/act_reloaded_gb`` (and on a GPU
  ``tidal/act_exposed_s``) for the same steps;
  and on a GPU ``tidal/peak_gib/<phase>``: the peak allocated from the start of a phase to
  the start of the next (``generate``; ``score``, the policy's log-probs of the samples;
  ``reference``; ``reward``, with reward models; ``loss``, with the backward and the
  optimizer step that follow it).
* ``save_model``, checkpoints and resume read and write the state wherever it is (tidal's
  state-dict hooks), so saving with the reference offloaded or the optimizer state on the
  host writes the real values.

Results do not change: the moves are pure data movement, bit-exact (tested against the same
TRL run without tidal).

A PEFT policy (``peft_config=``) works as in TRL: its reference is the policy itself with
the adapters disabled, so there is no reference role and nothing takes turns; the adapters'
optimizer state still leaves the device between steps, and activation offload finds the
transformer blocks inside the ``PeftModel``.

Refused, before any work (``ValueError`` naming the setting): DeepSpeed or FSDP through
accelerate (tidal's own adapters move those states; use ``tidal.distributed``), vLLM
generation (its engine holds its own copy of the weights and its own memory pool), more than
one process, and ``torch_compile=True``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import warnings
import weakref
from typing import Any, Callable

import torch
from transformers import TrainerCallback
from trl import GRPOTrainer, RLOOTrainer
from trl.trainer.callbacks import SyncRefModelCallback

from tidal.activations import offload_activations
from tidal.integrations.hf import (
    ActivationFigures,
    CPUAdamClipping,
    check_activation_fields,
    check_bool_fields,
    find_layers,
)
from tidal.memory import phase_need_bytes
from tidal.state.foreign import moved_out
from tidal.timeshare import Timeshare, TimeshareConfig
from tidal.timeshare.role import OptimizerResidency

__all__ = ["TidalConfig", "TidalGRPOTrainer", "TidalRLOOTrainer", "TidalRLTrainer"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class TidalConfig:
    """How :class:`TidalGRPOTrainer` and :class:`TidalRLOOTrainer` use tidal.

    Attributes:
        optimizer_residency: where the policy's optimizer state lives between steps
            (``"step"``: on the host except inside ``step()``; ``"stream"``: the same, moved a
            chunk at a time; ``"role"``: with the policy, so that with ``prefetch`` only the
            reference moves, behind generation: the fastest where the policy's weights,
            gradients and optimizer state fit beside the step's activations). Ignored for
            ``tidal.CPUAdam``, whose state is on the host by design.
        timeshare: the timeshare's settings (budget, headroom, transfer). The default keeps
            freed memory in this process's caching allocator (``release_to_driver=False``: every
            role lives in the trainer's process, and a release to the driver synchronises the
            device) and lets transitions return once their copies are queued
            (``wait_for_copies=False``: the host queues the next phase's work while the bytes
            move). A ``TimeshareConfig`` given here is used as it is.
        activation_offload: offload the activations the loss forward saves for backward
            (:func:`tidal.offload_activations` over ``activation_layers``, a dotted path to the
            policy's transformer blocks, or ``"auto"``: the paths of
            :data:`tidal.integrations.hf.AUTO_LAYER_PATHS`, which also says where a PEFT
            policy's path is read). Checked when the trainer is built. Saved tensors under
            ``activation_min_offload_bytes`` stay on the device.
        prefetch: the next role comes in behind the current phase's compute
            (:meth:`tidal.Timeshare.prefetch`): generation starts bringing the reference in,
            reference scoring starts bringing the reward model in (if there is one), and the
            last of them the policy back. On an accelerator each phase leaves free what it
            allocated the last time it ran (plus 10% and 256 MiB), so the first generation and
            scoring prefetch nothing; it trades peak memory for time. Each turn (generation,
            scoring, the loss) then moves out only what it takes to leave free what its phase
            allocated the last time (plus 10% and 256 MiB; within ``prefetch_peak_bytes`` if
            set), least recently used first: the reference's (and a reward model's) turn keeps
            the policy on the device where it fits, so the loss needs no copy of it back in;
            the loss's turn keeps the frozen reference where it fits beside the loss's and the
            backward's need (then nothing moves at all; counting the driver's free memory and
            the allocator's whole free segments, not the free pieces of its partly used ones,
            which the backward's large blocks may not fit; the room is read again right before
            the backward), and drops it without a copy where not.
            A phase that needs more than its last reading (longer prompts or completions) and
            runs out of memory beside the roles its turn kept (or a prefetch brought in) runs
            again once they are out, its random generators set back: the same results (the
            generation, the scorings and the loss's forward; not a forward whose activations
            are offloaded, nor the backward, which reads the room again instead).
            Where the room is lacking (and in the first step, before the phases were measured),
            generation's prefetch writes the policy back to the host and the switch releases it
            without a copy if nothing wrote it since.
            The policy's optimizer state (``"step"``/``"stream"`` residency) starts coming in
            as the backward starts (:meth:`tidal.Timeshare.prefetch_optimizer`), as much as the
            backward leaves free, so its step finds it arrived.
            Needs a role beside the policy (``beta > 0`` or a reward model) to move the roles
            ahead; the optimizer state is brought in ahead either way.
        prefetch_peak_bytes: with ``prefetch``, the device's allocated bytes a prefetch may
            bring it up to (what a phase will still allocate counted): prefetch trades peak
            memory for time, and this bounds the trade. ``None``: free memory decides.
    """

    optimizer_residency: OptimizerResidency = "step"
    timeshare: TimeshareConfig = dataclasses.field(
        default_factory=lambda: TimeshareConfig(release_to_driver=False, wait_for_copies=False)
    )
    activation_offload: bool = False
    activation_layers: str = "auto"
    activation_min_offload_bytes: int = 1 << 20
    prefetch: bool = False
    prefetch_peak_bytes: int | None = None

    def __post_init__(self) -> None:
        check_bool_fields(self)  # prefetch="no" is a truthy string: refused, not switched on
        if self.optimizer_residency not in ("step", "stream", "role"):
            raise ValueError(
                f"TidalConfig.optimizer_residency must be 'step', 'stream' or 'role', got {self.optimizer_residency!r}"
            )
        if not isinstance(self.timeshare, TimeshareConfig):
            raise TypeError(
                f"TidalConfig.timeshare must be a tidal.TimeshareConfig, got {type(self.timeshare).__name__}"
            )
        check_activation_fields(self)
        if self.prefetch_peak_bytes is not None and self.prefetch_peak_bytes < 0:
            raise ValueError(f"TidalConfig.prefetch_peak_bytes must be >= 0 or None, got {self.prefetch_peak_bytes}")


class TidalRLTrainer(ActivationFigures, CPUAdamClipping):
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

    def __init__(self, *args: Any, tidal: TidalConfig | None = None, **kwargs: Any) -> None:
        if tidal is not None and not isinstance(tidal, TidalConfig):
            raise TypeError(f"tidal must be a tidal.integrations.trl.TidalConfig, got {type(tidal).__name__}")
        _refuse_settings(
            kwargs.get("args") if "args" in kwargs else (args[2] if len(args) > 2 else None), type(self).__name__
        )
        super().__init__(*args, **kwargs)
        self.tidal_config = tidal or TidalConfig()
        self._refuse_prepared()
        if self.tidal_config.activation_offload:  # refused now, not at the first loss after a generation
            find_layers(self.accelerator.unwrap_model(self.model), self.tidal_config.activation_layers)
        self.timeshare = Timeshare(self.accelerator.device, config=self.tidal_config.timeshare)
        if self.ref_model is not None:
            _own_storages(self.ref_model)
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
                self.add_callback(_SyncReference(self))
        # Reward models (reward_funcs given as a model or a path): one frozen role, on the
        # device only while TRL scores the completions with them.
        reward_models = [f for f in self.reward_funcs if isinstance(f, torch.nn.Module)]
        if reward_models:
            for m in reward_models:
                _own_storages(m)
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
        self._tidal_memory = _PhaseMemory.of(self.timeshare.device)
        self._tidal_depth = 0
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
        _own_storages(self.accelerator.unwrap_model(self.model), optimizer)
        self.timeshare.add_role(
            "policy",
            model=self.accelerator.unwrap_model(self.model),
            optimizer=optimizer,
            optimizer_residency=self.tidal_config.optimizer_residency,
        )
        return True

    def _turn(self, role: str, phase: str | None = None):
        """The role on the device for a phase (a no-op before the policy is registered).
        ``phase`` names it (the policy's: ``"generate"``, ``"loss"``; default: the role's
        name for the reference and a reward model, ``"score"`` for the policy)."""
        if role == "policy" and not self._policy_ready():
            return _Phase(self, None, phase or "generate")
        if role != "policy" and "policy" not in self.timeshare.roles:
            self._policy_ready()
        phase = phase or (role if role in ("reference", "reward") else "score")
        return _Phase(self, role, phase, keep_free_bytes=self._keep_free(role, phase))

    def _keep_free(self, role: str, phase: str) -> int | None:
        """With ``prefetch``: the bytes the turn of ``role`` for ``phase`` keeps free beside it
        instead of switching every other role out: what the phase allocated the last time it
        ran (the loss's: with the backward and optimizer step after it, outside the allocator's
        fragments), plus 10% and 256 MiB. The roles that fit beside that stay on the device:
        the policy through the reference's (and a reward model's) scoring, so the loss needs no
        copy of it back in; the frozen reference through the loss and the next generation where
        the device has room for it too (nothing moves then). The others go, least recently
        used first (a frozen role dropped without a copy). None (every other role goes, as
        without prefetch) before the phase has run once, or where ``prefetch_peak_bytes``
        leaves no room for that beside what is allocated now."""
        cfg, memory, ts = self.tidal_config, self._tidal_memory, self.timeshare
        if not cfg.prefetch or memory is None or role not in ts.roles:
            return None
        if self._tidal_depth > 0 and ts.is_resident(role):
            return 0  # inside a phase that made the room already (the loss's policy log-probs): move nothing
        # The loss's turn also holds the policy through the backward and the optimizer step
        # after it, a phase of its own: both count (their sum bounds what the turn allocates,
        # as the backward starts with what the loss left allocated).
        phases = ("loss", "backward") if phase == "loss" else (phase,)
        growths = [memory.growth.get(p) for p in phases]
        if None in growths:
            return None
        keep = phase_need_bytes(sum(growths))
        if phase == "loss":
            # The backward allocates large blocks: free pieces of the allocator's partly used
            # segments do not count as room for keeping a role beside it (run i5: 2.71 GiB of
            # cached free memory could not hold a 612 MiB block), only the driver's free memory
            # and the whole free segments the allocator can give back to it.
            keep += ts.ops.fragmented_free_bytes()
        if cfg.prefetch_peak_bytes is not None:
            coming = 0 if ts.is_resident(role) else ts.role_bytes(role)  # a prefetched part counted twice: safe
            if memory.allocated() + coming + keep > cfg.prefetch_peak_bytes:
                return None
        return keep

    def _after(self, role: str) -> str:
        """The role TRL computes with after ``role``'s phase: generation (policy), reference
        scoring, reward models, then the loss (policy); the roles it does not have are skipped."""
        order = [r for r in ("reference", "reward") if r in self.timeshare.roles] + ["policy"]
        return order[0] if role == "policy" else order[order.index(role) + 1]

    # ---- the phases ---------------------------------------------------------------------------
    def _generate(self, prompts: list):
        with self._turn("policy", "generate"), self._generate_again_if_out_of_memory():
            # Queued once the generation's first forward starts, not before: a small
            # host-to-device copy (the prompts, what generate() builds from them) queued behind
            # gigabytes of prefetch waits for all of them (0.30 s of a Qwen2-7B step's generation
            # on an H200, the compute stream idle; benchmarks/RESULTS.md, issue 26).
            with _at_first_forward(lambda: self._prefetch("generate", self._after("policy"))):
                return super()._generate(prompts)

    def _get_per_token_logps_and_entropies(self, model, *args: Any, **kwargs: Any):
        role = "reference" if self.ref_model is not None and model is self.ref_model else "policy"
        with self._turn(role):
            if role == "reference":
                self._prefetch("reference", self._after("reference"))
            compute = lambda: super(TidalRLTrainer, self)._get_per_token_logps_and_entropies(model, *args, **kwargs)  # noqa: E731
            if torch.is_grad_enabled() and self.tidal_config.activation_offload:
                return compute()  # a failed forward's offloaded activations are not its to run again
            return self._again_if_out_of_memory(role, compute)

    # ---- a kept role that leaves no room ---------------------------------------------------------
    def _again_if_out_of_memory(self, role: str, compute: Callable[[], Any]) -> Any:
        """``compute()``: a phase's work that changes nothing but the random generators' state
        (generation, the scorings, the loss's forward). With ``prefetch``, where it runs out of
        device memory while roles a turn kept (or a prefetch brought in) are on the device
        beside ``role`` (the phase needs more than the last step's reading: longer prompts or
        completions), those go (:meth:`~tidal.Timeshare.evict_others`: a frozen role dropped
        without a copy), the random generators are set back to where they were, and it runs
        once more: its results are those of a run that never kept them. Its need is measured
        again from there, so the next turns keep for it. Where nothing was beside ``role``, the
        ``torch.OutOfMemoryError`` goes on as it came (the run does not fit without tidal's keep
        either). Memory cost: the random generators' state, a few kilobytes on the host."""
        ts = self.timeshare
        if not self.tidal_config.prefetch or role not in ts.roles or not ts.is_resident(role):
            return compute()
        generators = _RandomState(ts.device)
        try:
            return compute()
        except torch.OutOfMemoryError:
            if ts.evict_others(role) == 0:
                raise
        # Past the handler: the failed run's tensors, held by its traceback's frames, are freed.
        generators.restore()
        self._tidal_retries += 1
        warnings.warn(
            f"tidal: TRL's {role} ran out of device memory beside the roles its turn kept on the device "
            f"(its need grew since the last step); they were moved out and it ran again (same results, "
            f"{self._tidal_retries} such run(s) so far, logged as tidal/oom_retries)",
            stacklevel=2,
        )
        if self._tidal_memory is not None:
            self._tidal_memory.rebase()  # the need counted from what the eviction left
        return compute()

    @contextlib.contextmanager
    def _generate_again_if_out_of_memory(self):
        """The policy's ``generate()`` (what allocates the KV cache) run by
        :meth:`_again_if_out_of_memory` for the block: an attribute of the unwrapped policy's
        instance, removed as the block ends."""
        policy = self.accelerator.unwrap_model(self.model)
        if not self.tidal_config.prefetch or "policy" not in self.timeshare.roles:
            yield
            return
        own = vars(policy).get("generate")
        generate = policy.generate
        policy.generate = lambda *a, **kw: self._again_if_out_of_memory("policy", lambda: generate(*a, **kw))
        try:
            yield
        finally:
            if own is None:
                del policy.generate
            else:
                policy.generate = own

    def _calculate_rewards(self, *args: Any, **kwargs: Any):
        if "reward" not in self.timeshare.roles:
            return super()._calculate_rewards(*args, **kwargs)
        with self._turn("reward"):
            self._prefetch("reward", self._after("reward"))
            return super()._calculate_rewards(*args, **kwargs)

    def _prefetch(self, phase: str, then: str, *, growth: int | None = None) -> None:
        """With ``TidalConfig(prefetch=True)``: start bringing ``then`` in behind ``phase``
        (``"optimizer"``: the policy's optimizer state, ahead of its step), leaving free what
        ``phase`` allocated the last time it ran (or ``growth`` bytes), +10%, 256 MiB."""
        ts, cfg = self.timeshare, self.tidal_config
        if not cfg.prefetch:
            return
        if then == "optimizer":
            if "policy" not in ts.roles:
                return
        elif then not in ts.roles or len(ts.roles) < 2:
            return
        leave, limit = None, None
        memory = self._tidal_memory
        if memory is not None:
            growth = growth if growth is not None else memory.growth.get(phase)
            if growth is None:
                return  # its needs are not known yet: measured this time, used the next
            leave = phase_need_bytes(growth)
            if cfg.prefetch_peak_bytes is not None:
                limit = max(0, cfg.prefetch_peak_bytes - memory.allocated() - leave)
        if then == "optimizer":
            rec = ts.prefetch_optimizer("policy", leave_free_bytes=leave, limit_bytes=limit)
        else:
            # Written back ahead: only what the turn of `then` will move out (the policy's
            # after the scoring is the loss's).
            keep = self._keep_free(then, "loss" if then == "policy" else then)
            rec = ts.prefetch(then, leave_free_bytes=leave, limit_bytes=limit, keep_free_bytes=keep)
        if rec is not None and memory is not None:
            memory.prefetched(rec.bytes_in)

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
            need = None
            if self._tidal_memory is not None:
                need = self._tidal_memory.backward_need()
                self._room_for_backward(need)
                self._tidal_memory.start("backward")
            self._prefetch("backward", "optimizer", growth=need)
        return out

    def _room_for_backward(self, need: int | None) -> None:
        """With ``prefetch``: right before the backward, the loss's activations now allocated,
        move out what it takes to leave the backward's need (``need``:
        :meth:`_PhaseMemory.backward_need`, +10%, 256 MiB) free outside the allocator's
        fragments. A role the loss's turn kept on the last step's reading (a longer batch makes
        larger activations) goes now, a frozen one dropped without a copy; where the room is
        there, this reads the free memory and moves nothing."""
        cfg, ts = self.tidal_config, self.timeshare
        if not cfg.prefetch or need is None or "policy" not in ts.roles or len(ts.resident_roles) < 2:
            return
        ts.load("policy", keep_free_bytes=phase_need_bytes(need) + ts.ops.fragmented_free_bytes())

    def _sync_reference(self, alpha: float) -> None:
        """Mix the policy into the reference (see :class:`_SyncReference`)."""
        store, device = self.timeshare.store, self.timeshare.device
        policy = self.accelerator.unwrap_model(self.model)
        with torch.no_grad():
            for target, source in zip(self.ref_model.parameters(), policy.parameters(), strict=True):
                src = source.data
                if moved_out(src):
                    held = store.host_tensor(src)
                    assert held is not None, "an emptied policy tensor that the timeshare does not hold"
                    src = held.to(device)
                if not moved_out(target.data):
                    target.data.mul_(1.0 - alpha).add_(src, alpha=alpha)
                    continue
                host = store.host_tensor(target.data)
                assert host is not None, "an emptied reference tensor that the timeshare does not hold"
                mixed = host.to(device, copy=True)
                mixed.mul_(1.0 - alpha).add_(src, alpha=alpha)
                host.copy_(mixed)

    # ---- logging ------------------------------------------------------------------------------
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        peaks = self._tidal_memory.take_peaks() if self._tidal_memory is not None else {}
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
        logs.update(self._tidal_figures)
        self._tidal_figures.clear()
        for phase, peak in peaks.items():
            logs[f"tidal/peak_gib/{phase}"] = peak / 2**30
        super().log(logs, start_time)

    # ---- checks -------------------------------------------------------------------------------
    def _refuse_prepared(self) -> None:
        state, who = self.accelerator.state, type(self).__name__
        if self.accelerator.num_processes > 1:
            raise ValueError(
                f"{who} runs in one process ({self.accelerator.num_processes} were launched): its "
                f"roles take turns on one device. Launch one process per GPU without accelerate's multi-process "
                f"launcher, or use tidal.distributed for sharded roles"
            )
        if getattr(state, "deepspeed_plugin", None) is not None or getattr(state, "fsdp_plugin", None) is not None:
            raise ValueError(
                f"{who} does not work with DeepSpeed or FSDP through accelerate: those engines keep "
                "their own copies of the state. Turn them off in the accelerate config, or use "
                "tidal.distributed (add_deepspeed_role, FSDP2 roles) directly"
            )


class TidalGRPOTrainer(TidalRLTrainer, GRPOTrainer):
    """``trl.GRPOTrainer`` whose policy, reference and reward models take turns on the device
    (see the module docstring). Takes GRPOTrainer's arguments, plus ``tidal=TidalConfig(...)``."""


class TidalRLOOTrainer(TidalRLTrainer, RLOOTrainer):
    """``trl.RLOOTrainer`` (REINFORCE leave-one-out; a reference by default, ``beta=0.05``)
    whose policy, reference and reward models take turns on the device, as
    :class:`TidalGRPOTrainer`. Takes RLOOTrainer's arguments, plus ``tidal=TidalConfig(...)``."""


@contextlib.contextmanager
def _at_first_forward(fn: Callable[[], None]):
    """Run ``fn`` as the first module forward inside the block starts (by then the inputs the
    block prepared are on the device), or as the block ends if no module ran; not if it raised.

    A process-wide forward pre-hook (any module: a PEFT wrapper's generate() calls its base
    model's forward, not its own), removed when it fires: no cost for the rest of the block."""
    fired = False
    owner = threading.get_ident()  # another thread's modules do not start this block's work

    def hook(module, args):
        nonlocal fired
        if fired or threading.get_ident() != owner:
            return
        fired = True
        handle.remove()
        fn()

    handle = torch.nn.modules.module.register_module_forward_pre_hook(hook)
    try:
        yield
    finally:
        handle.remove()
    if not fired:
        fired = True
        fn()


class _Phase:
    """``with``: the role resident for the block. The outermost phase also marks where the
    device's peak is attributed: from its start until the next outermost phase starts (so the
    loss phase's peak includes the backward and the optimizer step that follow it)."""

    def __init__(
        self, trainer: TidalRLTrainer, role: str | None, phase: str, *, keep_free_bytes: int | None = None
    ) -> None:
        self.trainer, self.role, self.phase = trainer, role, phase
        self.keep_free_bytes = keep_free_bytes
        self._ctx = None

    def __enter__(self) -> None:
        tr = self.trainer
        outermost = tr._tidal_depth == 0 and tr._tidal_memory is not None
        if outermost:
            tr._tidal_memory.start(self.phase)
        tr._tidal_depth += 1
        if self.role is not None:
            self._ctx = tr.timeshare.use(self.role, keep_free_bytes=self.keep_free_bytes)
            try:
                self._ctx.__enter__()
            except BaseException:
                tr._tidal_depth -= 1
                raise
            if outermost:
                # The phase's need is what it allocates beside what its switch left: the loss's
                # activations fill the room of the reference its switch dropped (read from before
                # the switch, they counted as nothing, and the next loss kept the reference where
                # they did not fit: run i5, out of memory at 7B 64 x 256 on an H100).
                tr._tidal_memory.rebase()

    def __exit__(self, *exc) -> None:
        self.trainer._tidal_depth -= 1
        if self._ctx is not None:
            self._ctx.__exit__(*exc)


class _RandomState:
    """The state of the random generators a phase draws from (the host's and, on CUDA, the
    device's default generator), to run the phase again from the same draws."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.host = torch.get_rng_state()
        self.on_device = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    def restore(self) -> None:
        torch.set_rng_state(self.host)
        if self.on_device is not None:
            torch.cuda.set_rng_state(self.on_device, self.device)


class _PhaseMemory:
    """The device's allocated bytes per phase of the step (generation, scoring, the loss, the
    backward with the optimizer step after it): the peak of each, for the log lines, and what
    each allocated the last time it ran, which a prefetch started in it leaves free.

    A phase runs from its :meth:`start` to the next phase's. Its growth is its peak less what
    was allocated at its start and less what prefetches started in it brought in (memory of
    the next phase, not its own). A log line (:meth:`take_peaks`) in the middle of a phase
    reads and resets the device's peak counter but not the phase: its growth is the highest
    reading over the whole phase, however many log lines fall in it.

    ``allocated``, ``peak`` and ``reset`` read the device's allocator (on CUDA:
    ``torch.cuda.memory_allocated``, ``max_memory_allocated``, ``reset_peak_memory_stats``);
    :meth:`of` builds it for a device, None where the device has no such counters."""

    def __init__(self, allocated: Callable[[], int], peak: Callable[[], int], reset: Callable[[], None]) -> None:
        self.allocated, self._peak, self._reset = allocated, peak, reset
        self.growth: dict[str, int] = {}  # phase -> bytes it allocated the last time it ran
        self._peaks: dict[str, int] = {}  # phase -> peak since the last take_peaks()
        self._phase: str | None = None
        self._start = 0  # allocated at the running phase's start
        self._high = 0  # the running phase's highest peak reading so far
        self._prefetched = 0  # brought in by prefetches started in the running phase
        self._held_for_backward: int | None = None  # what the loss's forward held as the last backward started

    @classmethod
    def of(cls, device: torch.device) -> "_PhaseMemory | None":
        if device.type != "cuda":
            return None
        return cls(
            lambda: torch.cuda.memory_allocated(device),
            lambda: torch.cuda.max_memory_allocated(device),
            lambda: torch.cuda.reset_peak_memory_stats(device),
        )

    def _read(self) -> None:
        """Take the running phase's reading, and restart the device's peak counter."""
        if self._phase is not None:
            peak = self._peak()
            self._high = max(self._high, peak)
            self._peaks[self._phase] = max(self._peaks.get(self._phase, 0), peak)
            self.growth[self._phase] = max(0, self._high - self._start - self._prefetched)
        self._reset()

    def start(self, phase: str) -> None:
        """Close the running phase's reading and start ``phase``'s."""
        self._read()
        self._phase, self._start, self._high, self._prefetched = phase, self.allocated(), 0, 0

    def rebase(self) -> None:
        """Count the running phase's growth from what is allocated now: called once its turn's
        switch has run, so that what the switch freed (a role moved out) or brought in is not
        read as the phase's own need. The switch's peak stays in the phase's peak for the log;
        the phase's growth is first published when it is next read (a phase running for the
        first time has none yet: what is prefetched behind it waits for its measure)."""
        if self._phase is not None:
            self._peaks[self._phase] = max(self._peaks.get(self._phase, 0), self._peak())
        self._reset()
        self._start = self._high = self.allocated()

    def backward_need(self) -> int | None:
        """What the backward (with the optimizer step after it) will allocate, called as it
        starts: its growth the last time, scaled up by how much more the loss's forward holds
        now than it did at the same point then (a longer batch: larger activations, and larger
        gradients of them; never scaled down). None before the backward has run once."""
        held = max(1, self.allocated() - self._start)  # the loss's forward, since its switch
        before, self._held_for_backward = self._held_for_backward, held
        growth = self.growth.get("backward")
        if growth is None:
            return None
        return growth if before is None or held <= before else growth * held // before

    def prefetched(self, nbytes: int) -> None:
        """A prefetch started in the running phase brought ``nbytes`` in."""
        self._prefetched += nbytes

    def take_peaks(self) -> dict[str, int]:
        """Each phase's peak allocated bytes since the last call (the running one's so far)."""
        self._read()
        peaks, self._peaks = self._peaks, {}
        return peaks


class _SyncReference(TrainerCallback):
    """``sync_ref_model=True``: every ``ref_model_sync_steps`` steps the reference becomes
    ``(1 - alpha) * reference + alpha * policy``, as TRL's ``SyncRefModelCallback`` computes it
    (the same in-place ops on the device, so the same bits), wherever each tensor is: a
    reference tensor that is out is brought to the device one at a time, mixed there and
    written back into its host copy (the next reload brings the mix in); a policy tensor that
    is out is read from its host copy. Memory cost: on the device, one reference tensor (and
    one policy tensor, if out) at a time."""

    def __init__(self, trainer: TidalRLTrainer) -> None:
        # Weak: the trainer holds this callback; the trainer (and the pinned host memory of its
        # roles) must go when the user drops it, not at the next cyclic collection.
        self.trainer = weakref.ref(trainer)

    def on_step_end(self, args, state, control, **kwargs) -> None:
        trainer = self.trainer()
        if trainer is not None and state.global_step % args.ref_model_sync_steps == 0:
            trainer._sync_reference(args.ref_model_mixup_alpha)


def _own_storages(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Weights (and, after a resume, optimizer state) loaded on the CPU may be views of the
    memory-mapped checkpoint file, which tidal cannot free; give each such tensor memory of
    its own (same values; the same Parameter object, so optimizer keys and hooks stay valid).
    On a GPU the load already copied them."""
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            if t.numel() and not t.untyped_storage().resizable():
                t.data = t.data.clone()
        if optimizer is not None and not getattr(optimizer, "tidal_state_on_host", False):
            for st in optimizer.state.values():
                for k, v in st.items():
                    if isinstance(v, torch.Tensor) and v.numel() and not v.untyped_storage().resizable():
                        st[k] = v.clone()


def _refuse_settings(args: Any, who: str) -> None:
    """Settings tidal cannot work with, found in the GRPOConfig before TRL builds anything."""
    if args is None:
        return
    if getattr(args, "use_vllm", False):
        raise ValueError(
            f"{who} does not support use_vllm=True: vLLM keeps its own copy of the weights and its own "
            "memory pool, which a timeshare cannot move. Set use_vllm=False (generation then runs on the policy, "
            "which takes turns with the reference)"
        )
    if getattr(args, "torch_compile", False):
        raise ValueError(
            f"{who} does not support torch_compile=True: compiled graphs keep the addresses of the "
            "weights tidal moves. Set torch_compile=False"
        )
    if getattr(args, "deepspeed", None):
        raise ValueError(
            f"{who} does not work with deepspeed= in the training arguments: DeepSpeed keeps its own "
            "copies of the state. Remove it, or use tidal.distributed.add_deepspeed_role directly"
        )
    if getattr(args, "fsdp", None):
        raise ValueError(
            f"{who} does not work with fsdp= in the training arguments; remove it, or build FSDP2 roles "
            "with tidal.distributed directly"
        )
