"""TRL's GRPOTrainer alone against TRL with tidal (TidalGRPOTrainer), side by side on one GPU.

    python benchmarks/bench_trl.py [--preset qwen2-1.5b] [--steps 4] [--variants trl,step,stream,stream+prefetch]
        [--results PATH] [--json PATH]

A Qwen2-shape model built from a config (random bf16 weights, saved to a local folder so
TRL can load the policy and build its reference from it, as it does from a hub id), a
character-level tokenizer, prompts and a reward in Python. Each variant runs in its own
process (so one's allocator cache cannot flatter the next): ``trl`` is ``GRPOTrainer``;
``ds-zero3-offload`` is ``GRPOTrainer`` with DeepSpeed ZeRO-3, optimizer state and parameters
offloaded to the CPU (``GRPOConfig(deepspeed=...)``: the anchor a TRL user reaches for to fit a
model, DeepSpeedCPUAdam JIT-built on first use: set ``TORCH_EXTENSIONS_DIR`` to keep the build);
``step`` / ``stream`` / ``role`` are ``TidalGRPOTrainer`` with that optimizer residency, and a
``+prefetch`` suffix (``stream+prefetch``) adds ``TidalConfig(prefetch=True)``, and
``+budget=<GiB>``, ``+headroom=<GiB>``, ``+evict=as_needed`` set the timeshare
(``stream+prefetch+budget=14``: room for the policy's weights and the reference together keeps
the policy resident while the reference scores); ``+peak=<GiB>`` bounds what prefetches bring
in; ``+unpaced`` queues copies to the host whole (``TransferConfig(paced_piece_bytes=0)``, the
A/B of tidal.transfer.pacing). Per step it also records the host's time between generated
tokens (``token_gap_s``: one long gap is a token that waited). ``--reward-model``: every variant also scores
with a reward model of the policy's shape (TRL alone keeps it on the device; tidal makes it a
role).
Measured after the first step (warm-up): peak allocated device memory
(``torch.cuda.max_memory_allocated``), median step wall time (device-synchronised, from
``on_step_begin`` to ``on_step_end``), and for tidal the transitions' share of the step time.
Anchor: TRL alone (the ratio columns); targets: peak <= 0.6x at step time <= 1.05x.

Paired comparisons (``--paired N``): TRL alone and the tidal variants in rounds, a process each
or all in one process (``--in-process``), each variant's median step ratio against its round's
TRL run with a distribution-free 95% interval. ``--lockstep HOST:PORT --lockstep-rank 0|1``: two
such processes, one a GPU, start every step together, one running TRL alone while the other
runs tidal (``lockstep.py``); with ``--turns`` the two share one GPU and take turns step by step
instead. ``pool_paired.py --lockstep`` pairs their steps. Per measured step
the JSON also holds what the host gave it (``host_given_steps``, ``host_clock.py``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from tidal.plan.shapes import PRESETS as SHAPES, ModelShape  # noqa: E402  (stdlib only)

import host_clock  # noqa: E402  (benchmarks/, beside this file)
import lockstep  # noqa: E402


def _char_task():
    """tidal_recipes/grpo/char_task.py loaded on its own: the package's __init__ imports tidal,
    and a 'before:' variant must import the earlier tidal first."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "_char_task", os.path.join(ROOT, "tidal_recipes", "grpo", "char_task.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The model shapes: the planner's one list (tidal.plan.shapes), Qwen2's family, and two of
# this benchmark's own for dry runs (a CPU included; a vocabulary of the char task's size).
_QWEN2 = dict(tied_embeddings=False, qkv_bias=True, family="qwen2")
_DRY_RUNS = {
    "tiny": ModelShape(
        name="tiny", layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=16, vocab=256, **_QWEN2
    ),
    # the tensors of a 28-layer model (Qwen2-1.5B's count) at tiny sizes: host-side costs on a CPU
    "tiny28": ModelShape(
        name="tiny28", layers=28, hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=16, vocab=256, **_QWEN2
    ),
}
PRESETS: dict[str, ModelShape] = {**_DRY_RUNS, **{k: v for k, v in SHAPES.items() if v.family == "qwen2"}}
# TRL's accelerate configs, by --launch (the variants run under `accelerate launch` with it)
# TRL's accelerate configs; zero3-offload: its zero3.yaml with parameters and optimizer state on
# the CPU (DeepSpeedCPUAdam), the anchor a TRL user reaches for when the model does not fit.
LAUNCH_CONFIGS = {"ddp": "multi_gpu.yaml", "fsdp2": "fsdp2.yaml", "zero3-offload": "zero3.yaml"}
CHARS = list("0123456789+= abcdefghijklmnopqrstuvwxyz")


def qwen2_config(preset: str, *, pad_id: int, eos_id: int):
    """The Qwen2 shape of ``preset`` (random weights are built from it), bf16."""
    from transformers import Qwen2Config

    shape = PRESETS[preset]
    # The real vocabulary size: the embedding and head are a large part of a small model's bytes.
    # Untied, as every row in RESULTS.md ran (Qwen2-0.5B and 1.5B tie theirs).
    return Qwen2Config(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
        bos_token_id=eos_id,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )


def save_model(preset: str, path: str, reward_path: str | None = None) -> None:
    """The policy (a causal LM) at ``path``; with ``reward_path``, a reward model of the same
    shape (a sequence classifier with one label) there too."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    done = os.path.join(path, "bench_trl_saved")
    if reward_path is None and os.path.exists(done):
        return  # saved whole by an earlier run (--model-cache)
    task = _char_task()
    task.char_tokenizer(CHARS).save_pretrained(path)
    cfg = qwen2_config(preset, pad_id=task.PAD_ID, eos_id=task.EOS_ID)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(path)
    del model
    if reward_path is not None:
        task.char_tokenizer(CHARS).save_pretrained(reward_path)
        cfg.num_labels = 1
        torch.manual_seed(1)
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            reward = AutoModelForSequenceClassification.from_config(cfg, dtype=torch.bfloat16)
        reward.save_pretrained(reward_path)
        del reward
    torch.cuda.empty_cache()  # this process only orchestrates: the variants run in their own
    with open(done, "w") as f:
        f.write(preset)  # written last: a save cut short is not taken for a whole one


class _RawProfile:
    """torch's profiler without its event tree: ``stop()`` returns kineto's raw events (the
    tree ``torch.profiler.profile`` builds from a step's hundreds of thousands of events takes
    longer than the step)."""

    def __init__(self, cuda: bool) -> None:
        from torch.autograd import ProfilerActivity, ProfilerConfig, ProfilerState
        from torch._C._profiler import _ExperimentalConfig

        self.activities = {ProfilerActivity.CPU} | ({ProfilerActivity.CUDA} if cuda else set())
        self.config = ProfilerConfig(ProfilerState.KINETO, False, False, False, False, False, _ExperimentalConfig())

    def start(self) -> None:
        from torch.autograd import _enable_profiler, _prepare_profiler

        _prepare_profiler(self.config, self.activities)
        _enable_profiler(self.config, self.activities)

    def stop(self):
        from torch.autograd import _disable_profiler

        return _disable_profiler().events()


def _deepspeed_config() -> dict:
    """DeepSpeed ZeRO-3 with optimizer state and parameters offloaded to the CPU
    (``DeepSpeedCPUAdam``, pinned host memory): what a TRL user sets to fit a model that does
    not fit the GPU, through TRL's own ``GRPOConfig(deepspeed=...)``. One process: the
    distributed environment of a world of one is set here (DeepSpeed initialises it)."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)
    return {
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "offload_param": {"device": "cpu", "pin_memory": True},
            "overlap_comm": True,
            "contiguous_gradients": True,
            "stage3_gather_16bit_weights_on_model_save": False,
        },
        "bf16": {"enabled": "auto"},
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
    }


def _annotate(obj, attr: str, label: str) -> None:
    """Wrap ``obj.attr`` (a method) in a profiler range named ``label`` (profiling only)."""
    import functools

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


def _annotate_for_profile(trainer) -> None:
    """Ranges around the trainer's phases and tidal's verbs and host waits (see step_trace)."""
    import torch

    from tidal.device import SyncPolicy, use_sync_policy

    ref = getattr(trainer, "ref_model", None)
    inner = trainer._get_per_token_logps_and_entropies

    def logps(model, *a, **kw):
        label = "phase:reference" if ref is not None and model is ref else "phase:score"
        with torch.profiler.record_function(label):
            return inner(model, *a, **kw)

    trainer._get_per_token_logps_and_entropies = logps
    _annotate(trainer, "_generate", "phase:generate")
    _annotate(trainer, "_calculate_rewards", "phase:reward")
    _annotate(trainer, "compute_loss", "phase:loss_forward")
    _annotate(trainer.accelerator, "backward", "phase:backward")
    _annotate(trainer, "_clip_grad_norm", "phase:clip")
    ts = getattr(trainer, "timeshare", None)
    if ts is not None:
        for attr in ("load", "prefetch", "offload", "offload_optimizer_state", "reload_optimizer_state"):
            _annotate(ts, attr, f"tidal:{attr}")
        for attr in ("switch", "prefetch", "write_back", "cancel_prefetch", "_settle_write_backs", "recover"):
            _annotate(ts.store, attr, f"tidal:store.{attr}")
        backend = getattr(ts.store, "backend", None)
        while backend is not None:
            _annotate(backend, "settle", f"tidal:settle ({type(backend).__name__})")
            backend = getattr(backend, "fallback", None)

    class Named(SyncPolicy):
        def wait_host(self, name, event):
            with torch.profiler.record_function(f"wait:{name}"):
                super().wait_host(name, event)

    trainer._bench_sync_policy = use_sync_policy(Named())


_ALLOCATOR_COUNTERS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")


