"""Offloads that copy nothing (issue 16, item 1): a reference role's offload after its first.

    python benchmarks/bench_elision.py [--preset qwen2-1.5b] [--device cuda] [--cycles 3] [--results PATH]

One process, one model shape, three roles of the same shape side by side, each cycled out and
back ``--cycles`` times against a small trained role:

* ``copying``: an ordinary role (every offload copies every byte): the anchor;
* ``frozen``: ``add_role(frozen=True)`` (declared never written: released without a copy);
* ``checked``: ``add_role(skip_unchanged=True)`` (digested on the device at each offload; copied
  only if changed). Its last cycle writes one parameter first, so the checked offload copies
  that storage and skips the rest.

Every role goes out once first (its first offload copies). Then, per cycle, each role comes in
and goes out again; printed: the bytes copied and skipped and the seconds of each offload (the
digest included), with the ratio to the copying role's median offload (target: 0 bytes and
< 5% for the frozen and checked roles when nothing changed), and the reload beside it.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tidal import Timeshare  # noqa: E402
from tidal.units import format_bytes  # noqa: E402
from tidal_recipes.measure import build_model  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="qwen2-1.5b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--cycles", type=int, default=3)
    ap.add_argument("--results", default=None, help="append the rows to this RESULTS.md")
    args = ap.parse_args()
    dev = torch.device(args.device)
    models = {
        name: build_model(args.preset, device=dev, seed=i)[0] for i, name in enumerate(("copying", "frozen", "checked"))
    }
    trainer = torch.nn.Linear(256, 256, device=dev)
    ts = Timeshare(args.device)
    ts.add_role("copying", model=models["copying"])
    ts.add_role("frozen", model=models["frozen"], frozen=True)
    ts.add_role("checked", model=models["checked"], skip_unchanged=True)
    ts.add_role("train", model=trainer)
    rows: dict[str, list[tuple[int, int, float, float]]] = {name: [] for name in models}
    for name in models:  # every role out once (its first, copying offload) before measuring
        with ts.use(name):
            pass
    with ts.use("train"):
        pass
    for cycle in range(args.cycles + 1):
        for name, model in models.items():
            if cycle == args.cycles and name == "checked":
                with ts.use(name), torch.no_grad():
                    next(model.parameters()).add_(1.0)  # one storage changed before the last offload
            with ts.use(name):
                pass
            with ts.use("train"):
                out = ts.records[-1]  # the switch that took the role out
            with ts.use(name):
                back = ts.records[-1]
            rows[name].append((out.move.bytes_out, out.bytes_skipped, out.seconds, back.seconds))
    gpu = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    print(f"{gpu}, torch {torch.__version__}; preset {args.preset}; role state {format_bytes(rows['copying'][0][0])}")
    anchor = sorted(r[2] for r in rows["copying"])[len(rows["copying"]) // 2]
    lines = []
    for name, rs in rows.items():
        for i, (copied, skipped, s_out, s_in) in enumerate(rs):
            tag = "after a write" if name == "checked" and i == len(rs) - 1 else f"cycle {i + 1}"
            line = (
                f"  {name:<8} {tag:<14} offload copied {format_bytes(copied):>10}, skipped {format_bytes(skipped):>10}, "
                f"{s_out * 1e3:8.2f} ms ({s_out / anchor:.3f}x the copying offload's median); reload {s_in * 1e3:8.2f} ms"
            )
            print(line)
            lines.append((name, tag, copied, skipped, s_out, s_out / anchor, s_in))
    if args.results:
        day = datetime.date.today().isoformat()
        with open(args.results, "a") as f:
            f.write(
                f"\n### Offloads without a copy, {gpu}, {day} (benchmarks/bench_elision.py --preset {args.preset})\n"
                f"torch {torch.__version__}; anchor: the copying role's median offload after its first, "
                f"{anchor * 1e3:.2f} ms.\n\n| role | offload | copied | skipped | ms | x anchor | reload ms |\n"
                "|---|---|---|---|---|---|---|\n"
            )
            for name, tag, copied, skipped, s_out, ratio, s_in in lines:
                f.write(
                    f"| {name} | {tag} | {format_bytes(copied)} | {format_bytes(skipped)} | {s_out * 1e3:.2f} | "
                    f"{ratio:.3f} | {s_in * 1e3:.2f} |\n"
                )
    ts.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
