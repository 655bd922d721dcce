"""``tidal bench``: offload / reload / switch of a Qwen2-shape model's training state.

Everything runs on one device in one process, in this order, so each figure has its
reference measured next to it:

1. line rate: one large device buffer <-> an exact-size pinned host buffer, D2H alone, H2D
   alone, both at once on two streams (median of several reps after a warm-up);
2. anchor (verl / NeMo-Aligner style): per-tensor ``.to("cpu", non_blocking=True)`` of every
   param, grad and optimizer state tensor, synchronize, and back with ``.to(device)``; the
   first cycle (cold) and the median of the warm ones;
3. tidal: ``Timeshare.add_role`` (host memory pinned here, timed separately), then
   ``offload`` / ``load``, cold and warm, as a fraction of the line rate of step 1;
4. switch: a second role of the same preset; ``load("b")`` while "a" is resident (overlapped)
   against ``offload("a")`` + ``load("b")`` as two calls;
5. memory: tidal's host RAM against the bytes it holds, and the driver's free memory after an
   offload against the free memory before the model existed.

Params/optimizer state are compared to a reference taken before step 2 once everything is
done (``bit_exact``). Nothing printed is hard-coded: every figure is measured in this run.
"""

from __future__ import annotations

import datetime
import os
import statistics
import time
from typing import Callable

import torch

from tidal.device import DeviceOps, host_available_bytes
from tidal.units import format_bytes, gbps
from tidal.timeshare import Timeshare, TimeshareConfig
from tidal.transfer import TransferConfig
from tidal_recipes.measure import (
    PRESETS,
    StateReference,
    build_model,
    empty_host_cache,
    environment,
    make_adamw_state,
    measure_line_rate,
    named_state,
    timed,
)

__all__ = ["BenchSkipped", "run_bench", "format_result", "append_results_row", "TARGETS"]

GIB = 1 << 30
TARGETS = {"line_fraction_min": 0.95, "switch_ratio_max": 0.6, "host_ratio_max": 1.05, "free_gap_max_bytes": 256 << 20}


class BenchSkipped(RuntimeError):
    """The device or host has no room for the preset; nothing was measured."""


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _torch_pinned_bytes(ops: DeviceOps) -> int | None:
    """Bytes torch's pinned host cache holds (rounded blocks), where torch reports it."""
    if ops.device.type != "cuda" or not hasattr(torch.cuda, "host_memory_stats"):
        return None
    return int(torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)) or None


# ---- 2. anchor --------------------------------------------------------------------------------
def _anchor_offload(model, opt, device: torch.device, target: torch.device) -> tuple[list, int]:
    """verl's way: one ``.to(target, non_blocking=True)`` per state tensor, repointing params
    and grads through ``.data`` (as ``Module.to`` does) and replacing optimizer state values.
    Returns what moved (to move it back) and the bytes."""
    moved, nbytes = [], 0
    for p in dict.fromkeys(model.parameters()):
        for t in (p, p.grad):
            if t is not None and t.device == device:
                nbytes += t.numel() * t.element_size()
                t.data = t.data.to(target, non_blocking=True, copy=True)
                moved.append(("data", t, None))
    for state in opt.state.values():
        for key, v in state.items():
            if isinstance(v, torch.Tensor) and v.device == device:
                nbytes += v.numel() * v.element_size()
                state[key] = v.to(target, non_blocking=True, copy=True)
                moved.append(("state", state, key))
    return moved, nbytes


def _anchor_reload(moved: list, device: torch.device) -> None:
    for kind, obj, key in moved:
        if kind == "data":
            obj.data = obj.data.to(device, non_blocking=True, copy=True)
        else:
            obj[key] = obj[key].to(device, non_blocking=True, copy=True)


