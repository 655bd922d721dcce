"""The host-device copy rate each GPU of one host gets when every GPU copies at once, plain and
as tidal's transitions: one process per GPU.

    torchrun --nproc_per_node N benchmarks/bench_shared_copies.py [--gib 4] [--json PATH]

Every rank holds ``--gib`` GiB on its GPU and as much pinned host memory. Measured, each
direction in turn (device to host, host to device, then both at once):

* ``alone``: one rank copies while the others wait (each rank in turn): the line rate of one GPU;
* ``shared``: every rank copies at the same moment (after a barrier): what each gets when the
  host's memory and PCIe fabric are shared;
* ``tidal``: every rank at once, a role of the same bytes (64 MiB tensors) offloaded, loaded,
  then switched with a second role of the same size (``Timeshare`` keeping freed memory in the
  process's cache, as TidalGRPOTrainer has it; each move waited for, to time it), each move paired
  with a plain copy of the same direction, every rank at once, one right after the other (plain
  first in even repetitions, tidal first in odd ones): the host's state drifts between seconds
  (the same code measured 0.86x on one machine and 1.02x on another with the two measured in
  separate blocks), so the ratio is taken pair by pair; and each rank's tidal alone
  (``tidal_alone``), against ``alone``;
* ``tidal_unpaced`` (and ``tidal_unpaced_alone``): the same with the device-to-host copies
  queued whole (``TransferConfig(paced_piece_bytes=0)``), which shows what the pacing (one
  piece at the copy engine at a time, for the compute stream's reads) costs each direction.

Of each switch (both directions at once), plain and tidal's, when each direction's last copy
ended (timing events on the copy streams): a switch whose one direction ends well before the
other ran part of its time one way only.

Printed per rank and in the JSON: GB/s of each, and tidal / plain shared pair by pair (each
pair's ratio, their median, least and most; target >= 0.9). The host's
NUMA nodes and memory are read from /sys and /proc and printed with the GPUs.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import glob
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import tidal  # noqa: E402

MiB = 1 << 20


def _timed(fn, reps: int) -> float:
    """The median seconds of ``reps`` calls of ``fn`` (each synchronised)."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _copies(dev: torch.Tensor, host: torch.Tensor, dev2: torch.Tensor, host2: torch.Tensor) -> dict:
    d2h_stream, h2d_stream = torch.cuda.Stream(), torch.cuda.Stream()

    def d2h():
        with torch.cuda.stream(d2h_stream):
            host.copy_(dev, non_blocking=True)

    def h2d():
        with torch.cuda.stream(h2d_stream):
            dev2.copy_(host2, non_blocking=True)

    def both():
        d2h()
        h2d()

    def both_spans() -> dict:
        """Both at once, with when each direction's copy ended (s from the start)."""
        marks = {
            k: (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for k in ("d2h", "h2d")
        }
        marks["d2h"][0].record(d2h_stream)
        marks["h2d"][0].record(h2d_stream)
        both()
        marks["d2h"][1].record(d2h_stream)
        marks["h2d"][1].record(h2d_stream)
        torch.cuda.synchronize()
        return {k: a.elapsed_time(b) / 1e3 for k, (a, b) in marks.items()}

    return {"d2h": d2h, "h2d": h2d, "both": both, "both_spans": both_spans}


def _topology() -> dict:
    nodes = sorted(glob.glob("/sys/devices/system/node/node[0-9]*"))
    mem = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                k, v = line.split(":", 1)
                if k in ("MemTotal", "MemAvailable"):
                    mem[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return {
        "numa_nodes": len(nodes) or 1,
        "host_memory_bytes": mem.get("MemTotal"),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "cpus": os.cpu_count(),
    }


@contextlib.contextmanager
def _directions(engine):
    """Inside the block, when each direction of tidal's copies ended: a timing event on each
    copy stream at the block's start and after every segment the engine queues there; yields
    a dict filled at the block's end with ``d2h`` and ``h2d``, the seconds from the start to
    each direction's last copy (the bench's instrument: the engine's own methods, wrapped for
    the block and put back)."""
    start = {}
    last: dict[str, object] = {}
    spans: dict[str, float] = {}
    wrapped = {}
    for name, stream_attr, key in (("copy_out", "d2h_stream", "d2h"), ("copy_in", "h2d_stream", "h2d")):
        stream = getattr(engine, stream_attr)
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream)
        start[key] = ev
        original = getattr(engine, name)

        def timed(seg, _original=original, _stream=stream, _key=key):
            out = _original(seg)
            end = torch.cuda.Event(enable_timing=True)
            end.record(_stream)  # behind the segment's copy on its stream (the pacer's pieces too)
            last[_key] = end
            return out

        wrapped[name] = original
        setattr(engine, name, timed)
    try:
        yield spans
    finally:
        for name, original in wrapped.items():
            setattr(engine, name, original)
    torch.cuda.synchronize()
    for key in ("d2h", "h2d"):
        spans[key] = start[key].elapsed_time(last[key]) / 1e3 if key in last else 0.0


def _roles(nbytes: int, transfer) -> tuple[tidal.Timeshare, list, int]:
    """Two roles of ``nbytes`` each (64 MiB tensors) in a Timeshare that keeps freed memory in
    the process's cache as TidalGRPOTrainer has it (the next load takes it back without asking
    the driver; unlike the trainer's, each move is waited for, to time it), role ``a`` on the device, both pinned on the host
    once; and the bytes a role holds. ``transfer``: the roles' :class:`tidal.TransferConfig`
    (None: the default)."""
    pieces = max(1, nbytes // (64 * MiB))
    roles = []
    for _ in range(2):
        params = torch.nn.ParameterList(
            torch.nn.Parameter(torch.empty(64 * MiB // 2, dtype=torch.bfloat16, device="cuda"), requires_grad=False)
            for _ in range(pieces)
        )
        roles.append(params)
    kw = {"transfer": transfer} if transfer is not None else {}
    ts = tidal.Timeshare("cuda", config=tidal.TimeshareConfig(release_to_driver=False, **kw))
    ts.add_role("a", model=roles[0])
    ts.add_role("b", model=roles[1])
    ts.offload("b")
    ts.offload("a")  # pins the host slots: the timed moves below reuse them
    ts.load("a")
    return ts, roles, pieces * 64 * MiB


def _tidal_once(ts: tidal.Timeshare, direction: str, into: dict) -> float:
    """One of tidal's moves of role ``a`` (``d2h``: offload; ``h2d``: load; ``both``: a switch,
    ``a`` out and ``b`` in at once), its GB/s; for a switch, when each direction's copies ended
    goes into ``into`` (``both_d2h_s``, ``both_h2d_s``, ``both_s``). Leaves ``b`` on the device
    after a switch: :func:`_tidal_reset` puts ``a`` back, outside the timed windows."""
    if direction == "d2h":
        rec = ts.offload("a")
        return rec.bytes_out / rec.seconds / 1e9
    if direction == "h2d":
        rec = ts.load("a")
        return rec.bytes_in / rec.seconds / 1e9
    with _directions(ts.store.engine) as spans:
        with ts.use("b"):  # a switch: a out, b in, both directions at once
            rec = ts.records[-1]
    into.setdefault("both_d2h_s", []).append(spans["d2h"])
    into.setdefault("both_h2d_s", []).append(spans["h2d"])
    into.setdefault("both_s", []).append(rec.seconds)
    return (rec.bytes_out + rec.bytes_in) / rec.seconds / 1e9


def _tidal_reset(ts: tidal.Timeshare) -> None:
    ts.load("a")  # after a switch: a back in, b out (untimed)


DIRECTIONS = ("d2h", "h2d", "both")


def paired_summary(plain: dict[str, list[float]], tidal_: dict[str, list[float]]) -> dict:
    """Per direction, from rates taken in pairs (the same repetition, every rank at once, one
    right after the other): the median of each side, and tidal's ratio to plain pair by pair
    (each pair's ratio, their median, least and most)."""
    out: dict = {}
    for d in DIRECTIONS:
        ratios = [t / p for p, t in zip(plain[d], tidal_[d])]
        out[d] = {
            "plain_gbps": statistics.median(plain[d]),
            "tidal_gbps": statistics.median(tidal_[d]),
            "ratios": ratios,
            "ratio_median": statistics.median(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
        }
    return out


def _paired(copies: dict, nbytes: int, ts: tidal.Timeshare, reps: int) -> tuple[dict, dict]:
    """Plain copies and tidal's moves, every rank at once, in pairs: in each repetition and
    direction one of each, right after the other (plain first in even repetitions, tidal first
    in odd ones), so that the two see the host in the same state. Returns tidal's switch spans
    and :func:`paired_summary`'s figures."""
    plain: dict[str, list[float]] = {d: [] for d in DIRECTIONS}
    mine: dict[str, list[float]] = {d: [] for d in DIRECTIONS}
    spans: dict[str, list[float]] = {}
    for rep in range(reps):
        for d in DIRECTIONS:
            moved = nbytes * (2 if d == "both" else 1)
            for side in ("plain", "tidal") if rep % 2 == 0 else ("tidal", "plain"):
                dist.barrier()  # every rank starts its copy together
                if side == "plain":
                    plain[d].append(moved / _timed(copies[d], 1) / 1e9)
                else:
                    mine[d].append(_tidal_once(ts, d, spans))
        dist.barrier()  # no rank's copies still running while another puts its role back
        _tidal_reset(ts)
    dist.barrier()
    return {k: statistics.median(v) for k, v in spans.items()}, paired_summary(plain, mine)


def _alone(ts: tidal.Timeshare, rank: int, world: int, reps: int) -> dict:
    """Each rank's tidal moves with the other ranks idle, in turn: medians of ``reps``."""
    timed: dict[str, list[float]] = {}
    for r in range(world):
        for _ in range(reps):
            for d in DIRECTIONS:
                dist.barrier()
                if r == rank:
                    timed.setdefault(d, []).append(_tidal_once(ts, d, timed))
            dist.barrier()
            if r == rank:
                _tidal_reset(ts)
    dist.barrier()
    return {k: statistics.median(v) for k, v in timed.items()}


def _tidal_rates(copies: dict, nbytes: int, rank: int, world: int, reps: int, transfer) -> dict:
    """tidal's offload, load and switch (two roles of ``nbytes`` each, 64 MiB tensors) beside
    plain copies, every rank at once, in pairs (:func:`_paired`); then each rank's tidal alone
    in turn. ``transfer``: the roles' :class:`tidal.TransferConfig` (None: the default)."""
    ts, roles, moved = _roles(nbytes, transfer)
    spans, paired = _paired(copies, nbytes, ts, reps)
    alone = _alone(ts, rank, world, reps)
    ts.close()
    del roles
    torch.cuda.empty_cache()
    return {"paired": paired, "spans": spans, "alone": alone, "bytes": moved}


def _rank_lines(r: dict) -> str:
    """One rank's figures, as printed."""
    line = f"  rank {r['rank']}:"
    for d in DIRECTIONS:
        t, u = r["tidal"]["paired"][d], r["tidal_unpaced"]["paired"][d]
        line += (
            f"\n    {d}: plain alone {r['alone'][d]:.1f}, shared {r['shared'][d]:.1f} GB/s "
            f"({r['shared'][d] / r['alone'][d]:.2f}x alone); tidal alone {r['tidal_alone'][d]:.1f} "
            f"({r['tidal_alone'][d] / r['alone'][d]:.2f}x plain alone); shared, in pairs: tidal {t['tidal_gbps']:.1f} "
            f"against plain {t['plain_gbps']:.1f} GB/s, ratio median {t['ratio_median']:.2f}x "
            f"(pairs {t['ratio_min']:.2f}-{t['ratio_max']:.2f}x); unpaced {u['ratio_median']:.2f}x "
            f"({u['ratio_min']:.2f}-{u['ratio_max']:.2f}x)"
        )
    sp = r["shared_both_spans"]
    line += (
        f"\n    plain both at once, all ranks: its device-to-host copy ended {sp['d2h'] * 1e3:.1f} ms, its "
        f"host-to-device {sp['h2d'] * 1e3:.1f} ms after the start"
    )
    for label, t in (("tidal", r["tidal"]["spans"]), ("tidal alone", r["tidal_alone"])):
        line += (
            f"\n    {label}'s switch: {t['both_s'] * 1e3:.1f} ms on the host; its device-to-host copies "
            f"ended {t['both_d2h_s'] * 1e3:.1f} ms, its host-to-device {t['both_h2d_s'] * 1e3:.1f} ms after its "
            f"start"
        )
    return line


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=4.0, help="bytes each rank copies, in GiB")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions of each copy (median)")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(k, v)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    nbytes = int(a.gib * (1 << 30))
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev2 = torch.empty_like(dev)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host2 = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    copies = _copies(dev, host, dev2, host2)
    res: dict = {"rank": rank, "alone": {}, "shared": {}}
    spans = copies.pop("both_spans")
    for direction, fn in copies.items():
        moved = nbytes * (2 if direction == "both" else 1)
        fn()  # warm
        for r in range(world):  # each rank alone, in turn
            dist.barrier()
            if r == rank:
                res["alone"][direction] = moved / _timed(fn, a.reps) / 1e9
            torch.cuda.synchronize()
        dist.barrier()
        res["shared"][direction] = moved / _timed(fn, a.reps) / 1e9  # every rank at once
        dist.barrier()
        if direction == "both":
            res["shared_both_spans"] = spans()  # every rank at once again, each direction's end
            dist.barrier()

    # tidal: two roles of the same bytes, every rank at once, each move paired with a plain copy
    # of the same direction; as configured (device-to-host copies paced, one 64 MiB piece at the
    # copy engine at a time: tidal.transfer.pacing), then with the pacing off, to show what the
    # pacing costs where both directions run at once. The plain copies' memory stays for the pairs.
    for key, transfer in (("tidal", None), ("tidal_unpaced", tidal.TransferConfig(paced_piece_bytes=0))):
        got = _tidal_rates(copies, nbytes, rank, world, a.reps, transfer)
        res[key] = {"paired": got["paired"], "spans": got["spans"]}
        res[key + "_alone"] = got["alone"]
        res["tidal_bytes"] = got["bytes"]
    del copies, dev, dev2, host, host2
    torch.cuda.empty_cache()

    gathered: list = [None] * world
    dist.all_gather_object(gathered, res)
    if rank == 0:
        topo = _topology()
        print(
            f"{topo['gpus'][0] if topo['gpus'] else '?'} x {world}, {topo['numa_nodes']} NUMA node(s), "
            f"{(topo['host_memory_bytes'] or 0) / 2**30:.0f} GiB host, {topo['cpus']} cores; {a.gib} GiB a rank; "
            f"torch {torch.__version__}"
        )
        for r in gathered:
            print(_rank_lines(r))
        print(
            "target: tidal >= 0.9x the shared rate, every rank, every direction (each pair's ratio: tidal's move "
            "and a plain copy, every rank at once, one right after the other)"
        )
        if a.json:
            with open(a.json, "w") as f:
                json.dump(
                    {
                        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
                        "commit": os.environ.get("TIDAL_COMMIT", ""),
                        "topology": topo,
                        "gib": a.gib,
                        "world": world,
                        "ranks": gathered,
                    },
                    f,
                )
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
