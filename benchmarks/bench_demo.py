"""The colocated GRPO step on a GPU, and the planner's calibration against it.

For each configuration, in one process: run ``tidal demo``'s loop (timeshare on, then a
short run of the same loop with every role resident), read each phase's measured peak
allocated bytes (the phase's own compute, after its role switch; and the switch's), and set
them beside :func:`tidal.plan.predict_phases` for the same configuration. Prints one table
and appends rows to ``benchmarks/RESULTS.md`` (``--no-results`` to skip).

Usage::

    python benchmarks/bench_demo.py                       # the demo's GPU default, three calibration configs
    python benchmarks/bench_demo.py --configs demo --steps 30
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import os
import shutil
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tidal_recipes.cli.demo import DemoSettings, defaults_for, run_demo  # noqa: E402
from tidal.plan import predict_phases  # noqa: E402
from tidal_recipes.cli.demo_plan import plan_kwargs  # noqa: E402

CONFIGS = {
    # name: overrides of the GPU defaults of tidal demo
    "demo": {},
    "demo-adamw": {"optimizer": "adamw"},
    "cal-1.5b-cpu-adam-ckpt": {
        "preset": "qwen2-1.5b",
        "digits": 64,
        "prompts": 16,
        "group": 8,
        "micro_batch": 16,
        "grad_ckpt": True,
        "lr": 5e-5,
    },
    "cal-1.5b-adamw-ckpt": {
        "preset": "qwen2-1.5b",
        "optimizer": "adamw",
        "digits": 64,
        "prompts": 32,
        "group": 8,
        "micro_batch": 32,
        "grad_ckpt": True,
        "lr": 5e-5,
    },
    "cal-0.5b-long": {"preset": "qwen2-0.5b", "digits": 32, "prompts": 32, "group": 8, "micro_batch": 32},
}
PHASES = ("rollout", "reference", "train")


def prediction(s: DemoSettings) -> dict[str, int]:
    """The planner's per-phase peak for exactly what the demo runs (see
    :func:`tidal_recipes.cli.demo_plan.plan_kwargs`)."""
    return predict_phases(s.preset, **plan_kwargs(s))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--configs",
        nargs="+",
        default=["demo", "demo-adamw", "cal-0.5b-long", "cal-1.5b-cpu-adam-ckpt", "cal-1.5b-adamw-ckpt"],
        choices=sorted(CONFIGS),
    )
    ap.add_argument("--steps", type=int, default=30, help="steps of the demo run")
    ap.add_argument("--cal-steps", type=int, default=6, help="steps of the other runs")
    ap.add_argument("--baseline-steps", type=int, default=1)
    ap.add_argument("--out", default="tidal-bench-demo")
    ap.add_argument("--results", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md"))
    ap.add_argument("--no-results", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_demo: needs a CUDA device", file=sys.stderr)
        return 3
    gpu = torch.cuda.get_device_name()
    import transformers  # noqa: PLC0415

    versions = f"torch {torch.__version__}, transformers {transformers.__version__}"
    print(f"{gpu} | {versions}")
    rows = []
    for name in args.configs:
        base = defaults_for("cuda")
        base.update(CONFIGS[name])
        s = DemoSettings(**base, baseline_steps=args.baseline_steps, out_dir=os.path.join(args.out, name))
        s = dataclasses.replace(s, steps=args.steps if name == "demo" else args.cal_steps)
        print(f"\n=== {name}: {s}")
        summary = run_demo(s, log=lambda line: print(line, flush=True))
        pred = prediction(s)
        for ph in PHASES:
            meas = summary["phases"][ph]["compute_peak_allocated_bytes"]
            rows.append((name, s, ph, pred[ph], meas, summary))
        gc.collect()  # the run's models must be gone before the next configuration measures
        torch.cuda.empty_cache()
        if name == "demo" and summary.get("png"):
            shutil.copy(summary["png"], os.path.join(args.out, "..", "timeline_demo.png"))

    print("\nplanner calibration (peak allocated per phase, after the phase's switch):")
    print(f"{'config':<22} {'phase':<10} {'predicted GiB':>13} {'measured GiB':>12} {'pred/meas':>9}")
    for name, _s, ph, pred, meas, _ in rows:
        print(f"{name:<22} {ph:<10} {pred / 2**30:>13.3f} {meas / 2**30:>12.3f} {pred / meas:>9.3f}")
    if not args.no_results:
        new = not os.path.exists(args.results)
        with open(args.results, "a") as f:
            if new:
                f.write("# Benchmark results\n")
            f.write(f"\n<!-- bench_demo {datetime.date.today()} | {gpu} | {versions} -->\n")
            for name, s, ph, pred, meas, summ in rows:
                f.write(
                    f"| {gpu} | {name}: {s.preset} {s.dtype} {s.optimizer}{' +ckpt' if s.grad_ckpt else ''}, "
                    f"{s.prompts}x{s.group} seqs of {2 * s.digits + 2} tokens, micro {s.micro_batch} | {ph} | "
                    f"{pred / 2**30:.3f} | {meas / 2**30:.3f} | {pred / meas:.3f} |\n"
                )
            for name in dict.fromkeys(r[0] for r in rows):
                summ = next(r[5] for r in rows if r[0] == name)
                base = ", ".join(
                    f"{opt} {v / 2**30:.2f} GiB (ratio {summ['peak_timeshare_bytes'] / v:.2f})"
                    if isinstance(v, int)
                    else f"{opt} {v}"
                    for opt, v in summ["peak_all_resident_by_optimizer"].items()
                )
                f.write(
                    f"<!-- demo {name}: step {summ['step_seconds']:.3f} s, transitions "
                    f"{100 * summ['transition_fraction']:.1f}%, peak timeshare "
                    f"{summ['peak_timeshare_bytes'] / 2**30:.2f} GiB; all resident: {base}; reward "
                    f"{summ['reward_first']:.3f} -> {summ['reward_last']:.3f}; rollout left "
                    f"{summ['rollout_left_allocated_bytes']} B; max unreleased {summ['max_unreleased_bytes']} B -->\n"
                )
        print(f"rows appended to {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