def lockstep_patience(timeout_s: float, deadline: float, now: float, last_step_s: float, *, turns: bool) -> float:
    """How long a lockstep process waits for its partner: ``timeout_s``, less where the
    ``deadline`` (0: none) leaves room for only one more step like the last (and its results)
    after it. With ``turns`` a wait lasts the partner's step, or two (a process's turns come two
    partner steps apart where it goes first in a pair after going second in the one before), and
    a pair of steps begins only where it would end 20 s before the deadline (``_past_deadline``
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


def logged_per_step(history: list[dict], prefix: str) -> list[dict[str, float]]:
    """Of each measured step's log line (from step 2; the lines with a loss), the figures
    logged in GiB under ``prefix`` + ``<phase>``, in bytes by phase; steps without any left out."""
    out = [
        {k[len(prefix) :]: float(v) * 2**30 for k, v in h.items() if k.startswith(prefix)}
        for h in history
        if h.get("step", 0) >= 2 and "loss" in h
    ]
    return [x for x in out if x]


def run_variant(variant: str, model_path: str, steps: int, out_json: str, args) -> None:
    """One training run in this process; writes its measurements to ``out_json``.
    ``+expandable`` on a variant: the caching allocator's expandable segments (the parent
    sets PYTORCH_CUDA_ALLOC_CONF for this process); the rest of the name says the run."""
    name, variant = variant, variant.replace("+expandable", "")
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from tidal import TimeshareConfig
    from tidal.integrations.trl import TidalConfig, TidalGRPOTrainer

    times: list[float] = []
    lockstep_steps: list[dict] = []  # --lockstep: per measured step, its rendezvous with the partner
    peaks: list[int] = []
    allocator: list[dict] = []  # per measured step: the caching allocator's counters, and reserved bytes
    exposed: list[float] = []
    profiled: dict = {}

    cuda = torch.cuda.is_available()
    profile_step = args.profile_step
    rank = int(os.environ.get("RANK", "0"))
    if cuda:
        # This rank's GPU before the first CUDA call below (the host probe's tensor): made on
        # the default device, each rank's CUDA context and tensor sat on GPU 0 (3 x 614 MiB
        # beside rank 0 on 4 H100s, 2026-11-28). accelerate sets the same device later.
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if args.nproc > 1:
        out_json = f"{out_json}.rank{rank}"  # the parent merges the ranks' files
    from tidal.memory import host_rss_bytes

    rss_steps: list[int] = []  # this process's resident set at each measured step's end
    host_given: list[dict] = []  # per measured step: what the host gave it (host_clock.py)
    given_clock = host_clock.HostClock()  # closed with the run (it watches the garbage collector)

    def exposed_s(trainer) -> float:
        ts = getattr(trainer, "timeshare", None)
        if ts is None:
            return 0.0
        if hasattr(ts, "settle_stalls"):
            ts.settle_stalls(wait=True)  # the device is synchronised: every wait has run
        # Code from before records kept their host time had only blocking moves: their copy
        # and release time is what the host spent in them.
        return sum(
            getattr(r, "exposed_seconds", None) or (0.0 if r.queued else r.seconds + r.release_seconds)
            for r in ts.records
        )

    def host_stall_s(trainer) -> float:
        """The host's time in the verbs plus the compute stream's waits: what exposed_s was
        before the device gap was measured, an upper bound (the device may still run queued
        work while the host is in a verb)."""
        ts = getattr(trainer, "timeshare", None)
        if ts is None:
            return 0.0
        return sum(getattr(r, "host_seconds", 0.0) + getattr(r, "stall_seconds", 0.0) for r in ts.records)

    from phase_clock import HostProbe, PhaseClock, TokenGaps

    phases = PhaseClock(cuda)
    phase_steps: list[dict] = []
    tokens = TokenGaps(cuda, HostProbe("cuda" if cuda else "cpu"))
    token_steps: list[dict | None] = []  # per measured step: the gaps between generated tokens
    sampler = None
    if args.sample_stacks:
        from host_samples import StackSampler

        sampler = StackSampler(interval_s=0.002)
    host_stall: list[float] = []
    copy_tail: list[dict] = []  # per measured step: seconds tidal's copies ran on into it, by direction

    by_kind: list[dict] = []

    def per_kind(trainer) -> dict:
        """The measured step's transitions by kind: how many, bytes, the host's time in them
        (``alloc_s``: the part spent allocating device memory; ``queue_s``: inside the call that
        queues a prefetch's or write-back's copies) and the compute stream's waits."""
        out: dict = {}
        for r in trainer.timeshare.records[clock.seen :]:
            k = out.setdefault(
                r.kind,
                {"count": 0, "gb": 0.0, "host_s": 0.0, "alloc_s": 0.0, "queue_s": 0.0, "stall_s": 0.0, "gap_s": 0.0},
            )
            k["count"] += 1
            k["gb"] += (r.bytes_out + r.bytes_in) / 1e9
            k["host_s"] += getattr(r, "host_seconds", 0.0) or r.seconds
            k["alloc_s"] += getattr(r.move, "alloc_seconds", 0.0) or 0.0
            k["queue_s"] += getattr(r.move, "queue_seconds", 0.0) or 0.0  # inside the call queueing the copies
            k["stall_s"] += getattr(r, "stall_seconds", 0.0) or 0.0
            k["gap_s"] += getattr(r, "gap_seconds", None) or 0.0  # the compute stream's time in the verb
        return out

    moves: list[list] = []  # per measured step: its transitions in order (step_moves)

    workload: dict = {}  # what the step's floor is computed from (see _floor)
    stopped: dict = {}  # where --deadline-s ended the training early

    def since_launch() -> str:
        return f" (+{time.time() - args._launched:.1f} s after the launch)" if args._launched else ""

    def _past_deadline(step_s: float) -> bool:
        """Whether another step like this one (+15%), and 20 s to write the results, would end
        past the deadline, on any rank: the ranks decide alike, or one would wait in a
        collective for the others forever."""
        late = time.time() + 1.15 * step_s + 20.0 > args._deadline
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([float(late)], device="cuda" if dist.get_backend() == "nccl" else "cpu")
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            late = bool(flag.item())
        return late

    last_wall = [0.0]  # the last step's wall time in this run

    def _lockstep_patience() -> float:
        return lockstep_patience(args._lockstep.timeout_s, args._deadline, time.time(), last_wall[0], turns=args.turns)

    class BesideTheGradients(TrainerCallback):
        # Right before the optimizer step (the gradients clipped): the policy's weights and
        # gradients on the device, and the optimizer state's bytes (all of it, wherever it is).
        def on_pre_optimizer_step(self, a, state, control, **kw):
            if not cuda:
                return
            policy = trainer.accelerator.unwrap_model(trainer.model)
            # A sharded (DTensor) parameter, gradient or state: this rank's shard.
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
            workload.update(
                weights_bytes=weights,
                grads_bytes=grads,
                optimizer_state_bytes=state_bytes,
                device_total_bytes=torch.cuda.mem_get_info()[1],
            )

    class Clock(TrainerCallback):
        # state.global_step counts the steps done: the step starting now is global_step + 1.
        # Step boundaries wait for the compute stream (all of TRL's work), not for the device:
        # copies tidal queued without a host wait (an optimizer state's trip back to the host)
        # run on into the next step behind its generation, as they do in a run without this
        # clock; a device-wide synchronisation here would add their tail to every step.
        def on_step_begin(self, a, state, control, **kw):
            if cuda:
                torch.cuda.current_stream().synchronize()
                if state.global_step == 1:  # after the warm-up step
                    torch.cuda.reset_peak_memory_stats()
            self.lockstep = None
            if args._lockstep is not None:
                # --lockstep: this step starts with the partner process's (lockstep.py beside
                # this file), or with --turns once the partner's step before it has ended,
                # before the clock does: the wait is no part of the step.
                key = f"{args._run_index}/{state.global_step + 1}"
                if args.turns:
                    met, waited, order = args._lockstep.turn(args._turn_n, timeout_s=_lockstep_patience())
                    args._turn_n += 1
                    self.lockstep = {"key": key, "met": met, "wait_s": waited, "order": order}
                else:
                    met, waited = args._lockstep.barrier(key, timeout_s=_lockstep_patience())
                    self.lockstep = {"key": key, "met": met, "wait_s": waited}
                self.lockstep["started_at"] = time.time()
            self.prof = None
            if profile_step and state.global_step + 1 == profile_step:
                _annotate(trainer.optimizer, "step", "phase:optimizer")
                _annotate(trainer.optimizer, "zero_grad", "phase:zero_grad")
                try:
                    prof = _RawProfile(cuda)
                    prof.start()
                    self.prof = prof
                except Exception as e:  # a profiler this torch lacks costs the picture, not the run
                    profiled["error"] = f"profiler did not start: {e!r}"
            phases.wrap_optimizer(trainer)  # the trainer makes its optimizer in train()
            phases.take()  # a step's phases only
            self.exposed0 = exposed_s(trainer)
            self.host_stall0 = host_stall_s(trainer)
            self.counters0 = torch.cuda.memory_stats() if cuda else {}
            ts = getattr(trainer, "timeshare", None)
            self.seen = len(ts.records) if ts is not None else None
            if sampler is not None and state.global_step >= 1 and self.prof is None:
                sampler.start()  # the measured steps only
            self.tail = None
            if cuda and ts is not None:
                # Copies tidal queued before the step and still running when it starts (a
                # write-back of the last step's optimizer state): an event behind them on each
                # copy stream, timed against one on the compute stream now.
                begin = torch.cuda.Event(enable_timing=True)
                begin.record()
                ends = {}
                for name in ("d2h_stream", "h2d_stream"):
                    end = torch.cuda.Event(enable_timing=True)
                    end.record(getattr(ts.store.engine, name))
                    ends[name[:3]] = end
                self.tail = (begin, ends)
            if args._main_cores:
                # --main-cores: the main thread (the host-bound decode's) on one of two cores, the
                # partner's on the other, swapped every step: each side gets each core as often.
                # Last before the clock: threads started above keep the process's cores.
                core = args._main_cores[(state.global_step + args._run_index + args.lockstep_rank) % 2]
                os.sched_setaffinity(0, {core})  # 0: the calling thread alone
                if self.lockstep is not None:
                    self.lockstep["core"] = core
            given_clock.start()
            self.t0 = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            if cuda:
                if args.turns:
                    # --turns: the partner's step is next on this GPU: none of this step's
                    # copies may run on into it, so the step holds their tail too.
                    torch.cuda.synchronize()
                else:
                    torch.cuda.current_stream().synchronize()
            wall = time.perf_counter() - self.t0
            given = given_clock.stop()
            if args.turns and args._lockstep is not None:
                if self.lockstep is not None:
                    self.lockstep["ended_at"] = time.time()
                args._lockstep.end_turn()
            if args._main_cores:
                os.sched_setaffinity(0, args._process_cores)  # back on all of them between steps
            if sampler is not None:
                sampler.stop()
            # As it goes: a run cut by its time limit still shows each step it finished.
            print(f"[bench_trl] {name} step {state.global_step}: {wall:.3f} s{since_launch()}", flush=True)
            # --turns: this process's next step starts after the partner's, as long again.
            late = (
                bool(args._deadline)
                and state.global_step < state.max_steps
                and _past_deadline(wall * (2 if args.turns else 1))
            )
            if args._lockstep is not None and args._deadline and state.global_step < state.max_steps:
                # Both processes end their runs after the same step (the partner would wait for
                # a step that never starts): late if either's next step would pass the deadline.
                late = args._lockstep.agree(
                    f"end/{args._run_index}/{state.global_step}", late, timeout_s=_lockstep_patience()
                )
            last_wall[0] = wall
            if late:
                control.should_training_stop = True
                stopped.update(after_steps=state.global_step, of_steps=state.max_steps)
                print(
                    f"[bench_trl] {name}: ending after step {state.global_step} of {state.max_steps}: another "
                    f"would end past the bench's deadline",
                    flush=True,
                )
            if state.global_step <= 1 or (profile_step and state.global_step == profile_step):
                tokens.take()  # a step not measured: its tokens are not the next one's
            if profile_step and state.global_step == profile_step:
                if self.prof is not None:
                    try:
                        import step_trace

                        spans = step_trace.spans_from_events(self.prof.stop())
                        profiled["summary"] = step_trace.analyse(spans)
                        profiled["lanes"] = step_trace.compact(spans)
                        profiled["wall_s"] = wall
                    except Exception as e:
                        profiled["error"] = f"profile not analysed: {e!r}"
                    self.prof = None
                return  # the profiled step's time is not a measurement
            if state.global_step > 1:
                times.append(wall)
                if self.lockstep is not None:
                    lockstep_steps.append(self.lockstep)
                rss_steps.append(host_rss_bytes())
                host_given.append(given)
                exposed.append(exposed_s(trainer) - self.exposed0)  # settles the stalls per_kind reads
                host_stall.append(host_stall_s(trainer) - self.host_stall0)
                phase_steps.append(phases.take())  # the compute stream has run the step's work
                if rank == 0:  # as it goes, as the step times: a run cut short keeps them too
                    took = ", ".join(f"{k} {v:.2f}" for k, v in sorted(phase_steps[-1].items()))
                    print(f"[bench_trl] {name} step {state.global_step} phases (device s): {took}", flush=True)
                token_steps.append(tokens.take())
                if self.tail is not None:
                    begin, ends = self.tail
                    tails = {}
                    for direction, end in ends.items():
                        end.synchronize()  # read now: the step is over, the copies long done
                        tails[direction] = max(0.0, begin.elapsed_time(end) / 1e3)
                    copy_tail.append(tails)
                by_kind.append(per_kind(trainer) if self.seen is not None else {})
                moves.append(step_moves(trainer.timeshare.records[clock.seen :]) if self.seen is not None else [])
                peaks.append(torch.cuda.max_memory_allocated() if cuda else 1)
                if cuda:
                    # cudaMalloc/cudaFree calls, and retries (a retry frees the cache after a
                    # device-wide synchronisation) in the step: host time no tidal verb shows
                    now = torch.cuda.memory_stats()
                    row = {k: now.get(k, 0) - self.counters0.get(k, 0) for k in _ALLOCATOR_COUNTERS}
                    row["reserved_bytes"] = torch.cuda.memory_reserved()
                    allocator.append(row)

    cfg = GRPOConfig(
        output_dir=tempfile.mkdtemp(),
        beta=0.04,
        learning_rate=1e-6,
        max_steps=steps,
        num_generations=args.num_generations,
        # --micro-batch m: the step's completions in batch / m micro-batches of m, their
        # gradients accumulated (one generation, one optimizer step a step, as without it).
        per_device_train_batch_size=args.micro_batch or args.batch,
        gradient_accumulation_steps=args.batch // (args.micro_batch or args.batch),
        max_completion_length=args.completion,
        logging_steps=1,
        report_to=[],
        # FSDP2 through accelerate with mixed precision keeps fp32 masters of bf16 weights: the
        # sharded runs train the weights in their own dtype, as one GPU does without autocast.
        bf16=cuda and args.launch != "fsdp2",
        use_cpu=not cuda,
        save_strategy="no",
        seed=0,
        # Several processes: each loads the models whole onto its GPU (TRL's device_map="auto"
        # under FSDP spreads them over every GPU the process sees; tidal sets None itself).
        model_init_kwargs={"dtype": args.dtype, **({"device_map": None} if args.nproc > 1 else {})},
        deepspeed=_deepspeed_config() if variant == "ds-zero3-offload" else None,
    )
    data = Dataset.from_dict({"prompt": [f"{i}+{i}=" for i in range(256)]})
    reward_sevens = _char_task().reward_sevens
    rewards = [reward_sevens, args.reward_model_path] if args.reward_model_path else reward_sevens
    clock = Clock()
    # The process's resident set before any trainer exists (imports done, no model loaded):
    # what the host holds beyond it is the models' loading and what tidal keeps.
    baseline_rss = host_rss_bytes()
    callbacks = [clock, BesideTheGradients()]
    common = dict(model=model_path, reward_funcs=rewards, args=cfg, train_dataset=data, callbacks=callbacks)
    if variant == "trl":
        trainer = GRPOTrainer(**common)
    elif variant == "ds-zero3-offload":
        trainer = GRPOTrainer(**common)
    else:
        residency, *extras = variant.split(":", 1)[-1].split("+")
        # key=value suffixes: budget / headroom in GiB and evict set the timeshare, peak (GiB)
        # bounds what prefetches bring in
        settings = dict(e.split("=", 1) for e in extras if "=" in e)
        if any(e not in ("prefetch", "unpaced") and "=" not in e for e in extras) or set(settings) - {
            "budget",
            "headroom",
            "evict",
            "peak",
        }:
            raise ValueError(
                f"unknown variant {variant!r}: [before:]<residency>, optionally with '+prefetch', '+budget=<GiB>', "
                f"'+headroom=<GiB>', '+evict=as_needed', '+peak=<GiB>' and '+unpaced' (copies to the host "
                f"queued whole: TransferConfig(paced_piece_bytes=0))"
            )
        kw = {}
        if settings.keys() & {"budget", "headroom", "evict"} or "unpaced" in extras:
            ts_kw = dict(
                budget_bytes=int(float(settings["budget"]) * 2**30) if "budget" in settings else None,
                headroom_bytes=int(float(settings.get("headroom", 0)) * 2**30),
                evict=settings.get("evict", "others"),
            )
            if not variant.startswith("before:"):  # the trainer's own defaults, with these changed
                ts_kw.update(release_to_driver=False, wait_for_copies=False)
            if "unpaced" in extras:
                from tidal.transfer import TransferConfig

                ts_kw["transfer"] = TransferConfig(paced_piece_bytes=0)
            kw["timeshare"] = TimeshareConfig(**ts_kw)
        if "peak" in settings:
            kw["prefetch_peak_bytes"] = int(float(settings["peak"]) * 2**30)
        tidal_cfg = TidalConfig(optimizer_residency=residency, prefetch="prefetch" in extras, **kw)
        trainer = TidalGRPOTrainer(**common, tidal=tidal_cfg)
    print(f"[bench_trl] {name} rank {rank}: trainer ready{since_launch()}", flush=True)
    if profile_step:
        _annotate_for_profile(trainer)
    phases.wrap_trainer(trainer)
    tokens.wrap_trainer(trainer)
    t0 = time.perf_counter()
    error = None
    try:
        if profile_step:
            with trainer._bench_sync_policy:
                trainer.train()
        else:
            trainer.train()
    except torch.OutOfMemoryError as e:
        error = f"out of memory: {str(e).splitlines()[0]}"
        oom_at = _where_out_of_memory(trainer, e)
    finally:
        given_clock.close()
    if args.turns and args._lockstep is not None:
        # --turns: a step that ended in an error gives the partner its turn; what follows
        # (tidal's close() brings its roles back, the next run loads its models) waits for the
        # partner's last step, which shares this GPU.
        args._lockstep.end_turn()
        args._lockstep.barrier(f"run-end/{args._run_index}", timeout_s=_lockstep_patience())
    import tidal

    oom = error is not None
    if not error and not times:
        error = "no measured step: the deadline came before the second step ended"
    res = {"variant": name, "error": error, "wall_s": time.perf_counter() - t0, "tidal": tidal.__file__}
    if stopped:
        res["stopped_by_deadline"] = stopped
    if oom:
        res["oom_at"] = oom_at
    res.update(rank=rank, launch=str(trainer.accelerator.distributed_type), nproc=trainer.accelerator.num_processes)
    res["host_baseline_rss_bytes"] = baseline_rss
    if rss_steps:
        res["host_rss_bytes_steps"] = rss_steps
    if host_given:
        res["host_given_steps"] = host_given
    ts = getattr(trainer, "timeshare", None)
    if ts is not None:
        res["host_held_bytes"] = sum(ts.store.context.host_bytes().values())
        res["host_pinned_bytes"] = ts.store.context.pinned_bytes()
    if not error:
        # tidal's trainer restarts the device's peak counter at each phase (its per-phase peaks,
        # logged as tidal/peak_gib/<phase>): the step's peak is the highest of those too.
        phase_peaks = logged_per_step(trainer.state.log_history, "tidal/peak_gib/")
        if phase_peaks:
            res["phase_peak_bytes_steps"] = phase_peaks
            peaks.append(int(max(max(p.values()) for p in phase_peaks)))
        # The allocator's fragments each phase reached (the last time it ran, as of the step's
        # log line): what the schedule's prefetches and keeps leave free for them.
        fragments = logged_per_step(trainer.state.log_history, "tidal/fragments_gib/")
        if fragments:
            res["fragments_bytes_steps"] = fragments
        res.update(step_s=statistics.median(times), peak_bytes=max(peaks), steps_measured=len(times))
        # Interference from outside the run (the host, the machine) only ever slows a step: the
        # fastest step is the least disturbed reading of the step's own cost.
        res["step_min_s"] = min(times)
        res["completions_per_s"] = args.batch * max(1, args.nproc) / res["step_s"]
        res["loss"] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        res["exposed_s_per_step"] = statistics.median(exposed) if exposed else 0.0
        res["workload"] = workload
        res["step_times_s"] = times
        if lockstep_steps:
            res["lockstep_steps"] = lockstep_steps
        res["exposed_s_steps"] = exposed
        res["host_stall_s_per_step"] = statistics.median(host_stall) if host_stall else 0.0
        # Each phase's device seconds per measured step (benchmarks/phase_clock.py), and medians.
        res["phase_s_steps"] = phase_steps
        names = sorted({k for p in phase_steps for k in p})
        res["phase_s"] = {k: statistics.median(p.get(k, 0.0) for p in phase_steps) for k in names}
        if any(token_steps):
            res["token_gap_s_steps"] = token_steps
            got = [t for t in token_steps if t]
            res["token_gap_s"] = {k: statistics.median(t[k] for t in got if k in t) for k in got[0] if k != "count"}
        if copy_tail:
            res["copy_tail_s_steps"] = copy_tail
            res["copy_tail_s"] = {d: statistics.median(t[d] for t in copy_tail) for d in copy_tail[0]}
        if sampler is not None:
            res["host_samples"] = {
                "interval_s": sampler.interval_s,
                "steps": len(times),
                "by_verb": sampler.by_verb(),
                "top": sampler.top(15),
            }
        res["transitions_by_kind"] = by_kind
        res["transitions_steps"] = moves
        res["allocator_steps"] = allocator
        # TRL alone moves nothing; DeepSpeed's offload moves bytes this bench does not count (null).
        offloading = variant == "ds-zero3-offload" or (args.nproc > 1 and args.launch == "zero3-offload")
        res["moved_gb_per_step"] = None if offloading else 0.0
        if getattr(trainer, "timeshare", None) is not None:  # tidal's trainers
            recs = trainer.timeshare.records
            done = trainer.state.global_step
            res["transition_s_per_step"] = sum(r.seconds + r.release_seconds for r in recs) / max(done, 1)
            res["moved_gb_per_step"] = sum(r.bytes_out + r.bytes_in for r in recs) / 1e9 / max(done, 1)
            res["transition_gbps"] = (
                sum(r.bytes_out + r.bytes_in for r in recs) / max(sum(r.seconds for r in recs), 1e-9) / 1e9
            )
    if profiled:
        res["profile"] = profiled
    with open(out_json, "w") as f:
        json.dump(res, f)
    if args.nproc > 1:
        # After an error the other ranks wait for this one in a collective: ending it lets the
        # launcher end them (at once, where they would wait out NCCL's timeout). Without one,
        # nothing follows in this process: bringing a 32B policy's roles back only to free them
        # would spend the call's time after the results are written.
        sys.stdout.flush()
        os._exit(1 if error else 0)
    # This run's trainer goes, with its device memory and tidal's pinned host memory (close()
    # brings the roles back, then frees the host copies): with --in-process the next run
    # follows in this process.
    if ts is not None:
        ts.close()
    trainer = ts = None  # (the callbacks' closures read it too)
    import gc

    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


