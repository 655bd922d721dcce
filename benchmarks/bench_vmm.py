"""Address-stable release/restore on one GPU, side by side in one process (issue 15).

    python benchmarks/bench_vmm.py [--presets qwen2-1.5b,qwen2-7b] [--kv-gib 4] [--warm 3] [--results PATH]

For each preset the same allocations (every parameter of the Qwen2-shape model, bf16, one
allocation each, plus a KV cache of ``--kv-gib`` that needs no copy) are made three times and
cycled through three systems, one after the other:

* tidal's VMM region: weights in a ``backup`` tag, the KV cache in a ``discard`` tag; host memory
  reserved first (:meth:`Region.reserve_host`, timed on its own), then cold (first) and warm
  release/restore;
* tidal's resize backend: the weights as a timeshare role (offload / load), the KV cache
  freed and allocated again (it has no address-stable option there);
* ``torch_memory_saver`` (its torch hook mode, CPU backup for the weights, none for the KV
  cache): pause / resume, cold and warm. Skipped with the reason if it cannot be imported.

Every figure is a ratio against the line rate measured in the same run (``tidal bench``'s
measurement: one pinned 2 GiB copy each way, median of five after a warm-up). Release times run until the memory is back with the driver; restore
times until the bytes have landed (synchronised). Driver-level free memory is read after each
release.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tidal import Timeshare, TimeshareConfig  # noqa: E402
from tidal.device import DeviceOps  # noqa: E402
from tidal.units import format_bytes  # noqa: E402
from tidal.vmm import Region  # noqa: E402
from tidal_recipes.measure import measure_line_rate  # noqa: E402
from tidal_recipes.measure import PRESETS, PlainQwen2Shape  # noqa: E402

GiB = 1 << 30


def shapes(preset: str) -> list[torch.Size]:
    with torch.device("meta"):
        model = PlainQwen2Shape(PRESETS[preset])
    return [p.shape for p in model.parameters()]


def make_weights(shape_list: list[torch.Size]) -> list[torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    return [torch.empty(s, dtype=torch.bfloat16, device="cuda").normal_(generator=gen) for s in shape_list]


def driver_free() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def checksum(ts: list[torch.Tensor]) -> list[float]:
    return [float(t.float().sum()) for t in ts[:: max(1, len(ts) // 16)]]


def run_vmm(shape_list, kv_bytes, warm, **options) -> dict:
    region = Region("bench", **options)
    with region.allocate("weights"):
        weights = make_weights(shape_list)
    with region.allocate("kv", policy="discard"):
        kv = torch.empty(kv_bytes, dtype=torch.uint8, device="cuda")
    ref = checksum(weights)
    ptrs = [w.data_ptr() for w in weights] + [kv.data_ptr()]
    nbytes = sum(w.numel() * 2 for w in weights)
    r = {"bytes": nbytes}
    r["pin_s"] = timed(region.reserve_host)
    rel, res, free_after, driver_s = [], [], [], []
    for _ in range(1 + warm):
        rel.append(timed(region.release))
        driver_s.append(region.last_move.driver_seconds)
        free_after.append(driver_free())
        res.append(timed(region.restore))
        driver_s.append(region.last_move.driver_seconds)
        assert [w.data_ptr() for w in weights] + [kv.data_ptr()] == ptrs
    r["driver_s"] = driver_s
    assert checksum(weights) == ref, "VMM region: weights changed"
    r["copied"] = region.last_move.bytes_copied
    r["release"], r["restore"], r["free_after"] = rel, res, free_after
    del weights, kv
    region.close()  # every byte back: the next system starts from the same free memory
    return r, region


def run_resize(shape_list, kv_bytes, warm) -> dict:
    module = torch.nn.Module()
    module.w = torch.nn.ParameterList(torch.nn.Parameter(w, requires_grad=False) for w in make_weights(shape_list))
    ref = checksum(list(module.w))
    nbytes = sum(p.numel() * 2 for p in module.w)
    t0 = time.perf_counter()
    ts = Timeshare(device="cuda", config=TimeshareConfig())
    ts.add_role("weights", model=module)
    r = {"bytes": nbytes, "pin_s": time.perf_counter() - t0}
    kv = torch.empty(kv_bytes, dtype=torch.uint8, device="cuda")
    rel, res, free_after = [], [], []

    def release():
        nonlocal kv
        ts.offload("weights")
        kv = None
        torch.cuda.empty_cache()

    def restore():
        nonlocal kv
        ts.load("weights")
        kv = torch.empty(kv_bytes, dtype=torch.uint8, device="cuda")

    for _ in range(1 + warm):
        rel.append(timed(release))
        free_after.append(driver_free())
        res.append(timed(restore))
    assert checksum(list(module.w)) == ref, "resize backend: weights changed"
    r["release"], r["restore"], r["free_after"] = rel, res, free_after
    ts.close()
    del module, kv
    return r


def run_tms(shape_list, kv_bytes, warm) -> dict:
    try:
        from torch_memory_saver import torch_memory_saver as tms
    except Exception as e:  # noqa: BLE001 - reported, the rest of the bench runs
        return {"skipped": f"torch_memory_saver not importable: {type(e).__name__}: {e}"}
    if not getattr(run_tms, "configured", False):
        tms.hook_mode = "torch"  # settable once, before first use
        run_tms.configured = True
    with tms.region(tag="weights", enable_cpu_backup=True):
        weights = make_weights(shape_list)
    with tms.region(tag="kv"):
        kv = torch.empty(kv_bytes, dtype=torch.uint8, device="cuda")
    ref = checksum(weights)
    nbytes = sum(w.numel() * 2 for w in weights)
    rel, res, free_after = [], [], []
    for _ in range(1 + warm):
        rel.append(timed(tms.pause))
        free_after.append(driver_free())
        res.append(timed(tms.resume))
    assert checksum(weights) == ref, "torch_memory_saver: weights changed"
    r = {"bytes": nbytes, "release": rel, "restore": res, "free_after": free_after}
    import torch_memory_saver

    r["version"] = getattr(torch_memory_saver, "__version__", "0.0.10")
    del weights, kv
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", default="qwen2-1.5b,qwen2-7b")
    ap.add_argument("--kv-gib", type=float, default=4.0)
    ap.add_argument("--warm", type=int, default=3)
    ap.add_argument("--tms-warm", type=int, default=1, help="warm cycles for torch_memory_saver (slow)")
    ap.add_argument("--variants", action="store_true", help="also time the VMM region without its guard, etc.")
    ap.add_argument("--results", default=None, help="append the rows to this RESULTS.md")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_vmm needs a CUDA device")
        return 2
    torch.cuda.init()
    gpu = torch.cuda.get_device_name()
    rate = measure_line_rate(DeviceOps("cuda"), 2 * GiB)
    d2h, h2d = rate["d2h_gbps"], rate["h2d_gbps"]
    print(f"{gpu}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    print(f"line rate (pinned, 2 GiB, median of {rate['reps']}): D2H {d2h:.1f} GB/s, H2D {h2d:.1f} GB/s")
    kv_bytes = int(args.kv_gib * GiB)
    rows = []
    for preset in args.presets.split(","):
        shape_list = shapes(preset)
        torch.cuda.empty_cache()
        baseline = driver_free()
        vmm, region = run_vmm(shape_list, kv_bytes, args.warm)
        gc.collect()
        torch.cuda.empty_cache()
        resize = run_resize(shape_list, kv_bytes, args.warm)
        gc.collect()
        torch.cuda.empty_cache()
        tms = run_tms(shape_list, kv_bytes, args.tms_warm)
        gc.collect()
        torch.cuda.empty_cache()
        n = vmm["bytes"]
        print(
            f"\n{preset}: weights {format_bytes(n)} in {len(shape_list)} allocations, KV {format_bytes(kv_bytes)} "
            f"(no copy); baseline driver free {format_bytes(baseline)}"
        )
        print(f"  tidal VMM: host reserve+pin {vmm['pin_s']:.2f} s, copied per release {format_bytes(vmm['copied'])}")
        print(
            "  tidal VMM: seconds per release/restore "
            + ", ".join(f"{a * 1e3:.1f}/{b * 1e3:.1f} ms" for a, b in zip(vmm["release"], vmm["restore"]))
            + "; of which in driver calls "
            + ", ".join(f"{a * 1e3:.1f}/{b * 1e3:.1f}" for a, b in zip(vmm["driver_s"][::2], vmm["driver_s"][1::2]))
            + f" ms; copy alone at line rate {n / d2h / 1e6:.1f}/{n / h2d / 1e6:.1f} ms"
        )

        def line(name, r):
            rel, res = r["release"], r["restore"]
            warm_rel = min(rel[1:]) if len(rel) > 1 else float("nan")
            warm_res = min(res[1:]) if len(res) > 1 else float("nan")
            out = {
                "system": name,
                "release_cold": n / rel[0] / 1e9,
                "release_warm": n / warm_rel / 1e9,
                "restore_cold": n / res[0] / 1e9,
                "restore_warm": n / warm_res / 1e9,
                "held_after_release": baseline - min(r["free_after"]),
            }
            print(
                f"  {name:<22} release {out['release_cold']:6.1f} cold / {out['release_warm']:6.1f} warm GB/s "
                f"({out['release_cold'] / d2h:.2f} / {out['release_warm'] / d2h:.2f} of line rate); "
                f"restore {out['restore_cold']:6.1f} / {out['restore_warm']:6.1f} GB/s "
                f"({out['restore_cold'] / h2d:.2f} / {out['restore_warm'] / h2d:.2f}); driver-level held after "
                f"release vs baseline {format_bytes(out['held_after_release'])}"
            )
            return out

        v, z = line("tidal VMM region", vmm), line("tidal resize backend", resize)
        if "skipped" in tms:
            print(f"  torch_memory_saver: {tms['skipped']}")
            t = None
        else:
            t = line(f"torch_memory_saver {tms['version']}", tms)
            print(
                f"  tidal VMM vs torch_memory_saver (warm): release {v['release_warm'] / t['release_warm']:.1f}x, "
                f"restore {v['restore_warm'] / t['restore_warm']:.1f}x faster (target >= 8x)"
            )
        rows.append((preset, n, v, z, t))
        del region
        if args.variants:
            for opts in ({"guard_released": False}, {"release_to_driver": False}):
                gc.collect()
                torch.cuda.empty_cache()
                var, region = run_vmm(shape_list, kv_bytes, args.warm, **opts)
                print(
                    f"  variant {opts}: release/restore ms "
                    + ", ".join(f"{a * 1e3:.1f}/{b * 1e3:.1f}" for a, b in zip(var["release"], var["restore"]))
                )
                del region
    if args.results:
        append_results(args.results, gpu, d2h, h2d, kv_bytes, rows)
    return 0


def append_results(path, gpu, d2h, h2d, kv_bytes, rows) -> None:
    day = datetime.date.today().isoformat()
    lines = [
        "",
        f"### Address-stable release/restore, {gpu}, {day} (benchmarks/bench_vmm.py)",
        f"torch {torch.__version__}, CUDA {torch.version.cuda}; line rate in the run: D2H {d2h:.1f}, H2D {h2d:.1f} "
        f"GB/s; KV cache {format_bytes(kv_bytes)} (discard, not copied). GB/s of the weights' bytes; "
        "ratio to the line rate in brackets; cold = first cycle, warm = best of the later ones.",
        "",
        "| preset | weights | system | release cold | release warm | restore cold | restore warm | "
        "held after release |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for preset, n, *systems in rows:
        for s in systems:
            if s is None:
                continue
            lines.append(
                f"| {preset} | {format_bytes(n)} | {s['system']} | {s['release_cold']:.1f} ({s['release_cold'] / d2h:.2f}) "
                f"| {s['release_warm']:.1f} ({s['release_warm'] / d2h:.2f}) | {s['restore_cold']:.1f} "
                f"({s['restore_cold'] / h2d:.2f}) | {s['restore_warm']:.1f} ({s['restore_warm'] / h2d:.2f}) | "
                f"{format_bytes(s['held_after_release'])} |"
            )
    with open(path, "a") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
