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
        for p in procs:
            p.start()
        end = time.monotonic() + 300
        while any(p.is_alive() for p in procs) and time.monotonic() < end:
            if any(p.exitcode not in (None, 0) for p in procs):
                break  # one failed: the other would wait for its turn or the barrier forever
            time.sleep(0.05)
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        if any(p.exitcode != 0 for p in procs):
            raise SystemExit(f"a worker failed: exit codes {[p.exitcode for p in procs]}")
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
    args = ap.parse_args(argv)
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
