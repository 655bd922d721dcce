"""Entry point of the ``tidal`` command (``tidal ...`` or ``python -m tidal_recipes ...``).

Usage::

    tidal demo  [--device cpu|cuda|cuda:N] [--preset ...] [--steps N] [--optimizer adamw|cpu_adam] ...
    tidal bench [--preset tiny|qwen2-0.5b|qwen2-1.5b|qwen2-7b|qwen2.5-14b|qwen2.5-32b|llama3-8b] [--device cpu|cuda|cuda:N]
                [--warm-iters N] [--results PATH] [--json PATH]
    tidal plan  [--preset qwen2-1.5b | --config config.json] [--gpu-mem-gib G] [--gpus N] ...

Each subcommand registers itself with :func:`build_parser` through one ``_add_<name>``
function and runs through one ``_run_<name>`` function, so ``demo`` and ``plan`` slot in
next to ``bench``. Heavy imports (torch models, transformers) happen inside the runner,
so ``tidal --help`` is instant.

Exit codes: 0 done; 1 the run finished but state did not round-trip bit-exact; 2 usage
error (found before any work starts: bad arguments, an output path that cannot be written, a
config that cannot be read); 3 skipped because the device or host has no room for the preset;
4 the run finished and printed its results but an output file could not be written.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Callable, Sequence

from tidal.plan.shapes import ALL_PRESETS

from tidal_recipes.cli.args import (
    MAX_MIB,
    bounded_int,
    device_arg,
    finite_float,
    mib_arg,
    nonneg_int,
    output_problem,
    positive_int,
    seed_arg,
)

__all__ = ["build_parser", "main"]

EXIT_OK, EXIT_WRONG, EXIT_USAGE, EXIT_SKIPPED, EXIT_OUTPUT = 0, 1, 2, 3, 4
_PRESETS = tuple(ALL_PRESETS)  # the shapes' one list (tidal.plan.shapes: no torch)


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="offload / reload / switch benchmark of a Qwen2-shape model's training state",
        description="Measure, in one process on one device: the PCIe line rate, the per-tensor "
        ".to(non_blocking=True) anchor, tidal's offload/reload (cold and warm) as a fraction of "
        "the line rate, an overlapped role switch against sequential offload+reload, host RAM "
        "held and driver free memory after offload; then check the state round-tripped bit-exact.",
    )
    p.add_argument(
        "--preset",
        choices=_PRESETS,
        default=None,
        help="model shape (random weights, no download); default qwen2-1.5b on cuda, tiny on cpu",
    )
    p.add_argument(
        "--device", type=device_arg, default=None, help="cpu, cuda or cuda:N; default cuda when available, else cpu"
    )
    p.add_argument(
        "--warm-iters",
        type=bounded_int(0, 10_000, why="each cycle moves the whole state both ways"),
        default=3,
        help="warm cycles after the cold one; medians are taken over them (default 3, at most 10000)",
    )
    p.add_argument(
        "--line-mib",
        type=bounded_int(1, MAX_MIB, why="1 PiB"),
        default=None,
        help="size of the line-rate buffer in MiB, at least 1 (default 1024 on a GPU, 16 on cpu)",
    )
    p.add_argument(
        "--results",
        metavar="PATH",
        default=None,
        help="append a markdown row to PATH (header written if the file is new)",
    )
    p.add_argument("--json", metavar="PATH", default=None, help="write every figure as JSON to PATH")
    p.add_argument(
        "--per-storage-alloc",
        action="store_true",
        help="reload with one device allocation per storage (TransferConfig("
        "coalesce_allocations=False)), for comparison with the default",
    )
    p.add_argument(
        "--keep-cache",
        action="store_true",
        help="keep offloaded roles' freed blocks in torch's caching allocator "
        "(TimeshareConfig(release_to_driver=False)): faster reloads, but other "
        "processes do not see the memory",
    )
    p.set_defaults(run=_run_bench)


def _run_bench(args: argparse.Namespace) -> int:
    from tidal_recipes.cli.bench import BenchSkipped, run_bench  # noqa: PLC0415 (keep --help light)
    from tidal.device import DeviceOps  # noqa: PLC0415
    from tidal.transfer import TransferConfig  # noqa: PLC0415

    if args.device is not None:
        try:  # a device that is not there is a usage error: say what is visible, no traceback
            DeviceOps(args.device)
        except ValueError as e:
            print(f"tidal bench: error: {e}", file=sys.stderr)
            return EXIT_USAGE
    if _outputs_unwritable("bench", [("--results", args.results), ("--json", args.json)]):
        return EXIT_USAGE
    if args.line_mib:
        problem = _line_buffer_problem(args.line_mib, args.device)
        if problem:
            print(f"tidal bench: error: --line-mib {args.line_mib:,}: {problem}. Nothing was run", file=sys.stderr)
            return EXIT_USAGE

    def log(line: str) -> None:
        print(line, flush=True)

    try:
        result = run_bench(
            preset=args.preset,
            device=args.device,
            warm_iters=args.warm_iters,
            line_bytes=args.line_mib << 20 if args.line_mib else None,
            results_path=args.results,
            log=log,
            transfer=TransferConfig(coalesce_allocations=not args.per_storage_alloc),
            release_to_driver=not args.keep_cache,
        )
    except BenchSkipped as e:
        print(f"tidal bench: skipped: {e}", file=sys.stderr)
        return EXIT_SKIPPED
    ok = True
    if args.json:
        try:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2, default=str)
            log(f"wrote {args.json}")
        except OSError as e:
            print(
                f"tidal bench: error: could not write --json {args.json} ({e}); the figures are printed above",
                file=sys.stderr,
            )
            ok = False
    if not result.get("results_written", True):
        ok = False
    if not result["bit_exact"]:
        return EXIT_WRONG
    return EXIT_OK if ok else EXIT_OUTPUT


def _line_buffer_problem(mib: int, device: str | None) -> str | None:
    """Why the line-rate test cannot hold two buffers of ``mib`` MiB on the device and two
    on the host (four on the host for a CPU run), or None."""
    import torch  # noqa: PLC0415

    from tidal.device import DeviceOps  # noqa: PLC0415
    from tidal.memory import host_memory  # noqa: PLC0415
    from tidal.units import format_bytes  # noqa: PLC0415

    ops = DeviceOps(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    nbytes = mib << 20
    try:
        host_free = host_memory().available_bytes
    except OSError:
        host_free = None
    on_host = 2 * nbytes if ops.is_accelerator else 4 * nbytes
    if host_free is not None and on_host > host_free:
        return (
            f"the line-rate test holds {format_bytes(on_host)} of host buffers and this host has "
            f"{format_bytes(host_free)} available; choose a smaller --line-mib (default 1024 on a GPU, 16 on cpu)"
        )
    if ops.is_accelerator:
        free, _total = ops.driver_free_bytes()
        if 2 * nbytes > free:
            return (
                f"the line-rate test holds {format_bytes(2 * nbytes)} on {ops.device} and it has "
                f"{format_bytes(free)} free; choose a smaller --line-mib"
            )
    return None


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="GRPO with rollout, reference and training roles taking turns on one device",
        description="Train a Qwen2-shape model (random weights, no download) on a digit task with GRPO; "
        "its rollout, reference and training roles share the device through tidal's timeshare. Prints "
        "per-phase time, peak memory and bytes moved, the peak against all roles resident, and writes "
        "a memory-timeline PNG and a JSONL log. Defaults: a tiny model on the CPU; on a GPU the smallest "
        "Qwen2 shape that GPU cannot hold with every role resident (drawn beside the run to where it runs out "
        "of memory), whose memory levers (optimizer residency, gradient checkpointing, micro-batch) the "
        "planner picks for the GPU's and the host's memory, any lever given here kept as given.",
    )
    p.add_argument("--device", type=device_arg, default=None, help="cpu, cuda or cuda:N (default: cuda if present)")
    p.add_argument(
        "--preset",
        choices=_PRESETS,
        default=None,
        help="model shape (default nano on cpu; on a GPU the smallest shape it cannot hold with every role "
        "resident but can with the roles taking turns, else qwen2-0.5b)",
    )
    p.add_argument(
        "--steps",
        type=bounded_int(1, 1_000_000, why="a million steps"),
        default=None,
        help="GRPO steps (default 200 on cpu, 30 on a GPU; at most 1000000)",
    )
    p.add_argument("--task", choices=("copy", "reverse", "sort", "add"), default="copy")
    p.add_argument("--digits", type=positive_int, default=None, help="digits per prompt (= answer tokens)")
    p.add_argument("--prompts", type=positive_int, default=None, help="prompts per step")
    p.add_argument("--group", type=positive_int, default=None, help="samples per prompt (GRPO group)")
    p.add_argument("--micro-batch", type=positive_int, default=None, help="sequences per forward/backward")
    p.add_argument("--lr", type=finite_float(0.0, inclusive=False), default=None, help="learning rate (> 0)")
    p.add_argument("--optimizer", choices=("adamw", "cpu_adam"), default=None)
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None)
    p.add_argument(
        "--optimizer-residency",
        choices=("role", "step", "stream"),
        default=None,
        help="with adamw, where its state lives between steps: with the training role, or on the host and "
        "brought in for step() whole (step) or a chunk at a time (stream)",
    )
    p.add_argument(
        "--optim-state-dtype",
        choices=("fp32", "bf16"),
        default=None,
        help="with cpu_adam, its moments' dtype on the host (bf16: half their memory; fp32 masters stay)",
    )
    p.add_argument(
        "--grad-accumulation",
        choices=("device", "host"),
        default=None,
        help="with cpu_adam: sum micro-batch gradients on the GPU, one copy per step (default), or on the "
        "host as each is produced (no gradient stays on the GPU)",
    )
    p.add_argument(
        "--grad-ckpt",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="gradient checkpointing in training (default: off on cpu; on a GPU the planner decides, on "
        "with --roles processes|ray)",
    )
    p.add_argument(
        "--rollout-graph",
        action="store_true",
        help="decode with the step captured in a CUDA graph over a static KV cache, its memory in a tidal "
        "Region released between rollouts (CUDA only)",
    )
    p.add_argument(
        "--rollout-engine",
        choices=("hf", "vllm"),
        default="hf",
        help="roll out with the policy's own forward (hf, the default) or an in-process vLLM engine taking turns "
        "with the roles (vllm: vLLM installed, a CUDA device; no all-resident comparison: --baseline-steps 0)",
    )
    p.add_argument(
        "--prefetch",
        action="store_true",
        help="each phase brings the next phase's role in behind its compute and writes its own role back "
        "ahead of the switch (Timeshare.prefetch), within the last step's highest phase peak",
    )
    p.add_argument(
        "--async-transitions",
        action="store_true",
        help="transitions return once their copies are queued and freed memory stays in this process's "
        "allocator (as TidalGRPOTrainer does), so the host queues the next phase while the bytes move; "
        "--roles local only (the driver then does not see the freed memory)",
    )
    p.add_argument("--kl-coef", type=finite_float(0.0), default=0.02, help="KL to the reference (0: no reference role)")
    p.add_argument("--lora-rank", type=nonneg_int, default=0, help="train LoRA adapters of this rank (needs peft)")
    p.add_argument(
        "--baseline-steps",
        type=nonneg_int,
        default=None,
        help="steps of the same loop with all roles resident, to measure its peak (0: skip; default 2, "
        "0 with --rollout-engine vllm)",
    )
    p.add_argument(
        "--switch-extra-mib",
        type=mib_arg,
        default=256,
        help="cap on how much a role switch overlaps: one role's state plus this many MiB "
        "(default 256; --full-overlap lifts the cap)",
    )
    p.add_argument(
        "--full-overlap", action="store_true", help="let switches hold both roles' state at once (fastest, higher peak)"
    )
    p.add_argument(
        "--evict",
        choices=("others", "as_needed"),
        default=None,
        help="which roles a switch moves out: every other one (others), or only as many as the incoming "
        "role needs from free memory, less --headroom-mib (as_needed; on a GPU the planner picks it, with "
        "AdamW's state kept with the training role, when every role fits at once)",
    )
    p.add_argument(
        "--headroom-mib",
        type=mib_arg,
        default=None,
        help="device memory a reload leaves free for the phases (activations); with --evict as_needed also "
        "what evictions make room for (default 0; on a GPU with as_needed chosen, the planner's largest "
        "transient need of a phase)",
    )
    p.add_argument("--seed", type=seed_arg, default=0)
    p.add_argument(
        "--roles",
        choices=("local", "processes", "ray"),
        default="local",
        help="where the roles run: this process (default), or the policy and the reference "
        "as workers of their own processes sharing the device through a GPU lease, as spawned "
        "processes or as Ray actors (needs tidal[ray]); the verifier then runs in a CPU worker",
    )
    p.add_argument("--out", default="tidal-demo", help="folder for timeline.png and demo.jsonl")
    p.set_defaults(run=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    from tidal_recipes.cli.demo import DemoSettings, defaults_for, run_demo  # noqa: PLC0415
    from tidal.device import DeviceOps  # noqa: PLC0415

    if args.device is not None:
        try:
            DeviceOps(args.device)
        except ValueError as e:
            print(f"tidal demo: error: {e}", file=sys.stderr)
            return EXIT_USAGE
    if _outputs_unwritable("demo", [("--out", args.out)], folder=True):
        return EXIT_USAGE
    chosen = defaults_for(args.device)
    for name in (
        "preset",
        "steps",
        "digits",
        "prompts",
        "group",
        "micro_batch",
        "lr",
        "optimizer",
        "dtype",
        "grad_ckpt",
    ):
        if getattr(args, name) is not None:
            chosen[name] = getattr(args, name)
    sequences = chosen["prompts"] * chosen["group"]
    if chosen["micro_batch"] > sequences:  # a micro-batch cannot hold more sequences than a step has
        if args.micro_batch is not None:
            print(
                f"tidal demo: note: --micro-batch {args.micro_batch:,} is more than the {sequences} sequences of a "
                f"step ({chosen['prompts']} prompts x {chosen['group']}); using {sequences}",
                file=sys.stderr,
            )
        chosen["micro_batch"] = sequences
    try:
        settings = DemoSettings(
            **chosen,
            task=args.task,
            kl_coef=args.kl_coef,
            lora_rank=args.lora_rank,
            rollout_graph=args.rollout_graph,
            rollout_engine=args.rollout_engine,
            prefetch=args.prefetch,
            async_transitions=args.async_transitions,
            grad_accumulation=args.grad_accumulation or "device",
            optim_state_dtype=args.optim_state_dtype or "fp32",
            optimizer_residency=args.optimizer_residency or "stream",
            # vLLM takes one engine a process: no all-resident loop beside its run unless asked (then refused).
            baseline_steps=args.baseline_steps
            if args.baseline_steps is not None
            else (0 if args.rollout_engine == "vllm" else 2),
            seed=args.seed,
            switch_extra_mib=None if args.full_overlap else args.switch_extra_mib,
            evict=args.evict or "others",
            headroom_mib=args.headroom_mib,
            out_dir=args.out,
            roles=args.roles,
        )
    except ValueError as e:
        print(f"tidal demo: error: {e}. Nothing was run", file=sys.stderr)
        return EXIT_USAGE
    if not DeviceOps(settings.device).is_accelerator:
        problem = _host_memory_problem(settings)
        if problem:
            print(f"tidal demo: error: {problem}. Nothing was run", file=sys.stderr)
            return EXIT_USAGE
    if settings.roles == "local" and DeviceOps(settings.device).is_accelerator:
        # The levers the user left open come from the planner, for this GPU and this host.
        fixed = tuple(
            name
            for name, value in (
                ("optimizer", args.optimizer),
                ("optimizer_residency", args.optimizer_residency),
                ("grad_ckpt", args.grad_ckpt),
                ("optim_state_dtype", args.optim_state_dtype),
                ("grad_accumulation", args.grad_accumulation),
                ("micro_batch", args.micro_batch),
                ("evict", args.evict),
            )
            if value is not None
        )
        if args.preset is None and settings.rollout_engine == "hf" and settings.baseline_steps:
            settings = _beyond_resident(settings, fixed)
        settings = _plan_levers(settings, fixed)
        if settings is None:
            return EXIT_USAGE
    ignored = (
        [("--grad-accumulation", args.grad_accumulation), ("--optim-state-dtype", args.optim_state_dtype)]
        if settings.optimizer != "cpu_adam"
        else [("--optimizer-residency", args.optimizer_residency)]
    )
    for flag, value in ignored:
        if value is not None:
            print(
                f"tidal demo: warning: {flag} {value} is ignored with optimizer {settings.optimizer} "
                f"({'it is about CPU Adam' if settings.optimizer != 'cpu_adam' else 'CPU Adam keeps its state on the host'})",
                file=sys.stderr,
            )
    if settings.roles != "local":
        from tidal_recipes.cli.demo_remote import run_remote_demo as run_demo  # noqa: PLC0415
    try:
        summary = run_demo(settings, log=lambda line: print(line, flush=True))
    except (ImportError, ValueError) as e:
        print(f"tidal demo: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    return EXIT_OUTPUT if summary.get("unwritten") else EXIT_OK


def _host_memory_problem(settings) -> str | None:
    """On the CPU: why the step would not fit the host's available memory (by the planner's
    estimate), or None. On a GPU the planner's lever choice checks the GPU and the host."""
    from tidal.memory import host_memory  # noqa: PLC0415
    from tidal.units import format_bytes  # noqa: PLC0415
    from tidal_recipes.cli.demo_plan import host_need_bytes  # noqa: PLC0415

    try:
        available = host_memory().available_bytes
    except OSError:
        return None  # no /proc/meminfo: nothing to check against
    need = host_need_bytes(settings)
    if need <= available:
        return None
    return (
        f"this step needs about {format_bytes(need)} of memory ({settings.prompts} prompts x {settings.group} "
        f"samples of {2 * settings.digits + 2} tokens, micro-batch {settings.micro_batch}, {settings.preset}) and "
        f"this host has {format_bytes(available)} available; lower --prompts, --group, --digits or --micro-batch"
    )