def _where_out_of_memory(trainer, error: BaseException) -> dict:
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


def _line_rate() -> dict | None:
    """The PCIe line rate of this machine, measured here (``tidal bench``'s measurement): the
    bound a step that must move its bytes cannot beat, bytes moved / both directions' rate."""
    import torch

    if not torch.cuda.is_available():
        return None
    from tidal.device import DeviceOps
    from tidal_recipes.cli.bench import measure_line_rate

    return measure_line_rate(DeviceOps(torch.device("cuda")), 1 << 30)


def _bound(r: dict, base: dict | None, line: dict | None) -> float | None:
    """max(TRL alone's step, bytes moved per step / the bidirectional line rate)."""
    if base is None:
        return None
    copy_s = (r.get("moved_gb_per_step") or 0.0) / line["bidir_gbps"] if line else 0.0
    return max(base["step_s"], copy_s)


def _floor(r: dict, line: dict | None) -> dict | None:
    """The step's floor: the phases' compute (their device seconds less the compute stream's
    waits on tidal's copies) plus the optimizer state that cannot be on the device beside the
    weights and gradients while the backward runs (it must cross between the clipped backward
    and the step: no schedule overlaps it with compute), at the host-to-device line rate
    measured in this run. The room counted is all the device's memory less the weights and
    gradients: an upper bound, so the floor is a lower one. None without the phases, the
    workload's sizes or a line rate."""
    w, phases = r.get("workload") or {}, r.get("phase_s")
    if not phases or not w or not line:
        return None
    compute = max(0.0, sum(phases.values()) - (r.get("exposed_s_per_step") or 0.0))
    room = w["device_total_bytes"] - w["weights_bytes"] - w["grads_bytes"]
    beyond = max(0, w["optimizer_state_bytes"] - room)
    return {"floor_s": compute + beyond / (line["h2d_gbps"] * 1e9), "compute_s": compute, "beyond_room_bytes": beyond}


