"""A phase that runs out of device memory beside the roles its turn kept (or a prefetch
brought in) runs again once they are out, from the same random draws: the generation, the
scorings and the loss's forward, the loss's forward with its backward, and the optimizer step.
:class:`OutOfMemoryRetry`, a collaborator of :class:`~tidal.integrations.trl.adapter.TrlAdapter`."""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable

import torch

from tidal.device import RandomState
from tidal.integrations.seams import instead, wrap_step
from tidal.integrations.trl.launch import decodes_in_step
from tidal.memory import phase_need_bytes
from tidal.timeshare import Timeshare
from tidal.timeshare.schedule import PhaseSchedule

__all__ = ["OutOfMemoryRetry"]


class OutOfMemoryRetry:
    """Runs a TRL trainer's phases again after they run out of memory beside kept roles: its
    phases through :meth:`again`, the policy's ``generate()`` through :meth:`generating`, its
    micro-batches through :meth:`backward_again`, its optimizer's ``step()`` through what
    :meth:`wrap_step` installs. Works only with ``prefetch`` (without it, nothing is kept beside
    a phase and each call runs its work as it is).

    ``timeshare`` and ``schedule`` are the trainer's (the schedule's memory readings, where it
    has them, measure each phase again from what an eviction left); ``launch`` is the trainer's
    (``"single"``, ``"ddp"``, ``"fsdp2"``); ``optimizer_residency`` the policy's. :attr:`retries`
    counts the phases run again (logged as ``tidal/oom_retries``)."""

    def __init__(
        self,
        timeshare: Timeshare,
        schedule: PhaseSchedule,
        *,
        prefetch: bool,
        launch: str,
        optimizer_residency: str,
        activation_offload: bool,
    ) -> None:
        self.timeshare, self.schedule = timeshare, schedule
        self.prefetch, self.launch = prefetch, launch
        self.optimizer_residency, self.activation_offload = optimizer_residency, activation_offload
        self.retries = 0  # phases run again after running out of memory beside kept roles
        self.plain_backward = False  # a backward run again: nothing is prefetched beside it
        self.step_growth: tuple[int, int] | None = None  # the last step's (growth, state it brought in)
        self._step_before: tuple[int, int] = (0, 0)

    def _ran_again(self, what: str) -> None:
        self.retries += 1
        warnings.warn(
            f"tidal: TRL's {what} ran out of device memory beside the roles its turn kept on the device "
            f"(its need grew since the last step); they were moved out and it ran again (same results, "
            f"{self.retries} such run(s) so far, logged as tidal/oom_retries)",
            stacklevel=4,
        )

    def again(self, role: str, compute: Callable[[], Any]) -> Any:
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
        if not self.prefetch or role not in ts.roles or not ts.is_resident(role):
            return compute()
        generators = RandomState(ts.device)
        memory = self.schedule.memory
        # What the phase allocated before this part (a policy gathered for generation): its
        # own need, still allocated when the part runs again.
        before = memory.grown() if memory is not None else 0
        try:
            return compute()
        except torch.OutOfMemoryError:
            if ts.evict_others(role) == 0:
                raise
        # Past the handler: the failed run's tensors, held by its traceback's frames, are freed.
        generators.restore()
        self._ran_again(role)
        if memory is not None:
            memory.rebase(grown_bytes=before)  # the need counted from what the eviction left
        return compute()

    @contextlib.contextmanager
    def generating(self, policy: torch.nn.Module):
        """The unwrapped ``policy``'s ``generate()`` (what allocates the KV cache) run by
        :meth:`again` for the block: an attribute of the instance, removed as the block ends."""
        if not self.prefetch or "policy" not in self.timeshare.roles or decodes_in_step(policy):
            # (A sharded policy's generation that gathers per unit, and transformers syncs the
            # ranks' decoding loops where it knows the model sharded: no rank runs it alone.
            # Gathered whole for it, each rank decodes alone and can run it again alone.)
            yield
            return
        generate = policy.generate
        with instead(policy, "generate", lambda *a, **kw: self.again("policy", lambda: generate(*a, **kw))):
            yield

    def backward_again(self, trainer: Any, step: Callable[[], Any]) -> Any:
        """``step()``: the ``trainer``'s ``training_step`` for one micro-batch (its inputs
        prepared by its ``_prepare_inputs``, the loss's forward, its backward). With
        ``prefetch``, in one process, where it runs out of device memory beside roles its turns
        kept or the optimizer state brought in behind the backward, those go
        (:meth:`~tidal.Timeshare.evict_others`), the gradients it left are dropped, the random
        generators are set back to where they were after the inputs were prepared, and the
        forward and backward run again from the same inputs (no generation runs again),
        nothing prefetched beside the backward this time (:attr:`plain_backward`): its results
        are those of a run that never kept them.

        Only where no gradient was there before the micro-batch (its optimizer step's first, or
        only, micro-batch; or TRL's loss accumulated over one): a backward that failed part
        way added to some gradients already there, and those additions cannot be taken back
        bit for bit. Not with several processes (the backward's reduction is a collective the
        other ranks are in), activation offload, or an optimizer that takes the gradients to
        the host inside the backward (CPUAdam). Memory cost: the prepared inputs' reference and
        the random generators' state (kilobytes, on the host)."""
        ts = self.timeshare
        if not self.prefetch or self.activation_offload or self.launch != "single":
            return step()
        optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
        if optimizer is None or getattr(optimizer, "tidal_state_on_host", False):
            return step()
        if getattr(trainer, "use_adaptive_entropy", False):
            return step()  # the loss's forward moves TRL's entropy coefficient: not run twice
        params = [p for p in trainer.accelerator.unwrap_model(trainer.model).parameters() if p.requires_grad]
        if any(p.grad is not None for p in params):
            return step()  # a later micro-batch: the gradients before it cannot be restored
        metrics = getattr(trainer, "_metrics", None)  # TRL's per-mode lists of logged values
        prepared: list[tuple[Any, RandomState, dict]] = []
        prepare = trainer._prepare_inputs

        def recorded(batch: Any) -> Any:
            inputs = prepare(batch)  # (the generation's logged values are in TRL's lists now)
            prepared.append((inputs, RandomState(ts.device), _list_lengths(metrics)))
            return inputs

        try:
            with instead(trainer, "_prepare_inputs", recorded):
                return step()
        except torch.OutOfMemoryError:
            if not prepared or "policy" not in ts.roles or not ts.is_resident("policy"):
                raise
            if ts.evict_others("policy") == 0:
                raise
        # Past the handler: the failed run's graph and activations, held by its traceback, are freed.
        for p in params:
            p.grad = None
        inputs, generators, counts = prepared[0]
        _truncate_lists(metrics, counts)  # what the failed forward logged is logged by the next
        generators.restore()
        self._ran_again("loss forward and backward")
        self.plain_backward = True
        try:
            with instead(trainer, "_prepare_inputs", lambda batch: inputs):
                return step()
        finally:
            self.plain_backward = False

    def wrap_step(self, optimizer: torch.optim.Optimizer, *, scaled: bool) -> None:
        """With ``prefetch``: ``optimizer.step()`` (the policy's, called by Trainer) makes room
        for itself and runs again where it runs out of memory beside roles a turn kept.
        ``scaled``: accelerate's fp16 GradScaler steps it (nothing is installed then).

        Before the step: where another role is on the device, the step's need (what it
        allocated the last time: its temporaries, plus the optimizer state it brings in now; at
        the first step every other role goes) is left free outside the allocator's fragments,
        moving out what that takes. Where it still runs out of memory while tidal brings the
        optimizer state in (before the update touches anything; for a streamed step, between
        chunks, each of which consumes its gradients), the other roles and any prefetch go and
        ``step()`` runs again, completing exactly this step. Where the update's own arithmetic
        ran out of memory (some state already changed), the error goes on as it came.

        Installed as ``optimizer.step`` (an attribute of the instance, wrapping what was there:
        an LR scheduler's counter included) and two step hooks after the role's. Memory cost:
        none."""
        if not self.prefetch:
            return
        if scaled:
            # accelerate's fp16 GradScaler swaps optimizer.step for its own during each step.
            warnings.warn(
                "tidal: with fp16's GradScaler the optimizer step is not run again after running out of memory "
                "beside kept roles (accelerate swaps optimizer.step during the step); the other phases are",
                stacklevel=3,
            )
            return
        ts, inner = self.timeshare, optimizer.step
        state = {"outer": False, "math": False}

        def math_starts(opt: Any, args: Any, kwargs: Any) -> None:
            state["math"] = True  # after the role's pre-hook: the state is in, the update runs

        def math_ended(opt: Any, args: Any, kwargs: Any) -> None:
            state["math"] = False

        optimizer.register_step_pre_hook(math_starts)
        optimizer.register_step_post_hook(math_ended)

        def step(opt: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
            if state["outer"]:
                return inner(*args, **kwargs)  # a streamed step's chunk
            state["outer"], state["math"] = True, False
            try:
                self.room_for_step()
                try:
                    out = inner(*args, **kwargs)
                except torch.OutOfMemoryError:
                    if state["math"] or ts.evict_others("policy") == 0:
                        raise
                else:
                    self.step_measured()
                    return out
                # Past the handler: what the failed step allocated, held by its traceback, is freed.
                state["math"] = False
                self._ran_again("optimizer step")
                self.measure_step()  # from what the eviction left
                out = inner(*args, **kwargs)
                self.step_measured()
                return out
            finally:
                state["outer"] = False

        wrap_step(optimizer, step)

    def _state_to_bring(self) -> tuple[int, int]:
        """(bytes of the policy's optimizer state on the host that its step brings in, bytes of
        all of it)."""
        ts = self.timeshare
        role = ts.role("policy")
        entries = ts.store.resolve(role.optim_entries(ts.device, ts.config.min_offload_bytes))
        out = [e for e in entries if ts.store.is_offloaded(e.key) and not ts.store.is_arriving(e.key)]
        return sum(e.nbytes for e in out), sum(e.nbytes for e in entries)

    def room_for_step(self) -> None:
        """Before the policy's optimizer step (see :meth:`wrap_step`)."""
        ts = self.timeshare
        if "policy" not in ts.roles:
            return
        if len(ts.resident_roles) >= 2:
            last = self.step_growth
            if last is None:
                ts.evict_others("policy")  # its need is not known yet: measured alone
            else:
                growth, came = last
                streamed = self.optimizer_residency == "stream"  # its chunks in flight
                need = growth if streamed else max(0, growth - came) + self._state_to_bring()[0]
                ts.load("policy", keep_free_bytes=phase_need_bytes(need) + self.schedule.fragments("backward"))
        self.measure_step()  # once the room is made (a move out gives a prefetch's memory back first)

    def measure_step(self) -> None:
        """Start measuring the step from here: the state it will bring in, and its growth."""
        self._step_before = self._state_to_bring()
        if self.schedule.memory is not None:
            self.schedule.memory.begin_part("step")

    def step_measured(self) -> None:
        """The step ended: what it grew and the state that came to the device in it, for the
        next step's room."""
        memory = self.schedule.memory
        if memory is None or "policy" not in self.timeshare.roles:
            return
        growth = memory.end_part()
        bring, total = self._step_before
        # The state that came to the device in the step: what it brought in, and what it made
        # (the first step creates the optimizer's state).
        self.step_growth = (growth, bring + max(0, self._state_to_bring()[1] - total))


def _list_lengths(metrics: Any) -> dict:
    """The length of each list in TRL's ``_metrics`` (mode -> name -> list), to take back what a
    failed run appended."""
    if not isinstance(metrics, dict):
        return {}
    return {
        mode: {name: len(v) for name, v in names.items() if isinstance(v, list)}
        for mode, names in metrics.items()
        if isinstance(names, dict)
    }


def _truncate_lists(metrics: Any, counts: dict) -> None:
    """Take back what a failed run appended to TRL's ``_metrics``: each list back to its length
    before it, the lists it began removed."""
    if not isinstance(metrics, dict):
        return
    for mode, names in metrics.items():
        if not isinstance(names, dict):
            continue
        before = counts.get(mode, {})
        for name in [k for k, v in names.items() if isinstance(v, list)]:
            if name in before:
                del names[name][before[name] :]
            else:
                del names[name]
