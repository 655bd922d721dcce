"""What a run measures, step by step: the step clock and the memory beside the gradients (as
trainer callbacks), tidal's transitions read from its records, the profiler of one step, where
a run ran out of memory, and the machine's PCIe line rate.

:class:`StepProbes` holds one run's per-measured-step lists; its :meth:`StepProbes.callbacks`
are what the trainer is given. The first step is the warm-up: measured steps start at the
second (``state.global_step > 1`` at its end), the profiled step is never one. Step boundaries
wait for the compute stream (all of TRL's work), not for the device: copies tidal queued with
no host wait run on into the next step, as they do in a run without the clock (``--turns``: the
device, since the partner's step follows on the same GPU). torch and transformers are imported
where used.
"""

from __future__ import annotations

import functools
import os
import time

__all__ = [
    "ALLOCATOR_COUNTERS",
    "RawProfile",
    "StepProbes",
    "annotate_for_profile",
    "exposed_s",
    "host_stall_s",
    "line_rate",
    "lockstep_patience",
    "logged_per_step",
    "step_moves",
    "transitions_by_kind",
    "where_out_of_memory",
]

ALLOCATOR_COUNTERS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")
"""The caching allocator's counters read per measured step (``torch.cuda.memory_stats``)."""


def lockstep_patience(timeout_s: float, deadline: float, now: float, last_step_s: float, *, turns: bool) -> float:
    """How long a lockstep process waits for its partner: ``timeout_s``, less where the
    ``deadline`` (0: none) leaves room for only one more step like the last (and its results)
    after it. With ``turns`` a wait lasts the partner's step, or two (a process's turns come two
    partner steps apart where it goes first in a pair after going second in the one before), and
    a pair of steps begins only where it would end 20 s before the deadline (the deadline check
    of twice the step): the wait may last until then. At least 1 s."""
    if not deadline:
        return timeout_s
    if turns:
        room = deadline - now - 20.0
    else:
        room = deadline - now - 1.15 * last_step_s - 30.0
    return max(1.0, min(timeout_s, room))


def step_moves(records) -> list:
    """A step's transitions (timeshare records) in order, each ``[kind, roles out, role in, GB
    in, GB out, GB found arrived ahead, the compute stream's wait in s]``; the chunks of a
    streamed optimizer step summed into one row: what each turn moved and kept, to read a
    schedule by."""
    out: list = []
    for r in records:
        row = [
            r.kind,
            list(r.roles_out),
            r.role_in,
            r.bytes_in / 1e9,
            r.bytes_out / 1e9,
            r.bytes_prefetched / 1e9,
            getattr(r, "stall_seconds", 0.0) or 0.0,
        ]
        if out and r.kind == "optim-stream" and out[-1][0] == r.kind:
            out[-1][3:] = [a + b for a, b in zip(out[-1][3:], row[3:])]
        else:
            out.append(row)
    return [[k, o, i, *(round(x, 4) for x in rest)] for k, o, i, *rest in out]


def transitions_by_kind(records) -> dict:
    """A step's transitions (timeshare records) by kind: how many, GB, the host's time in them
    (``alloc_s``: the part spent allocating device memory; ``queue_s``: inside the call that
    queues a prefetch's or write-back's copies), the compute stream's waits (``stall_s``) and
    its time in the verbs (``gap_s``)."""
    out: dict = {}
    for r in records:
        k = out.setdefault(
            r.kind,
            {"count": 0, "gb": 0.0, "host_s": 0.0, "alloc_s": 0.0, "queue_s": 0.0, "stall_s": 0.0, "gap_s": 0.0},
        )
        k["count"] += 1
        k["gb"] += (r.bytes_out + r.bytes_in) / 1e9
        k["host_s"] += getattr(r, "host_seconds", 0.0) or r.seconds
        k["alloc_s"] += getattr(r.move, "alloc_seconds", 0.0) or 0.0
        k["queue_s"] += getattr(r.move, "queue_seconds", 0.0) or 0.0
        k["stall_s"] += getattr(r, "stall_seconds", 0.0) or 0.0
        k["gap_s"] += getattr(r, "gap_seconds", None) or 0.0
    return out