def run_anchor(ops: DeviceOps, model, opt, warm_iters: int) -> dict:
    """Cold (first) and warm (median) offload/reload through per-tensor ``.to``. The copy
    time runs to the synchronize; the offload's wall time adds ``empty_cache`` (verl calls
    it). ``copy=True`` only matters on CPU, where ``.to("cpu")`` would otherwise be a no-op."""
    host = torch.device("cpu")
    cycles, pinned_bytes, pinned = [], None, None
    for _ in range(1 + warm_iters):
        (moved, nbytes), t_out = timed(ops, lambda: _anchor_offload(model, opt, ops.device, host))
        _, t_release = timed(ops, ops.empty_cache)
        if pinned_bytes is None:
            pinned_bytes = _torch_pinned_bytes(ops)
            pinned = next((obj.is_pinned() for k, obj, _ in moved if k == "data"), None) if ops.is_accelerator else None
        _, t_in = timed(ops, lambda: _anchor_reload(moved, ops.device))
        cycles.append((nbytes, t_out, t_out + t_release, t_in))
        moved = None  # free the host copies before the next cycle makes new ones
    nbytes = cycles[0][0]
    warm = cycles[1:]
    res = {
        "bytes": nbytes,
        "host_tensors_pinned": pinned,
        "torch_pinned_cache_bytes": pinned_bytes,
        "offload_cold_gbps": gbps(nbytes, cycles[0][1]),
        "offload_cold_wall_gbps": gbps(nbytes, cycles[0][2]),
        "reload_cold_gbps": gbps(nbytes, cycles[0][3]),
    }
    if warm:
        res.update(
            offload_warm_gbps=gbps(nbytes, _median([c[1] for c in warm])),
            offload_warm_wall_gbps=gbps(nbytes, _median([c[2] for c in warm])),
            reload_warm_gbps=gbps(nbytes, _median([c[3] for c in warm])),
        )
    return res


# ---- 3-4. tidal -------------------------------------------------------------------------------
def run_tidal_cycles(
    ops: DeviceOps, ts: Timeshare, name: str, warm_iters: int, free_before_model: int, line: dict
) -> dict:
    """``offload(name)`` / ``load(name)`` cycles: cold = the first, warm = median of the rest.
    GB/s from the transition records (copy time) and from the wall time of the call; the
    copy-time GB/s also as a fraction of the ``line`` rate of the same direction."""
    rows, recs = [], []
    for _ in range(1 + warm_iters):
        rec_out, w_out = timed(ops, lambda: ts.offload(name))
        reserved = ops.reserved_bytes()  # what torch's allocator still holds with the role out
        rec_in, w_in = timed(ops, lambda: ts.load(name))
        rows.append(
            (rec_out.seconds, w_out, rec_in.seconds, w_in, free_before_model - rec_out.driver_free_after, reserved)
        )
        recs += [rec_out.as_dict(), rec_in.as_dict()]
    b_out, b_in = recs[0]["bytes_out"], recs[1]["bytes_in"]
    res = {
        "bytes_out": b_out,
        "bytes_in": b_in,
        "records": recs,
        "free_gap_bytes": [r[4] for r in rows],
        "allocator_reserved_after_offload_bytes": max(r[5] for r in rows),
    }
    columns = (
        ("offload", "_gbps", b_out),
        ("offload", "_wall_gbps", b_out),
        ("reload", "_gbps", b_in),
        ("reload", "_wall_gbps", b_in),
    )
    for col, (direction, suffix, nbytes) in enumerate(columns):
        secs = [r[col] for r in rows]
        res[f"{direction}_cold{suffix}"] = gbps(nbytes, secs[0])
        if warm_iters:
            res[f"{direction}_warm{suffix}"] = gbps(nbytes, _median(secs[1:]))
    for key in [k for k in res if k.endswith("_gbps") and "wall" not in k]:
        res[key.replace("_gbps", "_vs_line")] = res[key] / line["d2h_gbps" if key.startswith("offload") else "h2d_gbps"]
    return res


def run_switch(ops: DeviceOps, ts: Timeshare, warm_iters: int) -> dict:
    """Roles "a" and "b" (equal bytes), "a" resident. Per iteration: sequential =
    ``offload("a")`` + ``load("b")`` (two calls), then switch = ``load("a")`` while "b" is
    resident (the default budget evicts "b" during it, both copy engines busy). The first
    iteration is a warm-up; medians of the rest."""
    rows = []
    for i in range(1 + max(1, warm_iters)):
        r1, w1 = timed(ops, lambda: ts.offload("a"))
        r2, w2 = timed(ops, lambda: ts.load("b"))
        r3, w3 = timed(ops, lambda: ts.load("a"))
        assert r3 is not None and r3.kind == "switch", f"expected a switch, got {r3}"
        if i:
            rows.append((w1 + w2, r1.seconds + r2.seconds, w3, r3.seconds, r3.gbps))
    seq, seq_copy, sw, sw_copy, sw_gbps = (_median(list(col)) for col in zip(*rows))
    return {
        "iterations": len(rows),
        "sequential_s": seq,
        "switch_s": sw,
        "ratio": sw / seq,
        "sequential_copy_s": seq_copy,
        "switch_copy_s": sw_copy,
        "ratio_copy": sw_copy / seq_copy,
        "switch_gbps": sw_gbps,
        "bytes_each_way": r3.bytes_in,
    }


