"""What a large queued copy costs the compute stream's own small copies (issue 26).

    python benchmarks/bench_copy_contention.py [--gib 8] [--pieces-mib 1024,256,64,16]
        [--paced 64:1,64:2,16:2] [--gated 64,16] [--chained 64:1,32:2] [--tidal 64,0]
        [--loops read,upload,busy] [--json PATH]

A step of Hugging Face generation ends with a small device-to-host read (is every sequence
done?), so the host waits for one tiny copy per token. tidal's write-back and prefetch queue
gigabytes of copies on side streams while generation runs. If the copy engine serves the tiny
copy only after the large one in flight, each token waits for up to one large copy.

Measured here, one process, one GPU: a loop standing in for a decode step (a few bf16 matmuls
of a 7B layer's width on the compute stream, then ``.item()``) runs alone, then while ``--gib``
GiB go out (device to host, pinned) or come in on a side stream, queued as copies of each
``--pieces-mib`` size. Printed per case: the loop's median and 90th-percentile iteration time
against the loop alone, and the side copy's rate against the line rate measured alone.

``--paced PIECE_MIB:DEPTH,...``: the device-to-host copy fed by a host thread that keeps at most
DEPTH copies of PIECE_MIB queued (it waits for the oldest before queueing the next): whether a
bounded queue lets the loop's reads through, at what copy rate, and what the feeding thread
costs the loop (the GIL).

``--gated PIECE_MIB[:DEPTH],...``: every copy queued at once, each behind a device-side wait on
a pinned host word (``cuStreamWaitValue32``) that a host thread raises by one as each copy
finishes: DEPTH copies (default 1) released at a time with no host queueing in between.

``--chained PIECE_MIB:DEPTH,...``: every copy queued at once, with no host thread: the pieces
take turns on DEPTH + 1 side streams, each piece's stream waiting (an event) for the piece DEPTH
places before it, so the copy engine receives a piece only once that one has finished.

``--tidal PIECE_MIB,...``: the device-to-host copy as tidal queues a write-back
(``TransferEngine.queue_direct`` with ``TransferConfig(paced_piece_bytes=PIECE_MIB MiB)``; 0:
unpaced), the mechanism the cases above chose (:mod:`tidal.transfer.pacing`). Device-to-host only.

``--loops``: ``read`` is the loop above; ``upload`` starts each iteration with a small
host-to-device copy from pageable memory (inputs built on the host), to see what queued
host-to-device copies cost it; ``busy`` spends ``--busy-ms`` of pure Python on the host each
iteration before its kernels (a launch-heavy host, as Hugging Face generation is), holding the
GIL that a gating thread needs. Every case runs in both directions for each loop.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tidal.device import DeviceOps  # noqa: E402
from tidal.transfer import CopyItem, HostArena, TransferConfig, TransferEngine  # noqa: E402


def _spin(seconds: float) -> None:
    """Pure Python on the host for ``seconds``, holding the GIL (a launch-heavy host)."""
    end = time.perf_counter() + seconds
    n = 0
    while time.perf_counter() < end:
        n += 1


def _decode_like(x: torch.Tensor, w: torch.Tensor, layers: int, upload: bool = False, busy_s: float = 0.0) -> float:
    if busy_s:
        _spin(busy_s)
    y = x
    if upload:  # a small host-to-device copy from pageable memory, as inputs built on the host are
        y = y + torch.tensor([0.0], device=x.device, dtype=x.dtype)
    for _ in range(layers):
        y = torch.tanh(y @ w)
    return float(y[0, 0].item())  # the per-token device-to-host read


def _loop_until(done, x, w, layers: int, min_iters: int, upload: bool = False, busy_s: float = 0.0) -> list[float]:
    """Iteration times (s) of the decode-like loop until ``done()`` (and at least ``min_iters``)."""
    times = []
    while True:
        t0 = time.perf_counter()
        _decode_like(x, w, layers, upload, busy_s)
        times.append(time.perf_counter() - t0)
        if len(times) >= min_iters and done():
            return times


class _Gate:
    """Copies queued all at once, each behind a ``cuStreamWaitValue32`` on a pinned host word
    that a host thread raises one step per finished copy: the stream holds one copy released
    at a time, with nothing to queue from the host in between (whether the copy engine then
    serves other streams' copies between them is what this measures)."""

    def __init__(self) -> None:
        import ctypes

        lib = ctypes.CDLL("libcuda.so.1")
        self.wait = getattr(lib, "cuStreamWaitValue32_v2", None) or lib.cuStreamWaitValue32
        self.wait.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        get_dptr = lib.cuMemHostGetDevicePointer_v2
        get_dptr.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
        self.word = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        dptr = ctypes.c_uint64()
        if get_dptr(ctypes.byref(dptr), ctypes.c_void_p(self.word.data_ptr()), 0) != 0:
            raise RuntimeError("cuMemHostGetDevicePointer failed")
        self.dptr = dptr.value
        self.value = ctypes.c_uint32.from_address(self.word.data_ptr())

    def queue(self, dst, src, piece: int, stream) -> list:
        """Queue every piece behind its gate; the per-piece events."""
        import ctypes

        self.value.value = 0
        events = []
        with torch.cuda.stream(stream):
            for d, s in _pieces(dst, src, piece):
                # CU_STREAM_WAIT_VALUE_GEQ: the stream waits until the word reaches this piece's number
                rc = self.wait(ctypes.c_void_p(stream.cuda_stream), self.dptr, len(events) + 1, 0)
                if rc != 0:
                    self.value.value = 1 << 30  # open every gate queued so far
                    raise RuntimeError(f"cuStreamWaitValue32 failed ({rc})")
                d.copy_(s, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(stream)
                events.append(ev)
        return events

    def open_one_by_one(self, events: list, depth: int = 1) -> None:
        """A host thread's work: let copy k go once copy k - depth has finished."""
        try:
            for k in range(1, len(events) + 1):
                if k > depth:
                    events[k - 1 - depth].synchronize()
                self.value.value = k
        finally:
            self.value.value = 1 << 30  # nothing may stay gated


def _pieces(dst: list[torch.Tensor], src: list[torch.Tensor], piece: int):
    """(destination, source) byte slices of at most ``piece`` bytes covering dst[i] <- src[i]."""
    for d, s in zip(dst, src):
        db, sb = d.view(torch.uint8).view(-1), s.view(torch.uint8).view(-1)
        for start in range(0, db.numel(), piece):
            yield db[start : start + piece], sb[start : start + piece]


def _queue(dst: list[torch.Tensor], src: list[torch.Tensor], piece: int, stream) -> int:
    """Queue dst[i] <- src[i] on ``stream`` as copies of at most ``piece`` bytes; the count."""
    n = 0
    with torch.cuda.stream(stream):
        for d, s in _pieces(dst, src, piece):
            d.copy_(s, non_blocking=True)
            n += 1
    return n


def _feed(dst: list[torch.Tensor], src: list[torch.Tensor], piece: int, depth: int, stream, done) -> None:
    """Queue dst[i] <- src[i] on ``stream`` in ``piece``-byte copies, at most ``depth`` queued
    at a time, then record ``done`` (a host thread's work)."""
    inflight: list = []
    with torch.cuda.stream(stream):
        for d, s in _pieces(dst, src, piece):
            while len(inflight) >= depth:
                inflight.pop(0).synchronize()  # releases the GIL while it waits
            d.copy_(s, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(stream)
            inflight.append(ev)
        done.record(stream)


def _chain(dst: list[torch.Tensor], src: list[torch.Tensor], piece: int, depth: int, streams: list, after) -> tuple:
    """Queue dst[i] <- src[i] in ``piece``-byte copies taking turns on ``streams`` (depth + 1 of
    them), each behind the event of the copy ``depth`` places before it; every stream first waits
    for ``after``, and ``after`` then waits for all of them. Returns the number of copies."""
    for s in streams:
        s.wait_stream(after)
    done: list = []
    for k, (d, s) in enumerate(_pieces(dst, src, piece)):
        stream = streams[k % len(streams)]
        with torch.cuda.stream(stream):
            if k >= depth:
                stream.wait_event(done[k - depth])  # the copy engine gets this piece once that one has run
            d.copy_(s, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(stream)
            done.append(ev)
    for s in streams:
        after.wait_stream(s)
    return len(done)


def _row(direction, label, n, queued_s, copy_gbps, line_gbps, times, base_med, base_p90) -> dict:
    med = statistics.median(times)
    p90 = statistics.quantiles(times, n=10)[-1] if len(times) >= 10 else max(times)
    print(
        f"{direction} {label} ({n:>4} copies, queued in {queued_s * 1e3:6.1f} ms): "
        f"copy {copy_gbps:5.1f} GB/s ({copy_gbps / line_gbps:.2f}x line {line_gbps:.1f}); "
        f"decode-like iteration median {med * 1e3:6.2f} ms ({med / base_med:.2f}x alone "
        f"{base_med * 1e3:.2f}), p90 {p90 * 1e3:6.2f} ms ({p90 / base_p90:.2f}x), longest {max(times) * 1e3:6.2f} ms, "
        f"{len(times)} iterations",
        flush=True,
    )
    return dict(
        direction=direction,
        case=label,
        copies=n,
        queue_s=queued_s,
        copy_gbps=copy_gbps,
        line_gbps=line_gbps,
        iters=len(times),
        iter_median_ms=med * 1e3,
        iter_p90_ms=p90 * 1e3,
        iter_max_ms=max(times) * 1e3,
        alone_median_ms=base_med * 1e3,
        alone_p90_ms=base_p90 * 1e3,
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=8.0, help="bytes moved by the side copy, in GiB")
    ap.add_argument("--tensor-mib", type=int, default=1024, help="size of each tensor copied (a 7B embedding: ~1040)")
    ap.add_argument("--pieces-mib", default="1024,256,64,16", help="copy sizes to queue the tensors as")
    ap.add_argument("--paced", default="64:1,64:2,16:2", help="PIECE_MIB:DEPTH cases of a fed D2H copy")
    ap.add_argument(
        "--gated", default="64,16,32:2", help="PIECE_MIB[:DEPTH] cases of a D2H copy gated piece by piece on the device"
    )
    ap.add_argument(
        "--chained", default="64:1,32:2", help="PIECE_MIB:DEPTH cases of a D2H copy chained on side streams"
    )
    ap.add_argument("--tidal", default="64,0", help="PIECE_MIB cases of tidal's write-back (0: unpaced)")
    ap.add_argument(
        "--loops",
        default="read,upload,busy",
        help="loop kinds: read (.item()), upload (a small upload, then .item()), busy (host Python, then read)",
    )
    ap.add_argument("--busy-ms", type=float, default=3.0, help="host Python per iteration of the busy loop")
    ap.add_argument("--width", type=int, default=3584, help="the decode-like loop's matmul width")
    ap.add_argument("--layers", type=int, default=8, help="matmuls per iteration")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    pieces = [int(p) << 20 for p in args.pieces_mib.split(",")]
    dev = torch.device("cuda")
    tensor_bytes = args.tensor_mib << 20
    count = max(1, int(args.gib * (1 << 30)) // tensor_bytes)
    on_gpu = [torch.empty(tensor_bytes, dtype=torch.uint8, device=dev) for _ in range(count)]
    on_host = [torch.empty(tensor_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(count)]
    total = count * tensor_bytes
    x = torch.randn(64, args.width, device=dev, dtype=torch.bfloat16)
    w = torch.randn(args.width, args.width, device=dev, dtype=torch.bfloat16) / args.width**0.5
    side = torch.cuda.Stream()
    chain_streams = [torch.cuda.Stream() for _ in range(4)]
    for _ in range(20):  # warm-up: kernels, cuBLAS handles
        _decode_like(x, w, args.layers, upload=True)
    gate = None
    if args.gated:
        try:
            gate = _Gate()
        except Exception as e:  # a driver without stream memory operations: the other cases still run
            print(f"gated cases skipped: {e!r}", flush=True)

    rows = []
    engines: dict = {}  # tidal's engines, by piece MiB
    arena_items = None  # (tidal's host arena, the copy items of on_gpu)
    tidal_ops = DeviceOps(dev)
    for loop in args.loops.split(","):
        upload = loop == "upload"
        busy_s = args.busy_ms / 1e3 if loop == "busy" else 0.0
        alone = _loop_until(lambda: True, x, w, args.layers, 400 if not busy_s else 50, upload, busy_s)
        base_med, base_p90 = statistics.median(alone), statistics.quantiles(alone, n=10)[-1]
        print(f"loop '{loop}' alone: median {base_med * 1e3:.3f} ms, p90 {base_p90 * 1e3:.3f} ms", flush=True)

        def measure(direction, label, n, queued_s, start, end, done, line_gbps):
            times = _loop_until(done, x, w, args.layers, 5, upload, busy_s)
            end.synchronize()
            copy_gbps = total / (start.elapsed_time(end) / 1e3) / 1e9
            row = _row(f"{loop}: {direction}", label, n, queued_s, copy_gbps, line_gbps, times, base_med, base_p90)
            rows.append(dict(row, loop=loop))

        for direction in ("d2h", "h2d"):
            dst, src = (on_host, on_gpu) if direction == "d2h" else (on_gpu, on_host)
            # The line rate alone: the same bytes in whole-tensor copies, nothing else running.
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            _queue(dst, src, tensor_bytes, side)
            side.synchronize()
            line_gbps = total / (time.perf_counter() - t0) / 1e9
            for piece in pieces:
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0 = time.perf_counter()
                with torch.cuda.stream(side):
                    start.record()
                n = _queue(dst, src, piece, side)
                with torch.cuda.stream(side):
                    end.record()
                label = f"in {piece >> 20:>5} MiB copies, all queued"
                measure(direction, label, n, time.perf_counter() - t0, start, end, end.query, line_gbps)
            for case in args.paced.split(",") if args.paced else []:
                piece_mib, depth = (int(v) for v in case.split(":"))
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                with torch.cuda.stream(side):
                    start.record()
                feeder = threading.Thread(target=_feed, args=(dst, src, piece_mib << 20, depth, side, end), daemon=True)
                feeder.start()
                label = f"in {piece_mib:>5} MiB copies, fed {depth} at a time"
                done = lambda f=feeder, e=end: not f.is_alive() and e.query()  # noqa: E731
                measure(direction, label, total // (piece_mib << 20), 0.0, start, end, done, line_gbps)
                feeder.join()
            for case in args.gated.split(",") if gate is not None else []:
                piece_mib, depth = (int(v) for v in (case + ":1").split(":")[:2])
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                with torch.cuda.stream(side):
                    start.record()
                t0 = time.perf_counter()
                try:
                    events = gate.queue(dst, src, piece_mib << 20, side)
                except RuntimeError as e:
                    side.synchronize()  # the gates queued so far were opened by queue()
                    print(f"gated {piece_mib} MiB skipped: {e}", flush=True)
                    continue
                with torch.cuda.stream(side):
                    end.record()
                queued_s = time.perf_counter() - t0
                opener = threading.Thread(target=gate.open_one_by_one, args=(events, depth), daemon=True)
                opener.start()
                label = f"in {piece_mib:>5} MiB copies, all queued, gated {depth} at a time"
                measure(direction, label, len(events), queued_s, start, end, end.query, line_gbps)
                opener.join()
            for piece_mib in (int(v) for v in args.tidal.split(",")) if args.tidal and direction == "d2h" else []:
                eng = engines.get(piece_mib)
                if eng is None:
                    if arena_items is None:  # one host arena (pinned once) for every case
                        arena = HostArena(tidal_ops)
                        slots = arena.reserve([tensor_bytes] * count)
                        arena_items = (
                            arena,
                            [CopyItem(t.untyped_storage(), sl, tensor_bytes) for t, sl in zip(on_gpu, slots)],
                        )
                    arena = arena_items[0]
                    eng = TransferEngine(tidal_ops, arena, TransferConfig(paced_piece_bytes=piece_mib << 20))
                    engines[piece_mib] = eng
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                eng.begin_out()
                start.record(eng.d2h_stream)
                t0 = time.perf_counter()
                n0 = eng.pacer.pieces
                eng.queue_direct(arena_items[1], to_device=False)
                n = eng.pacer.pieces - n0 or count
                end.record(eng.d2h_stream)
                how = f"paced in {piece_mib:>3} MiB pieces" if piece_mib else "unpaced"
                label = f"tidal's write-back, {how}"
                measure(direction, label, n, time.perf_counter() - t0, start, end, end.query, line_gbps)
            for case in args.chained.split(",") if args.chained else []:
                piece_mib, depth = (int(v) for v in case.split(":"))
                if not 1 <= depth < len(chain_streams):
                    raise SystemExit(f"--chained depth must be 1..{len(chain_streams) - 1}, got {depth}")
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                with torch.cuda.stream(side):
                    start.record()
                t0 = time.perf_counter()
                n = _chain(dst, src, piece_mib << 20, depth, chain_streams[: depth + 1], side)
                with torch.cuda.stream(side):
                    end.record()
                label = f"in {piece_mib:>5} MiB copies, all queued, chained {depth} ahead"
                measure(direction, label, n, time.perf_counter() - t0, start, end, end.query, line_gbps)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, gib=total / 2**30, rows=rows),
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
