"""Where one training step's time goes, from a ``torch.profiler`` trace: the compute stream
against the two copy streams, the phases the host ran, and what the compute stream waited for.

Used by ``bench_trl.py --profile-step K`` (and testable on the CPU with made-up spans): the
profiler's events become :class:`Span` rows (a lane, a name, a start and an end in seconds
from the step's start); :func:`analyse` turns them into a summary (per-phase wall time,
stream busy time, copy bytes and how much of the copying ran beside compute, and the compute
stream's idle time by cause); :func:`draw` puts several runs one above the other in a PNG.

Lanes: ``host`` (annotations the benchmark put around the trainer's phases and tidal's verbs,
``phase:<name>`` / ``tidal:<name>`` / ``wait:<name>``), ``sync`` (CUDA runtime calls that
block the host: stream, event and device synchronisation, ``cudaFree``, ``cudaMalloc``,
synchronous copies), ``compute`` (the stream that ran the most kernel time), ``h2d`` and
``d2h`` (the streams whose copies go that way), ``other`` (any other stream).

Idle causes: a gap on the compute stream inside the step is charged to what the host did
during it, the first that applies: a ``wait:`` annotation (a host wait tidal made), a
``tidal:`` annotation (host time inside a tidal verb), a blocking runtime call, a copy
running on a copy stream while the host was not blocked (the compute stream waits on a copy
event), else the innermost phase (the trainer's own host work: Python, tokenizing, a
``.item()`` of its own).
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Iterable, Sequence

__all__ = ["Span", "spans_from_events", "spans_from_profiler", "analyse", "compact", "draw", "format_summary"]

_BLOCKING = (
    "cudaStreamSynchronize",
    "cudaEventSynchronize",
    "cudaDeviceSynchronize",
    "cudaFree",
    "cudaMalloc",
    "cudaMemcpy",  # synchronous (cudaMemcpyAsync is not matched: names are compared whole)
    "cudaHostRegister",
    "cudaHostUnregister",
    "cudaMemGetInfo",
)


@dataclasses.dataclass(frozen=True)
class Span:
    lane: str
    name: str
    start: float
    end: float
    nbytes: int = 0

    @property
    def seconds(self) -> float:
        return self.end - self.start


def spans_from_profiler(prof) -> list[Span]:
    """:func:`spans_from_events` of a finished ``torch.profiler.profile``."""
    return spans_from_events(prof.profiler.kineto_results.events())


def spans_from_events(events) -> list[Span]:
    """Kineto's events as spans, in seconds from the first event (kept: annotations, blocking
    runtime calls and every device event; the device events' streams become lanes)."""
    raw: list[tuple[str, str, int, int, int]] = []
    stream_kind: dict[int, str] = {}
    kernel_ns: dict[int, int] = {}
    for e in events:
        name = e.name()
        dev = str(e.device_type())
        start, dur = e.start_ns(), e.duration_ns()
        if dev.endswith("CPU"):
            if e.is_user_annotation() and name.split(":", 1)[0] in ("phase", "tidal", "wait"):
                raw.append(("host", name, start, start + dur, 0))
            elif name in _BLOCKING:
                raw.append(("sync", name, start, start + dur, 0))
            continue
        sid = e.device_resource_id()
        lower = name.lower()
        if "memcpy" in lower and "dtoh" in lower:
            stream_kind.setdefault(sid, "d2h")
        elif "memcpy" in lower and "htod" in lower:
            stream_kind.setdefault(sid, "h2d")
        elif "memcpy" not in lower and "memset" not in lower:
            kernel_ns[sid] = kernel_ns.get(sid, 0) + dur
        nbytes = 0
        try:
            nbytes = int(e.nbytes())
        except Exception:  # older torch: no byte count on memcpy events
            nbytes = 0
        raw.append((f"stream{sid}", name, start, start + dur, nbytes))
    compute = max(kernel_ns, key=kernel_ns.get) if kernel_ns else None
    lanes = {sid: kind for sid, kind in stream_kind.items()}
    if compute is not None:
        lanes[compute] = "compute"
    t0 = min((r[2] for r in raw), default=0)
    out = []
    for lane, name, s, e, n in raw:
        if lane.startswith("stream"):
            lane = _copy_lane(name) or lanes.get(int(lane[6:]), "other")
        out.append(Span(lane, name, (s - t0) / 1e9, (e - t0) / 1e9, n))
    return sorted(out, key=lambda sp: sp.start)


def _copy_lane(name: str) -> str | None:
    """A copy's lane from its own direction: a stream carries both kinds when small uploads (a
    digest kernel's metadata) share the stream of the large copies out."""
    lower = name.lower()
    if "memcpy" not in lower:
        return None
    if "dtoh" in lower:
        return "d2h"
    if "htod" in lower:
        return "h2d"
    return None


