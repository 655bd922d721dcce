"""Transitions behind compute (issue 16, item 2): the GRPO demo's step with and without prefetch.

    python benchmarks/bench_prefetch.py [--steps 6] [--optimizer cpu_adam adamw] [--results PATH]

One process; for each optimizer, ``tidal demo``'s loop at its GPU default (Qwen2-0.5B shape,
bf16, 64 prompts x 16 samples) is run twice with the same seed: the timeshare as it was (each
phase's role brought in by a switch when the phase starts), then with ``--prefetch`` (each phase
brings the next phase's role in behind its compute and writes its own role back ahead of the
switch, within the last step's highest phase peak). The first run also measures the same loop
with every role resident (its step time and peak).

Printed per run, over the steps after the first: the step's seconds, the exposed transition
seconds (the wall time of the switches, the optimizer-state moves around ``step()`` and the
prefetch calls: the time the step spends on transitions, not hidden behind compute) and their
share of the step (target: < 0.5% with prefetch), the bytes copied per step (switches,
optimizer moves, write-backs and prefetches) and how many of them ran behind compute, the peak
allocated memory, and the all-resident step beside them. Both runs must log the same rewards
(prefetch moves bytes only; the script says so or fails).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tidal.units import format_bytes  # noqa: E402
from tidal_recipes.cli.demo import DemoSettings, defaults_for, run_demo  # noqa: E402


def _steady(summary: dict) -> dict:
    phases = summary["phases"]
    moved = sum(v["moved_bytes"] for v in phases.values())
    ahead = sum(v.get("prefetched_bytes", 0) + v.get("written_back_bytes", 0) for v in phases.values())
    return {
        "step_s": summary["step_seconds"],
        "exposed_s": summary["transition_seconds"],
        "share": summary["transition_fraction"],
        "moved": moved,
        "ahead": ahead,
        "peak": summary["peak_timeshare_bytes"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--optimizer", nargs="+", default=["cpu_adam", "adamw"], choices=("cpu_adam", "adamw"))
    ap.add_argument("--preset", default=None, help="model shape (default: the demo's GPU default)")
    ap.add_argument("--out", default="tidal-bench-prefetch")
    ap.add_argument("--results", default=None, help="append the rows to this RESULTS.md")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_prefetch: needs a CUDA device", file=sys.stderr)
        return 3
    import transformers  # noqa: PLC0415

    gpu = torch.cuda.get_device_name()
    versions = f"torch {torch.__version__}, transformers {transformers.__version__}"
    # TIDAL_COMMIT: where the tree ran without its git history (a copy on a lent GPU machine).
    commit = (
        os.environ.get("TIDAL_COMMIT")
        or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
        ).stdout.strip()
        or "?"
    )
    print(f"{gpu} | {versions} | commit {commit}")
    table = []
    for opt in args.optimizer:
        base = defaults_for("cuda")
        base.update(optimizer=opt, steps=args.steps)
        if args.preset:
            base["preset"] = args.preset
        runs = {}
        for prefetch in (False, True):
            s = DemoSettings(
                **base,
                prefetch=prefetch,
                baseline_steps=2 if not prefetch else 0,
                baseline_optimizers=("same",),
                out_dir=os.path.join(args.out, f"{opt}-{'prefetch' if prefetch else 'switch'}"),
            )
            print(f"\n=== {opt}, prefetch={prefetch}: {s}", flush=True)
            runs[prefetch] = run_demo(s, log=lambda line: print(line, flush=True))
            gc.collect()
            torch.cuda.empty_cache()
        before, after = runs[False], runs[True]
        rewards_same = before["reward_first"] == after["reward_first"] and before["reward_last"] == after["reward_last"]
        resident_s = before["step_all_resident_seconds_by_optimizer"].get(opt)
        table.append((opt, base, _steady(before), _steady(after), resident_s, rewards_same))
        if not rewards_same:
            print(
                f"bench_prefetch: {opt}: the rewards differ with prefetch; prefetch must move bytes only",
                file=sys.stderr,
            )

    lines = [
        f"### {gpu}, {datetime.datetime.now():%Y-%m-%d %H:%M} (commit {commit})",
        f"{versions}; `python benchmarks/bench_prefetch.py --steps {args.steps}`: tidal demo's GPU default "
        f"(steps after the first); anchor: the same timeshare without prefetch; floor: the all-resident step.",
        "",
        "| optimizer | run | step s | exposed transitions s | share of step | copied/step | of it behind compute "
        "| peak alloc | step / all-resident |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for opt, _base, b, a, resident_s, _same in table:
        for name, r in (("switch (before)", b), ("prefetch (after)", a)):
            ratio = f"{r['step_s'] / resident_s:.3f}" if resident_s else "-"
            lines.append(
                f"| {opt} | {name} | {r['step_s']:.3f} | {r['exposed_s']:.4f} | {100 * r['share']:.2f}% "
                f"| {format_bytes(int(r['moved']))} | {format_bytes(int(r['ahead']))} | {format_bytes(int(r['peak']))} "
                f"| {ratio} |"
            )
        lines.append(
            f"| {opt} | all roles resident | {resident_s:.3f} | - | - | - | - | - | 1.000 |"
            if resident_s
            else f"| {opt} | all roles resident | - | - | - | - | - | - | - |"
        )
    lines.append("")
    for opt, _base, b, a, _r, same in table:
        lines.append(
            f"- {opt}: exposed transitions {b['exposed_s'] * 1e3:.1f} -> {a['exposed_s'] * 1e3:.1f} ms per step "
            f"({a['exposed_s'] / b['exposed_s']:.3f}x); rewards {'identical' if same else 'DIFFERENT'} with prefetch."
        )
    text = "\n".join(lines)
    print("\n" + text)
    if args.results:
        with open(args.results, "a") as f:
            f.write("\n" + text + "\n")
    return 0 if all(t[5] for t in table) else 1


if __name__ == "__main__":
    raise SystemExit(main())
