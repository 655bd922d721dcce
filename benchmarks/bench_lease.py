"""Cross-process lease hand-over vs an in-process switch, on one GPU (issue 7).

    python benchmarks/bench_lease.py [--role-gb 2] [--turns 6] [--overlap] [--results PATH]

Two roles of equal size (Linear layers with grads and AdamW state, ``optimizer_residency="role"``
so every byte moves with the role):

- **cross-process**: each role in its own spawned process and its own ``tidal.Timeshare``,
  taking turns through a :class:`~tidal.distributed.LeaseServer` (TCP, no Ray) with
  :func:`~tidal.distributed.timeshare_callbacks`. One hand-over is: the holder leaves its turn
  -> its offload is done and confirmed at driver level -> the waiter is granted -> the
  waiter's reload is done. Split into offload / grant / reload (``time.monotonic`` is one
  clock for every process of the machine). ``--overlap`` (issue 16): the hand-over overlaps
  both directions (``timeshare_callbacks(ts, role, lease=lease)``): the holder gives memory
  back ``--chunk-mb`` at a time and the waiter loads into it while the rest is still copied
  out; the hand-over then runs from the holder leaving its turn to the next holder entering
  its own (state loaded, previous release confirmed).
- **in-process**: both roles in one ``Timeshare``; ``with ts.use(other):`` switches them in one
  overlapped transition (D2H and H2D on separate copy engines), the same bytes each way. Also
  the same two moves one after the other in one process (``offload_all()`` then ``load()``),
  which is what the lease has to do: it separates the cost of crossing processes from the
  cost of not overlapping.

Every figure is the median of the warm hand-overs (the first ``--skip`` are left out; the
first is printed too). GB/s counts the bytes out plus the bytes in. ``--results`` appends a
row to the section "## Cross-process lease (issue 7)" at the end of that file (the section is
started if the file does not end with it).

``--two-gpus`` (issue 30) measures something else: whether two processes, each with its own
GPU, disturb each other's transitions. See :func:`two_gpus`::

    python benchmarks/bench_lease.py --two-gpus [--preset qwen2-1.5b] [--cycles 6] [--rounds 2]
        [--json PATH] [--results PATH]
    python benchmarks/bench_lease.py --two-gpus --device cpu --preset tiny   # dry run, no GPU
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tidal  # noqa: E402
from tidal.distributed.lease import GPULease, LeaseServer, timeshare_callbacks  # noqa: E402

SECTION = "## Cross-process lease (issue 7)"
SECTION_OVERLAP = "## Cross-process hand-over, overlapped (issue 16)"
WIDTH = 4096
ROLES = ("A", "B")


def _layers(role_gb: float) -> int:
    per_layer = (WIDTH * WIDTH + WIDTH) * 4 * 4  # fp32 params + grads + exp_avg + exp_avg_sq
    return max(1, round(role_gb * 1e9 / per_layer))


def _make_role(ts, name: str, layers: int) -> None:
    """A role on the device with its grads and AdamW state, registered in ``ts``."""
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, device="cuda") for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(8, WIDTH, device="cuda")).square().mean().backward()
    opt.step()
    torch.cuda.synchronize()
    ts.add_role(name, model=model, optimizer=opt, optimizer_residency="role")


def _worker(
    role: str,
    address: str,
    layers: int,
    turns: int,
    hold_s: float,
    overlap: bool,
    chunk_mb: int,
    barrier,
    out_path: str,
) -> None:
    torch.cuda.init()
    ts = tidal.Timeshare("cuda", config=tidal.TimeshareConfig(handover_chunk_bytes=chunk_mb << 20))
    rows = []
    with GPULease(address, holder=f"{role}:{os.getpid()}") as lease:
        barrier.wait(120)
        with lease.hold(role=role, release_fn=ts.offload_all):  # bring the role into being
            _make_role(ts, role, layers)
        cb = timeshare_callbacks(ts, role, lease=lease if overlap else None)
        for _ in range(turns):
            row: dict = {"role": role}

            def acquire_fn() -> None:
                row["load_start"] = time.monotonic()
                cb["acquire_fn"]()
                torch.cuda.synchronize()
                row["loaded"] = time.monotonic()
                row["bytes_in"] = ts.records[-1].bytes_in

            def release_fn() -> dict:
                conf = cb["release_fn"]()
                row["offloaded"] = time.monotonic()
                row["bytes_out"] = conf["bytes_out"]
                return conf

            with lease.hold(
                role=role, acquire_fn=acquire_fn, release_fn=release_fn, overlap=cb.get("overlap", False)
            ) as grant:
                row["granted"] = time.monotonic()  # the turn: state loaded, previous release done
                row["ticket"], row["after"] = grant.ticket, (grant.previous or {}).get("ticket")
                row["overlapped"] = grant.overlapped
                time.sleep(hold_s)  # the other process is queued by now: a hand-over has a waiter
                row["leave"] = time.monotonic()
            rows.append(row)
    with open(out_path, "w") as f:
        json.dump({"role_bytes": ts.role_bytes(role), "rows": rows}, f)
    barrier.wait(120)  # neither exits (freeing its context) while the other still takes turns


def _run_all(procs: list, *, timeout_s: float) -> None:
    """Start ``procs`` and wait for them all; kill the rest as soon as one fails (it would
    wait for its turn or a barrier forever) or after ``timeout_s``. ``SystemExit`` unless all
    exited with 0."""
    for p in procs:
        p.start()
    end = time.monotonic() + timeout_s
    while any(p.is_alive() for p in procs) and time.monotonic() < end:
        if any(p.exitcode not in (None, 0) for p in procs):
            break
        time.sleep(0.05)
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()
    if any(p.exitcode != 0 for p in procs):
        raise SystemExit(f"a worker failed or ran past {timeout_s:.0f} s: exit codes {[p.exitcode for p in procs]}")


def cross_process(
    layers: int, turns: int, hold_s: float, skip: int, overlap: bool = False, chunk_mb: int = 256
) -> dict:
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(len(ROLES))
    with tempfile.TemporaryDirectory() as d, LeaseServer(ttl_s=60.0) as server:
        procs = [
            ctx.Process(
                target=_worker,
                args=(r, server.address, layers, turns, hold_s, overlap, chunk_mb, barrier, os.path.join(d, r)),
            )
            for r in ROLES
        ]
        _run_all(procs, timeout_s=300)
        got = {r: json.load(open(os.path.join(d, r))) for r in ROLES}
    turns_all = sorted((t for r in ROLES for t in got[r]["rows"]), key=lambda t: t["granted"])
    hand = []
    for prev, nxt in zip(turns_all, turns_all[1:]):
        assert nxt["granted"] >= prev["offloaded"], "two holders at once"
        if prev["role"] == nxt["role"] or nxt["after"] != prev["ticket"]:
            continue  # not a hand-over between processes (or an untimed turn came between)
        hand.append(
            {
                "total": nxt["granted"] - prev["leave"],
                "offload": prev["offloaded"] - prev["leave"],
                # from the holder's release confirmed to the next load's start (the arbiter's
                # round trip; with overlap the load started before: 0)
                "grant": max(0.0, nxt["load_start"] - prev["offloaded"]),
                "reload": nxt["loaded"] - nxt["load_start"],
                # how long the next holder's load ran while the previous one still released
                "overlap": max(0.0, prev["offloaded"] - nxt["load_start"]),
                "overlapped": bool(nxt.get("overlapped")),
                "bytes": prev["bytes_out"] + nxt["bytes_in"],
            }
        )
    if len(hand) <= skip:
        raise SystemExit(f"only {len(hand)} hand-overs between processes; raise --turns")
    warm = hand[skip:]
    keys = ("total", "offload", "grant", "reload", "overlap", "bytes")
    med = {k: statistics.median(h[k] for h in warm) for k in keys}
    med["overlapped"] = sum(h["overlapped"] for h in warm)
    return {"role_bytes": got["A"]["role_bytes"], "first": hand[0], "median": med, "count": len(warm)}


def in_process(layers: int, turns: int, skip: int) -> dict:
    ts = tidal.Timeshare("cuda")
    for r in ROLES:
        _make_role(ts, r, layers)
        ts.offload(r)
    switch, seq = [], []
    ts.load(ROLES[0])
    for i in range(turns * len(ROLES)):
        nxt = ROLES[(i + 1) % len(ROLES)]
        torch.cuda.synchronize()
        t0 = time.monotonic()
        with ts.use(nxt):
            torch.cuda.synchronize()
            t1 = time.monotonic()
        rec = ts.records[-1]
        switch.append({"total": t1 - t0, "bytes": rec.bytes_out + rec.bytes_in})
    for i in range(turns * len(ROLES)):
        nxt = ROLES[i % len(ROLES)]
        torch.cuda.synchronize()
        t0 = time.monotonic()
        out = ts.offload_all()
        rec = ts.load(nxt)
        torch.cuda.synchronize()
        seq.append(
            {"total": time.monotonic() - t0, "bytes": (out.bytes_out if out else 0) + (rec.bytes_in if rec else 0)}
        )
    role_bytes = ts.role_bytes(ROLES[0])
    ts.close()
    return {
        "role_bytes": role_bytes,
        "switch": {k: statistics.median(s[k] for s in switch[skip:]) for k in ("total", "bytes")},
        "switch_first": switch[0]["total"],
        "sequential": {k: statistics.median(s[k] for s in seq[skip:]) for k in ("total", "bytes")},
    }


# ---- two processes, one GPU and one lease each (issue 30) -------------------------------------
SECTION_TWO = "## Two processes, one GPU and one lease each (issue 30)"
TWO_ROLE = "policy"
TWO_TARGET = 0.9  # each process's transitions with the other moving too, x its line rate alone
_DIRECTIONS = (("offload", "d2h_gbps"), ("reload", "h2d_gbps"))


def _two_gpu_worker(
    index: int,
    device_kind: str,
    preset: str,
    dtype_name: str,
    address: str,
    cycles: int,
    rounds: int,
    line_bytes: int,
    barrier,
    out_path: str,
) -> None:
    """Process ``index`` of :func:`two_gpus`: one role (``preset`` with grads and AdamW state)
    on ``cuda:<index>`` (or the CPU), every transition inside a turn of its own GPU's lease
    (the arbiter at ``address``), in lockstep with the other process through ``barrier``.
    Writes what it measured to ``out_path`` (JSON)."""
    from tidal.device import DeviceOps
    from tidal_recipes.measure import measure_line_rate
    from tidal_recipes.measure import StateReference, build_model, make_adamw_state, named_state

    cuda = device_kind == "cuda"
    if cuda:
        torch.cuda.set_device(index)
    else:
        torch.set_num_threads(1)  # two processes on a small CPU machine: no oversubscription
    device = f"cuda:{index}" if cuda else "cpu"
    ops = DeviceOps(device)
    torch.empty(1, device=device)  # the context exists before anything is measured
    me: dict = {"index": index, "device": device, "pid": os.getpid(), "gpu": "cpu"}
    if cuda:
        props = torch.cuda.get_device_properties(index)
        me["gpu"] = props.name
        if all(hasattr(props, f"pci_{k}_id") for k in ("domain", "bus", "device")):  # ints in torch's properties
            me["pci"] = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}"

    def sync() -> None:
        barrier.wait(600)

    # The line rate on this device: this process alone (the other one waits), then both
    # processes copying at the same time (for comparison; the target is against "alone").
    me["line"] = {}
    for who in (0, 1, "both"):
        sync()
        if who in (index, "both"):
            me["line"]["alone" if who == index else "both"] = measure_line_rate(ops, line_bytes)

    ts = tidal.Timeshare(device)
    cb: dict = {}

    def reload_into(row: dict) -> None:
        ops.synchronize()
        row["in_t0"] = time.monotonic()
        cb["acquire_fn"]()
        ops.synchronize()
        row["in_t1"] = time.monotonic()
        rec = ts.records[-1]
        assert rec.kind == "reload", f"expected a reload, got {rec.kind}"
        row.update(reload_gbps=rec.gbps, reload_s=rec.seconds, bytes_in=rec.bytes_in)

    def offload_from(row: dict) -> dict:
        row["out_t0"] = time.monotonic()
        conf = cb["release_fn"]()  # offload, memory back to the driver, the driver's reading
        row["out_t1"] = time.monotonic()
        rec = ts.records[-1]
        assert rec.kind == "offload", f"expected an offload, got {rec.kind}"
        row.update(
            offload_gbps=rec.gbps,
            offload_s=rec.seconds,
            bytes_out=rec.bytes_out,
            release_s=rec.release_seconds,
            unreleased=rec.unreleased_bytes,
            driver_free=conf["driver_free_bytes"],
        )
        return conf

    rows: list[dict] = []
    with GPULease(address, holder=f"{TWO_ROLE}{index}:{os.getpid()}") as lease:
        # The role comes into being in a first turn (both processes at once); that turn ends,
        # one process after the other, with the role's first (cold) offload, alone.
        cold: dict = {}
        lease.acquire(TWO_ROLE, release_fn=lambda: offload_from(cold))
        t0 = time.perf_counter()
        model, impl = build_model(preset, device=device, dtype=getattr(torch, dtype_name))
        opt = make_adamw_state(model)
        ops.synchronize()
        me.update(model=impl, build_s=time.perf_counter() - t0)
        reference = StateReference(named_state(model, opt), mode="fingerprint" if cuda else "clone")
        t0 = time.perf_counter()
        ts.add_role(TWO_ROLE, model=model, optimizer=opt, optimizer_residency="role")
        cb.update(timeshare_callbacks(ts, TWO_ROLE))
        me.update(role_bytes=ts.role_bytes(TWO_ROLE), add_role_s=time.perf_counter() - t0)
        for who in (0, 1):
            sync()
            if who == index:
                lease.release()
        me["cold_offload"] = cold

        # Rounds of: process 0 alone (the other waits, its role offloaded), process 1 alone,
        # both at once (each cycle's reloads start together, and its offloads).
        for rnd in range(rounds):
            for phase, active in (("alone", (0,)), ("alone", (1,)), ("both", (0, 1))):
                sync()
                if index not in active:
                    continue
                together = len(active) > 1
                for cycle in range(cycles):
                    if together:
                        sync()
                    row: dict = {"round": rnd, "phase": phase, "cycle": cycle}
                    with lease.hold(
                        role=TWO_ROLE,
                        acquire_fn=lambda row=row: reload_into(row),
                        release_fn=lambda row=row: offload_from(row),
                    ):
                        if together:
                            sync()  # both reloaded: the offloads start together too
                    rows.append(row)
        sync()
        # Bit-exact after every cycle: one last turn compares the state with the reference.
        check: dict = {}
        with lease.hold(role=TWO_ROLE, acquire_fn=lambda: reload_into(check), release_fn=lambda: offload_from(check)):
            bad = reference.mismatches(named_state(model, opt))
        me.update(bit_exact=not bad, mismatches=bad[:5])
    me["rows"] = rows
    with open(out_path, "w") as f:
        json.dump(me, f)
    sync()  # neither exits while the other still measures


def _overlap(a: tuple[float, float], b: tuple[float, float]) -> float:
    """Fraction of interval ``a`` that interval ``b`` covers."""
    span = a[1] - a[0]
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0])) / span if span > 0 else 0.0


def summarise_two(procs: list[dict]) -> dict:
    """Per process and direction: the cold transition, the medians (with ranges) of the warm
    ones alone and with the other process moving at once, each against this process's line
    rate alone; how much the two processes' transitions overlapped in time; the verdict."""
    out: dict = {"processes": [], "target": TWO_TARGET}
    both_rows = [{(r["round"], r["cycle"]): r for r in p["rows"] if r["phase"] == "both"} for p in procs]
    worst = None
    for i, p in enumerate(procs):
        other = both_rows[1 - i]
        s: dict = {"index": p["index"], "device": p["device"], "gpu": p["gpu"], "role_bytes": p["role_bytes"]}
        for kind, line_key in _DIRECTIONS:
            line = p["line"]["alone"][line_key]
            ts_key = "out" if kind == "offload" else "in"
            # The cold transitions: the creation turn's offload, the first cycle's reload.
            cold = p["cold_offload"] if kind == "offload" else p["rows"][0]
            d: dict = {"line_alone": line, "line_both": p["line"]["both"][line_key], "cold": cold[f"{kind}_gbps"]}
            for phase in ("alone", "both"):
                rows = [r for r in p["rows"] if r["phase"] == phase and r is not cold]
                xs = [r[f"{kind}_gbps"] for r in rows]
                d[phase] = {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "count": len(xs)}
                d[phase]["x_line"] = d[phase]["median"] / line
                # The lease callback's whole time (the offload's also returns the memory to the
                # driver and reads the driver's free memory), for comparison.
                d[phase]["wall_median"] = statistics.median(
                    _gbps(r[f"bytes_{ts_key}"], r[f"{ts_key}_t1"] - r[f"{ts_key}_t0"]) for r in rows
                )
            d["both_x_alone"] = d["both"]["median"] / d["alone"]["median"]
            laps = [
                _overlap((r[f"{ts_key}_t0"], r[f"{ts_key}_t1"]), (o[f"{ts_key}_t0"], o[f"{ts_key}_t1"]))
                for key, r in both_rows[i].items()
                if (o := other.get(key)) is not None
            ]
            d["overlap"] = statistics.median(laps) if laps else 0.0
            d["pass"] = d["both"]["x_line"] >= TWO_TARGET
            if worst is None or d["both"]["x_line"] < worst[0]:
                worst = (d["both"]["x_line"], f"process {p['index']} {kind}")
            s[kind] = d
        s["bit_exact"] = p["bit_exact"]
        s["unreleased_max"] = max(r["unreleased"] for r in p["rows"])
        out["processes"].append(s)
    out["worst"] = {"x_line": worst[0], "where": worst[1]}
    out["pass"] = all(s[k]["pass"] and s["bit_exact"] for s in out["processes"] for k, _ in _DIRECTIONS)
    return out


