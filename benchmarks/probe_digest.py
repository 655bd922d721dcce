"""How long the one-kernel digest takes on a model's storages, split host / device (GPU probe).

    python benchmarks/probe_digest.py [--preset qwen2-1.5b]

Prints, for the model's parameter storages: the host time to queue ``digest_many``, the device
time of the queued work (CUDA events), the time to the digests on the host (``tolist``), the
same for one storage of the same total size, and the HBM read rate this implies.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tidal.state.digest import digest_many  # noqa: E402
from tidal_recipes.cli.models import build_model  # noqa: E402


def measure(views, reps=5):
    rows = []
    for _ in range(reps):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        a.record()
        d = digest_many(views)
        b.record()
        t1 = time.perf_counter()
        d.tolist()
        t2 = time.perf_counter()
        rows.append(((t1 - t0) * 1e3, a.elapsed_time(b), (t2 - t0) * 1e3))
    return min(rows, key=lambda r: r[2])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="qwen2-1.5b")
    args = ap.parse_args()
    model, _ = build_model(args.preset, device="cuda")
    storages = {p.untyped_storage()._cdata: p.untyped_storage() for p in model.parameters()}
    views = list(storages.values())  # as the store passes them
    total = sum(v.nbytes() for v in views)
    digest_many(views).tolist()  # compile
    host, dev, wall = measure(views)
    print(
        f"{len(views)} storages, {total / 2**30:.2f} GiB: queue {host:.2f} ms (host), device {dev:.2f} ms, to host {wall:.2f} ms; {total / dev / 1e6:.0f} GB/s on the device"
    )
    one = torch.empty(total, dtype=torch.uint8, device="cuda")
    host, dev, wall = measure([one])
    print(
        f"1 storage, {total / 2**30:.2f} GiB: queue {host:.2f} ms, device {dev:.2f} ms, to host {wall:.2f} ms; {total / dev / 1e6:.0f} GB/s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
