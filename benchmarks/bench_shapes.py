"""Reload, offload and switch on shapes beyond ``tidal bench``'s, each beside the line rate and
beside plain pinned copies of the same bytes, measured in the same process.

    python benchmarks/bench_shapes.py [--shapes llama-tied,llama-fused,small-tensors,qwen2-1.5b]
        [--warm 5] [--trace] [--json PATH]

Each shape runs in its own process (``--one NAME``), so its "cold" figures are the first
reload after its roles were built and first moved out, as in an RL run's first step. A shape is:

- ``llama-tied``: an actor of Llama shape (hidden 2048, intermediate 5632, 16 layers, 16 heads, 8
  KV heads, vocab 32000, tied embeddings) with ``AdamW(foreach=True)`` state that moves with the
  role; a critic (the same at 8 layers, SGD with momentum); a frozen reference (16 layers);
- ``llama-fused``: the actor's shape with untied embeddings and ``AdamW(fused=True)`` (whose
  ``step`` counters are one 4-byte device tensor per parameter);
- ``small-tensors``: 24 layers of hidden 1024 with biases on every projection and norms, AdamW
  (foreach): every storage below the engine's direct-copy size, so all of it goes through buckets;
- ``qwen2-1.5b``: the state ``tidal bench`` moves (Qwen2-1.5B, AdamW), for no regression.

Per role: ``offload`` / ``load`` cold (the first) and warm (median of ``--warm``), GB/s from the
move's own time (the record), as a fraction of the line rate (one 1 GiB copy each way, both at once
on two streams) and of plain copies of the same storages (one ``copy_(non_blocking=True)`` per
storage between it and a pinned host tensor of its size, on one side stream, the device memory
already there): the rate the hardware gives for those sizes. The switch: one role out while
another comes in (``load`` under the default budget), against its ideal: the longest of the bytes
out at the D2H rate, the bytes in at the H2D rate, both at the bidirectional rate. Memory: the
driver's free memory after each offload against before the roles were built, the host's RSS
against the bytes tidal holds, and every tensor's bytes after the last cycle against before the
first (device fingerprints).

``--trace`` runs each shape a second time with the CUDA profiler on one cold and one warm reload
and an offload, and says where each move's time went: before its first copy (host work), gaps
between copies on the copy stream (and what ran in them), the copies' own rate, after the last
copy (host work); plus the allocator's ``cudaMalloc`` time and count. Nothing printed is
hard-coded: every figure is measured in the run.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import dataclasses
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from tidal.device import DeviceOps, SyncPolicy, use_sync_policy  # noqa: E402
from tidal.timeshare import Timeshare, TimeshareConfig  # noqa: E402
from tidal_recipes.measure import empty_host_cache, environment, measure_line_rate  # noqa: E402
from tidal_recipes.measure import StateReference, build_model, make_adamw_state  # noqa: E402

SHAPES = ("llama-tied", "llama-fused", "small-tensors", "qwen2-1.5b")
TARGETS = {"reload_vs_line_min": 0.95, "switch_vs_ideal_max": 1.05, "free_gap_max_bytes": 256 << 20}
GIB = 1 << 30


# ---- the roles -----------------------------------------------------------------------------
def _llama(device, dtype, *, layers, hidden, intermediate, heads, kv_heads, vocab, tied, bias=False, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415 (only where it runs)

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        tie_word_embeddings=tied,
        attention_bias=bias,
        mlp_bias=bias,
    )
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype)
    return model


def _stepped(model, opt_factory, seed):
    """An optimizer over ``model`` whose state exists: random grads, one step."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.grad = torch.randn(p.shape, dtype=p.dtype, device=p.device, generator=gen)
    opt = opt_factory(model.parameters())
    opt.step()
    return opt


def _adamw_foreach(params):
    return torch.optim.AdamW(params, lr=1e-4, foreach=True)


def _adamw_fused(params):
    return torch.optim.AdamW(params, lr=1e-4, fused=True)


def _sgd_momentum(params):
    return torch.optim.SGD(params, lr=1e-3, momentum=0.9)


