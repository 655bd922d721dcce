"""TRL's GRPOTrainer with its colocated vLLM engine (``use_vllm=True, vllm_mode="colocate"``,
sleep mode on) alone, beside TidalGRPOTrainer on the same engine: the step, the generation, and
the device's peak at driver level (torch's counters keep counting vLLM's pool while it sleeps).

Workload: a random Qwen2-shape model in bf16 (``--preset``), 64 completions (8 prompts x 8) x
``--completion`` tokens, beta 0.04, the char task's reward; one process per variant (vLLM's
engine is built once per process), in the order given (``--variants trl,tidal,...``);
``tidal+kv=<GiB>`` gives the engine a KV cache of that size (``TidalConfig(vllm_kv_cache_bytes)``;
``kv=auto``: sized for the generation batch at ``--max-model-len``),
``tidal+<residency>`` picks the optimizer residency (step, stream, role), ``tidal+prefetch`` keeps
what fits (``TidalConfig(prefetch=True)``: the engine's turns too), ``tidal+peak=<GiB>`` bounds
what a prefetch or a keep may bring the device to (``prefetch_peak_bytes``), ``trl+util=<f>`` and
``tidal+util=<f>`` set ``vllm_gpu_memory_utilization`` (0.3). ``--cap-gib G``: another process
holds all but G GiB of the GPU first (an 80 GB GPU stood in for on an H200); a variant that runs
out of memory says so in its row.

``--micro N`` trains the 64 completions in micro-batches of N (gradient accumulation; one
generation a step, as at 64).

Measured after ``--warmup`` steps: each step's wall time (from ``on_step_begin`` to
``on_step_end``, the compute stream synchronised at both: not the whole device, whose wait would
add to the step the copies tidal leaves running on its own stream across the step's end, which
the next step's work overlaps), each generation's (TRL's ``_generate``, the same way), the peak of the
device's used memory (``total - free`` from ``cudaMemGetInfo`` sampled every 10 ms, less what the
capping process holds), each phase's device seconds (``phase_clock.PhaseClock``), and for tidal
its transitions and host memory. A tidal row's floor is bench_trl.py's (``trl_bench.report.step_floor``): the phases' compute (their
device seconds less what the steps waited on tidal's copies) plus the optimizer state that cannot
be on the device beside the weights and gradients (none where it fits) at the host-to-device line
rate measured in this run; its host memory is read against what tidal holds plus the process's
baseline. Prints the variants side by side with the ratio to the first ``trl`` run, and writes a
JSON per run and one merged JSON.

``--turns`` pairs steps instead of processes: each round runs its two variants (``trl`` and one
tidal variant) as two processes on the GPU at once, which take turns step by step
(``lockstep.Lockstep.turn``; in the n-th pair of steps the one that goes first alternates with n),
the second building its engine only once the first's is built and asleep (vLLM sizes its pool from
the memory it sees while it builds); the next round swaps which process runs which. A tidal step is
set against the TRL + vLLM step of the same pair: a step apart in time on the same GPU and host,
so the drift of the host between processes and over a call (the spread of separate runs) falls out
of the ratio. A turn ends once this process's device is idle (``torch.cuda.synchronize()``), and
that wait is in the step: nothing of one process's step overlaps the other's. Both processes must
fit on the device at once (Qwen2-1.5B does; 7B does not). The peak is then each process's own
(NVML's per-process figure, sampled) where NVML is there, else the device's, both processes in it
(the row says which).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)


class DriverPeak:
    """The device's used memory (driver level) sampled on a thread: ``peak()`` since ``reset()``.
    ``own=True``: this process's own (NVML's per-process figure) where NVML can be read, else the
    device's (``self.own`` says which was read)."""

    def __init__(self, every_s: float = 0.01, *, own: bool = False) -> None:
        import torch

        self._torch, self.every_s = torch, every_s
        self.total = torch.cuda.mem_get_info()[1]
        self._nvml = _own_usage_reader() if own else None
        self.own = self._nvml is not None
        self._max_used = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _used(self) -> int:
        if self._nvml is not None:
            return self._nvml()
        return self.total - self._torch.cuda.mem_get_info()[0]

    def _run(self) -> None:
        while not self._stop.is_set():
            self._max_used = max(self._max_used, self._used())
            time.sleep(self.every_s)

    def reset(self) -> None:
        self._max_used = self._used()

    def peak(self) -> int:
        return self._max_used

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _own_usage_reader():
    """A function returning this process's device memory as NVML reports it (bytes), or None
    where NVML cannot be read (no pynvml, or no per-process figure on this driver)."""
    try:
        import pynvml

        import torch

        pynvml.nvmlInit()
        index = torch.cuda.current_device()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible:
            index = int(visible.split(",")[index])
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        pid = os.getpid()

        def read() -> int:
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if proc.pid == pid and proc.usedGpuMemory is not None:
                    return int(proc.usedGpuMemory)
            return 0

        torch.cuda.init()
        torch.empty(1, device="cuda")  # this process on the device, so NVML lists it
        return read if read() > 0 else None
    except Exception:  # no pynvml, or NVML cannot say: the device's figure instead
        return None