def two_gpus(
    *, device: str, preset: str, dtype: str, cycles: int, rounds: int, line_bytes: int, timeout_s: float = 480.0
) -> dict:
    """Two spawned processes, process ``i`` on ``cuda:i``, each holding one role of ``preset``
    (params, grads and AdamW moments in ``dtype``; ``optimizer_residency="role"``, so every
    byte moves) through its own GPU's :class:`~tidal.distributed.LeaseServer` with
    :func:`~tidal.distributed.timeshare_callbacks`: a turn reloads the role, leaving it
    offloads it and gives the memory back to the driver. Measured, in one run:

    - each process's pinned line rate (1 GiB by default) alone, then both at once;
    - ``rounds`` x (process 0 alone for ``cycles`` turns while process 1 waits; process 1
      alone; both at once, every reload and every offload started together by a barrier).

    Returns the raw rows of both processes and :func:`summarise_two`'s verdict: each
    process's transitions with the other moving at once, at least ``TWO_TARGET`` x its line
    rate alone (tidal's copy time, the same figure as ``TransitionRecord.gbps``), and its
    state bit-exact afterwards. ``device="cpu"``: the same code on two CPU processes, a dry
    run whose figures mean nothing."""
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(2)
    with (
        tempfile.TemporaryDirectory() as d,
        LeaseServer(ttl_s=60.0) as lease0,
        LeaseServer(ttl_s=60.0) as lease1,
    ):
        paths = [os.path.join(d, f"process{i}.json") for i in range(2)]
        procs = [
            ctx.Process(
                target=_two_gpu_worker,
                args=(i, device, preset, dtype, srv.address, cycles, rounds, line_bytes, barrier, paths[i]),
            )
            for i, srv in enumerate((lease0, lease1))
        ]
        _run_all(procs, timeout_s=timeout_s)
        got = [json.load(open(path)) for path in paths]
    return {"raw": got, "summary": summarise_two(got)}


