"""The bench's flags and ``main``: the model saved and the line rate measured in a process of
their own, then each variant in a child process of its own (so one's allocator cache cannot
flatter the next; under ``accelerate launch`` with ``--nproc`` > 1), or with ``--paired
--in-process`` the rounds in turn in one child; the report after each.

The child processes run the entry script (``benchmarks/bench_trl.py``) with the hidden flags
``--_prepare`` (save the model, measure the line rate), ``--_variant V`` (one run) or
``--_sequence V1,V2,...`` (runs in turn), each writing JSON to ``--_out``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import lockstep

from trl_bench import ENTRY_SCRIPT, report as report_mod
from trl_bench.host_watch import run_watching_host_memory
from trl_bench.variants import Variant, VariantError
from trl_bench.workload import PRESETS

__all__ = ["LAUNCH_CONFIGS", "build_parser", "child_cmd", "launched", "main", "merged_ranks", "run_order"]

LAUNCH_CONFIGS = {"ddp": "multi_gpu.yaml", "fsdp2": "fsdp2.yaml", "zero3-offload": "zero3.yaml"}
"""TRL's accelerate configs by ``--launch``; ``zero3-offload``: its zero3.yaml with parameters and
optimizer state on the CPU, the anchor a TRL user reaches for when the model does not fit."""

_USAGE = """\
python benchmarks/bench_trl.py [--preset qwen2-1.5b] [--steps 4] [--variants trl,step,stream,stream+prefetch]
    [--results PATH] [--json PATH]