def _beyond_resident(settings, fixed: tuple[str, ...]):
    """On a GPU, with no --preset: the smallest shape this GPU cannot hold with every role
    resident but can with the roles taking turns (:func:`~tidal_recipes.cli.demo_plan.workload_beyond_resident`),
    said in a line; where none fits this machine, the settings as they are, said why."""
    from tidal.device import DeviceOps  # noqa: PLC0415
    from tidal.memory import host_memory  # noqa: PLC0415
    from tidal_recipes.cli.demo_plan import workload_beyond_resident  # noqa: PLC0415

    _free, total = DeviceOps(settings.device).driver_free_bytes()
    work = workload_beyond_resident(
        settings, fixed=fixed, gpu_mem_bytes=total, host_mem_bytes=host_memory().available_bytes
    )
    if work.preset is None:
        print(
            f"tidal demo: note: {work.why}; running {settings.preset}, which fits with every role resident too "
            "(--preset picks a shape)",
            flush=True,
        )
        return settings
    print(
        f"tidal demo: the workload for this GPU: {work.why}. The same loop with every role resident runs once "
        f"beside it, to where it runs out of memory (--preset {settings.preset}: the small default)",
        flush=True,
    )
    return dataclasses.replace(settings, preset=work.preset, beyond_resident=True)