def format_two(res: dict, args) -> str:
    s = res["summary"]
    lines = [
        f"two processes, one device and one lease each: {args.preset} ({args.dtype}) with grads and AdamW state, "
        f"{args.rounds} rounds x {args.cycles} turns per phase"
    ]
    for p, raw in zip(s["processes"], res["raw"]):
        la, lb = raw["line"]["alone"], raw["line"]["both"]
        lines.append(
            f"process {p['index']} on {p['device']} ({p['gpu']}{', PCI ' + raw['pci'] if raw.get('pci') else ''}): "
            f"role {p['role_bytes'] / 1e9:.3f} GB; line rate alone D2H {la['d2h_gbps']:.1f}, H2D {la['h2d_gbps']:.1f}, "
            f"both ways {la['bidir_gbps']:.1f} GB/s; with the other copying too D2H {lb['d2h_gbps']:.1f}, "
            f"H2D {lb['h2d_gbps']:.1f}; bit-exact {p['bit_exact']}; unreleased after an offload at most "
            f"{p['unreleased_max'] / (1 << 20):.0f} MiB"
        )
        for kind, _ in _DIRECTIONS:
            d = p[kind]
            a, b = d["alone"], d["both"]
            lines.append(
                f"  {kind:<7} cold {d['cold']:.1f} GB/s | alone median {a['median']:.1f} = {a['x_line']:.2f}x line "
                f"(range {a['min']:.1f}-{a['max']:.1f}, {a['count']}) | both at once median {b['median']:.1f} = "
                f"{b['x_line']:.2f}x line alone (range {b['min']:.1f}-{b['max']:.1f}, {b['count']}; overlapped "
                f"{d['overlap']:.0%} of the time) | both / alone {d['both_x_alone']:.2f} | "
                f"{'ok' if d['pass'] else 'BELOW'} (>= {TWO_TARGET}x) | callback wall: alone {a['wall_median']:.1f}, "
                f"both {b['wall_median']:.1f} GB/s"
            )
    w = s["worst"]
    lines.append(
        f"verdict: {'PASS' if s['pass'] else 'FAIL'}: every transition of both processes, moving at once, "
        f">= {TWO_TARGET}x its line rate alone and bit-exact (worst {w['x_line']:.2f}x: {w['where']})"
    )
    return "\n".join(lines)