def _x(ratio: float | None) -> str:
    return f"{ratio:.2f}" if ratio is not None else "-"


def median_ci95(values: list[float]) -> tuple[float, float] | None:
    """A distribution-free 95% interval for the median of ``values`` (independent draws): the
    order statistics ``x(k)`` and ``x(n+1-k)`` for the largest ``k`` whose two tails of the
    binomial(n, 1/2) hold at most 2.5% each. None below 6 values (no such ``k``)."""
    import math

    x, n = sorted(values), len(values)
    k = 0
    while k < n // 2 and sum(math.comb(n, i) for i in range(k + 1)) / 2**n <= 0.025:
        k += 1
    return (x[k - 1], x[n - k]) if k >= 1 else None


def _paired(results: list) -> dict:
    """Per tidal variant run in rounds with TRL alone (``--paired``): each of its runs against
    the TRL run of its round, the ratio of their median steps (and of their generation phases):
    the median ratio, its 95% interval (:func:`median_ci95`) and n. The TRL run of a run's round
    is the nearest before it with no run of the same variant between them, else the nearest
    after it so (rounds run trl A B, then B A trl)."""
    out: dict = {}
    for i, r in enumerate(results):
        if r["variant"] == "trl" or r.get("error"):
            continue
        j = next((k for k in range(i - 1, -1, -1) if results[k]["variant"] == "trl"), None)
        if j is None or any(x["variant"] == r["variant"] for x in results[j + 1 : i]):
            j = next((k for k in range(i + 1, len(results)) if results[k]["variant"] == "trl"), None)
            if j is None or any(x["variant"] == r["variant"] for x in results[i + 1 : j]):
                continue
        base = results[j]
        if base.get("error"):
            continue
        row = out.setdefault(
            r["variant"], {"step": [], "generate": [], "tokens": {}, "generate_per_probe": [], "peak": []}
        )
        row["step"].append(r["step_s"] / base["step_s"])
        if r.get("peak_bytes") and base.get("peak_bytes"):
            row["peak"].append(r["peak_bytes"] / base["peak_bytes"])
        gen, gen0 = r.get("phase_s", {}).get("generate"), base.get("phase_s", {}).get("generate")
        if gen and gen0:
            row["generate"].append(gen / gen0)
        # The token's time split (TokenGaps): which part of it differs from TRL alone's.
        tok, tok0 = r.get("token_gap_s") or {}, base.get("token_gap_s") or {}
        for k in ("median", "launch", "device", "device_forward"):
            if tok.get(k) and tok0.get(k):
                row["tokens"].setdefault(k, []).append(tok[k] / tok0[k])
        if gen and gen0 and tok.get("probe") and tok0.get("probe"):
            # Generation per unit of the host's speed (HostProbe) beside it: a host-bound
            # decode's ratio with the host's drift between the two runs taken out.
            row["generate_per_probe"].append((gen / tok["probe"]) / (gen0 / tok0["probe"]))
    return {
        name: {
            "ratio_median": statistics.median(row["step"]),
            "ratio_ci95": median_ci95(row["step"]),
            "n": len(row["step"]),
            "ratios": row["step"],
            "peak_ratios": row["peak"],
            "generate_ratios": row["generate"],
            "generate_ratio_median": statistics.median(row["generate"]) if row["generate"] else None,
            "generate_ratio_ci95": median_ci95(row["generate"]) if row["generate"] else None,
            "token_ratio_medians": {k: statistics.median(v) for k, v in row["tokens"].items()},
            "token_ratios": row["tokens"],
            "generate_per_probe_ratio_median": (
                statistics.median(row["generate_per_probe"]) if row["generate_per_probe"] else None
            ),
            "generate_per_probe_ratio_ci95": median_ci95(row["generate_per_probe"])
            if row["generate_per_probe"]
            else None,
            "generate_per_probe_ratios": row["generate_per_probe"],
        }
        for name, row in out.items()
    }


