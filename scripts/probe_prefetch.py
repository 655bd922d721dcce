"""Where a prefetch's host time goes and why a write-back does or does not count, on the demo's
loop: every store verb timed (host), every settled write-back's digests compared, every record
printed.

    python scripts/probe_prefetch.py [--preset qwen2-0.5b] [--optimizer cpu_adam] [--steps 3]
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tidal.state.store import OffloadStore  # noqa: E402
from tidal_recipes.cli.demo import DemoSettings, _trainer, defaults_for  # noqa: E402

TIMES: dict[str, list[float]] = {}


def timed(name, fn):
    @functools.wraps(fn)
    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            TIMES.setdefault(name, []).append(time.perf_counter() - t0)

    return wrapper


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default=None)
    ap.add_argument("--optimizer", default="cpu_adam")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--no-prefetch", action="store_true", help="the same loop without prefetch, for comparison")
    ap.add_argument("--no-write-back", action="store_true", help="prefetch the next role, write nothing back")
    args = ap.parse_args()
    base = defaults_for("cuda" if torch.cuda.is_available() else "cpu")
    base.update(optimizer=args.optimizer, steps=args.steps)
    if args.preset:
        base["preset"] = args.preset
    s = DemoSettings(**base, prefetch=not args.no_prefetch, baseline_steps=0)
    if args.no_write_back:
        from tidal.timeshare.timeshare import Timeshare as _TS  # noqa: PLC0415

        _TS.prefetch = functools.partialmethod(_TS.prefetch, write_back=False)
    settle = OffloadStore._settle_write_backs

    def settle_logged(self):
        for wb in self._writing:
            self.engine.wait("write_back_done", wb.done)
            pre, post = wb.pre.tolist(), wb.post.tolist()
            bad = sum(a != b for a, b in zip(pre, post))
            slot = sum(self._slots.get(e.key) is None or self._slots[e.key][1]() is not e.storage for e in wb.entries)
            print(f"  write-back settled: {len(pre)} storages, {bad} changed during the copy, {slot} slot mismatches")
        return settle(self)

    OffloadStore._settle_write_backs = settle_logged
    for name in ("write_back", "prefetch", "switch", "prepare", "_check_unchanged", "cancel_prefetch"):
        setattr(OffloadStore, name, timed(name, getattr(OffloadStore, name)))
    import tidal.state.store as store_mod  # noqa: PLC0415
    from tidal.state.backends import ResizeBackend  # noqa: PLC0415
    from tidal.timeshare.timeshare import Timeshare  # noqa: PLC0415
    from tidal.transfer.engine import TransferEngine  # noqa: PLC0415

    store_mod.digest_many = timed("digest_many", store_mod.digest_many)
    store_mod.snapshot = timed("snapshot", store_mod.snapshot)
    for cls, names in (
        (OffloadStore, ("_queue_arrivals", "forget_unreferenced", "_reserve_device_block", "_move", "_claim")),
        (TransferEngine, ("copy_in", "copy_out", "plan", "begin_in", "begin_out")),
        (ResizeBackend, ("restore", "reserve", "release", "settle")),
        (Timeshare, ("_live", "_choose_evictions", "resident_keys", "_incoming", "_outgoing", "_transition")),
    ):
        for name in names:
            setattr(cls, name, timed(f"{cls.__name__}.{name}", getattr(cls, name)))
    tr = _trainer(s, timeshare=True)
    for i in range(args.steps):
        TIMES.clear()
        t0 = time.perf_counter()
        res = tr.step()
        phases = ", ".join(
            f"{k} {v['seconds']:.3f} s (transitions {1e3 * v['transition_seconds']:.1f} ms)"
            for k, v in res.phases.items()
        )
        print(f"step {i}: {time.perf_counter() - t0:.3f} s; {phases}; host ms per call (calls):")
        for k, v in sorted(TIMES.items(), key=lambda kv: -sum(kv[1])):
            print(f"    {k:<36} {1e3 * sum(v):8.2f} ms ({len(v)})")
    for r in tr.ts.records:
        print(
            f"{r.index:>3} {r.kind:<12} out={','.join(r.roles_out) or '-':<22} in={r.role_in or '-':<12} "
            f"copied out {r.bytes_out / 2**20:8.1f} MiB, skipped {r.bytes_skipped / 2**20:8.1f}, in {r.bytes_in / 2**20:8.1f}, "
            f"arrived ahead {r.bytes_prefetched / 2**20:8.1f}; {1e3 * r.seconds:7.1f} ms"
        )
    tr.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