# ---- the whole run ---------------------------------------------------------------------------
def run_bench(
    *,
    preset: str | None = None,
    device: str | torch.device | None = None,
    warm_iters: int = 3,
    line_bytes: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    results_path: str | None = None,
    transfer: TransferConfig | None = None,
    release_to_driver: bool = True,
    log: Callable[[str], None] = print,
) -> dict:
    """Run the whole benchmark (see the module docstring) and return every figure.

    ``preset``/``device`` default to ``qwen2-1.5b`` on an available CUDA device, else
    ``tiny`` on the CPU. Raises :class:`BenchSkipped` when the preset cannot fit. Prints
    the report through ``log``; with ``results_path`` appends a markdown row there.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    ops = DeviceOps(device)
    preset = preset or ("qwen2-1.5b" if ops.is_accelerator else "tiny")
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    if warm_iters < 0:
        raise ValueError(f"warm_iters must be >= 0, got {warm_iters}")
    spec = PRESETS[preset]
    if ops.device.type == "cuda":
        torch.cuda.set_device(ops.device)
    torch.empty(1, device=ops.device)  # create the context now: its memory is not ours to count
    ops.synchronize()
    ops.empty_cache()
    free0, total0 = ops.driver_free_bytes()
    env = environment(ops)
    est = 4 * spec.param_count() * dtype.itemsize  # params, grads, exp_avg, exp_avg_sq in their dtype
    temp = 2 * spec.largest_param() * dtype.itemsize + GIB  # the step's temporaries, margin
    log(
        f"tidal bench: {preset} on {env['device']} ({env['device_name']}), est. state {format_bytes(est)}, "
        f"driver free {format_bytes(free0)} of {format_bytes(total0)}, host available {format_bytes(host_available_bytes())}"
    )
    if ops.is_accelerator and est + temp > free0:
        raise BenchSkipped(
            f"{preset} needs ~{format_bytes(est + temp)} on {ops.device} but {format_bytes(free0)} is free"
        )
    if est + 2 * GIB > host_available_bytes():
        raise BenchSkipped(
            f"{preset} needs ~{format_bytes(est)} of host RAM to offload into; "
            f"{format_bytes(host_available_bytes())} is available"
        )
    res: dict = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "env": env,
        "preset": preset,
        "dtype": str(dtype).removeprefix("torch."),
        "warm_iters": warm_iters,
        "targets": TARGETS,
        "driver_free_before_model": free0,
    }

    nbytes = line_bytes or (GIB if ops.is_accelerator else 16 << 20)
    nbytes = int(min(nbytes, max(free0 // 4, 1 << 20)))
    log(f"[1/5] line rate, {format_bytes(nbytes)} each way ...")
    res["line_rate"] = line = measure_line_rate(ops, nbytes)

    log(f"[2/5] building {preset} + AdamW state ...")
    t0 = time.perf_counter()
    model, impl = build_model(preset, device=ops.device, dtype=dtype)
    opt = make_adamw_state(model)
    ops.synchronize()
    res.update(
        model_impl=impl,
        params=sum(p.numel() for p in dict.fromkeys(model.parameters())),
        build_seconds=time.perf_counter() - t0,
    )
    # An exact host copy needs host RAM equal to the state on top of tidal's (two roles) and
    # the anchor's pinned cache; when that cannot fit, checksums on the device stand in.
    mode = "clone" if not ops.is_accelerator or 5 * est + 8 * GIB < host_available_bytes() else "fingerprint"
    reference = StateReference(named_state(model, opt), mode=mode)
    res["reference_mode"] = mode

    pow2 = sum(
        1 << max(0, (t.numel() * t.element_size() - 1).bit_length())
        for t in named_state(model, opt).values()
        if t.device == ops.device
    )
    if ops.is_accelerator and pow2 + 4 * GIB > host_available_bytes():
        res["anchor"] = {
            "skipped": f"torch's pinned cache would round the state up to {format_bytes(pow2)}; "
            f"{format_bytes(host_available_bytes())} host RAM is available"
        }
        log(f"[3/5] anchor skipped: {res['anchor']['skipped']}")
    else:
        log("[3/5] anchor: per-tensor .to(non_blocking=True) ...")
        res["anchor"] = run_anchor(ops, model, opt, warm_iters)
        res["bit_exact_anchor"] = not reference.mismatches(named_state(model, opt))
    empty_host_cache(ops)

    log("[4/5] tidal: add_role + offload/load cycles ...")
    transfer = transfer or TransferConfig()
    ts = Timeshare(ops.device, config=TimeshareConfig(transfer=transfer, release_to_driver=release_to_driver))
    res["tidal_config"] = (
        f"{'coalesced' if transfer.coalesce_allocations else 'per-storage'} alloc, "
        f"{'release to driver' if release_to_driver else 'keep in torch cache'}"
    )
    t0 = time.perf_counter()
    ts.add_role("a", model=model, optimizer=opt, optimizer_residency="role")
    tid = {
        "add_role_seconds": time.perf_counter() - t0,
        "pin_seconds": ts.store.arena.pin_seconds,
        "bytes": ts.role_bytes("a"),
        "host_reserved_bytes": ts.store.host_reserved_bytes,
    }
    res["tidal"] = tid = tid | run_tidal_cycles(ops, ts, "a", warm_iters, free0, line)
    res["memory"] = {
        "host_ratio": tid["host_reserved_bytes"] / tid["bytes"],
        "free_gap_max_bytes": max(tid["free_gap_bytes"]) if ops.is_accelerator else None,
    }

    room = ops.driver_free_bytes()[0] + ops.cached_free_bytes() - ts.store.staging_bytes(2)
    if room < est + temp or host_available_bytes() < est + 2 * GIB:
        res["switch"] = {
            "skipped": f"no room for a second {preset}: {format_bytes(room)} free on the device "
            f"and {format_bytes(host_available_bytes())} on the host, "
            f"~{format_bytes(est + temp)} needed"
        }
        log(f"[5/5] switch skipped: {res['switch']['skipped']}")
    else:
        log("[5/5] switch a <-> b ...")
        model_b, _ = build_model(preset, device=ops.device, dtype=dtype, seed=1)
        opt_b = make_adamw_state(model_b, seed=2)
        ts.add_role("b", model=model_b, optimizer=opt_b, optimizer_residency="role")
        ts.offload("b")
        sw = run_switch(ops, ts, warm_iters)
        sw["vs_bidir_line"] = sw["switch_gbps"] / line["bidir_gbps"]
        res["switch"] = sw
        both = ts.role_bytes("a") + ts.role_bytes("b")
        res["memory"]["host_ratio_two_roles"] = ts.store.host_reserved_bytes / both
    ts.load("a")
    bad = reference.mismatches(named_state(model, opt))
    res.update(bit_exact=not bad, mismatches=bad[:8], transitions=len(ts.records))
    ts.close()
    res["pass"] = _verdicts(res, ops.is_accelerator)
    for line_ in format_result(res).splitlines():
        log(line_)
    if results_path:
        try:
            append_results_row(results_path, res)
            log(f"appended a row to {results_path}")
        except OSError as e:  # the figures are printed above and returned: say so, lose nothing
            res["results_written"] = False
            log(f"could not append to {results_path} ({e}); the figures are printed above")
    return res


def _verdicts(res: dict, accel: bool) -> dict:
    t, m, sw = res["tidal"], res["memory"], res["switch"]
    fr = [v for k, v in t.items() if k.endswith("_vs_line")]
    # The line-rate and switch targets are about PCIe copy engines; on the CPU the "copies"
    # are serial memcpys into freshly faulted pages, so those verdicts are not given there.
    return {
        "line_rate": min(fr) >= TARGETS["line_fraction_min"] if fr and accel else None,
        "switch": sw["ratio"] <= TARGETS["switch_ratio_max"] if "ratio" in sw and accel else None,
        "host_ram": m["host_ratio"] <= TARGETS["host_ratio_max"],
        # With release_to_driver=False the memory is meant to stay in torch's cache.
        "driver_free": m["free_gap_max_bytes"] <= TARGETS["free_gap_max_bytes"]
        if accel and "keep in torch cache" not in res.get("tidal_config", "")
        else None,
        "bit_exact": res["bit_exact"],
    }


# ---- output -----------------------------------------------------------------------------------
def _f(x, spec: str = ".1f", none: str = "-") -> str:
    return none if x is None else format(x, spec)


def format_result(r: dict) -> str:
    """The plain-text report of a :func:`run_bench` result (only measured figures)."""
    e, ln, a, t, m, sw = r["env"], r["line_rate"], r["anchor"], r["tidal"], r["memory"], r["switch"]
    L = [
        f"device  {e['device']} ({e['device_name']})   torch {e['torch']}  CUDA {e['cuda'] or '-'}  "
        f"transformers {e['transformers'] or 'not installed'}  python {e['python']}",
        f"model   {r['preset']}: {r['model_impl']}, {r['params'] / 1e9:.3f} G params, {r['dtype']}; state "
        f"{t['bytes'] / 1e9:.3f} GB (params + grads + AdamW exp_avg, exp_avg_sq); warm iters {r['warm_iters']}",
        "",
        f"line rate ({format_bytes(ln['bytes'])} {'pinned' if ln['pinned'] else 'unpinned'} host buffer, "
        f"median of {ln['reps']}):"
        f"  D2H {ln['d2h_gbps']:.1f}  H2D {ln['h2d_gbps']:.1f}  both at once {ln['bidir_gbps']:.1f} GB/s",
        "",
        f"{'GB/s':<44}{'offload cold':>13}{'warm':>8}{'reload cold':>13}{'warm':>8}",
    ]

    def row(label, d, key, spec=".1f"):
        cells = [_f(d.get(f"{k}{key}"), spec) for k in ("offload_cold", "offload_warm", "reload_cold", "reload_warm")]
        return f"  {label:<42}{cells[0]:>13}{cells[1]:>8}{cells[2]:>13}{cells[3]:>8}"

    if "skipped" in a:
        L.append(f"  anchor skipped: {a['skipped']}")
    else:
        L.append(row("anchor: per-tensor .to(non_blocking=True)", a, "_gbps"))
    L.append(row("tidal: Timeshare offload/load (copy)", t, "_gbps"))
    L.append(row("tidal: wall time of the call", t, "_wall_gbps"))
    L.append(row(f"tidal / line rate (target >= {TARGETS['line_fraction_min']})", t, "_vs_line", ".3f"))
    if "skipped" not in a and a.get("offload_warm_gbps"):
        L.append(
            f"  tidal / anchor, warm:{'':<21}{t.get('offload_warm_gbps', 0) / a['offload_warm_gbps']:>13.2f}{'':>8}"
            f"{t.get('reload_warm_gbps', 0) / a['reload_warm_gbps']:>13.2f}"
        )
    L.append(
        f"  pin at add_role (once): {t['add_role_seconds']:.3f} s wall, {t['pin_seconds']:.3f} s pinning "
        f"{format_bytes(t['host_reserved_bytes'])}"
    )
    L.append("")
    if "skipped" in sw:
        L.append(f"switch: skipped ({sw['skipped']})")
    else:
        L.append(f"switch a -> b, {sw['bytes_each_way'] / 1e9:.3f} GB each way, median of {sw['iterations']}:")
        L.append(
            f"  sequential offload(a) + load(b): {sw['sequential_s']:.4f} s   switch load(a) with b resident: "
            f"{sw['switch_s']:.4f} s   ratio {sw['ratio']:.3f} (target <= {TARGETS['switch_ratio_max']})"
        )
        L.append(
            f"  copy time only: {sw['sequential_copy_s']:.4f} s vs {sw['switch_copy_s']:.4f} s = {sw['ratio_copy']:.3f};"
            f" switch {sw['switch_gbps']:.1f} GB/s = {sw['vs_bidir_line']:.2f} x both-directions line rate"
        )
    L.append("")
    anchor_host = ""
    if a.get("torch_pinned_cache_bytes"):
        anchor_host = (
            f"; anchor's pinned cache {format_bytes(a['torch_pinned_cache_bytes'])} = "
            f"{a['torch_pinned_cache_bytes'] / a['bytes']:.3f}x"
        )
    L.append(
        f"host RAM: tidal holds {format_bytes(t['host_reserved_bytes'])} for {format_bytes(t['bytes'])} = "
        f"{m['host_ratio']:.4f}x (target <= {TARGETS['host_ratio_max']}){anchor_host}"
    )
    if m["free_gap_max_bytes"] is not None:
        L.append(
            f"driver free after offload: at worst {format_bytes(m['free_gap_max_bytes'])} below the free memory "
            f"before the model was built (target <= {format_bytes(TARGETS['free_gap_max_bytes'])}); torch's "
            f"allocator held {format_bytes(t['allocator_reserved_after_offload_bytes'])} of it, the rest is outside "
            f"torch (CUDA context growth, e.g. lazily loaded kernels)"
        )
    else:
        L.append("driver free after offload: not applicable on cpu")
    L.append(
        f"bit-exact after {r['transitions']} transitions ({r['reference_mode']} reference): "
        f"{'yes' if r['bit_exact'] else 'NO: ' + ', '.join(r['mismatches'])}"
        + ("" if "bit_exact_anchor" not in r else f"; anchor round trips: {'yes' if r['bit_exact_anchor'] else 'NO'}")
    )
    verdict = ", ".join(f"{k} {'ok' if v else 'MISSED'}" for k, v in r["pass"].items() if v is not None)
    L.append(f"targets: {verdict}")
    if e["device"] == "cpu":
        L.append("  (line-rate and switch targets apply on a GPU: on cpu every copy is a serial memcpy)")
    return "\n".join(L)


_COLUMNS = [
    "date",
    "GPU",
    "torch",
    "CUDA",
    "preset",
    "state GB",
    "D2H",
    "H2D",
    "bidir",
    "anchor out cold/warm",
    "anchor in cold/warm",
    "tidal out cold (x line)",
    "tidal out warm (x line)",
    "tidal in cold (x line)",
    "tidal in warm (x line)",
    "switch/seq",
    "host RAM x",
    "free gap MiB",
    "bit-exact",
    "tidal config",
]


def append_results_row(path: str, r: dict) -> None:
    """Append one markdown row (GB/s unless noted) to ``path``, writing the header first if
    the file does not exist yet."""
    e, ln, a, t, m, sw = r["env"], r["line_rate"], r["anchor"], r["tidal"], r["memory"], r["switch"]

    def x(d):
        g, v = t.get(f"{d}_gbps"), t.get(f"{d}_vs_line")
        return "-" if g is None else f"{g:.1f} ({v:.2f})"

    gap = m["free_gap_max_bytes"]
    cells = [
        r["date"][:16].replace("T", " "),
        e["device_name"],
        e["torch"],
        e["cuda"] or "-",
        r["preset"],
        f"{t['bytes'] / 1e9:.2f}",
        f"{ln['d2h_gbps']:.1f}",
        f"{ln['h2d_gbps']:.1f}",
        f"{ln['bidir_gbps']:.1f}",
        f"{_f(a.get('offload_cold_gbps'))} / {_f(a.get('offload_warm_gbps'))}",
        f"{_f(a.get('reload_cold_gbps'))} / {_f(a.get('reload_warm_gbps'))}",
        x("offload_cold"),
        x("offload_warm"),
        x("reload_cold"),
        x("reload_warm"),
        _f(sw.get("ratio"), ".3f"),
        f"{m['host_ratio']:.3f}",
        "-" if gap is None else f"{gap / 2**20:.0f}",
        "yes" if r["bit_exact"] else "NO",
        r.get("tidal_config", "-"),
    ]
    new = not os.path.exists(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a") as f:
        if new:
            f.write(
                "# tidal offload benchmark results\n\nWritten by `tidal bench --results` "
                "(benchmarks/bench_offload.py). GB/s unless noted; `(x line)` is the fraction of the "
                "line rate measured in the same run.\n\n"
            )
            f.write("| " + " | ".join(_COLUMNS) + " |\n|" + "---|" * len(_COLUMNS) + "\n")
        f.write("| " + " | ".join(c.replace("|", "/") for c in cells) + " |\n")