def _pooled(results: list) -> dict:
    """Per variant run in more than one process: the median of every measured step of all its
    processes, and how many processes and steps that is. Empty where no variant repeats."""
    by: dict[str, list] = {}
    for r in results:
        if not r.get("error") and r.get("step_times_s"):
            by.setdefault(r["variant"], []).append(r["step_times_s"])
    return {
        name: {
            "median_s": statistics.median(t for steps in runs for t in steps),
            "processes": len(runs),
            "steps": sum(len(steps) for steps in runs),
        }
        for name, runs in by.items()
        if len(runs) > 1
    }


def _report_so_far(args, results: list, reward_path, *, final: bool = False) -> None:
    """Print (``final``: the table, profiles and rows) and write the JSON and picture of the
    variants measured so far."""
    import torch
    import transformers
    import trl

    base = next((r for r in results if r["variant"] == "trl" and not r.get("error")), None)
    gpu = getattr(args, "gpu_name", None) or "CPU"  # read by the preparing process: this one keeps off the GPU
    print(f"\n{gpu}, torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}")
    what = f"{args.preset} {args.dtype}" + (" + reward model" if reward_path else "")
    print(
        f"{what}, {args.batch} completions x {args.completion} tokens per step, beta 0.04, weights {args.dtype}"
        + (", bf16 autocast" if gpu != "CPU" and not (args.nproc > 1 and args.launch == "fsdp2") else "")
    )
    rows = []
    date = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    trl_runs = [r for r in results if r["variant"] == "trl" and not r.get("error")]
    # DeepSpeed ZeRO-3 offload, the anchor a TRL user reaches for when the model does not fit
    ds = next((r for r in results if r["variant"] == "ds-zero3-offload" and not r.get("error")), None)
    for n, r in enumerate(results):
        # With several TRL-alone processes (variants "trl,X,trl,X" or "trl,X,X,trl"), each variant
        # against the one run just before it and the one just after it too: steps vary between
        # processes more than between neighbours.
        before = next((b for b in reversed(results[:n]) if b["variant"] == "trl" and not b.get("error")), None)
        after = next((b for b in results[n + 1 :] if b["variant"] == "trl" and not b.get("error")), None)
        if r.get("error"):
            line = f"  {r['variant']:8s} {r['error'][:120]}"
            for at in [r.get("oom_at")] + [x.get("oom_at") for x in r.get("ranks", [])]:
                if at:
                    line += (
                        f"\n    out of memory at step {at.get('step')}, phase {at.get('phase')}, resident "
                        f"{at.get('resident_roles')}, prefetched {(at.get('prefetched_bytes') or 0) / 2**30:.2f} GiB, "
                        f"allocated {(at.get('allocated_bytes') or 0) / 2**30:.2f} GiB; "
                        + " <- ".join(reversed(at.get("frames", [])[-4:]))
                    )
            row = f"| {date} | {gpu} | {torch.__version__} | {trl.__version__} | {what} | {args.batch}x{args.completion} | {r['variant']} | {r['error'][:80]} | - | - | - | - | - |"
        else:
            pr = r["peak_bytes"] / base["peak_bytes"] if base else None
            sr = r["step_s"] / base["step_s"] if base else None
            share = r.get("exposed_s_per_step", 0.0) / r["step_s"]
            bound = _bound(r, base, getattr(args, "line_rate", None))
            fastest = r["step_min_s"] / base["step_min_s"] if base and "step_min_s" in base else None
            r["bound_s"] = bound
            line = (
                f"  {r['variant']:8s} step {r['step_s']:.3f} s ({_x(sr)} TRL)  peak {r['peak_bytes'] / 2**30:.2f} GiB "
                f"({_x(pr)} TRL)  exposed {share:.1%} of the step (host+stall "
                f"{r.get('host_stall_s_per_step', 0.0) / r['step_s']:.1%}), "
                + (
                    f"{r['moved_gb_per_step']:.1f} GB/step at {r.get('transition_gbps', 0):.1f} GB/s"
                    if r.get("moved_gb_per_step") is not None
                    else "bytes moved not counted"
                )
                + (f"  bound {bound:.3f} s ({r['step_s'] / bound:.2f}x)" if bound else "")
                + (f"  fastest step {r['step_min_s']:.3f} s ({_x(fastest)} TRL's)" if "step_min_s" in r else "")
                + (
                    f"  ({r['step_s'] / before['step_s']:.2f}x the TRL process before it)"
                    if len(trl_runs) > 1 and before is not None and before is not base
                    else ""
                )
                + (
                    f"  ({r['step_s'] / after['step_s']:.2f}x the TRL process after it)"
                    if len(trl_runs) > 1 and after is not None and r["variant"] != "trl"
                    else ""
                )
                + (
                    f"  against DeepSpeed ZeRO-3 offload: step {r['step_s'] / ds['step_s']:.2f}x, "
                    f"peak {r['peak_bytes'] / ds['peak_bytes']:.2f}x"
                    if ds is not None and r is not ds
                    else ""
                )
            )
            row = (
                f"| {date} | {gpu} | {torch.__version__} | {trl.__version__} | {what} | {args.batch}x{args.completion} | "
                f"{r['variant']} | {r['step_s']:.3f} | {_x(sr)} | {r['peak_bytes'] / 2**30:.2f} | {_x(pr)} | {share:.3f} | "
                f"{r.get('transition_gbps', 0):.1f} |"
            )
        if r.get("stopped_by_deadline"):
            d = r["stopped_by_deadline"]
            line += f"\n    ended by the bench's deadline after step {d['after_steps']} of {d['of_steps']}"
        print(line)
        one = getattr(args, "one_gpu", {}).get(r["variant"])
        if one is not None and not r.get("error"):
            r["one_gpu_completions_per_s"] = one
            print(
                f"    throughput: {r['completions_per_s']:.2f} completions/s on {r['nproc']} GPUs against {one:.2f} on one "
                f"in the same call: {r['completions_per_s'] / one:.2f}x (target >= {0.9 * r['nproc']:.1f}x)"
            )
        anchor = getattr(args, "anchor", None)
        if anchor is not None and not r.get("error"):
            r["anchor"] = {k: anchor.get(k) for k in ("variant", "launch_name", "step_s", "peak_bytes")}
            print(
                f"    against {anchor['variant']} under {anchor.get('launch_name')} (--anchor-json): step "
                f"{r['step_s'] / anchor['step_s']:.2f}x ({anchor['step_s']:.3f} s), peak "
                f"{r['peak_bytes'] / anchor['peak_bytes']:.2f}x ({anchor['peak_bytes'] / 2**30:.2f} GiB)"
            )
        gen_one = getattr(args, "one_gpu_generate", {}).get(r["variant"])
        gen = (r.get("phase_s") or {}).get("generate")
        if gen_one and gen and not r.get("error"):
            r["one_gpu_generate_s"] = gen_one
            print(
                f"    generation: {gen:.3f} s a step on each of {r['nproc']} GPUs ({r.get('launch')}) against {gen_one:.3f} s "
                f"on one GPU in the same call: {gen / gen_one:.2f}x (target <= 1.15x under FSDP2)"
            )
        if r.get("nproc", 1) > 1 and not r.get("error"):
            print(
                f"    {r['nproc']} processes ({r.get('launch')}): {args.batch * r['nproc'] / r['step_s']:.2f} "
                f"completions/s; per rank: "
                + "; ".join(
                    f"rank {x['rank']} step {x['step_s']:.3f} s, peak {x['peak_bytes'] / 2**30:.1f} GiB, host held "
                    f"{(x.get('host_held_bytes') or 0) / 2**30:.1f} GiB, RSS {max(x.get('host_rss_bytes_steps') or [0]) / 2**30:.1f} GiB"
                    for x in r["ranks"]
                    if not x.get("error")
                )
            )
        floor = None if r.get("error") else _floor(r, getattr(args, "line_rate", None))
        if floor is not None:
            r.update(floor)
            print(
                f"    floor {floor['floor_s']:.3f} s (compute {floor['compute_s']:.3f} s + "
                f"{floor['beyond_room_bytes'] / 1e9:.1f} GB of optimizer state beyond the room beside the gradients at "
                f"the line rate): step {r['step_s'] / floor['floor_s']:.2f}x the floor (target <= 1.10x); exposed "
                f"{r.get('exposed_s_per_step', 0.0) / r['step_s']:.1%}"
            )
        held, base_rss = r.get("host_held_bytes"), r.get("host_baseline_rss_bytes")
        peak_rss = r.get("host_peak_rss_bytes") or max(r.get("host_rss_bytes_steps") or [0])
        if r.get("ranks"):  # the process tree's RSS is every rank's: against every rank's held
            held = sum(x.get("host_held_bytes") or 0 for x in r["ranks"])
            base_rss = sum(x.get("host_baseline_rss_bytes") or 0 for x in r["ranks"])
        if held and base_rss and peak_rss and not r.get("error"):
            allowed = 1.10 * held + base_rss
            print(
                f"    host: peak RSS {peak_rss / 2**30:.1f} GiB against 1.10 x held {held / 2**30:.1f} GiB + the process "
                f"before any trainer {base_rss / 2**30:.1f} GiB = {allowed / 2**30:.1f} GiB: {peak_rss / allowed:.2f}x"
            )
        if r.get("phase_s"):
            print(
                "    phases (s, median; device time on a GPU): "
                + ", ".join(f"{k} {v:.3f}" for k, v in r["phase_s"].items())
            )
        if r.get("token_gap_s"):
            g = r["token_gap_s"]
            print(
                f"    between generated tokens (host, median of steps): longest {g['longest'] * 1e3:.1f} ms, "
                f"median {g['median'] * 1e3:.1f} ms ("
                + (f"host inside the forward {g['launch'] * 1e3:.1f} ms" if "launch" in g else "")
                + (
                    f"; device {g['device'] * 1e3:.1f} ms a token, {g['device_forward'] * 1e3:.1f} ms inside the forward"
                    if "device" in g
                    else ""
                )
                + f"), beyond twice the median {g['excess']:.3f} s a step"
                + (f"; the host probe beside it {g['probe'] * 1e6:.2f} us an op" if g.get("probe") else "")
            )
        if r.get("copy_tail_s"):
            print(
                "    tidal's copies still running as the step began (s, median): "
                + ", ".join(f"{k.upper()} {v:.3f}" for k, v in r["copy_tail_s"].items())
            )
        if r.get("host_peak_rss_bytes"):
            avail = r.get("host_min_available_bytes")
            print(
                f"    host memory: the variant's processes peaked at {r['host_peak_rss_bytes'] / 2**30:.1f} GiB resident"
                + (
                    f" ({r['host_peak_rss_at_s']:.0f} s after the launch)"
                    if r.get("host_peak_rss_at_s") is not None
                    else ""
                )
                + (f"; the host's available memory fell to {avail / 2**30:.1f} GiB" if avail is not None else "")
                + (f" of {r['host_total_bytes'] / 2**30:.1f} GiB" if r.get("host_total_bytes") else "")
            )
        samples = r.get("host_samples")
        if samples:
            per = samples["steps"] or 1
            print(f"    host time in verbs per step (sampled): {samples['by_verb']} / {per} steps")
            for t in samples["top"][:6]:
                print(f"      {t['seconds'] / per:7.3f} s  {t['verb']:<20} {t['tidal_frame']}  <- {t['frame']}")
        rows.append(row)
    pooled = _pooled(results)
    if pooled:
        ref = pooled.get("trl")
        print(
            "  pooled over the processes of a variant (the median of every measured step of all of them; steps "
            "vary between processes of the same code more than between neighbours): "
            + "; ".join(
                f"{name} {p['median_s']:.3f} s ({p['processes']} processes, {p['steps']} steps"
                + (f", {p['median_s'] / ref['median_s']:.2f}x TRL's" if ref and name != "trl" else "")
                + ")"
                for name, p in pooled.items()
            )
        )
    for name, pr in _paired(results).items():
        ci = pr["ratio_ci95"]
        gci = pr["generate_ratio_ci95"]
        print(
            f"  paired against the TRL run of each round: {name} step {pr['ratio_median']:.3f}x TRL's (median of "
            f"{pr['n']} pairs; 95% interval "
            + (f"{ci[0]:.3f}-{ci[1]:.3f}" if ci else "needs >= 6 pairs")
            + ")"
            + (
                f", generation {pr['generate_ratio_median']:.3f}x" + (f" ({gci[0]:.3f}-{gci[1]:.3f})" if gci else "")
                if pr["generate_ratio_median"] is not None
                else ""
            )
            + (
                f"; generation over the host probe beside it {pr['generate_per_probe_ratio_median']:.3f}x"
                + (
                    f" ({pr['generate_per_probe_ratio_ci95'][0]:.3f}-{pr['generate_per_probe_ratio_ci95'][1]:.3f})"
                    if pr.get("generate_per_probe_ratio_ci95")
                    else ""
                )
                if pr.get("generate_per_probe_ratio_median") is not None
                else ""
            )
            + (
                "; a token (median ratios: gap, host in the forward, device a token, device in the forward): "
                + ", ".join(f"{k} {v:.3f}x" for k, v in pr["token_ratio_medians"].items())
                if pr.get("token_ratio_medians")
                else ""
            )
        )
    print(
        "targets (64 x 256): 1.5B fp32 step <= 1.05x TRL (paired, the 95% interval's upper end) at peak <= 0.5x, "
        "generation <= 1.02x; 7B bf16 exposed <= 3% of the step; prefetch never slower than without"
    )
    profiled = [(r["variant"], r["profile"]) for r in results if r.get("profile", {}).get("summary")]
    if profiled:
        import step_trace

        for name, prof in profiled if final else [p for p in profiled if p[0] == results[-1]["variant"]]:
            print(step_trace.format_summary(f"{name} (profiled step {args.profile_step})", prof["summary"]))
        if args.picture:
            step_trace.draw(
                [
                    (f"{name}: step {prof['summary']['step_s']:.2f} s (profiled)", prof["lanes"])
                    for name, prof in profiled
                ],
                args.picture,
                title=f"{gpu}: {what}, {args.batch} x {args.completion}, one steady step",
            )
            print(f"picture: {args.picture}")
    if args.results and final:
        with open(args.results, "a") as f:
            f.write("\n".join(rows) + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "preset": args.preset,
                    "dtype": args.dtype,
                    "batch": args.batch,
                    "micro_batch": args.micro_batch,
                    "completion": args.completion,
                    "num_generations": args.num_generations,
                    "reward_model": bool(reward_path),
                    "gpu": gpu,
                    "torch": torch.__version__,
                    "transformers": transformers.__version__,
                    "trl": trl.__version__,
                    "commit": args.commit,
                    "date": date,
                    "line_rate": getattr(args, "line_rate", None),
                    "nproc": args.nproc,
                    "launch": args.launch if args.nproc > 1 else "single",
                    "trl_loading": args.trl_loading if args.nproc > 1 and args.launch == "fsdp2" else None,
                    "host_floor_gib": args.host_floor_gib,
                    "pooled": pooled,
                    "paired": _paired(results),
                    "variants": results,
                },
                f,
            )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen2-1.5b", choices=sorted(PRESETS))
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--variants", default="trl,step,stream,stream+prefetch")
    p.add_argument("--batch", type=int, default=16, help="per_device_train_batch_size (completions per step)")
    p.add_argument("--num-generations", type=int, default=8)
    p.add_argument("--completion", type=int, default=32, help="max_completion_length")
    p.add_argument(
        "--micro-batch",
        type=int,
        default=None,
        help="completions a forward and backward takes (per_device_train_batch_size, with "
        "gradient_accumulation_steps = batch / this); default: the whole batch at once",
    )
    p.add_argument("--dtype", default="float32", help="weights as TRL loads them (its default: float32)")
    p.add_argument(
        "--reward-model",
        action="store_true",
        help="every variant also scores with a reward model of the policy's shape (TRL keeps it on the "
        "device; tidal gives it a turn)",
    )
    p.add_argument("--results", default=None)
    p.add_argument("--json", default=None)
    p.add_argument(
        "--profile-step",
        type=int,
        default=0,
        help="profile this step (1-based; not counted in the step times) with torch.profiler: where its time "
        "goes (benchmarks/step_trace.py) is printed and put in the JSON",
    )
    p.add_argument("--picture", default=None, help="with --profile-step: draw the profiled steps to this PNG")
    p.add_argument("--profile-variants", default="", help="with --profile-step: profile only these (comma-separated)")
    p.add_argument("--commit", default=os.environ.get("TIDAL_COMMIT", ""), help="the commit measured (for the JSON)")
    p.add_argument(
        "--before",
        default=os.path.join(ROOT, ".before"),
        help="a folder holding the tidal package of an earlier commit, for 'before:<variant>' variants "
        "(git archive <commit> tidal | tar -x -C .before)",
    )
    p.add_argument(
        "--sample-stacks",
        action="store_true",
        help="sample the host's Python stack every 2 ms in the measured steps: where the time inside tidal's "
        "verbs goes (benchmarks/host_samples.py), in the JSON and printed",
    )
    p.add_argument(
        "--nproc",
        type=int,
        default=1,
        help="processes (one GPU each) a variant runs in, under `accelerate launch` with TRL's config for --launch",
    )
    p.add_argument(
        "--launch",
        choices=sorted(LAUNCH_CONFIGS),
        default="ddp",
        help="with --nproc > 1: ddp, fsdp2, or zero3-offload (TRL alone only: tidal refuses DeepSpeed through "
        "accelerate)",
    )
    p.add_argument(
        "--one-gpu-json",
        default=None,
        help="with --nproc > 1: the JSON of the same workload on one GPU (this script, run just before on the "
        "same machine): each variant's throughput is printed against it",
    )
    p.add_argument(
        "--anchor-json",
        default=None,
        help="the JSON of an anchor run of the same workload (this script, e.g. TRL alone under --launch "
        "zero3-offload on the same GPUs): each variant's step and peak are printed against its first run that ran",
    )
    p.add_argument(
        "--paired",
        type=int,
        default=0,
        help="run TRL alone and each tidal variant in N rounds (trl X Y, then Y X trl, ...; a process each, or one "
        "process with --in-process) and report each variant's median step ratio against the TRL run of its round, "
        "with its 95%% interval (in the JSON: paired)",
    )
    p.add_argument(
        "--in-process",
        action="store_true",
        help="with --paired: the runs alternate in one process (each a trainer of its own, freed before the "
        "next), so no pair spans two processes, whose steps differ more than one process's do",
    )
    p.add_argument(
        "--lockstep",
        default=None,
        metavar="HOST:PORT",
        help="with --paired --in-process and one tidal variant: this process and a partner (the same command "
        "with --lockstep-rank 1, on another GPU of the machine) start every step together, one running TRL alone "
        "while the other runs tidal, swapping each run; rank 0 hosts the rendezvous at HOST:PORT "
        "(benchmarks/lockstep.py). pool_paired.py --lockstep pairs their steps",
    )
    p.add_argument(
        "--lockstep-rank",
        type=int,
        default=0,
        choices=(0, 1),
        help="with --lockstep: 0 runs the --paired order (TRL alone first), 1 its complement",
    )
    p.add_argument(
        "--turns",
        action="store_true",
        help="with --lockstep: the two processes share one GPU (give both the same one) and take turns step by "
        "step instead of starting together: each step runs alone on the GPU and the host, the partner's the step "
        "before or after it; in each pair of steps the one that goes first alternates. A step ends once all its "
        "device work has (its copies' tail included)",
    )
    p.add_argument(
        "--main-cores",
        default=None,
        metavar="A,B",
        help="with --lockstep: each measured step's main thread on core A or B (Linux core numbers), the partner's "
        "on the other, swapped every step, so that a core faster than the other (a host-bound decode runs at its "
        "core's pace) favours neither side; the core is recorded with each step (lockstep_steps)",
    )
    p.add_argument(
        "--model-cache",
        default=None,
        help="a folder where the preset's random model is saved once and found by later runs (a 14B save takes "
        "about a minute); default: a new temporary folder each run",
    )
    p.add_argument(
        "--trl-loading",
        choices=("every-rank", "rank0"),
        default="every-rank",
        help="TRL alone under --launch fsdp2: every rank loads the weights (default; the values right), or only "
        "rank 0, as fsdp2.yaml says (the host holds one copy, not one a rank; TRL's reference is then empty on the "
        "other ranks: its memory is right, its values are not, so only for where it runs out of memory)",
    )
    p.add_argument(
        "--host-floor-gib",
        type=float,
        default=0.0,
        help="stop a variant (its whole process group) when the host's available memory falls below this many GiB, "
        "and record it as out of host memory with what its processes held; 0 (default): never",
    )
    p.add_argument(
        "--deadline-s",
        type=float,
        default=0.0,
        help="end each variant's training after the step that leaves less than that step's time (+15%%, and 20 s "
        "to write its results) before this many seconds from the bench's start, all ranks alike; the JSON says "
        "how many steps ran and that the deadline ended it (a call's time limit then still yields the steps "
        "run); 0 (default): no deadline",
    )
    p.add_argument("--_deadline", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--_launched", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--_variant", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_sequence", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_prepare", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--_model", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--reward-model-path", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.micro_batch is not None and (args.micro_batch < 1 or args.batch % args.micro_batch):
        p.error(f"--micro-batch {args.micro_batch} must divide --batch {args.batch}")
    for flag, path in (("--anchor-json", args.anchor_json), ("--one-gpu-json", args.one_gpu_json)):
        if path and not os.path.isfile(path):
            # Before any model is saved or process launched: a wrong path wastes no GPU time.
            p.error(f"{flag} {path}: no such file (give the path of a JSON this bench wrote, e.g. under gpu.sh's $OUT)")
    if args._prepare:
        import torch

        save_model(args.preset, args._model, args.reward_model_path)
        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
        with open(args._out, "w") as f:
            json.dump({"line_rate": _line_rate(), "gpu": gpu}, f)
        return 0
    if args.in_process and (not args.paired or args.nproc > 1):
        p.error("--in-process alternates the --paired runs in one process: it needs --paired and --nproc 1")
    if args.lockstep and not args._sequence:  # (the child running the sequence is given it whole)
        ours = [v for v in args.variants.split(",") if v != "trl"]
        if not args.in_process or len(ours) != 1:
            p.error(
                "--lockstep pairs TRL alone with one tidal variant, run in turn in one process: it needs --paired N "
                f"--in-process and --variants trl,<one variant> (got --variants {args.variants})"
            )
        try:
            lockstep.parse_address(args.lockstep)
        except ValueError as e:
            p.error(str(e))
    if args.turns and not args.lockstep:
        p.error("--turns makes the two --lockstep processes take turns on one GPU: it needs --lockstep")
    args._turn_n = 0  # --turns: the steps this process has started, all runs together
    args._main_cores = None
    if args.main_cores:
        if not args.lockstep:
            p.error("--main-cores swaps two cores between the lockstep partners: it needs --lockstep")
        try:
            cores = [int(x) for x in args.main_cores.split(",")]
        except ValueError:
            cores = []
        allowed = os.sched_getaffinity(0)
        if len(cores) != 2 or cores[0] == cores[1] or any(c not in allowed for c in cores):
            p.error(
                f"--main-cores {args.main_cores}: give two different cores of this process's, A,B (it may run on "
                f"{sorted(allowed)})"
            )
        args._main_cores, args._process_cores = cores, allowed
    args._lockstep, args._run_index = None, 0
    if args._sequence:
        # --paired --in-process: each run in turn in this process, its trainer freed before the next.
        if args.lockstep:
            args._lockstep = lockstep.Lockstep(args.lockstep, args.lockstep_rank)
        for i, v in enumerate(args._sequence.split(",")):
            args._run_index = i
            run_variant(v, args._model, args.steps, f"{args._out}.{i}", args)
            with open(f"{args._out}.{i}") as f:  # in the log as it goes: a run cut short keeps what it measured
                done = json.load(f)
                print(f"[bench_trl] run {i}: " + json.dumps({k: x for k, x in done.items() if k != "profile"}))
            if done.get("stopped_by_deadline"):
                # The deadline ended this run early: the next would not finish either (with
                # --lockstep the partner ended the same run at the same step and stops here too).
                print(f"[bench_trl] the deadline ended run {i}: runs {i + 1}- not run", flush=True)
                break
        return 0
    if args._variant:
        if args._variant.startswith("before:"):
            # The code measured before the change: its tidal package, exported to --before.
            sys.path.insert(0, os.path.abspath(args.before))
        run_variant(args._variant, args._model, args.steps, args._out, args)
        return 0

    args.anchor = None
    if args.anchor_json:
        with open(args.anchor_json) as f:
            anchor = json.load(f)
        args.anchor = next((v for v in anchor["variants"] if not v.get("error")), None)
        if args.anchor is not None:
            args.anchor["launch_name"] = anchor.get("launch")
    args.one_gpu, args.one_gpu_generate = {}, {}
    if args.one_gpu_json:
        with open(args.one_gpu_json) as f:
            ones = [v for v in json.load(f)["variants"] if not v.get("error")]
        args.one_gpu = {v["variant"]: v["completions_per_s"] for v in ones}
        # Each generation's device seconds on one GPU: the same completions a rank generates.
        args.one_gpu_generate = {
            v["variant"]: v["phase_s"]["generate"] for v in ones if "generate" in v.get("phase_s", {})
        }
    work = tempfile.mkdtemp()
    model_path = os.path.join(args.model_cache or work, args.preset)
    t0 = time.perf_counter()
    args._deadline = time.time() + args.deadline_s if args.deadline_s > 0 else 0.0
    reward_path = os.path.join(work, args.preset + "-reward") if args.reward_model else None
    # In a process of its own: this one would keep a CUDA context and the line-rate buffers in
    # its cache on the GPU all run long (2.67 GiB seen beside every variant), memory neither TRL
    # nor tidal could use.
    prepared = os.path.join(work, "prepared.json")
    cmd = [sys.executable, __file__, "--_prepare", "--preset", args.preset, "--_model", model_path, "--_out", prepared]
    subprocess.run(cmd + (["--reward-model-path", reward_path] if reward_path else []), check=True)
    with open(prepared) as f:
        ready = json.load(f)
    args.line_rate, args.gpu_name = ready["line_rate"], ready["gpu"]
    print(f"saved {args.preset} to {model_path} in {time.perf_counter() - t0:.1f} s", flush=True)
    if args.line_rate:
        lr = args.line_rate
        print(
            f"line rate in this run: D2H {lr['d2h_gbps']:.1f}, H2D {lr['h2d_gbps']:.1f}, "
            f"both at once {lr['bidir_gbps']:.1f} GB/s (1 GiB pinned copies, median of 5)",
            flush=True,
        )
    results = []
    variants = args.variants.split(",")
    if args.paired:
        # Rounds of TRL alone and each variant, every other round in reverse (trl A B, B A trl,
        # trl A B, ...): each variant runs as often after its TRL run as before it, so a host
        # whose speed drifts through the call (2.2x within one process on an H100 machine,
        # 2026-11-27) favours neither side.
        ours = [v for v in variants if v != "trl"]
        variants = [v for r in range(args.paired) for v in (["trl", *ours] if r % 2 == 0 else [*ours, "trl"])]
        if args.lockstep_rank == 1:
            # The partner of rank 0's order: tidal where it runs TRL alone and the reverse, so
            # every step of each runs beside a step of the other, on each GPU in turn.
            variants = [ours[0] if v == "trl" else "trl" for v in variants]
    if args.in_process:
        out = os.path.join(work, "sequence.json")
        cmd = _child_cmd(args, ["--_sequence", ",".join(variants)], out, model_path, reward_path, profile=False)
        env = dict(os.environ)
        env.setdefault("CUDA_VISIBLE_DEVICES", "0")
        rc, host = _run_watching_host_memory(cmd, env)
        for i, v in enumerate(variants):
            path = f"{out}.{i}"
            why = "not run: an earlier run was ended by the bench's deadline" if rc == 0 else f"exit {rc}"
            res = json.load(open(path)) if os.path.exists(path) else {"variant": v, "error": why}
            res.update(host, in_process=True)
            results.append(res)
        _report_so_far(args, results, reward_path, final=True)
        return 0
    for v in variants:
        out = os.path.join(work, f"{v}.json")
        cmd = _child_cmd(args, ["--_variant", v], out, model_path, reward_path, profile=True)
        env = dict(os.environ)
        if "+expandable" in v:
            env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        if args.nproc > 1:
            cmd = _launched(cmd, args)
        elif "CUDA_VISIBLE_DEVICES" not in env:
            # One process, one GPU: TRL loads a model given by path with device_map="auto",
            # over every GPU the process sees (on a 4-GPU machine the one-GPU run spanned four).
            env["CUDA_VISIBLE_DEVICES"] = "0"
        rc, host = _run_watching_host_memory(cmd, env, floor_bytes=int(args.host_floor_gib * 2**30))
        res = _merged_ranks(out, args.nproc, v) if args.nproc > 1 else None
        if res is None:
            res = json.load(open(out)) if os.path.exists(out) else {"variant": v, "error": f"exit {rc}"}
        res.update(host)
        if "host_stopped" in host:
            h = host["host_stopped"]
            res["error"] = (
                f"out of host memory: stopped by the bench when the host's available memory fell to "
                f"{h['available_bytes'] / 2**30:.1f} GiB (floor {h['floor_bytes'] / 2**30:.1f}) after {h['after_s']} s, "
                f"the run's processes holding {h['tree_rss_bytes'] / 2**30:.1f} GiB"
                + (f" (the run's own error before that: {res['error']})" if res.get("error") else "")
            )
        results.append(res)
        print(json.dumps({k: x for k, x in res.items() if k != "profile"}), flush=True)
        _report_so_far(args, results, reward_path)  # a run cut short keeps what it measured
    _report_so_far(args, results, reward_path, final=True)
    return 0


def _child_cmd(args, what: list[str], out: str, model_path: str, reward_path: str | None, *, profile: bool) -> list:
    """The command line of a child process running ``what`` (``--_variant V`` or
    ``--_sequence V1,V2,...``) with this run's settings, writing its JSON to ``out``."""
    v = what[1]
    return (
        [
            sys.executable,
            __file__,
            *what,
            "--_deadline",
            repr(args._deadline),
            "--_launched",
            repr(time.time()),
            "--_model",
            model_path,
            "--_out",
            out,
            "--steps",
            str(args.steps),
            "--batch",
            str(args.batch),
            "--num-generations",
            str(args.num_generations),
            "--completion",
            str(args.completion),
            "--dtype",
            args.dtype,
            "--profile-step",
            str(
                args.profile_step
                if profile and (not args.profile_variants or v in args.profile_variants.split(","))
                else 0
            ),
            "--before",
            args.before,
            "--nproc",
            str(args.nproc),
            "--launch",
            args.launch,
        ]
        + (["--sample-stacks"] if args.sample_stacks else [])
        + (["--micro-batch", str(args.micro_batch)] if args.micro_batch else [])
        + (["--reward-model-path", reward_path] if reward_path else [])
        + (["--lockstep", args.lockstep, "--lockstep-rank", str(args.lockstep_rank)] if args.lockstep else [])
        + (["--main-cores", args.main_cores] if args.main_cores else [])
        + (["--turns"] if args.turns else [])
    )


def _launched(cmd: list[str], args) -> list[str]:
    """``cmd`` (a variant's process: ``python bench_trl.py --_variant ...``) under ``accelerate
    launch`` with ``--nproc`` processes and TRL's config for ``--launch`` (its multi_gpu.yaml or
    fsdp2.yaml, as a TRL user launches), on a free port."""
    variant = cmd[cmd.index("--_variant") + 1] if "--_variant" in cmd else ""
    import socket

    import trl

    config = os.path.join(os.path.dirname(trl.__file__), "accelerate_configs", LAUNCH_CONFIGS[args.launch])
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mixed = "no" if args.launch == "fsdp2" else "bf16"  # see bf16= in run_variant
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config]
    launch += ["--num_processes", str(args.nproc), "--mixed_precision", mixed, "--main_process_port", str(port)]
    if args.launch == "fsdp2" and variant == "trl" and args.trl_loading == "every-rank":
        # TRL alone: every rank loads the weights. With only the first loading them (fsdp2.yaml's
        # cpu_ram_efficient_loading), accelerate sends the policy's shards, but TRL shards its
        # reference as loaded, empty on the other ranks. tidal's variants keep fsdp2.yaml's
        # setting: their reference's shards come from rank 0's weights as the policy's do.
        launch += ["--fsdp_cpu_ram_efficient_loading", "false"]
    if args.launch == "zero3-offload":
        launch += ["--offload_optimizer_device", "cpu", "--offload_param_device", "cpu"]
    return launch + cmd[1:]