Each variant runs in its own process: trl is GRPOTrainer, ds-zero3-offload GRPOTrainer with DeepSpeed
ZeRO-3 offload, step / stream / role TidalGRPOTrainer with that optimizer residency, with suffixes
+prefetch, +budget=<GiB>, +headroom=<GiB>, +evict=as_needed, +peak=<GiB>, +unpaced, +expandable
(benchmarks/trl_bench/variants.py). Measured after the first step (warm-up): peak allocated device
memory, median step wall time (from on_step_begin to on_step_end, the compute stream synchronised),
tidal's transitions' exposed share of the step, each phase's device time, the gaps between generated
tokens. Anchor: TRL alone (the ratio columns); targets: peak <= 0.6x at step time <= 1.05x.
"""


def build_parser() -> argparse.ArgumentParser:
    """The bench's flags (``--help``), the hidden ones of its child processes included."""
    p = argparse.ArgumentParser(
        description="TRL's GRPOTrainer alone against TRL with tidal (TidalGRPOTrainer), side by side on one GPU.",
        epilog=_USAGE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = p.add_argument
    add("--preset", default="qwen2-1.5b", choices=sorted(PRESETS))
    add("--steps", type=int, default=4)
    add("--variants", default="trl,step,stream,stream+prefetch", help="comma-separated (see below)")
    add("--batch", type=int, default=16, help="per_device_train_batch_size (completions per step)")
    add("--completion", type=int, default=32, help="max_completion_length")
    add(
        "--micro-batch",
        type=int,
        default=None,
        help="completions a forward and backward takes (per_device_train_batch_size, with "
        "gradient_accumulation_steps = batch / this); default: the whole batch at once",
    )
    add("--dtype", default="float32", help="weights as TRL loads them (its default: float32)")
    add(
        "--reward-model",
        action="store_true",
        help="every variant also scores with a reward model of the policy's shape (TRL keeps it on the "
        "device; tidal gives it a turn)",
    )
    add("--results", default=None, help="append the RESULTS.md rows to this file")
    add("--json", default=None, help="write every variant's measurements to this JSON")
    add(
        "--profile-step",
        type=int,
        default=0,
        help="profile this step (1-based; not counted in the step times) with torch.profiler: where its time "
        "goes (benchmarks/step_trace.py) is printed and put in the JSON",
    )
    add("--picture", default=None, help="with --profile-step: draw the profiled steps to this PNG")
    add("--profile-variants", default="", help="with --profile-step: profile only these (comma-separated)")
    add(
        "--sample-stacks",
        action="store_true",
        help="sample the host's Python stack every 2 ms in the measured steps: where the time inside tidal's "
        "verbs goes (benchmarks/host_samples.py), in the JSON and printed",
    )
    add(
        "--nproc",
        type=int,
        default=1,
        help="processes (one GPU each) a variant runs in, under `accelerate launch` with TRL's config for --launch",
    )
    add(
        "--launch",
        choices=sorted(LAUNCH_CONFIGS),
        default="ddp",
        help="with --nproc > 1: ddp, fsdp2, or zero3-offload (TRL alone only: tidal refuses DeepSpeed through "
        "accelerate)",
    )
    add(
        "--one-gpu-json",
        default=None,
        help="with --nproc > 1: the JSON of the same workload on one GPU (this script, run just before on the "
        "same machine): each variant's throughput is printed against it",
    )
    add(
        "--anchor-json",
        default=None,
        help="the JSON of an anchor run of the same workload (this script, e.g. TRL alone under --launch "
        "zero3-offload on the same GPUs): each variant's step and peak are printed against its first run that ran",
    )
    add(
        "--paired",
        type=int,
        default=0,
        help="run TRL alone and each tidal variant in N rounds (trl X Y, then Y X trl, ...; a process each, or one "
        "process with --in-process) and report each variant's median step ratio against the TRL run of its round, "
        "with its 95%% interval (in the JSON: paired)",
    )
    add(
        "--in-process",
        action="store_true",
        help="with --paired: the runs alternate in one process (each a trainer of its own, freed before the "
        "next), so no pair spans two processes, whose steps differ more than one process's do",
    )
    add(
        "--lockstep",
        default=None,
        metavar="HOST:PORT",
        help="with --paired --in-process and one tidal variant: this process and a partner (the same command "
        "with --lockstep-rank 1, on another GPU of the machine) start every step together, one running TRL alone "
        "while the other runs tidal, swapping each run; rank 0 hosts the rendezvous at HOST:PORT "
        "(benchmarks/lockstep.py). pool_paired.py --lockstep pairs their steps",
    )
    add(
        "--lockstep-rank",
        type=int,
        default=0,
        choices=(0, 1),
        help="with --lockstep: 0 runs the --paired order (TRL alone first), 1 its complement",
    )
    add(
        "--turns",
        action="store_true",
        help="with --lockstep: the two processes share one GPU (give both the same one) and take turns step by "
        "step instead of starting together: each step runs alone on the GPU and the host, the partner's the step "
        "before or after it; in each pair of steps the one that goes first alternates. A step ends once all its "
        "device work has (its copies' tail included)",
    )
    add(
        "--main-cores",
        default=None,
        metavar="A,B",
        help="with --lockstep: each measured step's main thread on core A or B (Linux core numbers), the partner's "
        "on the other, swapped every step, so that a core faster than the other (a host-bound decode runs at its "
        "core's pace) favours neither side; the core is recorded with each step (lockstep_steps)",
    )
    add(
        "--model-cache",
        default=None,
        help="a folder where the preset's random model is saved once and found by later runs (a 14B save takes "
        "about a minute); default: a new temporary folder each run",
    )
    add(
        "--trl-loading",
        choices=("every-rank", "rank0"),
        default="every-rank",
        help="TRL alone under --launch fsdp2: every rank loads the weights (default; the values right), or only "
        "rank 0, as fsdp2.yaml says (the host holds one copy, not one a rank; TRL's reference is then empty on the "
        "other ranks: its memory is right, its values are not, so only for where it runs out of memory)",
    )
    add(
        "--host-floor-gib",
        type=float,
        default=0.0,
        help="stop a variant (its whole process group) when the host's available memory falls below this many GiB, "
        "and record it as out of host memory with what its processes held; 0 (default): never",
    )
    add(
        "--deadline-s",
        type=float,
        default=0.0,
        help="end each variant's training after the step that leaves less than that step's time (+15%%, and 20 s "
        "to write its results) before this many seconds from the bench's start, all ranks alike; the JSON says "
        "how many steps ran and that the deadline ended it (a call's time limit then still yields the steps "
        "run); 0 (default): no deadline",
    )
    for hidden in ("--_variant", "--_sequence", "--_model", "--_out", "--reward-model-path"):
        add(hidden, default=None, help=argparse.SUPPRESS)
    for hidden in ("--_deadline", "--_launched"):
        add(hidden, type=float, default=0.0, help=argparse.SUPPRESS)
    add("--_prepare", action="store_true", help=argparse.SUPPRESS)
    return p


def _check(p: argparse.ArgumentParser, args) -> None:
    """Refuse (``p.error``, exit 2) what cannot run, before any model is saved or process
    launched; set the run state the flags imply (``_main_cores``, ``_process_cores``,
    ``_turn_n``, ``_lockstep``, ``_run_index``, ``commit``)."""
    if args.micro_batch is not None and (args.micro_batch < 1 or args.batch % args.micro_batch):
        p.error(f"--micro-batch {args.micro_batch} must divide --batch {args.batch}")
    for flag, path in (("--anchor-json", args.anchor_json), ("--one-gpu-json", args.one_gpu_json)):
        if path and not os.path.isfile(path):
            p.error(f"{flag} {path}: no such file (give the path of a JSON this bench wrote, e.g. under gpu.sh's $OUT)")
    for v in (args._sequence or args._variant or args.variants).split(","):
        try:
            Variant.parse(v)
        except VariantError as e:
            p.error(str(e))
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
    args._main_cores = args._process_cores = None
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
    args._turn_n = 0  # --turns: the steps this process has started, all runs together
    args._lockstep, args._run_index = None, 0
    args.commit = os.environ.get("TIDAL_COMMIT", "")  # the commit measured (for the JSON)


def run_order(variants: list[str], rounds: int, lockstep_rank: int = 0) -> list[str]:
    """The runs of ``--paired rounds`` (0: ``variants`` as given): rounds of TRL alone and each
    tidal variant, every other round in reverse (trl A B, B A trl, trl A B, ...), so each
    variant runs as often after its TRL run as before it and a host whose speed drifts through
    the call favours neither side. ``lockstep_rank`` 1: rank 0's complement (tidal where rank 0
    runs TRL alone and the reverse; one tidal variant), so every step of each runs beside a step
    of the other."""
    if not rounds:
        return list(variants)
    ours = [v for v in variants if v != "trl"]
    order = [v for r in range(rounds) for v in (["trl", *ours] if r % 2 == 0 else [*ours, "trl"])]
    if lockstep_rank == 1:
        order = [ours[0] if v == "trl" else "trl" for v in order]
    return order


def child_cmd(args, what: list[str], out: str, model_path: str, *, profile: bool) -> list[str]:
    """The command line of a child process running ``what`` (``--_variant V`` or ``--_sequence
    V1,V2,...``) with this run's settings, writing its JSON to ``out``; ``profile``: with
    ``--profile-step`` where ``--profile-variants`` (if given) names the variant."""
    v = what[1]
    profile_step = (
        args.profile_step if profile and (not args.profile_variants or v in args.profile_variants.split(",")) else 0
    )
    cmd = [sys.executable, ENTRY_SCRIPT, *what, "--_deadline", repr(args._deadline), "--_launched", repr(time.time())]
    cmd += ["--_model", model_path, "--_out", out, "--steps", str(args.steps), "--batch", str(args.batch)]
    cmd += ["--completion", str(args.completion), "--dtype", args.dtype, "--profile-step", str(profile_step)]
    cmd += ["--nproc", str(args.nproc), "--launch", args.launch]
    cmd += ["--sample-stacks"] if args.sample_stacks else []
    cmd += ["--micro-batch", str(args.micro_batch)] if args.micro_batch else []
    cmd += ["--reward-model-path", args.reward_model_path] if args.reward_model_path else []
    cmd += ["--lockstep", args.lockstep, "--lockstep-rank", str(args.lockstep_rank)] if args.lockstep else []
    cmd += ["--main-cores", args.main_cores] if args.main_cores else []
    cmd += ["--turns"] if args.turns else []
    return cmd


def launched(cmd: list[str], args) -> list[str]:
    """``cmd`` (a variant's process: ``python bench_trl.py --_variant ...``) under ``accelerate
    launch`` with ``args.nproc`` processes and TRL's config for ``args.launch`` (its
    multi_gpu.yaml, fsdp2.yaml or zero3.yaml, as a TRL user launches), on a free port. Mixed
    precision bf16 but under FSDP2 (see :func:`trl_bench.workload.grpo_config`). Under FSDP2,
    TRL alone's ranks each load the weights unless ``args.trl_loading`` is ``rank0``: with only
    the first loading them (fsdp2.yaml's cpu_ram_efficient_loading) accelerate sends the
    policy's shards, but TRL shards its reference as loaded, empty on the other ranks; tidal's
    variants keep fsdp2.yaml's setting (their reference's shards come from rank 0's weights as
    the policy's do)."""
    import trl

    variant = cmd[cmd.index("--_variant") + 1] if "--_variant" in cmd else ""
    config = os.path.join(os.path.dirname(trl.__file__), "accelerate_configs", LAUNCH_CONFIGS[args.launch])
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mixed = "no" if args.launch == "fsdp2" else "bf16"
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config]
    launch += ["--num_processes", str(args.nproc), "--mixed_precision", mixed, "--main_process_port", str(port)]
    if args.launch == "fsdp2" and variant == "trl" and args.trl_loading == "every-rank":
        launch += ["--fsdp_cpu_ram_efficient_loading", "false"]
    if args.launch == "zero3-offload":
        launch += ["--offload_optimizer_device", "cpu", "--offload_param_device", "cpu"]
    return launch + cmd[1:]


