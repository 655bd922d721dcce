"""Diagnostic: where does reload time go? Runs offload/reload cycles of a Qwen2-shape role
under several allocation settings in one process and prints per-reload copy seconds, host
seconds spent allocating, and GB/s. Usage: python scripts/probe_reload.py [preset]"""

import sys
import time

import torch

import tidal
from tidal_recipes.cli.models import build_model, make_adamw_state


def main() -> None:
    preset = sys.argv[1] if len(sys.argv) > 1 else "qwen2-1.5b"
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model, _ = build_model(preset, device=dev)
    opt = make_adamw_state(model)
    for coalesce, release in ((True, True), (False, True), (True, False), (False, False)):
        ts = tidal.Timeshare(
            dev, config=tidal.TimeshareConfig(transfer=tidal.TransferConfig(coalesce_allocations=coalesce))
        )
        if not release:  # ceiling: the allocator keeps the blocks, the driver maps nothing
            ts.ops.empty_cache = lambda: None
        ts.add_role("a", model=model, optimizer=opt, optimizer_residency="role")
        for cycle in range(4):
            out = ts.offload("a")
            t0 = time.perf_counter()
            rec = ts.load("a")
            wall = time.perf_counter() - t0
            print(
                f"coalesce={coalesce} release={release} cycle {cycle}: offload {out.gbps:5.1f} GB/s release {out.release_seconds * 1e3:5.1f} ms | "
                f"reload {rec.gbps:5.1f} GB/s copy {rec.seconds * 1e3:6.1f} ms wall {wall * 1e3:6.1f} ms "
                f"alloc {ts.store.last_move.alloc_seconds * 1e3:6.1f} ms segments {ts.store.last_move.segments}",
                flush=True,
            )
        ts.close()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
