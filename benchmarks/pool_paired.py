"""Pool the pairs of several ``bench_trl.py --paired`` runs into one ratio and its 95% interval.

Each input is the JSON of one bench process (``--paired N --in-process``) that ran TRL alone and
tidal in turn on its own GPU; ``gpu.sh trl:paired`` with ``PAIRED_GPUS=k`` runs k of them at
once, one a GPU of one machine. Every pair stays inside its process (a tidal run against the TRL
run of its round, as ``trl_bench.stats.paired`` pairs them), so what differs between processes (the
GPU, the host's speed then) cancels within each ratio; the pooled figures are the median of all
the processes' ratios and the distribution-free interval for it (``trl_bench.stats.median_ci95``).

    python3 benchmarks/pool_paired.py --json OUT.json IN.json [IN.json ...]

The processes share the host: its memory, its PCIe fabric and its cores. The output says how
many ran at once, so a reader can weigh that against one process alone on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from trl_bench.stats import median_ci95, paired  # noqa: E402

__all__ = ["lockstep_pairs", "pool"]


_WORKLOAD = ("preset", "dtype", "batch", "completion")


def _workloads(runs: list[dict]) -> set[tuple]:
    """The distinct workloads (:data:`_WORKLOAD`) the bench JSONs ``runs`` measured."""
    return {tuple(r.get(k) for k in _WORKLOAD) for r in runs}


def _summary(values: list[float]) -> dict:
    return {
        "ratio_median": statistics.median(values) if values else None,
        "ratio_ci95": median_ci95(values) if values else None,
        "n": len(values),
    }


def pool(runs: list[dict]) -> dict:
    """``runs``: the JSON objects of bench_trl.py ``--paired`` processes. Returns, per tidal
    variant, the step ratio's median, 95% interval and n over every process's pairs (the
    ``paired`` field of bench_trl's JSON, with ``processes``), the same for the generation phase
    and for the generation per unit of the host's speed, the highest peak ratio, and each process's own ``paired``
    summary under ``per_process``. Raises ``ValueError`` when no input holds a pair, or when the
    inputs measured different workloads (preset, dtype, batch, completion)."""
    if not runs:
        raise ValueError("no bench JSON given: pass the files bench_trl.py --paired wrote")
    shapes = _workloads(runs)
    if len(shapes) > 1:
        raise ValueError(
            f"the runs measured different workloads {sorted(map(str, shapes))} ({', '.join(_WORKLOAD)}): pool one"
        )
    out: dict = {}
    for i, run in enumerate(runs):
        for name, p in paired(run.get("variants", [])).items():
            row = out.setdefault(name, {"step": [], "generate": [], "per_probe": [], "peak": [], "per_process": []})
            row["step"] += p["ratios"]
            row["peak"] += p["peak_ratios"]
            row["generate"] += p["generate_ratios"]
            row["per_probe"] += p["generate_per_probe_ratios"]
            row["per_process"].append({"process": i, "gpu": run.get("gpu"), **_summary(p["ratios"])})
    if not out:
        raise ValueError("no pair in the inputs: each needs TRL alone and a tidal variant run in turn (--paired)")
    pooled = {}
    for name, row in out.items():
        gen, probe = _summary(row["generate"]), _summary(row["per_probe"])
        pooled[name] = {
            **_summary(row["step"]),
            "processes": len(row["per_process"]),
            "ratios": row["step"],
            # The highest of tidal's peaks against its pair's TRL peak: the "at <= 0.5x" side.
            "peak_ratio_max": max(row["peak"]) if row["peak"] else None,
            "generate_ratio_median": gen["ratio_median"],
            "generate_ratio_ci95": gen["ratio_ci95"],
            "generate_per_probe_ratio_median": probe["ratio_median"],
            "generate_per_probe_ratio_ci95": probe["ratio_ci95"],
            "per_process": row["per_process"],
        }
    return pooled


def _generate_s(run: dict, k: int) -> float | None:
    """The generation phase's seconds in measured step ``k`` of ``run`` (None if not recorded)."""
    steps = run.get("phase_s_steps") or []
    return steps[k].get("generate") if k < len(steps) else None


def lockstep_pairs(*runs: dict) -> dict:
    """The steps of ``bench_trl.py --lockstep`` processes, given as ranks 0 and 1 of one
    lockstep, then of the next (other calls or machines), that started together: where one ran
    TRL alone and the other tidal, each measured step of tidal against the step of TRL alone
    that began with it (the same rendezvous key, met on both sides). Returns, per tidal variant:
    the step ratio's median, 95% interval and n, the same over the runs' medians (a run is the
    independent unit) and for the generation phase, the medians with tidal on rank 0's GPU and
    on rank 1's (a GPU's own speed shows as their difference), with ``--main-cores`` those with
    tidal's main thread on each core (a core's own speed), with ``--turns`` (the two taking
    turns on one GPU: paired steps are neighbours, not simultaneous) those with tidal's step
    first and second in its pair (a drift in time shows as their difference), and the largest
    gap between two paired steps' starts. Raises ``ValueError`` for an odd number of inputs, when they hold no
    such step, or measured different workloads."""
    if not runs or len(runs) % 2:
        raise ValueError(f"--lockstep pairs processes two by two (ranks 0 and 1 of each): got {len(runs)} inputs")
    if len(_workloads(list(runs))) > 1:
        raise ValueError(f"the processes measured different workloads ({', '.join(_WORKLOAD)}): pair one")
    out: dict = {}
    both = [
        (f"{i // 2}:" if len(runs) > 2 else "", ra, rb)
        for i in range(0, len(runs), 2)
        for ra, rb in zip(runs[i].get("variants", []), runs[i + 1].get("variants", []))
    ]
    for prefix, ra, rb in both:
        names = (ra["variant"], rb["variant"])
        if names.count("trl") != 1 or ra.get("error") or rb.get("error"):
            continue
        ours, base, side = (rb, ra, 1) if names[0] == "trl" else (ra, rb, 0)
        met = {s["key"]: (k, s) for k, s in enumerate(ours.get("lockstep_steps", [])) if s["met"]}
        row = out.setdefault(
            ours["variant"],
            {
                "step": [],
                "generate": [],
                "by_side": {0: [], 1: []},
                "by_core": {},
                "by_order": {},
                "turns": set(),  # whether each paired step came from --turns
                "skew": [],
                "keys": [],
            },
        )
        for k, s in enumerate(base.get("lockstep_steps", [])):
            if not s["met"] or s["key"] not in met:
                continue
            j, t = met[s["key"]]
            ratio = ours["step_times_s"][j] / base["step_times_s"][k]
            row["step"].append(ratio)
            row["by_side"][side].append(ratio)
            if "core" in t:  # --main-cores: the core tidal's main thread had for the step
                row["by_core"].setdefault(t["core"], []).append(ratio)
            if "order" in t:  # --turns: whether tidal's step ran before TRL's or after it
                row["by_order"].setdefault(t["order"], []).append(ratio)
            row["turns"].add("order" in t)
            row["skew"].append(abs(t["started_at"] - s["started_at"]))
            row["keys"].append(prefix + s["key"])
            gen, gen0 = _generate_s(ours, j), _generate_s(base, k)
            if gen and gen0:
                row["generate"].append(gen / gen0)
    if not any(r["step"] for r in out.values()):
        raise ValueError(
            "no step of tidal started together with one of TRL alone: pass the JSON of bench_trl.py --lockstep "
            "rank 0 and rank 1 (the same call)"
        )
    for name, row in out.items():
        if len(row["turns"]) > 1:
            raise ValueError(
                f"{name}: some inputs took turns on one GPU (--turns) and some started their steps together: "
                "pool the calls of one method"
            )
    result = {}
    for name, row in out.items():
        gen = _summary(row["generate"])
        # The steps of one run share more than the host of the moment (a run's host-bound decode
        # kept its own pace: 37 to 60 ms a token between runs of one process on an H200
        # machine, 2026-11-28): a run's median ratio is the independent unit, its interval the
        # one to quote.
        by_run: dict[str, list] = {}
        for key, ratio in zip(row["keys"], row["step"]):
            by_run.setdefault(key.split("/")[0], []).append(ratio)
        per_run = [statistics.median(v) for v in by_run.values()]
        run_summary = _summary(per_run)
        result[name] = {
            **_summary(row["step"]),
            "run_ratio_median": run_summary["ratio_median"],
            "run_ratio_ci95": run_summary["ratio_ci95"],
            "runs": run_summary["n"],
            "run_ratios": per_run,
            "ratios": row["step"],
            "keys": row["keys"],
            "generate_ratio_median": gen["ratio_median"],
            "generate_ratio_ci95": gen["ratio_ci95"],
            "generate_ratios": row["generate"],
            # --turns: both ranks on one GPU, so the split is by process; paired steps start a
            # step apart by design (no skew to report).
            "ratio_median_by_gpu": {
                (f"tidal in rank {side}'s process" if row["by_order"] else f"tidal on rank {side}'s GPU"): (
                    statistics.median(v) if v else None
                )
                for side, v in row["by_side"].items()
            },
            "start_skew_s_max": None if row["by_order"] else max(row["skew"]),
        }
        if row["by_order"]:
            result[name]["ratio_median_by_order"] = {
                ("tidal first" if o == 0 else "tidal second"): statistics.median(v)
                for o, v in sorted(row["by_order"].items())
            }
        if row["by_core"]:
            result[name]["ratio_median_by_core"] = {
                f"tidal's main thread on core {c}": statistics.median(v) for c, v in sorted(row["by_core"].items())
            }
    return result


def _fmt(ci) -> str:
    return f"{ci[0]:.3f}-{ci[1]:.3f}" if ci else "no interval (fewer than 6)"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("inputs", nargs="+", help="bench_trl.py --paired JSON files, one a process")
    p.add_argument("--json", required=True, help="where to write the pooled JSON")
    p.add_argument(
        "--lockstep",
        action="store_true",
        help="the inputs are bench_trl.py --lockstep ranks 0 and 1 (of one call, then of the next, ...): also pair "
        "each step of tidal with the step of TRL alone that started with it on the other GPU (in the JSON: lockstep)",
    )
    args = p.parse_args(argv)
    if args.lockstep and len(args.inputs) % 2:
        p.error(f"--lockstep pairs processes two by two (ranks 0 and 1 of each): got {len(args.inputs)} inputs")
    missing = [f for f in args.inputs if not os.path.isfile(f)]
    if missing:
        p.error(f"no such file: {', '.join(missing)} (a bench process that died writes none: see its log)")
    runs = []
    for f in args.inputs:
        with open(f) as fh:
            runs.append(json.load(fh))
    try:
        pooled = pool(runs)
        together = lockstep_pairs(*runs) if args.lockstep else None
    except ValueError as e:
        p.error(str(e))
    first = runs[0]
    with open(args.json, "w") as f:
        json.dump(
            {
                **{
                    k: first.get(k) for k in ("preset", "dtype", "batch", "completion", "gpu", "torch", "trl", "commit")
                },
                # --lockstep: two at once, each pair of inputs a call of its own
                "processes_at_once": 2 if args.lockstep else len(runs),
                **({"lockstep_calls": len(runs) // 2} if args.lockstep else {}),
                "inputs": [os.path.basename(x) for x in args.inputs],
                "paired": pooled,
                **({"lockstep": together} if together is not None else {}),
            },
            f,
        )
    at_once = (
        f"{len(runs) // 2} pairs of processes, each pair at once" if args.lockstep else f"{len(runs)} processes at once"
    )
    print(f"pooled {at_once}, one a GPU ({first.get('gpu')}):")
    for name, r in pooled.items():
        print(
            f"  {name}: step {r['ratio_median']:.3f}x TRL alone's (median of {r['n']} pairs; 95% interval "
            f"{_fmt(r['ratio_ci95'])}) at peaks up to {r['peak_ratio_max'] or float('nan'):.2f}x its; generation {r['generate_ratio_median'] or float('nan'):.3f}x "
            f"({_fmt(r['generate_ratio_ci95'])}); per unit of the host's speed "
            f"{r['generate_per_probe_ratio_median'] or float('nan'):.3f}x"
        )
        for q in r["per_process"]:
            print(f"    process {q['process']}: {q['ratio_median']:.3f}x over {q['n']} pairs")
    for name, r in (together or {}).items():
        by = ", ".join(f"{k} {v:.3f}x" for k, v in r["ratio_median_by_gpu"].items() if v is not None)
        by += "".join(f", {k} {v:.3f}x" for k, v in r.get("ratio_median_by_core", {}).items())
        by += "".join(f", {k} {v:.3f}x" for k, v in r.get("ratio_median_by_order", {}).items())
        turns = "ratio_median_by_order" in r
        how = "steps taken in turns on one GPU" if turns else "steps started together on two GPUs"
        # (in turns a pair's starts are a step apart: no skew to report)
        skew = "" if turns else f"; starts at most {r['start_skew_s_max'] * 1e3:.0f} ms apart"
        print(
            f"  {name}, {how}: step {r['ratio_median']:.3f}x TRL alone's (median of "
            f"{r['n']} steps; 95% interval {_fmt(r['ratio_ci95'])}; over the {r['runs']} runs' medians "
            f"{r['run_ratio_median']:.3f}x, {_fmt(r['run_ratio_ci95'])}); generation {r['generate_ratio_median'] or float('nan'):.3f}x "
            f"({_fmt(r['generate_ratio_ci95'])}); {by}{skew}"
        )
    print(
        "targets (64 x 256, 1.5B fp32): the step's interval's upper end <= 1.05 at <= 0.5x TRL's peak; generation <= 1.02x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