def _merged_ranks(out: str, nproc: int, variant: str = "") -> dict | None:
    """The ranks' results of one variant as one: rank 0's, with the step the slowest rank's
    median (the ranks wait for each other), the peak the highest rank's, and each rank's step,
    peak, exposed share and host memory under ``ranks``. None if no rank wrote one."""
    ranks = []
    for r in range(nproc):
        try:
            with open(f"{out}.rank{r}") as f:
                ranks.append(json.load(f))
        except OSError:
            ranks.append({"rank": r, "error": "no result (the process died)"})
    if all(x.get("error") == "no result (the process died)" for x in ranks):
        return None
    res = dict(next((x for x in ranks if "variant" in x), ranks[0]))
    res["variant"] = res.get("variant") or variant
    # The first rank's own error (the others' follow from it: killed by the launcher).
    errors = sorted((x["error"] for x in ranks if x.get("error")), key=lambda e: e.startswith("no result"))
    if errors:
        res["error"] = errors[0]
    else:
        res["step_s"] = max(x["step_s"] for x in ranks)
        res["step_min_s"] = max(x["step_min_s"] for x in ranks)
        res["peak_bytes"] = max(x["peak_bytes"] for x in ranks)
        res["exposed_s_per_step"] = max(x.get("exposed_s_per_step", 0.0) for x in ranks)
    keys = ("rank", "error", "step_s", "step_min_s", "peak_bytes", "exposed_s_per_step", "moved_gb_per_step")
    keys += ("transition_gbps", "host_held_bytes", "host_pinned_bytes", "host_rss_bytes_steps", "launch")
    keys += ("host_baseline_rss_bytes", "oom_at", "phase_peak_bytes_steps")  # each rank's logged phase peaks
    keys += ("step_times_s", "stopped_by_deadline")
    res["ranks"] = [{k: x.get(k) for k in keys} for x in ranks]
    res["nproc"] = nproc
    return res