def build_roles(shape: str, device, dtype=torch.bfloat16, *, toy: bool = False) -> list[dict]:
    """The roles of ``shape``: dicts of name, model, optimizer (or None), frozen. The first two
    are the switch's pair (the first out while the second comes in, then back). ``toy``: the
    same structure at a size for a CPU run."""
    s = (lambda n: max(1, n // 16)) if toy else (lambda n: n)
    llama = dict(hidden=s(2048), intermediate=s(5632), heads=16 if not toy else 4, kv_heads=8 if not toy else 2)
    vocab = s(32000)
    if shape == "llama-tied":
        actor = _llama(device, dtype, layers=16 if not toy else 2, vocab=vocab, tied=True, **llama)
        critic = _llama(device, dtype, layers=8 if not toy else 1, vocab=vocab, tied=True, seed=1, **llama)
        ref = _llama(device, dtype, layers=16 if not toy else 2, vocab=vocab, tied=True, seed=2, **llama)
        ref.requires_grad_(False)
        return [
            dict(name="actor", model=actor, optimizer=_stepped(actor, _adamw_foreach, 1), frozen=False),
            dict(name="critic", model=critic, optimizer=_stepped(critic, _sgd_momentum, 2), frozen=False),
            dict(name="reference", model=ref, optimizer=None, frozen=True),
        ]
    if shape == "llama-fused":
        a = _llama(device, dtype, layers=16 if not toy else 2, vocab=vocab, tied=False, **llama)
        b = _llama(device, dtype, layers=16 if not toy else 2, vocab=vocab, tied=False, seed=1, **llama)
        return [
            dict(name="a", model=a, optimizer=_stepped(a, _adamw_fused, 1), frozen=False),
            dict(name="b", model=b, optimizer=_stepped(b, _adamw_fused, 2), frozen=False),
        ]
    if shape == "small-tensors":
        small = dict(hidden=s(1024), intermediate=s(2816), heads=16 if not toy else 4, kv_heads=16 if not toy else 4)
        a = _llama(device, dtype, layers=24 if not toy else 3, vocab=vocab, tied=False, bias=True, **small)
        b = _llama(device, dtype, layers=24 if not toy else 3, vocab=vocab, tied=False, bias=True, seed=1, **small)
        return [
            dict(name="a", model=a, optimizer=_stepped(a, _adamw_foreach, 1), frozen=False),
            dict(name="b", model=b, optimizer=_stepped(b, _adamw_foreach, 2), frozen=False),
        ]
    if shape == "qwen2-1.5b":
        preset = "tiny" if toy else "qwen2-1.5b"
        a, _ = build_model(preset, device=device, dtype=dtype)
        b, _ = build_model(preset, device=device, dtype=dtype, seed=1)
        return [
            dict(name="a", model=a, optimizer=make_adamw_state(a), frozen=False),
            dict(name="b", model=b, optimizer=make_adamw_state(b, seed=2), frozen=False),
        ]
    raise ValueError(f"unknown shape {shape!r}; choose from {', '.join(SHAPES)}")


def role_tensors(role: dict) -> dict[str, torch.Tensor]:
    """Every tensor of the role by a stable name (params, grads, optimizer state on the device)."""
    out: dict[str, torch.Tensor] = {}
    names = {}
    for n, p in role["model"].named_parameters():
        names[id(p)] = n
        out[f"param:{n}"] = p
        if p.grad is not None:
            out[f"grad:{n}"] = p.grad
    for n, b in role["model"].named_buffers():
        out[f"buffer:{n}"] = b
    if role["optimizer"] is not None:
        for p, st in role["optimizer"].state.items():
            for k, v in st.items():
                if isinstance(v, torch.Tensor) and v.device == p.device:
                    out[f"optim:{names.get(id(p), hex(id(p)))}:{k}"] = v
    return out


def _storages(tensors: dict[str, torch.Tensor]) -> list[torch.UntypedStorage]:
    seen: dict[int, torch.UntypedStorage] = {}
    for t in tensors.values():
        st = t.untyped_storage()
        if st.nbytes():
            seen.setdefault(st.data_ptr(), st)
    return list(seen.values())


# ---- the plain copies ----------------------------------------------------------------------
def plain_copies(ops: DeviceOps, storages: list[torch.UntypedStorage], reps: int = 3) -> dict:
    """GB/s of one ``copy_(non_blocking=True)`` per storage between it and a pinned host tensor of
    its size on one side stream, each way (device memory already allocated: the hardware's rate for
    these sizes). Medians of ``reps`` after a warm-up. The pinned buffers are freed after."""
    dev = [torch.empty(0, dtype=torch.uint8, device=ops.device).set_(s, 0, (s.nbytes(),), (1,)) for s in storages]
    host = [torch.empty(d.numel(), dtype=torch.uint8, pin_memory=ops.is_accelerator) for d in dev]
    keep = [d.clone() for d in dev] if not ops.is_accelerator else None
    stream = ops.new_stream()
    nbytes = sum(d.numel() for d in dev)

    def run(to_host: bool) -> float:
        ops.synchronize()
        t0 = time.perf_counter()
        with ops.on_stream(stream):
            for d, h in zip(dev, host):
                (h.copy_(d, non_blocking=True) if to_host else d.copy_(h, non_blocking=True))
        ops.synchronize()
        return time.perf_counter() - t0

    out = {"bytes": nbytes, "storages": len(dev)}
    for name, to_host in (("d2h", True), ("h2d", False)):
        run(to_host)
        secs = [run(to_host) for _ in range(reps)]
        out[f"{name}_gbps"] = nbytes / statistics.median(secs) / 1e9
    if keep is not None:
        for d, k in zip(dev, keep):
            d.copy_(k)
    host.clear()  # the pinned buffers go
    return out


# ---- the host's timeline of a move (the trace pass) -----------------------------------------
class PointClock(SyncPolicy):
    """The default waits, with the host's time of every point and wait of a move recorded."""

    def __init__(self) -> None:
        self.marks: list[tuple[float, str]] = []

    def point(self, name: str) -> None:
        self.marks.append((time.perf_counter(), name))

    def wait_host(self, name: str, event) -> None:
        self.marks.append((time.perf_counter(), f"wait:{name}"))
        super().wait_host(name, event)
        self.marks.append((time.perf_counter(), f"waited:{name}"))


def summarize_points(marks: list[tuple[float, str]], t0: float, t1: float) -> dict:
    """Host milliseconds from ``t0`` to the first and the last of each point, and the time spent
    in host waits, of the marks between ``t0`` and ``t1``."""
    out: dict = {"ms": (t1 - t0) * 1e3, "first_ms": {}, "last_ms": {}, "counts": {}, "waiting_ms": 0.0}
    waiting = None
    for t, name in marks:
        if not t0 <= t <= t1:
            continue
        out["first_ms"].setdefault(name, (t - t0) * 1e3)
        out["last_ms"][name] = (t - t0) * 1e3
        out["counts"][name] = out["counts"].get(name, 0) + 1
        if name.startswith("wait:"):
            waiting = t
        elif name.startswith("waited:") and waiting is not None:
            out["waiting_ms"] += (t - waiting) * 1e3
            waiting = None
    return out


def summarize_trace(events: list[dict], window: tuple[float, float], direction: str) -> dict:
    """Where a move's time went, from the profiler's chrome-trace events (microseconds) inside
    ``window`` (the move's user annotation): the copies of ``direction`` ("HtoD" or "DtoH") on
    their stream(s), the gaps between them, the kernels in those gaps, host-side cudaMalloc."""
    w0, w1 = window
    copies = sorted(
        (e for e in events if e.get("cat") == "gpu_memcpy" and direction in e.get("name", "") and w0 <= e["ts"] <= w1),
        key=lambda e: e["ts"],
    )
    out: dict = {"window_ms": (w1 - w0) / 1e3, "copies": len(copies)}
    mallocs = [
        e for e in events if e.get("cat") == "cuda_runtime" and e.get("name") == "cudaMalloc" and w0 <= e["ts"] <= w1
    ]
    out["cuda_malloc"] = {"count": len(mallocs), "ms": sum(e.get("dur", 0) for e in mallocs) / 1e3}
    if not copies:
        return out
    nbytes = sum(int(e.get("args", {}).get("bytes", 0)) for e in copies)
    first, last = copies[0]["ts"], max(e["ts"] + e.get("dur", 0) for e in copies)
    busy = sum(e.get("dur", 0) for e in copies)
    gaps = []
    end = copies[0]["ts"] + copies[0].get("dur", 0)
    for e in copies[1:]:
        if e["ts"] > end:
            gaps.append((e["ts"] - end, end, e["ts"]))
        end = max(end, e["ts"] + e.get("dur", 0))
    kernels = [e for e in events if e.get("cat") == "kernel" and w0 <= e["ts"] <= w1]
    in_gaps = 0.0
    for _, g0, g1 in gaps:
        in_gaps += sum(max(0.0, min(g1, k["ts"] + k.get("dur", 0)) - max(g0, k["ts"])) for k in kernels)
    sizes = sorted(int(e.get("args", {}).get("bytes", 0)) for e in copies)
    # What the host ran before the first copy: the longest calls (torch ops, CUDA runtime).
    lead: dict[str, float] = {}
    for e in events:
        if e.get("cat") in ("cpu_op", "cuda_runtime", "cuda_driver") and w0 <= e["ts"] < first:
            lead[e["name"]] = lead.get(e["name"], 0.0) + e.get("dur", 0) / 1e3
    out["lead_calls_ms"] = {k: round(v, 3) for k, v in sorted(lead.items(), key=lambda kv: -kv[1])[:8]}
    out.update(
        bytes=nbytes,
        lead_ms=(first - w0) / 1e3,
        span_ms=(last - first) / 1e3,
        tail_ms=(w1 - last) / 1e3,
        copy_busy_ms=busy / 1e3,
        gaps_ms=sum(g for g, _, _ in gaps) / 1e3,
        gaps_over_20us=sum(1 for g, _, _ in gaps if g > 20),
        largest_gaps_us=sorted((round(g, 1) for g, _, _ in gaps), reverse=True)[:8],
        kernels_in_gaps_ms=in_gaps / 1e3,
        copy_gbps=nbytes / busy / 1e3 if busy else None,
        span_gbps=nbytes / (last - first) / 1e3 if last > first else None,
        window_gbps=nbytes / (w1 - w0) / 1e3 if w1 > w0 else None,
        copy_bytes_median=sizes[len(sizes) // 2],
        copy_bytes_min=sizes[0],
    )
    return out


# ---- one shape -----------------------------------------------------------------------------
def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _median(xs):
    return statistics.median(xs) if xs else None


def run_shape(shape: str, *, device: str, warm: int, trace: bool, toy: bool = False, log=print) -> dict:
    """Measure one shape (see the module docstring); returns every figure."""
    ops = DeviceOps(device)
    if ops.device.type == "cuda":
        torch.cuda.set_device(ops.device)
    torch.empty(1, device=ops.device)
    ops.synchronize()
    ops.empty_cache()
    free0 = ops.driver_free_bytes()[0]
    res: dict = {"shape": shape, "env": environment(ops), "warm": warm, "toy": toy}
    res["line_rate"] = line = measure_line_rate(ops, GIB if ops.is_accelerator else 16 << 20)
    bidir = line["bidir_gbps"]
    roles = build_roles(shape, ops.device, toy=toy)
    ops.synchronize()
    refs = {r["name"]: StateReference(role_tensors(r), mode="fingerprint") for r in roles}
    res["roles"] = {}
    for r in roles:
        sts = _storages(role_tensors(r))
        res["roles"][r["name"]] = {
            "bytes": sum(s.nbytes() for s in sts),
            "storages": len(sts),
            "storages_below_8mib": sum(s.nbytes() < 8 << 20 for s in sts),
        }
    ops.synchronize()
    rss0 = _rss_bytes()
    # Every role may stay resident while each is cycled alone; the switch then runs under the
    # default budget (one role resident), so loading one moves the other out.
    held = sum(r["bytes"] for r in res["roles"].values())
    ts = Timeshare(ops.device, config=TimeshareConfig(budget_bytes=held))
    for r in roles:
        ts.add_role(
            r["name"],
            model=r["model"],
            optimizer=r["optimizer"],
            optimizer_residency="role",
            frozen=r["frozen"],
        )
    clock = PointClock() if trace else None
    prof = None
    windows: dict[str, tuple[float, float]] = {}
    host_windows: dict[str, tuple[float, float]] = {}

    def timed(label: str, fn):
        ops.synchronize()
        t0 = time.perf_counter()
        if prof is not None:
            with torch.profiler.record_function(f"bench:{label}"):
                rec = fn()
        else:
            rec = fn()
        ops.synchronize()
        t1 = time.perf_counter()
        host_windows[label] = (t0, t1)
        return rec, t1 - t0

    ctx = use_sync_policy(clock) if clock is not None else None
    if ctx is not None:
        ctx.__enter__()
    if trace and ops.is_accelerator:
        prof = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        )
        prof.__enter__()
    try:
        cycles_of: dict[str, list] = {r["name"]: [] for r in roles}

        def cycle(name: str, i: int) -> None:
            rec_out, w_out = timed(f"{name}:offload{i}", lambda: ts.offload(name))
            rec_in, w_in = timed(f"{name}:reload{i}", lambda: ts.load(name))
            cycles_of[name].append((rec_out, w_out, rec_in, w_in))

        # Each role's first cycle (cold: nothing of it has moved before, no copy of its bytes
        # has run), then the plain copies of its storages, then its warm cycles.
        for r in roles:
            cycle(r["name"], 0)
        for r in roles:
            res["roles"][r["name"]]["plain"] = plain_copies(ops, _storages(role_tensors(r)))
        empty_host_cache(ops)  # the plain copies' pinned buffers are not tidal's to count
        for r in roles:
            for i in range(1, 1 + (1 if trace else warm)):
                cycle(r["name"], i)
        for r in roles:
            name = r["name"]
            row = res["roles"][name]
            cycles = cycles_of[name]
            b_out, b_in = cycles[0][0].bytes_out, cycles[0][2].bytes_in
            row.update(bytes_out=b_out, bytes_in=b_in)
            for label, sel in (("cold", cycles[:1]), ("warm", cycles[1:])):
                if not sel:
                    continue
                out_b = sel[0][0].bytes_out  # a frozen role's later offloads copy nothing
                row[f"offload_{label}_bytes"] = out_b
                if out_b:
                    row[f"offload_{label}_gbps"] = out_b / _median([c[0].seconds for c in sel]) / 1e9
                    row[f"offload_{label}_vs_line"] = row[f"offload_{label}_gbps"] / line["d2h_gbps"]
                row[f"offload_{label}_ms"] = _median([c[0].seconds for c in sel]) * 1e3
                in_s = _median([c[2].seconds for c in sel])
                row[f"reload_{label}_gbps"] = b_in / in_s / 1e9
                row[f"reload_{label}_wall_gbps"] = b_in / _median([c[3] for c in sel]) / 1e9
                row[f"reload_{label}_vs_line"] = row[f"reload_{label}_gbps"] / line["h2d_gbps"]
                row[f"reload_{label}_vs_plain"] = row[f"reload_{label}_gbps"] / row["plain"]["h2d_gbps"]
                row[f"reload_{label}_alloc_ms"] = _median([c[2].move.alloc_seconds for c in sel]) * 1e3
                row[f"reload_{label}_segments"] = sel[0][2].move.segments
        # The switch: the first role in while the second goes out (the default budget keeps one role).
        a, b = roles[0]["name"], roles[1]["name"]
        ts.config = dataclasses.replace(ts.config, budget_bytes=None)
        ts.load(b)
        sw = []
        for i in range(1 + (1 if trace else max(1, warm))):
            for incoming, outgoing in ((a, b), (b, a)):
                rec, wall = timed(f"switch:{incoming}<-{outgoing}:{i}", lambda: ts.load(incoming))
                assert rec is not None and rec.kind == "switch", f"expected a switch, got {rec}"
                if i:
                    sw.append((incoming, rec, wall))
        res["switch"] = {}
        for incoming, outgoing in ((a, b), (b, a)):
            mine = [(rec, wall) for inc, rec, wall in sw if inc == incoming]
            rec0 = mine[0][0]
            ideal = (
                max(
                    rec0.bytes_out / line["d2h_gbps"],
                    rec0.bytes_in / line["h2d_gbps"],
                    (rec0.bytes_out + rec0.bytes_in) / bidir,
                )
                / 1e9
            )
            secs = _median([rec.seconds for rec, _ in mine])
            res["switch"][f"{incoming}<-{outgoing}"] = {
                "bytes_out": rec0.bytes_out,
                "bytes_in": rec0.bytes_in,
                "seconds": secs,
                "wall_seconds": _median([w for _, w in mine]),
                "ideal_seconds": ideal,
                "vs_ideal": secs / ideal,
            }
    finally:
        if prof is not None:
            prof.__exit__(None, None, None)
        if ctx is not None:
            ctx.__exit__(None, None, None)
    if trace:
        res["host_profile"] = {}
        for label, out_role, in_role in (("reload", roles[0]["name"], None), ("switch", None, roles[1]["name"])):
            ts.load(roles[0]["name"])
            if out_role:
                ts.offload(out_role)
            ops.synchronize()
            prof_py = cProfile.Profile()
            prof_py.enable()
            ts.load(in_role or out_role)
            ops.synchronize()
            prof_py.disable()
            stats = pstats.Stats(prof_py)
            top = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:14]  # by own time
            res["host_profile"][label] = [
                {"function": f"{os.path.basename(f)}:{line}({fn})", "calls": nc, "own_ms": tt * 1e3, "cum_ms": ct * 1e3}
                for (f, line, fn), (_, nc, tt, ct, _) in top
            ]
    # Every role out: the driver should have back all it had before they were built.
    ts.offload_all()
    ops.synchronize()
    ops.empty_cache()
    gap = free0 - ops.driver_free_bytes()[0]
    ts.load(roles[0]["name"])
    res["memory"] = {
        "free_gap_max_bytes": gap if ops.is_accelerator else None,
        "host_rss_growth_bytes": _rss_bytes() - rss0,
        "host_reserved_bytes": ts.store.host_reserved_bytes,
        "held_bytes": sum(ts.role_bytes(r["name"]) for r in roles),
    }
    bad = []
    for r in roles:
        ts.load(r["name"])
        bad += [f"{r['name']}:{m}" for m in refs[r["name"]].mismatches(role_tensors(r))]
    res["bit_exact"] = not bad
    res["mismatches"] = bad[:8]
    if trace and clock is not None:
        res["host_points"] = {k: summarize_points(clock.marks, *w) for k, w in host_windows.items()}
    if prof is not None:
        path = tempfile.mktemp(suffix=".json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
        os.unlink(path)
        anns = {
            e["name"].removeprefix("bench:"): (e["ts"], e["ts"] + e.get("dur", 0))
            for e in events
            if e.get("cat") == "user_annotation" and e.get("name", "").startswith("bench:")
        }
        windows.update(anns)
        res["trace"] = {
            k: summarize_trace(events, w, "DtoH" if ":offload" in k else "HtoD")
            | ({"d2h": summarize_trace(events, w, "DtoH")} if k.startswith("switch") else {})
            for k, w in windows.items()
        }
    ts.close()
    for line_ in format_shape(res).splitlines():
        log(line_)
    return res


def format_shape(res: dict) -> str:
    ln = res["line_rate"]
    L = [
        f"== {res['shape']}{' (toy)' if res['toy'] else ''} on {res['env'].get('device_name', res['env'].get('device'))}: "
        f"line D2H {ln['d2h_gbps']:.1f} H2D {ln['h2d_gbps']:.1f} both {ln['bidir_gbps']:.1f} GB/s"
    ]
    for name, r in res["roles"].items():
        p = r["plain"]
        parts = [
            f"  {name:<10} {r['bytes'] / 1e9:6.2f} GB in {r['storages']} storages ({r['storages_below_8mib']} < 8 MiB);",
            f"plain out {p['d2h_gbps']:.1f} in {p['h2d_gbps']:.1f} GB/s;",
        ]
        for label in ("cold", "warm"):
            if f"reload_{label}_gbps" in r:
                out = (
                    f"out {r[f'offload_{label}_gbps']:.1f} ({r[f'offload_{label}_vs_line']:.2f}x line)"
                    if f"offload_{label}_gbps" in r
                    else f"out nothing copied ({r[f'offload_{label}_ms']:.1f} ms)"
                )
                parts.append(
                    f"{label}: {out} "
                    f"in {r[f'reload_{label}_gbps']:.1f} GB/s ({r[f'reload_{label}_vs_line']:.2f}x line, "
                    f"{r[f'reload_{label}_vs_plain']:.2f}x plain; alloc {r[f'reload_{label}_alloc_ms']:.1f} ms);"
                )
        L.append(" ".join(parts))
    for k, s in res.get("switch", {}).items():
        L.append(
            f"  switch {k}: {s['bytes_out'] / 1e9:.2f} GB out, {s['bytes_in'] / 1e9:.2f} GB in: {s['seconds'] * 1e3:.1f} ms "
            f"against an ideal of {s['ideal_seconds'] * 1e3:.1f} ms: {s['vs_ideal']:.3f}x (target <= {TARGETS['switch_vs_ideal_max']})"
        )
    m = res["memory"]
    gap = m["free_gap_max_bytes"]
    L.append(
        f"  memory: driver free gap with every role out {'-' if gap is None else f'{gap / 2**20:.0f} MiB'}; host RSS +{m['host_rss_growth_bytes'] / 2**30:.2f} GiB "
        f"for {m['host_reserved_bytes'] / 2**30:.2f} GiB reserved ({m['held_bytes'] / 2**30:.2f} GiB of state); "
        f"bit-exact {res['bit_exact']}"
    )
    for k, t in res.get("trace", {}).items():
        if "bytes" not in t:
            continue
        L.append(
            f"  trace {k}: {t['window_ms']:.2f} ms; {t['copies']} copies ({t['bytes'] / 1e9:.2f} GB, median "
            f"{t['copy_bytes_median'] / 2**20:.1f} MiB) busy {t['copy_busy_ms']:.2f} ms at {t['copy_gbps']:.1f} GB/s; "
            f"before the first {t['lead_ms']:.2f} ms, gaps {t['gaps_ms']:.2f} ms ({t['gaps_over_20us']} > 20 us, kernels "
            f"{t['kernels_in_gaps_ms']:.2f} ms; largest {t['largest_gaps_us'][:4]} us), after the last {t['tail_ms']:.2f} ms; "
            f"cudaMalloc {t['cuda_malloc']['count']} x = {t['cuda_malloc']['ms']:.2f} ms; before the first copy: {t['lead_calls_ms']}"
        )
    for label, top in res.get("host_profile", {}).items():
        L.append(
            f"  host profile of a {label} (cProfile, own time): "
            + "; ".join(f"{t['function']} x{t['calls']} {t['own_ms']:.2f} ms" for t in top)
        )
    for k, h in res.get("host_points", {}).items():
        first = {n: round(v, 2) for n, v in h["first_ms"].items() if not n.startswith("waited")}
        L.append(f"  host {k}: {h['ms']:.2f} ms, waiting {h['waiting_ms']:.2f} ms; first ms of each point {first}")
    return "\n".join(L)


# ---- the driver ------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--warm", type=int, default=5, help="warm cycles per role (median)")
    ap.add_argument("--trace", action="store_true", help="a second, profiled run of each shape")
    ap.add_argument("--toy", action="store_true", help="each shape at a size for a CPU run")
    ap.add_argument("--json", help="write every figure here")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--one-json", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    shapes = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        ap.error(f"unknown shape(s) {', '.join(unknown)}; choose from {', '.join(SHAPES)}")
    if args.warm < 1:
        ap.error(f"--warm must be >= 1, got {args.warm}")
    if args.one:
        res = run_shape(args.one, device=args.device, warm=args.warm, trace=args.trace, toy=args.toy)
        with open(args.one_json, "w") as f:
            json.dump(res, f, indent=1, default=str)
        return 0
    out = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "targets": TARGETS, "runs": []}
    rc = 0
    for shape in shapes:
        for trace in (False, True) if args.trace else (False,):
            with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
                path = f.name
            cmd = [sys.executable, os.path.abspath(__file__), "--one", shape, "--one-json", path]
            cmd += ["--device", args.device, "--warm", str(args.warm)] + (["--trace"] if trace else [])
            cmd += ["--toy"] if args.toy else []
            print(f"$ {' '.join(cmd[1:])}", flush=True)
            code = subprocess.call(cmd)
            if code:
                print(f"{shape}: exit status {code}", flush=True)
                rc = 1
                continue
            with open(path) as f:
                out["runs"].append(json.load(f) | {"traced": trace})
            os.unlink(path)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