_RANK_KEYS = (
    "rank",
    "error",
    "step_s",
    "step_min_s",
    "peak_bytes",
    "exposed_s_per_step",
    "moved_gb_per_step",
    "transition_gbps",
    "host_held_bytes",
    "host_pinned_bytes",
    "host_rss_bytes_steps",
    "launch",
    "host_baseline_rss_bytes",
    "oom_at",
    "phase_peak_bytes_steps",
    "step_times_s",
    "stopped_by_deadline",
)


def merged_ranks(out: str, nproc: int, variant: str = "") -> dict | None:
    """The ranks' results of one variant (``<out>.rank<r>``) as one: rank 0's, with the step
    the slowest rank's median (the ranks wait for each other), the peak the highest rank's, the
    error the first rank's own (the others' follow from it: killed by the launcher), and each
    rank's step, peak, exposed share and host memory under ``ranks``. None if no rank wrote one."""
    died = "no result (the process died)"
    ranks = []
    for r in range(nproc):
        try:
            with open(f"{out}.rank{r}") as f:
                ranks.append(json.load(f))
        except OSError:
            ranks.append({"rank": r, "error": died})
    if all(x.get("error") == died for x in ranks):
        return None
    res = dict(next((x for x in ranks if "variant" in x), ranks[0]))
    res["variant"] = res.get("variant") or variant
    errors = sorted((x["error"] for x in ranks if x.get("error")), key=lambda e: e.startswith("no result"))
    if errors:
        res["error"] = errors[0]
    else:
        res["step_s"] = max(x["step_s"] for x in ranks)
        res["step_min_s"] = max(x["step_min_s"] for x in ranks)
        res["peak_bytes"] = max(x["peak_bytes"] for x in ranks)
        res["exposed_s_per_step"] = max(x.get("exposed_s_per_step", 0.0) for x in ranks)
    res["ranks"] = [{k: x.get(k) for k in _RANK_KEYS} for x in ranks]
    res["nproc"] = nproc
    return res