def logged_per_step(history: list[dict], prefix: str) -> list[dict[str, float]]:
    """Of each measured step's log line (from step 2; the lines with a loss), the figures
    logged in GiB under ``prefix`` + ``<phase>``, in bytes by phase; steps without any left out."""
    out = [
        {k[len(prefix) :]: float(v) * 2**30 for k, v in h.items() if k.startswith(prefix)}
        for h in history
        if h.get("step", 0) >= 2 and "loss" in h
    ]
    return [x for x in out if x]


def exposed_s(trainer) -> float:
    """Seconds the trainer's transitions so far left the step waiting (0 without a timeshare):
    each record's exposed time, its copy and release time for a blocking record that has none.
    Settles the timeshare's stalls first (call it with the device synchronised)."""
    ts = getattr(trainer, "timeshare", None)
    if ts is None:
        return 0.0
    if hasattr(ts, "settle_stalls"):
        ts.settle_stalls(wait=True)
    return sum(
        getattr(r, "exposed_seconds", None) or (0.0 if r.queued else r.seconds + r.release_seconds) for r in ts.records
    )


def host_stall_s(trainer) -> float:
    """The host's time in the verbs plus the compute stream's waits, over the trainer's
    transitions so far (0 without a timeshare): an upper bound of :func:`exposed_s` (the device
    may still run queued work while the host is in a verb)."""
    ts = getattr(trainer, "timeshare", None)
    if ts is None:
        return 0.0
    return sum(getattr(r, "host_seconds", 0.0) + getattr(r, "stall_seconds", 0.0) for r in ts.records)


class RawProfile:
    """torch's profiler without its event tree: :meth:`stop` returns kineto's raw events (the
    tree ``torch.profiler.profile`` builds from a step's hundreds of thousands of events takes
    longer than the step)."""

    def __init__(self, cuda: bool) -> None:
        from torch._C._profiler import _ExperimentalConfig
        from torch.autograd import ProfilerActivity, ProfilerConfig, ProfilerState

        self.activities = {ProfilerActivity.CPU} | ({ProfilerActivity.CUDA} if cuda else set())
        self.config = ProfilerConfig(ProfilerState.KINETO, False, False, False, False, False, _ExperimentalConfig())

    def start(self) -> None:
        from torch.autograd import _enable_profiler, _prepare_profiler

        _prepare_profiler(self.config, self.activities)
        _enable_profiler(self.config, self.activities)

    def stop(self):
        from torch.autograd import _disable_profiler

        return _disable_profiler().events()


def annotate(obj, attr: str, label: str) -> None:
    """Wrap ``obj.attr`` (a method) in a profiler range named ``label``; once (a method wrapped
    already, or missing, is left as it is)."""
    import torch

    fn = getattr(obj, attr, None)
    if fn is None or getattr(fn, "_bench_label", None):
        return

    @functools.wraps(fn)
    def wrapped(*a, **kw):
        with torch.profiler.record_function(label):
            return fn(*a, **kw)

    wrapped._bench_label = label
    setattr(obj, attr, wrapped)


def annotate_for_profile(trainer):
    """Profiler ranges around the trainer's phases (``phase:*``), tidal's verbs
    (``tidal:*``) and the host's waits (``wait:<name>``), as ``step_trace`` reads them. Returns
    the sync-policy context the training must run inside for the waits to be named."""
    import torch

    from tidal.device import SyncPolicy, use_sync_policy

    ref = getattr(trainer, "ref_model", None)
    inner = trainer._get_per_token_logps_and_entropies

    def logps(model, *a, **kw):
        label = "phase:reference" if ref is not None and model is ref else "phase:score"
        with torch.profiler.record_function(label):
            return inner(model, *a, **kw)

    trainer._get_per_token_logps_and_entropies = logps
    annotate(trainer, "_generate", "phase:generate")
    annotate(trainer, "_calculate_rewards", "phase:reward")
    annotate(trainer, "compute_loss", "phase:loss_forward")
    annotate(trainer.accelerator, "backward", "phase:backward")
    annotate(trainer, "_clip_grad_norm", "phase:clip")
    ts = getattr(trainer, "timeshare", None)
    if ts is not None:
        for attr in ("load", "prefetch", "offload", "offload_optimizer_state", "reload_optimizer_state"):
            annotate(ts, attr, f"tidal:{attr}")
        for attr in ("switch", "prefetch", "write_back", "cancel_prefetch", "_settle_write_backs", "recover"):
            annotate(ts.store, attr, f"tidal:store.{attr}")
        backend = getattr(ts.store, "backend", None)
        while backend is not None:
            annotate(backend, "settle", f"tidal:settle ({type(backend).__name__})")
            backend = getattr(backend, "fallback", None)

    class Named(SyncPolicy):
        def wait_host(self, name, event):
            with torch.profiler.record_function(f"wait:{name}"):
                super().wait_host(name, event)

    return use_sync_policy(Named())


