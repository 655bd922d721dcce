"""cProfile of Timeshare.prefetch's host time on the demo's policy shape (Qwen2-0.5B, bf16):
where the milliseconds a prefetch costs its phase go.

    python scripts/probe_prefetch_host.py [--preset qwen2-0.5b]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from tidal import Timeshare
from tidal_recipes.cli.models import build_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen2-0.5b")
    args = ap.parse_args()
    a = build_model(args.preset, device="cuda", dtype=torch.bfloat16, seed=0)[0]
    b = build_model(args.preset, device="cuda", dtype=torch.bfloat16, seed=1)[0]
    ts = Timeshare("cuda")
    ts.add_role("a", model=a)
    ts.add_role("b", model=b, frozen=True)
    for _ in range(3):
        with ts.use("b"):
            pass
        with ts.use("a"):
            pass
    for i in range(4):
        prof = cProfile.Profile() if i == 3 else None
        with ts.use("a"):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            if prof:
                prof.enable()
            ts.prefetch("b")
            t1 = time.perf_counter()
            if prof:
                prof.disable()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
        with ts.use("b"):
            t3 = time.perf_counter()
        torch.cuda.synchronize()
        rec = ts.records[-1]
        print(
            f"prefetch host {1e3 * (t1 - t0):.2f} ms (its copies done after {1e3 * (t2 - t0):.2f} ms); "
            f"the switch that claims it {1e3 * (t3 - t2):.2f} ms: copied out {rec.bytes_out}, skipped "
            f"{rec.bytes_skipped}, in {rec.bytes_in}, arrived ahead {rec.bytes_prefetched}"
        )
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