def _prepare(args) -> int:
    """``--_prepare``: save the model at ``--_model`` (and a reward model at
    ``--reward-model-path``, if given), and write the line rate and the GPU's
    name to ``--_out``."""
    import torch

    from trl_bench.probes import line_rate
    from trl_bench.workload import save_model

    save_model(args.preset, args._model, args.reward_model_path)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    with open(args._out, "w") as f:
        json.dump({"line_rate": line_rate(), "gpu": gpu}, f)
    return 0


def _run_sequence(args) -> int:
    """``--_sequence``: each run in turn in this process, its trainer freed before the next,
    each result printed as it is written (a run cut short keeps what it measured); a run the
    deadline ended early ends the sequence (with ``--lockstep`` the partner ended the same run
    at the same step and stops here too)."""
    from trl_bench.run import run_variant

    if args.lockstep:
        args._lockstep = lockstep.Lockstep(args.lockstep, args.lockstep_rank)
    for i, v in enumerate(args._sequence.split(",")):
        args._run_index = i
        run_variant(v, args._model, f"{args._out}.{i}", args)
        with open(f"{args._out}.{i}") as f:
            done = json.load(f)
        print(f"[bench_trl] run {i}: " + json.dumps({k: x for k, x in done.items() if k != "profile"}))
        if done.get("stopped_by_deadline"):
            print(f"[bench_trl] the deadline ended run {i}: runs {i + 1}- not run", flush=True)
            break
    return 0