def where_out_of_memory(trainer, error: BaseException) -> dict:
    """Where a run ran out of device memory: the step, tidal's phase and what it had on the
    device then (its resident roles, the bytes prefetches had brought in), the allocator's
    counts, and the innermost frames of the error's traceback that are TRL's, transformers',
    torch's or tidal's."""
    import traceback

    import torch

    out: dict = {"step": trainer.state.global_step + 1}
    ts = getattr(trainer, "timeshare", None)
    schedule = getattr(trainer, "_tidal_schedule", None)
    memory = schedule.memory if schedule is not None else None
    if ts is not None:
        out["resident_roles"] = sorted(ts.resident_roles)
        out["prefetched_bytes"] = ts.store.prefetched_bytes
    if memory is not None:
        out["phase"] = memory._phase
        out["phase_growth_bytes"] = dict(memory.growth)
        out["phase_start_bytes"] = memory._start  # allocated as the phase's count began
        out["phase_fragments_bytes"] = dict(memory.fragments)
    if schedule is not None:
        out["gathered_bytes"] = list(schedule._gathered)  # this generation's gather, the last's
    if torch.cuda.is_available():
        # The peak of the failing phase (its counter restarts at each phase), before the failed
        # allocation: the error's own message says what was allocated as it failed.
        out["peak_bytes"] = torch.cuda.max_memory_allocated()
        out["allocated_bytes"] = torch.cuda.memory_allocated()
        out["reserved_bytes"] = torch.cuda.memory_reserved()
        out["driver_free_bytes"] = torch.cuda.mem_get_info()[0]
    frames = traceback.extract_tb(error.__traceback__)
    keep = ("/trl/", "/transformers/", "/torch/", "/tidal/")
    out["frames"] = [
        f"{f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}"
        for f in frames
        if any(k in f.filename for k in keep)
    ][-12:]
    return out


