"""Offload / reload / switch benchmark on the GPU: qwen2-1.5b, then qwen2-7b if it fits.

    python benchmarks/bench_offload.py [--device cuda:0] [--warm-iters 3] [--results PATH]

Each preset runs in its own process (``python -m tidal_recipes bench``), so each one's "cold"
figures are the first transitions after start-up and one preset's pinned memory or
allocator cache cannot flatter or starve the next. Every run appends a row to
``benchmarks/RESULTS.md`` and writes its JSON to ``--json-dir``; this script then prints what each
run measured. A preset that does not fit on the device (``tidal bench`` exit code 3) is
reported as skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PRESETS = ("qwen2-1.5b", "qwen2-7b")
EXIT_SKIPPED = 3


def run_preset(preset: str, device: str, warm_iters: int, results: str, json_dir: str) -> dict | None:
    """Run one preset in a fresh process; its output streams through. Returns its figures,
    or None if it was skipped for lack of room."""
    json_path = os.path.join(json_dir, f"bench_{preset}.json")
    cmd = [
        sys.executable,
        "-m",
        "tidal_recipes",
        "bench",
        "--preset",
        preset,
        "--device",
        device,
        "--warm-iters",
        str(warm_iters),
        "--results",
        results,
        "--json",
        json_path,
    ]
    print(f"\n$ {' '.join(cmd)}", flush=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    rc = subprocess.call(cmd, cwd=ROOT, env=env)
    if rc == EXIT_SKIPPED:
        return None
    if rc not in (0, 1):  # 1: ran, but the state was not bit-exact (reported below)
        raise SystemExit(f"tidal bench --preset {preset} failed with exit code {rc}")
    with open(json_path) as f:
        return json.load(f)


def summary(preset: str, r: dict | None) -> str:
    if r is None:
        return f"{preset:<11} skipped: no room on the device or host"
    t, ln, sw, a = r["tidal"], r["line_rate"], r["switch"], r["anchor"]
    parts = [
        f"{preset:<11} {t['bytes'] / 1e9:6.2f} GB",
        f"line D2H/H2D/bidir {ln['d2h_gbps']:.1f}/{ln['h2d_gbps']:.1f}/{ln['bidir_gbps']:.1f}",
    ]
    if "skipped" not in a:
        parts.append(
            f"anchor out {a['offload_cold_gbps']:.1f}/{a.get('offload_warm_gbps', 0):.1f} "
            f"in {a['reload_cold_gbps']:.1f}/{a.get('reload_warm_gbps', 0):.1f}"
        )
    parts.append(
        "tidal x line out {:.3f}/{:.3f} in {:.3f}/{:.3f}".format(
            t["offload_cold_vs_line"],
            t.get("offload_warm_vs_line", float("nan")),
            t["reload_cold_vs_line"],
            t.get("reload_warm_vs_line", float("nan")),
        )
    )
    parts.append(f"switch/seq {sw['ratio']:.3f}" if "ratio" in sw else "switch skipped")
    parts.append(f"host {r['memory']['host_ratio']:.3f}x")
    gap = r["memory"]["free_gap_max_bytes"]
    if gap is not None:
        parts.append(f"free gap {gap / 2**20:.0f} MiB")
    parts.append("bit-exact" if r["bit_exact"] else "NOT BIT-EXACT")
    return " | ".join(parts)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--warm-iters", type=int, default=3)
    p.add_argument("--results", default=os.path.join(HERE, "RESULTS.md"))
    p.add_argument("--json-dir", default=None, help="where the per-preset JSON goes (default: a temp dir)")
    args = p.parse_args(argv)
    json_dir = args.json_dir or tempfile.mkdtemp(prefix="tidal-bench-")
    os.makedirs(json_dir, exist_ok=True)
    runs = {preset: run_preset(preset, args.device, args.warm_iters, args.results, json_dir) for preset in PRESETS}
    print("\nsummary (GB/s; cold/warm; every figure measured in the runs above):")
    for preset, r in runs.items():
        print("  " + summary(preset, r))
    print(f"rows appended to {args.results}; JSON in {json_dir}")
    return 0 if all(r is None or r["bit_exact"] for r in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