def _plan_levers(settings, fixed: tuple[str, ...]):
    """The demo settings with the planner's levers for this machine, after printing what it
    chose and why; None (after an error) if nothing fits."""
    from tidal.device import DeviceOps  # noqa: PLC0415
    from tidal.memory import host_memory  # noqa: PLC0415
    from tidal.plan import build_plan  # noqa: PLC0415
    from tidal_recipes.cli.demo_plan import choose_levers, plan_config  # noqa: PLC0415

    def plan_peak(settings, *, resident: bool = False) -> int:
        plan = build_plan(dataclasses.replace(plan_config(settings), timeshare=not resident))
        return plan.device_peak_bytes

    _free, total = DeviceOps(settings.device).driver_free_bytes()
    chosen, rec = choose_levers(
        settings, fixed=fixed, gpu_mem_bytes=total, host_mem_bytes=host_memory().available_bytes
    )
    lines = rec.summary()
    if not rec.fits:
        print("tidal demo: error: the planner finds no way to fit this step on this machine:", file=sys.stderr)
        for line in lines:
            print(f"  {line}", file=sys.stderr)
        print(
            "Set the levers yourself (--optimizer, --grad-ckpt, --optim-state-dtype) to run anyway, or lower "
            "--prompts, --group or --micro-batch. Nothing was run",
            file=sys.stderr,
        )
        return None
    mine = f" (set by you: {', '.join(fixed)})" if fixed else ""
    print(f"tidal demo: levers from the planner for this GPU ({total / 2**30:.1f} GiB) and host{mine}:", flush=True)
    for line in lines:
        print(f"  {line}", flush=True)
    print(
        f"  -> optimizer {chosen.optimizer}"
        + (
            f" ({chosen.optim_state_dtype} moments)"
            if chosen.optimizer == "cpu_adam"
            else f" (state residency {chosen.optimizer_residency})"
        )
        + (f", gradients summed on the {chosen.grad_accumulation}" if chosen.optimizer == "cpu_adam" else "")
        + f", gradient checkpointing {'on' if chosen.grad_ckpt else 'off'}, micro-batch {chosen.micro_batch}"
        + (
            f" (the largest that fits with these: {plan_peak(chosen) / 2**30:.2f} GiB peak with context)"
            if "micro_batch" not in fixed
            else ""
        ),
        flush=True,
    )
    if chosen.evict == "as_needed" and "evict" not in fixed:
        print(
            f"  -> every role fits at once ({plan_peak(chosen, resident=True) / 2**30:.2f} GiB peak with context, "
            f"all resident): they stay resident, moved out only if memory runs short (evict as_needed, "
            f"{chosen.headroom_mib} MiB headroom), AdamW's state with the training role",
            flush=True,
        )
    return chosen