def line_rate() -> dict | None:
    """The PCIe line rate of this machine, measured here (``tidal bench``'s measurement:
    ``d2h_gbps``, ``h2d_gbps``, ``bidir_gbps``): the bound a step that must move its bytes
    cannot beat. None without a GPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    from tidal.device import DeviceOps
    from tidal_recipes.measure import measure_line_rate

    return measure_line_rate(DeviceOps(torch.device("cuda")), 1 << 30)


class StepProbes:
    """One run's measurements, per measured step, taken by the callbacks
    (:meth:`callbacks`) of the trainer :meth:`attach` names.

    ``name``: the variant's name (in the log lines); ``args``: the bench's parsed flags and the
    launch's state (``_lockstep``, ``_deadline``, ``_launched``, ``_run_index``, ``_turn_n``,
    ``_main_cores``, ``_process_cores``, and ``profile_step``, ``turns``, ``lockstep_rank``,
    ``sample_stacks``). Per measured step (lists in step order): ``times`` (wall s),
    ``lockstep_steps``, ``peaks`` (max allocated bytes), ``allocator`` (counter deltas and
    reserved bytes), ``exposed``, ``host_stall``, ``rss_steps``, ``host_given``,
    ``phase_steps``, ``token_steps``, ``copy_tail``, ``by_kind``, ``moves``; and ``workload``
    (the sizes beside the gradients), ``profiled`` (the profiled step), ``stopped`` (where the
    deadline ended the training)."""

    def __init__(self, name: str, args, *, cuda: bool, rank: int) -> None:
        import host_clock
        from phase_clock import HostProbe, PhaseClock, TokenGaps

        self.name, self.args, self.cuda, self.rank = name, args, cuda, rank
        self.trainer = None
        self.times: list[float] = []
        self.lockstep_steps: list[dict] = []
        self.peaks: list[int] = []
        self.allocator: list[dict] = []
        self.exposed: list[float] = []
        self.host_stall: list[float] = []
        self.rss_steps: list[int] = []
        self.host_given: list[dict] = []
        self.phase_steps: list[dict] = []
        self.token_steps: list[dict | None] = []
        self.copy_tail: list[dict] = []
        self.by_kind: list[dict] = []
        self.moves: list[list] = []
        self.workload: dict = {}
        self.profiled: dict = {}
        self.stopped: dict = {}
        self.given_clock = host_clock.HostClock()  # closed with the run (it watches the garbage collector)
        self.phases = PhaseClock(cuda)
        self.tokens = TokenGaps(cuda, HostProbe("cuda" if cuda else "cpu"))
        self.sampler = None
        if args.sample_stacks:
            from host_samples import StackSampler

            self.sampler = StackSampler(interval_s=0.002)
        self._last_wall = 0.0
        self._step: dict = {}  # the step in progress: what its end reads

    def attach(self, trainer) -> None:
        """Measure ``trainer`` (made with :meth:`callbacks`): its phases and generated tokens
        are clocked from now on."""
        self.trainer = trainer
        self.phases.wrap_trainer(trainer)
        self.tokens.wrap_trainer(trainer)

    def callbacks(self) -> list:
        """The trainer callbacks that take the measurements: the step clock, and the sizes
        read right before the optimizer step."""
        from transformers import TrainerCallback

        probes = self

        class StepClock(TrainerCallback):
            def on_step_begin(self, a, state, control, **kw):
                probes.step_begin(state)

            def on_step_end(self, a, state, control, **kw):
                probes.step_end(state, control)

        class BesideTheGradients(TrainerCallback):
            def on_pre_optimizer_step(self, a, state, control, **kw):
                probes.before_optimizer_step()

        return [StepClock(), BesideTheGradients()]

    def since_launch(self) -> str:
        """`` (+N s after the launch)`` for a log line, or nothing where the launch time is unknown."""
        launched = self.args._launched
        return f" (+{time.time() - launched:.1f} s after the launch)" if launched else ""

    def lockstep_patience(self) -> float:
        """:func:`lockstep_patience` for this run now."""
        a = self.args
        return lockstep_patience(a._lockstep.timeout_s, a._deadline, time.time(), self._last_wall, turns=a.turns)

    def past_deadline(self, step_s: float) -> bool:
        """Whether another step like this one (+15%), and 20 s to write the results, would end
        past the deadline, on any rank: the ranks decide alike, or one would wait in a
        collective for the others forever."""
        import torch
        import torch.distributed as dist

        late = time.time() + 1.15 * step_s + 20.0 > self.args._deadline
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([float(late)], device="cuda" if dist.get_backend() == "nccl" else "cpu")
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            late = bool(flag.item())
        return late

    def before_optimizer_step(self) -> None:
        """Right before the optimizer step (the gradients clipped), on a GPU: the policy's
        weights and gradients on the device, the optimizer state's bytes (all of it, wherever
        it is; a sharded tensor: this rank's shard) and the device's total memory, into
        ``workload``."""
        if not self.cuda:
            return
        import torch

        trainer = self.trainer
        policy = trainer.accelerator.unwrap_model(trainer.model)
        local = lambda t: getattr(t, "_local_tensor", t)  # noqa: E731
        params = [local(p) for p in policy.parameters()]
        weights = sum(p.numel() * p.element_size() for p in params)
        grads = sum(local(p.grad).numel() * p.element_size() for p in policy.parameters() if p.grad is not None)
        opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
        state_bytes = sum(
            local(t).numel() * t.element_size()
            for st in opt.state.values()
            for t in st.values()
            if torch.is_tensor(t) and t.dim() > 0
        )
        self.workload.update(
            weights_bytes=weights,
            grads_bytes=grads,
            optimizer_state_bytes=state_bytes,
            device_total_bytes=torch.cuda.mem_get_info()[1],
        )

    def _meet_partner(self, state) -> dict | None:
        """``--lockstep``: this step starts with the partner process's, or with ``--turns``
        once the partner's step before it has ended, before the clock starts (the wait is no
        part of the step). The rendezvous's record, or None without a partner."""
        a = self.args
        if a._lockstep is None:
            return None
        key = f"{a._run_index}/{state.global_step + 1}"
        if a.turns:
            met, waited, order = a._lockstep.turn(a._turn_n, timeout_s=self.lockstep_patience())
            a._turn_n += 1
            met_at = {"key": key, "met": met, "wait_s": waited, "order": order}
        else:
            met, waited = a._lockstep.barrier(key, timeout_s=self.lockstep_patience())
            met_at = {"key": key, "met": met, "wait_s": waited}
        met_at["started_at"] = time.time()
        return met_at

    def step_begin(self, state) -> None:
        """The clock's start of a step (``state.global_step`` steps done: this is the next)."""
        import torch

        a, cuda, trainer, step = self.args, self.cuda, self.trainer, self._step
        if cuda:
            torch.cuda.current_stream().synchronize()
            if state.global_step == 1:  # after the warm-up step
                torch.cuda.reset_peak_memory_stats()
        step.clear()
        step["lockstep"] = self._meet_partner(state)
        step["prof"] = None
        if a.profile_step and state.global_step + 1 == a.profile_step:
            annotate(trainer.optimizer, "step", "phase:optimizer")
            annotate(trainer.optimizer, "zero_grad", "phase:zero_grad")
            try:
                prof = RawProfile(cuda)
                prof.start()
                step["prof"] = prof
            except Exception as e:  # a profiler this torch lacks costs the picture, not the run
                self.profiled["error"] = f"profiler did not start: {e!r}"
        self.phases.wrap_optimizer(trainer)  # the trainer makes its optimizer in train()
        self.phases.take()  # a step's phases only
        step["exposed0"] = exposed_s(trainer)
        step["host_stall0"] = host_stall_s(trainer)
        step["counters0"] = torch.cuda.memory_stats() if cuda else {}
        ts = getattr(trainer, "timeshare", None)
        step["seen"] = len(ts.records) if ts is not None else None
        if self.sampler is not None and state.global_step >= 1 and step["prof"] is None:
            self.sampler.start()  # the measured steps only
        step["tail"] = None
        if cuda and ts is not None:
            # Copies tidal queued before the step and still running when it starts (a
            # write-back of the last step's optimizer state): an event behind them on each
            # copy stream, timed against one on the compute stream now.
            begin = torch.cuda.Event(enable_timing=True)
            begin.record()
            ends = {}
            for stream in ("d2h_stream", "h2d_stream"):
                end = torch.cuda.Event(enable_timing=True)
                end.record(getattr(ts.store.engine, stream))
                ends[stream[:3]] = end
            step["tail"] = (begin, ends)
        if a._main_cores:
            # --main-cores: the main thread (the host-bound decode's) on one of two cores, the
            # partner's on the other, swapped every step: each side gets each core as often.
            # Last before the clock: threads started above keep the process's cores.
            core = a._main_cores[(state.global_step + a._run_index + a.lockstep_rank) % 2]
            os.sched_setaffinity(0, {core})  # 0: the calling thread alone
            if step["lockstep"] is not None:
                step["lockstep"]["core"] = core
        self.given_clock.start()
        step["t0"] = time.perf_counter()

    def _should_stop(self, state, wall: float) -> bool:
        """Whether the training ends after this step: another like it would pass the bench's
        deadline (``--turns``: this process's next step starts after the partner's, as long
        again), on either lockstep partner (both end after the same step)."""
        a = self.args
        if not a._deadline or state.global_step >= state.max_steps:
            return False
        late = self.past_deadline(wall * (2 if a.turns else 1))
        if a._lockstep is not None:
            late = a._lockstep.agree(
                f"end/{a._run_index}/{state.global_step}", late, timeout_s=self.lockstep_patience()
            )
        return late

    def step_end(self, state, control) -> None:
        """The clock's end of a step: its wall time printed as it goes, the deadline checked,
        and for a measured step every per-step list appended to."""
        import torch

        from tidal.memory import host_rss_bytes

        a, cuda, trainer, step = self.args, self.cuda, self.trainer, self._step
        if cuda:
            if a.turns:
                torch.cuda.synchronize()  # the partner's step is next on this GPU: none of this one's copies run into it
            else:
                torch.cuda.current_stream().synchronize()
        wall = time.perf_counter() - step["t0"]
        given = self.given_clock.stop()
        if a.turns and a._lockstep is not None:
            if step["lockstep"] is not None:
                step["lockstep"]["ended_at"] = time.time()
            a._lockstep.end_turn()
        if a._main_cores:
            os.sched_setaffinity(0, a._process_cores)  # back on all of them between steps
        if self.sampler is not None:
            self.sampler.stop()
        print(f"[bench_trl] {self.name} step {state.global_step}: {wall:.3f} s{self.since_launch()}", flush=True)
        late = self._should_stop(state, wall)
        self._last_wall = wall
        if late:
            control.should_training_stop = True
            self.stopped.update(after_steps=state.global_step, of_steps=state.max_steps)
            print(
                f"[bench_trl] {self.name}: ending after step {state.global_step} of {state.max_steps}: another "
                f"would end past the bench's deadline",
                flush=True,
            )
        profiled_step = bool(a.profile_step) and state.global_step == a.profile_step
        if state.global_step <= 1 or profiled_step:
            self.tokens.take()  # a step not measured: its tokens are not the next one's
        if profiled_step:
            self._analyse_profile(wall)
            return  # the profiled step's time is not a measurement
        if state.global_step <= 1:
            return
        self.times.append(wall)
        if step["lockstep"] is not None:
            self.lockstep_steps.append(step["lockstep"])
        self.rss_steps.append(host_rss_bytes())
        self.host_given.append(given)
        self.exposed.append(exposed_s(trainer) - step["exposed0"])  # settles the stalls read below
        self.host_stall.append(host_stall_s(trainer) - step["host_stall0"])
        self.phase_steps.append(self.phases.take())  # the compute stream has run the step's work
        if self.rank == 0:  # as it goes, as the step times: a run cut short keeps them too
            took = ", ".join(f"{k} {v:.2f}" for k, v in sorted(self.phase_steps[-1].items()))
            print(f"[bench_trl] {self.name} step {state.global_step} phases (device s): {took}", flush=True)
        self.token_steps.append(self.tokens.take())
        if step["tail"] is not None:
            begin, ends = step["tail"]
            tails = {}
            for direction, end in ends.items():
                end.synchronize()  # read now: the step is over, the copies long done
                tails[direction] = max(0.0, begin.elapsed_time(end) / 1e3)
            self.copy_tail.append(tails)
        seen = step["seen"]
        records = trainer.timeshare.records[seen:] if seen is not None else None
        self.by_kind.append(transitions_by_kind(records) if records is not None else {})
        self.moves.append(step_moves(records) if records is not None else [])
        self.peaks.append(torch.cuda.max_memory_allocated() if cuda else 1)
        if cuda:
            # cudaMalloc/cudaFree calls, and retries (a retry frees the cache after a
            # device-wide synchronisation) in the step: host time no tidal verb shows
            now = torch.cuda.memory_stats()
            row = {k: now.get(k, 0) - step["counters0"].get(k, 0) for k in ALLOCATOR_COUNTERS}
            row["reserved_bytes"] = torch.cuda.memory_reserved()
            self.allocator.append(row)

    def _analyse_profile(self, wall: float) -> None:
        """The profiled step's spans, summary and lanes (``step_trace``) into ``profiled``."""
        prof = self._step.get("prof")
        if prof is None:
            return
        try:
            import step_trace

            spans = step_trace.spans_from_events(prof.stop())
            self.profiled["summary"] = step_trace.analyse(spans)
            self.profiled["lanes"] = step_trace.compact(spans)
            self.profiled["wall_s"] = wall
        except Exception as e:
            self.profiled["error"] = f"profile not analysed: {e!r}"
        self._step["prof"] = None