def append_two_rows(path: str, res: dict, args, versions: str) -> None:
    header = f"""{SECTION_TWO}

Two processes, process i on GPU i, each holding a {args.preset} role ({args.dtype} params, grads and
AdamW moments, all moving with the role) through its own GPU's `LeaseServer` with
`timeshare_callbacks`: a turn reloads the role, leaving it offloads it and returns the memory to
the driver. In one run: each process's pinned line rate alone and with the other copying too;
then rounds of process 0 alone (the other waiting), process 1 alone, both at once (reloads and
offloads started together by a barrier; "overlap" = the median share of a transition during
which the other process's ran). GB/s = tidal's copy time (`TransitionRecord.gbps`); medians of
the warm turns (cold = the first offload and reload, apart). Target: both at once >= {TWO_TARGET}x
the line rate alone, each process, each way.
Command: `python benchmarks/bench_lease.py --two-gpus --results benchmarks/RESULTS.md`.

| date | GPU | versions | process | role GB | line alone D2H / H2D | offload alone (x line) | offload both (x line alone) | reload alone (x line) | reload both (x line alone) | overlap out / in | bit-exact | verdict |
|---|---|---|---|---|---|---|---|---|---|---|---|---|
"""
    rows = []
    for p in res["summary"]["processes"]:
        o, r = p["offload"], p["reload"]
        rows.append(
            f"| {datetime.datetime.now():%Y-%m-%d %H:%M} | {p['gpu']} | {versions} | {p['index']} ({p['device']}) | "
            f"{p['role_bytes'] / 1e9:.2f} | {o['line_alone']:.1f} / {r['line_alone']:.1f} | "
            f"{o['alone']['median']:.1f} ({o['alone']['x_line']:.2f}x) | {o['both']['median']:.1f} "
            f"({o['both']['x_line']:.2f}x) | {r['alone']['median']:.1f} ({r['alone']['x_line']:.2f}x) | "
            f"{r['both']['median']:.1f} ({r['both']['x_line']:.2f}x) | {o['overlap']:.0%} / {r['overlap']:.0%} | "
            f"{p['bit_exact']} | {'ok' if o['pass'] and r['pass'] else 'below'} |\n"
        )
    _append(path, SECTION_TWO, header, "".join(rows))