def child(variant: str, model_path: str, args) -> dict:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from trl_bench.workload import char_task
    from phase_clock import PhaseClock
    from tidal.memory import host_rss_bytes

    name, *extras = variant.split("+")
    opts = dict(e.split("=", 1) if "=" in e else (e, "") for e in extras)
    util = float(opts.get("util", 0.3))
    cfg = GRPOConfig(
        output_dir=tempfile.mkdtemp(),
        beta=0.04,
        learning_rate=1e-6,
        max_steps=args.warmup + args.steps,
        num_generations=8,
        per_device_train_batch_size=args.micro,
        gradient_accumulation_steps=64 // args.micro,
        max_completion_length=args.completion,
        logging_steps=1,
        report_to=[],
        bf16=True,
        save_strategy="no",
        seed=0,
        model_init_kwargs={"dtype": "bfloat16"},
        use_vllm=True,
        vllm_mode="colocate",
        vllm_enable_sleep_mode=True,
        vllm_gpu_memory_utilization=util,
        vllm_max_model_length=args.max_model_len,
    )
    data = Dataset.from_dict({"prompt": [f"{i}+{i}=" for i in range(512)]})
    turns = None
    if args._lockstep:
        import lockstep

        turns = lockstep.Lockstep(args._lockstep, args._rank, timeout_s=args.turn_timeout)
    peak = DriverPeak(own=turns is not None)
    held_by_cap = args.cap_held_bytes
    steps: list[dict] = []
    phases = PhaseClock(cuda=True)
    box: list = []  # the trainer, once built

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **kw):
            self.turn = None
            if turns is not None:  # wait for this step's turn: the partner's step ran before it, or runs after
                met, waited, order = turns.turn(len(steps))
                self.turn = {"n": len(steps), "met": met, "first": order == 0, "waited_s": waited}
            torch.cuda.current_stream().synchronize()
            phases.wrap_optimizer(box[0])  # the trainer makes its optimizer in train()
            phases.take()  # this step's phases only
            self.t0 = time.perf_counter()
            peak.reset()

        def on_step_end(self, *a, **kw):
            if turns is not None:
                torch.cuda.synchronize()  # the whole device: no copy of this step runs into the partner's turn
            else:
                torch.cuda.current_stream().synchronize()
            steps.append(
                {
                    "seconds": time.perf_counter() - self.t0,
                    "peak_bytes": peak.peak() - held_by_cap,
                    "phase_s": phases.take(),
                }
            )
            if turns is not None:
                steps[-1]["turn"] = self.turn
                turns.end_turn()
            s = steps[-1]  # as it goes: a run cut short keeps its steps in the log
            print(
                f"[bench_trl_vllm] {variant} step {len(steps)}: {s['seconds']:.3f} s, peak "
                f"{s['peak_bytes'] / 2**30:.2f} GiB, phases {sum(s['phase_s'].values()):.3f} s",
                flush=True,
            )

    common = dict(
        model=model_path, reward_funcs=char_task().reward_sevens, args=cfg, train_dataset=data, callbacks=[Clock()]
    )
    baseline_rss = host_rss_bytes()
    out: dict = {"variant": variant, "gpu": torch.cuda.get_device_name(), "steps": steps}
    if turns is not None:
        out["peak_is_own"] = peak.own
    try:
        if turns is not None and args._rank == 1:
            turns.barrier("built/0")  # build this engine once the partner's is built and asleep
        if name == "trl":
            trainer = GRPOTrainer(**common)
        else:
            from tidal.integrations.trl import TidalConfig, TidalGRPOTrainer

            kv = opts.get("kv")
            residency = next((r for r in ("step", "stream", "role") if r in opts), "step")
            peak_gib = opts.get("peak")
            tidal = TidalConfig(
                optimizer_residency=residency,
                prefetch="prefetch" in opts,
                prefetch_peak_bytes=int(float(peak_gib) * 2**30) if peak_gib else None,
                vllm_kv_cache_bytes=("auto" if kv == "auto" else int(float(kv) * 2**30)) if kv else None,
            )
            trainer = TidalGRPOTrainer(**common, tidal=tidal)
        if turns is not None:
            if args._rank == 0:
                turns.barrier("built/0")
            turns.barrier("built/1")  # both engines built: the first turn may start
        gen_s: list[float] = []
        inner = trainer._generate

        def timed(prompts):
            torch.cuda.current_stream().synchronize()
            t0 = time.perf_counter()
            r = inner(prompts)
            torch.cuda.current_stream().synchronize()
            gen_s.append(time.perf_counter() - t0)
            return r

        trainer._generate = timed
        phases.wrap_trainer(trainer)
        box.append(trainer)
        trainer.train()
        weights = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
        out["workload"] = {
            "device_total_bytes": (args.cap_gib * 2**30) if args.cap_gib else torch.cuda.mem_get_info()[1],
            "weights_bytes": weights,
            "grads_bytes": weights,  # full-parameter: a gradient for every weight
            "optimizer_state_bytes": _optimizer_state_bytes(trainer),
        }
        out["generate_s"] = gen_s
        hist = [h for h in trainer.state.log_history if "loss" in h]
        out["losses"] = [h.get("loss") for h in hist]
        # TRL's own log lines (tidal's figures and the timings left out) and a digest of the
        # final weights: what the identity check sets against the first TRL + vLLM run.
        out["trl_logs"] = [{k: v for k, v in h.items() if k in _COMPARED} for h in hist]
        out["weights_sha256"] = _weights_digest(trainer.accelerator.unwrap_model(trainer.model))
        out["kv_cache_tokens"] = _kv_cache_tokens(trainer)
        out["host_rss_bytes"] = host_rss_bytes()
        out["baseline_rss_bytes"] = baseline_rss
        ts = getattr(trainer, "timeshare", None)
        if ts is not None:
            out["host_held_bytes"] = sum(ts.store.context.host_bytes().values())
            out["moved_bytes"] = sum(r.bytes_in + r.bytes_out for r in ts.records)
            out["transitions"] = len(ts.records)
            # Each step's tidal log line (the phases' peaks, what moved, its exposed time) and
            # the last step's transitions one by one: where the time over TRL's went.
            out["tidal_logs"] = [{k: v for k, v in h.items() if k.startswith("tidal/")} for h in hist]
            ts.settle_stalls(wait=True)
            per_step = len(ts.records) // max(1, len(steps))
            out["last_transitions"] = [
                {
                    "kind": r.kind,
                    "out": list(r.roles_out),
                    "in": r.role_in,
                    "note": r.note,
                    "gb_out": r.bytes_out / 1e9,
                    "gb_in": r.bytes_in / 1e9,
                    "s": r.seconds,
                    "exposed_s": r.exposed_seconds,
                }
                for r in ts.records[-per_step:]
            ]
        out["ok"] = True
    except Exception as e:  # a variant that does not fit says so in its row
        import traceback

        out["ok"] = False
        out["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        out["traceback"] = traceback.format_exc()[-3000:]
    finally:
        peak.stop()
        if turns is not None:
            turns.end_turn()  # a step cut short by an error: the partner's turn comes all the same
            # Rank 0 hosts the store: it stays until the partner is done with it (or gone).
            turns.barrier("done")
    return out


#: TRL's logged values that the same run must reproduce (not timings, not tidal's own figures).
_COMPARED = (
    "loss",
    "grad_norm",
    "reward",
    "reward_std",
    "kl",
    "entropy",
    "completions/mean_length",
    "completions/min_length",
    "completions/max_length",
    "clip_ratio/region_mean",
)


def _weights_digest(model) -> str:
    """SHA-256 of the model's parameters' bytes, in their order (host copies, one at a time)."""
    import hashlib

    import torch

    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _kv_cache_tokens(trainer) -> int | None:
    """The tokens the colocated engine's KV cache holds (vLLM's blocks times their size), or None
    where the engine does not say."""
    llm = getattr(getattr(trainer, "vllm_generation", None), "llm", None)
    cache = getattr(getattr(getattr(llm, "llm_engine", None), "vllm_config", None), "cache_config", None)
    blocks, size = getattr(cache, "num_gpu_blocks", None), getattr(cache, "block_size", None)
    return int(blocks) * int(size) if blocks and size else None


def identity(rows: list[dict]) -> list[dict]:
    """Each finished run against the first finished ``trl`` run: whether TRL's log lines are
    equal (and their largest difference) and whether the final weights are the same bytes."""
    ok = [r for r in rows if r.get("ok") and r.get("trl_logs") is not None]
    base = next((r for r in ok if r["variant"].split("+")[0] == "trl"), None)
    if base is None:
        return []
    out = []
    for r in ok:
        if r is base:
            continue
        a, b = base["trl_logs"], r["trl_logs"]
        diffs = [
            abs(x[k] - y[k])
            for x, y in zip(a, b)
            for k in x.keys() & y.keys()
            if isinstance(x[k], (int, float)) and isinstance(y[k], (int, float))
        ]
        out.append(
            {
                "variant": r["variant"],
                "round": r.get("round"),
                "logs_equal": len(a) == len(b) and a == b,
                "max_log_diff": max(diffs) if diffs else None,
                "weights_equal": r["weights_sha256"] == base["weights_sha256"],
            }
        )
    return out


def _optimizer_state_bytes(trainer) -> int:
    """The bytes of the optimizer's state tensors (their shapes: wherever they are now)."""
    import torch

    inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    n = 0
    for st in inner.state.values():
        for v in st.values():
            if torch.is_tensor(v) and v.dim() > 0:
                n += v.numel() * v.element_size()
    return n


def _floor(r: dict, line: dict | None, warmup: int) -> dict | None:
    """bench_trl.py's floor (``trl_bench.report.step_floor``) for a tidal row, over the steps
    after ``warmup``: the phases' compute (their device seconds less the steps' waits on tidal's
    copies) plus the optimizer state beyond the room beside the weights and gradients at the
    host-to-device line rate; None without the phases or a line rate."""
    steps, logs, w = r.get("steps", [])[warmup:], (r.get("tidal_logs") or [])[warmup:], r.get("workload")
    if not steps or not w or not line or not all("phase_s" in s for s in steps):
        return None
    compute = statistics.median(sum(s["phase_s"].values()) for s in steps)
    exposed = statistics.median(h.get("tidal/exposed_s", 0.0) for h in logs) if logs else 0.0
    compute = max(0.0, compute - exposed)
    room = w["device_total_bytes"] - w["weights_bytes"] - w["grads_bytes"]
    beyond = max(0, w["optimizer_state_bytes"] - room)
    return {"floor_s": compute + beyond / (line["h2d_gbps"] * 1e9), "compute_s": compute, "beyond_room_bytes": beyond}


def _summary(r: dict, warmup: int) -> dict:
    steps = r.get("steps", [])[warmup:]
    gen = r.get("generate_s", [])[warmup:]
    return {
        "step_s": statistics.median(s["seconds"] for s in steps) if steps else None,
        "step_range": (min(s["seconds"] for s in steps), max(s["seconds"] for s in steps)) if steps else None,
        "generate_s": statistics.median(gen) if gen else None,
        "peak_gib": max(s["peak_bytes"] for s in steps) / 2**30 if steps else None,
        "n": len(steps),
    }


def _paired_rounds(rows: list[dict]) -> dict:
    """Per tidal variant: each round's median step against that round's TRL + vLLM run (the
    runs of one round are neighbours in time), the median of those ratios and its 95% interval
    (``trl_bench.stats.median_ci95``: distribution-free, None below 6 rounds)."""
    from trl_bench.stats import median_ci95

    base = {
        r["round"]: r["summary"]["step_s"] for r in rows if r["variant"].startswith("trl") and r["summary"]["step_s"]
    }
    ratios: dict = {}
    for r in rows:
        v, step = r["variant"], r["summary"]["step_s"]
        if v.startswith("trl") or not step or r["round"] not in base:
            continue
        ratios.setdefault(v, []).append(step / base[r["round"]])
    return {
        v: {"ratios": xs, "ratio_median": statistics.median(xs), "ratio_ci95": median_ci95(xs), "n": len(xs)}
        for v, xs in ratios.items()
    }


def turns_problem(variants: list[str], turns: bool, cap_gib: float | None) -> str | None:
    """Why ``--turns`` cannot run these settings (what to give instead), or None."""
    if not turns:
        return None
    kinds = [v.split("+")[0] for v in variants]
    if len(variants) != 2 or sorted(kinds) != ["tidal", "trl"]:
        return (
            f"--turns pairs the steps of two processes, TRL + vLLM alone and one tidal variant: give two "
            f"variants, one trl and one tidal (e.g. --variants trl,tidal+role+prefetch+kv=auto), not {variants}"
        )
    if cap_gib is not None:
        return "--turns runs two processes on the whole GPU at once: it cannot run under --cap-gib; leave one out"
    return None


def turn_ranks(variants: list[str], rnd: int) -> list[str]:
    """The variant each process (rank 0, rank 1) runs in round ``rnd``: swapped every round."""
    return list(variants) if rnd % 2 == 0 else list(variants[::-1])


def turn_pairs(rows: list[dict], warmup: int) -> dict:
    """``--turns``: per tidal variant, each step after ``warmup`` against the TRL + vLLM step of
    its pair (the same turn number in the same round, both taken in turn), the step's and the
    generation's: their medians and 95% intervals (``trl_bench.stats.median_ci95``) over every
    round's pairs, and each round's median ratio. A step the partner was not there for (a lost
    turn) or a run that failed pairs with nothing."""
    from trl_bench.stats import median_ci95

    def turn_steps(r: dict) -> dict:
        gen = r.get("generate_s") or []
        out = {}
        for i, s in enumerate(r.get("steps") or []):
            t = s.get("turn")
            if i >= warmup and t and t.get("met"):
                out[t["n"]] = (s["seconds"], gen[i] if i < len(gen) else None)
        return out

    got: dict = {}
    for rnd in sorted({r["round"] for r in rows}):
        runs = [r for r in rows if r["round"] == rnd and r.get("steps")]
        base = next((r for r in runs if r["variant"].split("+")[0] == "trl"), None)
        if base is None:
            continue
        anchor = turn_steps(base)
        for r in runs:
            if r is base or r["variant"].split("+")[0] == "trl":
                continue
            mine = turn_steps(r)
            ns = sorted(anchor.keys() & mine.keys())
            if not ns:
                continue
            g = got.setdefault(r["variant"], {"ratios": [], "generate_ratios": [], "round_medians": []})
            xs = [mine[n][0] / anchor[n][0] for n in ns]
            g["ratios"] += xs
            g["round_medians"].append(statistics.median(xs))
            g["generate_ratios"] += [mine[n][1] / anchor[n][1] for n in ns if mine[n][1] and anchor[n][1]]
    return {
        v: {
            **g,
            "n": len(g["ratios"]),
            "ratio_median": statistics.median(g["ratios"]),
            "ratio_ci95": median_ci95(g["ratios"]),
            "generate_ratio_median": statistics.median(g["generate_ratios"]) if g["generate_ratios"] else None,
            "generate_ratio_ci95": median_ci95(g["generate_ratios"]),
        }
        for v, g in got.items()
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen2-1.5b")
    p.add_argument("--variants", default="trl,tidal")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--completion", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--micro", type=int, default=64, help="completions a micro-batch (64 / it accumulated)")
    p.add_argument("--cap-gib", type=float, default=None)
    p.add_argument("--model-dir", default=None)
    p.add_argument("--json", default=None)
    p.add_argument("--timeout", type=int, default=900, help="seconds each variant's process may run")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the variants this many times, the order reversed every other round (ABBA...): each tidal "
        "run's median step against its round's trl run, their median ratio and a 95%% interval",
    )
    p.add_argument(
        "--turns",
        action="store_true",
        help="each round's two variants (trl and one tidal variant) as two processes on the GPU at once, taking "
        "turns step by step; each tidal step against the TRL + vLLM step of its pair; the next round swaps the "
        "processes (see the module's text)",
    )
    p.add_argument(
        "--port", type=int, default=29631, help="with --turns: the first round's rendezvous port on 127.0.0.1"
    )
    p.add_argument("--turn-timeout", type=float, default=300.0, help="with --turns: seconds to wait for the partner")
    p.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_lockstep", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--_out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_model", default=None, help=argparse.SUPPRESS)
    p.add_argument("--cap-held-bytes", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.micro <= 0 or 64 % args.micro:
        p.error(f"--micro must divide the 64 completions of a step, got {args.micro}")
    problem = turns_problem(args.variants.split(","), args.turns, args.cap_gib)
    if problem:
        p.error(problem)
    if args._child:
        res = child(args._child, args._model, args)
        with open(args._out, "w") as f:
            json.dump(res, f)
        return 0 if res.get("ok") else 1

    import torch

    from trl_bench.probes import line_rate
    from trl_bench.workload import save_model

    model_dir = args.model_dir or os.path.join(tempfile.gettempdir(), f"bench_vllm_{args.preset}")
    save_model(args.preset, model_dir)
    line = line_rate()  # before another process holds the device's memory
    if line:
        print(f"line rate: {line}", flush=True)
    cap_proc, held = None, 0
    if args.cap_gib is not None:
        free, total = torch.cuda.mem_get_info()
        held = int(total - args.cap_gib * 2**30)
        code = (
            "import torch, sys, time; x = torch.empty(int(sys.argv[1]), dtype=torch.uint8, device='cuda'); "
            "print('held', flush=True); time.sleep(100000)"
        )
        cap_proc = subprocess.Popen([sys.executable, "-c", code, str(held)], stdout=subprocess.PIPE, text=True)
        cap_proc.stdout.readline()
    import importlib.metadata as md

    versions = {k: md.version(k) for k in ("torch", "transformers", "trl", "vllm")}
    rows = []
    variants = args.variants.split(",")
    order = [(r, v) for r in range(args.rounds) for v in (variants if r % 2 == 0 else variants[::-1])]

    def command(v: str, out: str, extra: list[str]) -> list[str]:
        cmd = [sys.executable, __file__, "--_child", v, "--_out", out, "--_model", model_dir]
        cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--completion", str(args.completion)]
        cmd += ["--max-model-len", str(args.max_model_len), "--cap-held-bytes", str(held)]
        cmd += ["--micro", str(args.micro), "--turn-timeout", str(args.turn_timeout)]
        if args.cap_gib is not None:
            cmd += ["--cap-gib", str(args.cap_gib)]
        return cmd + extra

    def collect(v: str, out: str, rnd: int, t0: float) -> dict:
        try:
            with open(out) as f:
                res = json.load(f)
        except (OSError, json.JSONDecodeError):
            res = {"variant": v, "ok": False, "error": "no result (crashed or timed out)"}
        res["process_s"] = time.perf_counter() - t0
        res["round"] = rnd
        res["summary"] = _summary(res, args.warmup)
        if res.get("ok") and res.get("host_held_bytes") is not None:
            res["summary"].update(_floor(res, line, args.warmup) or {})
            res["summary"]["host_rss_over_held_plus_baseline"] = res["host_rss_bytes"] / (
                res["host_held_bytes"] + res["baseline_rss_bytes"]
            )
        print(f"== {v} (round {rnd}): ok={res.get('ok')} {res['summary']} {res.get('error', '')}", flush=True)
        return res

    gpu = torch.cuda.get_device_name()

    def write_json(rows: list[dict]) -> None:
        # Written after every round as well, so a call that runs out of time keeps the rounds done.
        if not args.json:
            return
        out = {
            "gpu": gpu,
            "versions": versions,
            "preset": args.preset,
            "cap_gib": args.cap_gib,
            "micro": args.micro,
            "line_rate": line,
            "rows": rows,
            "paired": _paired_rounds(rows),
            "paired_by_turns": turn_pairs(rows, args.warmup) if args.turns else {},
            "identity": identity(rows),
        }
        with open(args.json, "w") as f:
            json.dump(out, f)

    try:
        if args.turns:
            for rnd in range(args.rounds):
                ranks = turn_ranks(variants, rnd)
                address = f"127.0.0.1:{args.port + rnd}"
                t0 = time.perf_counter()
                procs = []
                for rank, v in enumerate(ranks):
                    out = tempfile.mktemp(suffix=".json")
                    cmd = command(v, out, ["--_lockstep", address, "--_rank", str(rank)])
                    # Each engine's own one-process group (vLLM's external launcher) on a port of its own.
                    env = {
                        **os.environ,
                        "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(args.port + 100 + 2 * rnd + rank),
                    }
                    procs.append((v, out, subprocess.Popen(cmd, env=env)))
                for v, out, proc in procs:
                    try:
                        proc.wait(timeout=max(1.0, args.timeout - (time.perf_counter() - t0)))
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait()
                    rows.append(collect(v, out, rnd, t0))
                write_json(rows)
        else:
            for rnd, v in order:
                out = tempfile.mktemp(suffix=".json")
                t0 = time.perf_counter()
                try:
                    subprocess.run(command(v, out, []), timeout=args.timeout)
                except subprocess.TimeoutExpired:
                    pass
                rows.append(collect(v, out, rnd, t0))
                write_json(rows)
    finally:
        if cap_proc is not None:
            cap_proc.kill()
    base = next((r for r in rows if r["variant"].split("+")[0] == "trl" and r["summary"]["step_s"]), None)
    print(
        f"\n{gpu}, {versions}; {args.preset} bf16, 64 x {args.completion}"
        + (f", capped at {args.cap_gib} GiB" if args.cap_gib else "")
    )
    print(f"{'variant':<22}{'step s':>9}{'x TRL':>8}{'gen s':>8}{'peak GiB':>10}{'x TRL':>8}  steps  note")
    for r in rows:
        s = r["summary"]
        ratio = s["step_s"] / base["summary"]["step_s"] if base and s["step_s"] else None
        pratio = s["peak_gib"] / base["summary"]["peak_gib"] if base and s["peak_gib"] else None

        def f(x, fmt):
            width = int(fmt.split(".")[0]) if fmt[0].isdigit() else 0
            return format(x, fmt) if x is not None else "-".rjust(width)

        note = r.get("error", "")[:80] if not r.get("ok") else ""
        if s.get("floor_s"):
            note = (
                f"floor {s['floor_s']:.3f} s (compute {s['compute_s']:.3f} + "
                f"{s['beyond_room_bytes'] / 1e9:.1f} GB beyond the room): {s['step_s'] / s['floor_s']:.3f}x; "
                f"host RSS {s['host_rss_over_held_plus_baseline']:.3f}x held + baseline"
            )
        print(
            f"{r['variant']:<22}{f(s['step_s'], '9.3f')}{f(ratio, '8.3f')}{f(s['generate_s'], '8.3f')}"
            f"{f(s['peak_gib'], '10.2f')}{f(pratio, '8.3f')}  {s['n']:>5}  {note}"
        )
    paired = _paired_rounds(rows)
    for v, st in paired.items():
        ci = st["ratio_ci95"]
        interval = f"{ci[0]:.3f}-{ci[1]:.3f}" if ci else "needs 6 rounds or more"
        print(f"paired, {v}: step {st['ratio_median']:.3f}x TRL + vLLM's (median of {st['n']} rounds; 95% {interval})")
    by_turns = turn_pairs(rows, args.warmup) if args.turns else {}
    for v, st in by_turns.items():
        ci, gci = st["ratio_ci95"], st["generate_ratio_ci95"]
        print(
            f"paired by turns, {v}: step {st['ratio_median']:.3f}x TRL + vLLM's (median of {st['n']} pairs of steps; "
            f"95% {f'{ci[0]:.3f}-{ci[1]:.3f}' if ci else 'needs 6 pairs or more'}), generation "
            f"{st['generate_ratio_median']:.3f}x"
            + (f" (95% {gci[0]:.3f}-{gci[1]:.3f})" if gci else "")
            + f"; by round: {', '.join(f'{x:.3f}' for x in st['round_medians'])}"
        )
    same = identity(rows)
    for i in same:
        diff = f"{i['max_log_diff']:.3g}" if i["max_log_diff"] is not None else "-"
        print(
            f"against the first TRL + vLLM run, {i['variant']} (round {i['round']}): TRL's log lines "
            f"{'equal' if i['logs_equal'] else 'differ'} (largest difference {diff}), final weights "
            f"{'the same bytes' if i['weights_equal'] else 'differ'}"
        )
    for r in rows:
        if r.get("kv_cache_tokens"):
            logs = r.get("tidal_logs") or [{}]
            kv = logs[-1].get("tidal/engine_gib/kv_cache")
            print(
                f"{r['variant']}: KV cache of {r['kv_cache_tokens']} tokens"
                + (f" ({kv:.2f} GiB at driver level)" if kv else "")
                + f"; generation {r['summary']['generate_s'] or float('nan'):.3f} s"
            )
    write_json(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