def _read_other_calls(args) -> None:
    """``--anchor-json``: its first run that ran (``args.anchor``, with its ``launch_name``);
    ``--one-gpu-json``: each variant's completions a second and generation seconds on one GPU
    (``args.one_gpu``, ``args.one_gpu_generate``)."""
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
        args.one_gpu_generate = {
            v["variant"]: v["phase_s"]["generate"] for v in ones if "generate" in v.get("phase_s", {})
        }


def _prepare_in_child(args, model_path: str, work: str) -> None:
    """Save the model and measure the line rate in a process of its own (this one would keep a
    CUDA context and the line-rate buffers in its cache on the GPU all run long, memory neither
    TRL nor tidal could use); ``args.line_rate`` and ``args.gpu_name`` from it."""
    t0 = time.perf_counter()
    prepared = os.path.join(work, "prepared.json")
    cmd = [sys.executable, ENTRY_SCRIPT, "--_prepare", "--preset", args.preset, "--_model", model_path]
    cmd += ["--_out", prepared] + (["--reward-model-path", args.reward_model_path] if args.reward_model_path else [])
    subprocess.run(cmd, check=True)
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


def _in_one_child(args, variants: list[str], work: str, model_path: str) -> list[dict]:
    """``--paired --in-process``: the runs in turn in one child process; a run missing from it
    is an error (its exit status, or the deadline's end of an earlier run)."""
    out = os.path.join(work, "sequence.json")
    cmd = child_cmd(args, ["--_sequence", ",".join(variants)], out, model_path, profile=False)
    env = dict(os.environ)
    env.setdefault("CUDA_VISIBLE_DEVICES", "0")
    rc, host = run_watching_host_memory(cmd, env)
    results = []
    for i, v in enumerate(variants):
        path = f"{out}.{i}"
        why = "not run: an earlier run was ended by the bench's deadline" if rc == 0 else f"exit {rc}"
        res = json.load(open(path)) if os.path.exists(path) else {"variant": v, "error": why}
        res.update(host, in_process=True)
        results.append(res)
    return results


def _in_its_own_child(args, v: str, work: str, model_path: str) -> dict:
    """Variant ``v`` in a child process of its own (under ``accelerate launch`` with
    ``--nproc`` > 1; else on GPU 0 unless ``CUDA_VISIBLE_DEVICES`` says: TRL loads a model given
    by path with device_map="auto", over every GPU the process sees), its host memory watched;
    its result, or an error from its exit status or the host-memory floor."""
    out = os.path.join(work, f"{v}.json")
    cmd = child_cmd(args, ["--_variant", v], out, model_path, profile=True)
    env = {**os.environ, **Variant.parse(v).env()}
    if args.nproc > 1:
        cmd = launched(cmd, args)
    elif "CUDA_VISIBLE_DEVICES" not in env:
        env["CUDA_VISIBLE_DEVICES"] = "0"
    rc, host = run_watching_host_memory(cmd, env, floor_bytes=int(args.host_floor_gib * 2**30))
    res = merged_ranks(out, args.nproc, v) if args.nproc > 1 else None
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
    return res


def main(argv=None) -> int:
    """The bench: ``argv`` (None: ``sys.argv[1:]``) parsed and checked; a child's part, or the
    whole bench (the model, the runs, the report). Returns the exit status."""
    p = build_parser()
    args = p.parse_args(argv)
    _check(p, args)
    if args._prepare:
        return _prepare(args)
    if args._sequence:
        return _run_sequence(args)
    if args._variant:
        from trl_bench.run import run_variant

        run_variant(args._variant, args._model, args._out, args)
        return 0
    _read_other_calls(args)
    work = tempfile.mkdtemp()
    model_path = os.path.join(args.model_cache or work, args.preset)
    args._deadline = time.time() + args.deadline_s if args.deadline_s > 0 else 0.0
    args.reward_model_path = os.path.join(work, args.preset + "-reward") if args.reward_model else None
    _prepare_in_child(args, model_path, work)
    variants = run_order(args.variants.split(","), args.paired, args.lockstep_rank)
    if args.in_process:
        results = _in_one_child(args, variants, work, model_path)
    else:
        results = []
        for v in variants:
            results.append(_in_its_own_child(args, v, work, model_path))
            print(json.dumps({k: x for k, x in results[-1].items() if k != "profile"}), flush=True)
            report_mod.report(args, results)  # a run cut short keeps what it measured
    report_mod.report(args, results, final=True)
    return 0