def _tree_pids(pid: int) -> list[int]:
    """``pid`` and its descendants now (``/proc``; those that end meanwhile are skipped)."""
    pids, todo = [], [pid]
    while todo:
        p = todo.pop()
        pids.append(p)
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo += [int(c) for c in f.read().split()]
        except (OSError, ValueError):
            continue
    return pids


def _tree_rss_bytes(pid: int) -> int:
    """Resident bytes of ``pid`` and its descendants (``/proc``; 0 where unreadable)."""
    total = 0
    for p in _tree_pids(pid):
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
        except (OSError, ValueError):
            continue
    return total


def _run_watching_host_memory(
    cmd: list[str], env: dict, interval_s: float = 0.5, floor_bytes: int = 0, timeline_every_s: float = 5.0
) -> tuple[int, dict]:
    """Run a variant's process; return its exit status and the host memory seen while it ran:
    its process tree's peak resident bytes and when (seconds after the launch), the lowest
    ``MemAvailable`` (or cgroup room), read every ``interval_s``, and a reading every
    ``timeline_every_s`` (``host_rss_timeline``: [seconds, tree RSS, available]). A variant killed by the kernel (exit -9) with the available memory near
    0 ran the host out of memory. With ``floor_bytes``, the process and its descendants are killed as soon
    as the available memory falls below it (``host_stopped`` says when and at what): a run
    that would take the host's last memory is stopped before the kernel's killer picks a
    process (the machine's own, or this one) and before the host stops answering."""
    import signal

    from tidal.device import host_memory

    # In this process's group, not a new one: a `timeout` around the bench ends the variant too.
    proc = subprocess.Popen(cmd, env=env)
    peak_rss, peak_at, min_avail, total, stopped = 0, None, None, None, None
    timeline, last_kept = [], -1e9
    t0 = time.perf_counter()
    while proc.poll() is None:
        rss = _tree_rss_bytes(proc.pid)
        now = time.perf_counter() - t0
        if rss > peak_rss:
            peak_rss, peak_at = rss, round(now, 1)
        try:
            mem = host_memory()
        except OSError:
            mem = None
        if now - last_kept >= timeline_every_s:  # when the memory went up: loading, a step
            timeline.append([round(now, 1), rss, mem.available_bytes if mem is not None else None])
            last_kept = now
        if mem is not None:
            total = mem.total_bytes
            min_avail = mem.available_bytes if min_avail is None else min(min_avail, mem.available_bytes)
            if floor_bytes and mem.available_bytes < floor_bytes and stopped is None:
                stopped = {
                    "after_s": round(time.perf_counter() - t0, 1),
                    "available_bytes": mem.available_bytes,
                    "floor_bytes": floor_bytes,
                    "tree_rss_bytes": rss,
                }
                print(
                    f"[bench_trl] host memory available {mem.available_bytes / 2**30:.1f} GiB of "
                    f"{total / 2**30:.1f} fell below the floor of {floor_bytes / 2**30:.1f} GiB after "
                    f"{stopped['after_s']} s (the run's processes hold {rss / 2**30:.1f} GiB): stopping it",
                    flush=True,
                )
                for p in reversed(_tree_pids(proc.pid)):  # the ranks first, the launcher last
                    try:
                        os.kill(p, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        time.sleep(interval_s)
    res = {
        "host_peak_rss_bytes": peak_rss,
        "host_peak_rss_at_s": peak_at,
        "host_min_available_bytes": min_avail,
        "host_total_bytes": total,
        "host_rss_timeline": timeline,
    }
    if stopped is not None:
        res["host_stopped"] = stopped
    return proc.returncode, res


if __name__ == "__main__":
    sys.exit(main())