def _outputs_unwritable(command: str, paths: list[tuple[str, str | None]], *, folder: bool = False) -> bool:
    """Print an error for each output path that cannot be written; True if any."""
    bad = False
    for flag, path in paths:
        problem = output_problem(path, folder=folder) if path is not None and path != "-" else None
        if problem is not None:
            print(f"tidal {command}: error: {flag} {path}: {problem}. Nothing was run", file=sys.stderr)
            bad = True
    return bad


def _add_plan(sub: argparse._SubParsersAction) -> None:
    from tidal_recipes.cli.plan import add_parser  # noqa: PLC0415 (arithmetic only: no torch model, no CUDA)

    add_parser(sub)


_SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [_add_demo, _add_bench, _add_plan]


def _version() -> str:
    # From the installed distribution: importing tidal itself would import torch.
    try:
        from importlib.metadata import PackageNotFoundError, version  # noqa: PLC0415

        return version("tidal")
    except PackageNotFoundError:
        return "(not installed: run from a checkout)"


class _Parser(argparse.ArgumentParser):
    """argparse with its errors on one line: what is wrong and where the options are listed,
    without the usage synopsis (a screenful for ``tidal demo``) in front of it."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (`{self.prog} --help` lists the options)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="tidal",
        description="tidal: GPU time-sharing for the roles of LLM RL training.",
    )
    parser.add_argument("--version", action="version", version=f"tidal {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in _SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the subcommand, return its exit code."""
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
    except SystemExit as e:  # argparse exits on --help (0) and on usage errors (2)
        return int(e.code or 0)
    if extra:
        # Named after the subcommand they follow: its --help lists what it takes.
        prog = f"tidal {args.command}" if getattr(args, "command", None) else "tidal"
        print(
            f"{prog}: error: unrecognized arguments: {' '.join(extra)} (`{prog} --help` lists the options)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    if getattr(args, "run", None) is None:
        parser.print_help()
        return EXIT_USAGE
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