def _union(spans: Iterable[Span]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for sp in sorted(spans, key=lambda s: s.start):
        if merged and sp.start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], sp.end)
        else:
            merged.append([sp.start, sp.end])
    return [(a, b) for a, b in merged]


def _length(intervals: Sequence[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _intersect(a: Sequence[tuple[float, float]], b: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo < hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _gaps(busy: Sequence[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    out, t = [], lo
    for a, b in busy:
        if a > t:
            out.append((t, min(a, hi)))
        t = max(t, b)
        if t >= hi:
            break
    if t < hi:
        out.append((t, hi))
    return [(a, b) for a, b in out if b > a]


def _clip(iv: Sequence[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    return [(max(a, lo), min(b, hi)) for a, b in iv if min(b, hi) > max(a, lo)]


def analyse(spans: Sequence[Span], *, min_gap_s: float = 20e-6) -> dict:
    """The summary of one profiled step (see the module docstring). Returns a dict:
    ``step_s``; ``lanes`` (busy seconds per lane); ``phases`` (per top-level phase: host
    seconds, compute busy seconds in its window, bytes and seconds copied each way and the
    copy seconds that ran beside compute); ``idle`` (compute idle seconds by cause, largest
    first); ``copy_overlap`` (the fraction of all copy time that ran beside compute)."""
    if not spans:
        return {"step_s": 0.0, "lanes": {}, "phases": [], "idle": [], "copy_overlap": 0.0}
    lo = min(s.start for s in spans)
    hi = max(s.end for s in spans)
    by_lane: dict[str, list[Span]] = {}
    for s in spans:
        by_lane.setdefault(s.lane, []).append(s)
    busy = {lane: _union(v) for lane, v in by_lane.items() if lane not in ("host", "sync")}
    compute = busy.get("compute", [])
    copies = _union([s for lane in ("h2d", "d2h") for s in by_lane.get(lane, [])])
    host = by_lane.get("host", [])
    phases = [s for s in host if s.name.startswith("phase:")]
    top = [p for p in phases if not any(q is not p and q.start <= p.start and p.end <= q.end for q in phases)]
    phase_rows = []
    for p in top:
        window = [(p.start, p.end)]
        row = {
            "phase": p.name[6:],
            "start_s": p.start - lo,
            "host_s": p.seconds,
            "compute_s": _length(_intersect(compute, window)),
        }
        for lane in ("h2d", "d2h"):
            sp = [s for s in by_lane.get(lane, []) if p.start <= s.start < p.end]
            row[f"{lane}_s"] = _length(_union(sp))
            row[f"{lane}_gb"] = sum(s.nbytes for s in sp) / 1e9
        row["copy_beside_compute_s"] = _length(_intersect(_intersect(copies, window), compute))
        phase_rows.append(row)
    # The compute stream's idle time, charged to a cause.
    wait_spans = [s for s in host if s.name.startswith("wait:")]
    verb_spans = [s for s in host if s.name.startswith("tidal:")]
    sync_spans = by_lane.get("sync", [])
    layers = [
        ("wait", _Layer(_union(wait_spans)), wait_spans),
        ("tidal", _Layer(_union(verb_spans)), verb_spans),
        ("sync", _Layer(_union(sync_spans)), sync_spans),
    ]
    copy_layer = _Layer(copies)
    short = "short gaps (< %d us)" % round(min_gap_s * 1e6)
    idle: dict[str, float] = {}

    def charge(key: str, seconds: float) -> None:
        idle[key] = idle.get(key, 0.0) + seconds

    for a, b in _gaps(compute, lo, hi):
        if b - a < min_gap_s:
            charge(short, b - a)
            continue
        rest = [(a, b)]
        for label, layer, named in layers:
            nxt = []
            for x, y in rest:
                hit = layer.within(x, y)
                for u, v in hit:
                    who = _innermost(named, (u + v) / 2)
                    key = f"{label} {who.name}" if who is not None else label
                    if label == "sync":
                        outer = _innermost(host, (u + v) / 2)
                        key += f" (in {outer.name})" if outer is not None else ""
                    charge(key, v - u)
                nxt += _gaps(hit, x, y)
            rest = nxt
        for x, y in rest:
            hit = copy_layer.within(x, y)
            for u, v in hit:
                charge("gpu waits on a copy", v - u)
            for u, v in _gaps(hit, x, y):
                who = _innermost(phases, (u + v) / 2)
                charge(f"host {who.name[6:]}" if who is not None else "host (outside the phases)", v - u)
    copy_total = _length(copies)
    return {
        "step_s": hi - lo,
        "lanes": {lane: _length(v) for lane, v in busy.items()},
        "phases": phase_rows,
        "idle": sorted(idle.items(), key=lambda kv: -kv[1]),
        "copy_overlap": _length(_intersect(copies, compute)) / copy_total if copy_total else 0.0,
        "copy_gb": {lane: sum(s.nbytes for s in by_lane.get(lane, [])) / 1e9 for lane in ("h2d", "d2h")},
    }


class _Layer:
    """Disjoint sorted intervals, cut to a window in log time."""

    def __init__(self, intervals: Sequence[tuple[float, float]]) -> None:
        self.intervals = list(intervals)
        self.starts = [a for a, _ in self.intervals]

    def within(self, x: float, y: float) -> list[tuple[float, float]]:
        i = max(0, bisect.bisect_right(self.starts, x) - 1)
        out = []
        while i < len(self.intervals) and self.intervals[i][0] < y:
            a, b = self.intervals[i]
            if b > x:
                out.append((max(a, x), min(b, y)))
            i += 1
        return out


def _innermost(spans: Sequence[Span], t: float) -> Span | None:
    inside = [s for s in spans if s.start <= t <= s.end]
    return min(inside, key=lambda s: s.seconds) if inside else None


def compact(spans: Sequence[Span], *, join_s: float = 200e-6) -> dict[str, list[tuple[float, float, str]]]:
    """Per lane, the spans merged where they are less than ``join_s`` apart (what a picture
    needs, small enough to keep): ``(start, end, name)``; host phases are kept whole."""
    out: dict[str, list[tuple[float, float, str]]] = {}
    for lane in sorted({s.lane for s in spans}):
        rows = sorted((s for s in spans if s.lane == lane), key=lambda s: s.start)
        if lane == "host":
            phases = [s for s in rows if s.name.startswith("phase:")]
            out[lane] = [
                (p.start, p.end, p.name)
                for p in phases
                if not any(q is not p and q.start <= p.start and p.end <= q.end for q in phases)
            ]
            continue
        merged: list[list] = []
        for s in rows:
            if merged and s.start - merged[-1][1] < join_s:
                merged[-1][1] = max(merged[-1][1], s.end)
            else:
                merged.append([s.start, s.end, ""])
        out[lane] = [tuple(m) for m in merged]
    return out


def format_summary(title: str, summary: dict) -> str:
    """The summary as text: phases, lanes, idle causes."""
    lines = [f"{title}: step {summary['step_s']:.3f} s (profiled), copies beside compute {summary['copy_overlap']:.0%}"]
    lines.append(
        f"  {'phase':<12} {'start s':>8} {'host s':>8} {'compute s':>9} {'H2D GB':>7} {'H2D s':>6} "
        f"{'D2H GB':>7} {'D2H s':>6} {'beside compute s':>16}"
    )
    for r in summary["phases"]:
        lines.append(
            f"  {r['phase']:<12} {r['start_s']:>8.3f} {r['host_s']:>8.3f} {r['compute_s']:>9.3f} "
            f"{r['h2d_gb']:>7.2f} {r['h2d_s']:>6.3f} {r['d2h_gb']:>7.2f} {r['d2h_s']:>6.3f} "
            f"{r['copy_beside_compute_s']:>16.3f}"
        )
    lines.append("  busy: " + ", ".join(f"{k} {v:.3f} s" for k, v in sorted(summary["lanes"].items())))
    lines.append("  compute stream idle, by cause:")
    for cause, s in summary["idle"][:14]:
        lines.append(f"    {s:8.3f} s  {cause}")
    return "\n".join(lines)


def draw(runs: Sequence[tuple[str, dict]], path: str, *, title: str = "") -> None:
    """One panel per run (``(label, compact(spans))``), lanes host / compute / H2D / D2H,
    on a shared time axis in seconds from the step's start."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lanes = ("host", "compute", "h2d", "d2h")
    colors = {"compute": "#4477aa", "h2d": "#228833", "d2h": "#ee6677", "other": "#bbbbbb"}
    phase_colors = ["#ccbb44", "#66ccee", "#aa3377", "#bbbbbb", "#44aa99", "#999933", "#882255"]
    fig, axes = plt.subplots(len(runs), 1, figsize=(14, 1.5 + 1.3 * len(runs)), squeeze=False, sharex=True)
    names: dict[str, str] = {}
    for ax, (label, compacted) in zip(axes[:, 0], runs):
        for row, lane in enumerate(lanes):
            y = len(lanes) - 1 - row
            for start, end, name in compacted.get(lane, []):
                if lane == "host":
                    key = name[6:]
                    color = names.setdefault(key, phase_colors[len(names) % len(phase_colors)])
                    ax.broken_barh([(start, end - start)], (y - 0.4, 0.8), color=color, alpha=0.8)
                else:
                    ax.broken_barh([(start, max(end - start, 1e-4))], (y - 0.4, 0.8), color=colors[lane])
        ax.set_yticks(range(len(lanes)))
        ax.set_yticklabels(list(reversed(["phases", "compute", "H2D copy", "D2H copy"])))
        ax.set_title(label, fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("seconds from the start of the profiled step")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in names.values()]
    fig.legend(handles, list(names), loc="upper right", fontsize=8, ncol=min(len(names), 7))
    if title:
        fig.suptitle(title, fontsize=10, x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)