def main_two(args) -> int:
    if args.device == "cuda" and (not torch.cuda.is_available() or torch.cuda.device_count() < 2):
        print(f"bench_lease --two-gpus: needs 2 CUDA devices, found {torch.cuda.device_count()}")
        return 3
    if args.cycles < 1 or args.rounds < 1 or args.cycles * args.rounds < 2:
        raise SystemExit(
            f"--cycles {args.cycles} x --rounds {args.rounds}: at least 2 turns per phase are needed "
            f"(the first reload is the cold one, kept apart from the medians)"
        )
    line_bytes = int(args.line_mb * (1 << 20)) if args.line_mb else (1 << 30 if args.device == "cuda" else 16 << 20)
    versions = f"torch {torch.__version__}, CUDA {torch.version.cuda}, tidal {tidal.__version__}"
    print(f"bench_lease --two-gpus | {versions} | device {args.device}", flush=True)
    t0 = time.monotonic()
    res = two_gpus(
        device=args.device,
        preset=args.preset,
        dtype=args.dtype,
        cycles=args.cycles,
        rounds=args.rounds,
        line_bytes=line_bytes,
        timeout_s=args.timeout_s,
    )
    res.update(versions=versions, seconds=time.monotonic() - t0, args=vars(args))
    print(format_two(res, args))
    print(f"run {res['seconds']:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
        print(f"json written to {args.json}")
    if args.results:
        append_two_rows(args.results, res, args, versions)
        print(f"rows appended to {args.results} ({SECTION_TWO})")
    return 0 if res["summary"]["pass"] else 1


def _gbps(b: float, s: float) -> float:
    return b / s / 1e9 if s > 0 else float("nan")


def append_row(path: str, gpu: str, versions: str, cross: dict, local: dict, layers: int) -> None:
    header = f"""{SECTION}

Two roles of equal size (fp32 Linear {WIDTH}x{WIDTH} layers with grads and AdamW state, all of it
moving with the role). Cross-process: each role in its own process and `Timeshare`, taking turns
through a `LeaseServer` (TCP) with `timeshare_callbacks`; a hand-over runs from the holder
leaving its turn to the next holder's reload being done, as offload (and driver-level
confirmation) / grant (the arbiter's round trip) / reload. In-process: both roles in one
`Timeshare`; switch = `with ts.use(other)` (offload and reload overlapped), sequential =
`offload_all()` then `load()`. Medians of the warm hand-overs; GB/s counts bytes out + in;
ratio = cross-process hand-over / in-process switch.
Command: `python benchmarks/bench_lease.py --results benchmarks/RESULTS.md`.

| date | GPU | versions | role state GB | hand-over s (offload / grant / reload) | hand-over GB/s | first hand-over s | in-process switch s | switch GB/s | in-process sequential s | sequential GB/s | ratio cross / switch | ratio cross / sequential |
|---|---|---|---|---|---|---|---|---|---|---|---|---|
"""
    m, sw, sq = cross["median"], local["switch"], local["sequential"]
    _append(
        path,
        SECTION,
        header,
        f"| {datetime.datetime.now():%Y-%m-%d %H:%M} | {gpu} | {versions} | {cross['role_bytes'] / 1e9:.2f} "
        f"({layers} layers) | {m['total']:.4f} ({m['offload']:.4f} / {m['grant']:.4f} / {m['reload']:.4f}) | "
        f"{_gbps(m['bytes'], m['total']):.1f} | {cross['first']['total']:.4f} | {sw['total']:.4f} | "
        f"{_gbps(sw['bytes'], sw['total']):.1f} | {sq['total']:.4f} | {_gbps(sq['bytes'], sq['total']):.1f} | "
        f"{m['total'] / sw['total']:.2f} | {m['total'] / sq['total']:.2f} |\n",
    )


def append_overlap_row(path: str, gpu: str, versions: str, seq: dict, ovl: dict, local: dict, chunk_mb: int) -> None:
    header = f"""{SECTION_OVERLAP}

The same two roles and processes as in the issue-7 section, one run: the sequential hand-over
(all out, confirmed, then all in), the overlapped one (`timeshare_callbacks(ts, role,
lease=lease)`: the holder gives memory back chunk by chunk, each chunk confirmed by this
process's allocator reading, and the waiter loads into it), and the in-process switch. A
hand-over runs from the holder leaving its turn to the next holder entering its own (state
loaded, previous release confirmed); "overlap" is how long the next load ran while the previous
holder still released. Medians of the warm hand-overs. Target (issue 16): overlapped <= 1.15x
the in-process switch.
Command: `python benchmarks/bench_lease.py --overlap --results benchmarks/RESULTS.md`.

| date | GPU | versions | role state GB | chunk MiB | sequential s | overlapped s (offload / reload / overlap) | overlapped turns | in-process switch s | sequential / switch | overlapped / switch |
|---|---|---|---|---|---|---|---|---|---|---|
"""
    m, o, sw = seq["median"], ovl["median"], local["switch"]
    _append(
        path,
        SECTION_OVERLAP,
        header,
        f"| {datetime.datetime.now():%Y-%m-%d %H:%M} | {gpu} | {versions} | {ovl['role_bytes'] / 1e9:.2f} | "
        f"{chunk_mb} | {m['total']:.4f} | {o['total']:.4f} ({o['offload']:.4f} / {o['reload']:.4f} / "
        f"{o['overlap']:.4f}) | {o['overlapped']}/{ovl['count']} | {sw['total']:.4f} | "
        f"{m['total'] / sw['total']:.2f} | {o['total'] / sw['total']:.2f} |\n",
    )


def _append(path: str, section: str, header: str, row: str) -> None:
    """Append ``row`` to ``path``, starting ``section`` with ``header`` unless the file ends with it."""
    text = open(path).read() if os.path.exists(path) else ""
    heads = [line for line in text.splitlines() if line.startswith("## ")]
    with open(path, "a") as f:
        if not heads or heads[-1] != section:
            f.write(("\n" if text and not text.endswith("\n\n") else "") + header)
        f.write(row)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--role-gb", type=float, default=2.0, help="state bytes of each role (GB, approximate)")
    ap.add_argument("--turns", type=int, default=6, help="turns per role")
    ap.add_argument("--skip", type=int, default=2, help="hand-overs left out of the medians (warm-up)")
    ap.add_argument("--hold-s", type=float, default=0.05, help="how long each turn holds the lease")
    ap.add_argument("--results", default=None, help="append a row to this markdown file")
    ap.add_argument(
        "--overlap",
        action="store_true",
        help="also the overlapped hand-over (issue 16), side by side with the sequential",
    )
    ap.add_argument("--chunk-mb", type=int, default=256, help="with --overlap: memory given back at a time (MiB)")
    two = ap.add_argument_group("--two-gpus (issue 30): two processes, one GPU and one lease each")
    two.add_argument("--two-gpus", action="store_true", help="run this measurement instead of the ones above")
    two.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a dry run of the same code")
    two.add_argument("--preset", default="qwen2-1.5b", help="model shape (tidal_recipes.cli.models.PRESETS)")
    two.add_argument("--dtype", default="bfloat16", help="of params, grads and moments (bfloat16: 12.3 GB at 1.5B)")
    two.add_argument("--cycles", type=int, default=6, help="lease turns per phase")
    two.add_argument("--rounds", type=int, default=2, help="rounds of (process 0 alone, process 1 alone, both)")
    two.add_argument("--line-mb", type=float, default=None, help="line-rate buffer (default 1024 MiB, 16 on CPU)")
    two.add_argument("--timeout-s", type=float, default=480.0, help="kill both processes after this long")
    two.add_argument("--json", default=None, help="write the rows and the summary here")
    args = ap.parse_args(argv)
    if args.two_gpus:
        return main_two(args)
    if not torch.cuda.is_available():
        print("bench_lease: needs a CUDA device; skipped")
        return 0
    gpu = torch.cuda.get_device_name()
    versions = f"torch {torch.__version__}, CUDA {torch.version.cuda}, tidal {tidal.__version__}"
    layers = _layers(args.role_gb)
    print(f"{gpu} | {versions} | {layers} layers of {WIDTH}x{WIDTH} per role", flush=True)
    cross = cross_process(layers, args.turns, args.hold_s, args.skip)  # before this process touches CUDA
    ovl = None
    if args.overlap:
        ovl = cross_process(layers, args.turns, args.hold_s, args.skip, overlap=True, chunk_mb=args.chunk_mb)
    local = in_process(layers, args.turns, args.skip)
    m, f0, sw, sq = cross["median"], cross["first"], local["switch"], local["sequential"]
    print(f"role state: {cross['role_bytes'] / 1e9:.3f} GB each (in-process {local['role_bytes'] / 1e9:.3f} GB)")
    print(
        f"cross-process hand-over (median of {cross['count']}): {m['total']:.4f} s = offload {m['offload']:.4f} "
        f"+ grant {m['grant']:.4f} + reload {m['reload']:.4f}; {m['bytes'] / 1e9:.3f} GB moved, "
        f"{_gbps(m['bytes'], m['total']):.1f} GB/s (offload {_gbps(m['bytes'] / 2, m['offload']):.1f}, "
        f"reload {_gbps(m['bytes'] / 2, m['reload']):.1f})"
    )
    print(
        f"  first hand-over: {f0['total']:.4f} s (offload {f0['offload']:.4f}, grant {f0['grant']:.4f}, "
        f"reload {f0['reload']:.4f})"
    )
    print(
        f"in-process switch (ts.use, overlapped): {sw['total']:.4f} s, {sw['bytes'] / 1e9:.3f} GB, "
        f"{_gbps(sw['bytes'], sw['total']):.1f} GB/s (first {local['switch_first']:.4f} s)"
    )
    print(f"in-process sequential (offload_all, load): {sq['total']:.4f} s, {_gbps(sq['bytes'], sq['total']):.1f} GB/s")
    print(
        f"ratio cross-process / in-process switch: {m['total'] / sw['total']:.2f}; "
        f"/ in-process sequential: {m['total'] / sq['total']:.2f}"
    )
    if ovl is not None:
        o = ovl["median"]
        print(
            f"overlapped hand-over (median of {ovl['count']}, {o['overlapped']} overlapped, chunks of "
            f"{args.chunk_mb} MiB): {o['total']:.4f} s = offload {o['offload']:.4f}, next load {o['reload']:.4f} "
            f"of which {o['overlap']:.4f} during the offload; ratio / in-process switch: "
            f"{o['total'] / sw['total']:.2f} (target <= 1.15), sequential: {m['total'] / sw['total']:.2f}"
        )
    if args.results:
        if ovl is not None:
            append_overlap_row(args.results, gpu, versions, cross, ovl, local, args.chunk_mb)
            print(f"row appended to {args.results} ({SECTION_OVERLAP})")
        else:
            append_row(args.results, gpu, versions, cross, local, layers)
            print(f"row appended to {args.results} ({SECTION})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
