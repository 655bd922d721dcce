"""Per-transition telemetry: what moved, how fast, and what the driver saw."""

from __future__ import annotations

import dataclasses
import time
import warnings
from typing import Any

from tidal.units import format_bytes
from tidal.state.result import MoveResult

__all__ = ["TransitionLog", "TransitionRecord", "format_report"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransitionRecord:
    """One transition of a timeshare: the store's :class:`MoveResult` (bytes, seconds, driver
    readings), with what the timeshare knows around it (which roles, the host memory held).

    ``unreleased_bytes`` is what tidal freed (net of what it loaded) that the driver did not
    get back: caching-allocator segments still shared with live tensors. Only meaningful on
    an accelerator.

    ``host_seconds`` is the host's wall time inside the verb that made the move (planning,
    queueing, any host wait, the release), since the previous record of the same verb (in a
    streamed optimizer step: since the end of the chunk's update);
    ``stall_seconds`` the time the compute stream then waited for the move's copies (device
    events; 0 until :meth:`Timeshare.settle_stalls` has read them, and for moves it did not
    wait for).
    ``gap_seconds`` is, on an accelerator, the compute stream's time over the same window, read from two device events: how
    long the device's own work waited on the transition, for the host to queue past it or for
    its copies. It is smaller than the host time when the device still had work queued while
    the host was in the verb. None where not measured (CPU, a verb that changed streams) and
    until :meth:`Timeshare.settle_stalls` has read it.

    :attr:`exposed_seconds` is what the transition cost the work around it: ``gap_seconds``
    where measured (at most ``host_seconds + stall_seconds``: on a stream shared with another
    thread the gap also holds that thread's kernels), else ``host_seconds + stall_seconds``
    (an upper bound on a device with a queue).
    """

    index: int
    kind: str
    roles_out: tuple[str, ...]
    role_in: str | None
    move: MoveResult
    host_reserved_bytes: int
    unreleased_bytes: int
    note: str = ""
    host_seconds: float = 0.0
    stall_seconds: float = 0.0
    gap_seconds: float | None = None

    # The move's own figures, read through (one record of them, in the MoveResult).
    bytes_out = property(lambda self: self.move.bytes_out)
    bytes_in = property(lambda self: self.move.bytes_in)
    seconds = property(lambda self: self.move.seconds)
    release_seconds = property(lambda self: self.move.release_seconds)
    driver_free_before = property(lambda self: self.move.driver_free_before)
    driver_free_after = property(lambda self: self.move.driver_free_after)
    bytes_skipped = property(lambda self: self.move.bytes_skipped)
    bytes_prefetched = property(lambda self: self.move.bytes_prefetched)
    queued = property(lambda self: self.move.queued)

    @property
    def gbps(self) -> float:
        return self.move.gbps

    @property
    def exposed_seconds(self) -> float:
        bound = self.host_seconds + self.stall_seconds
        # The gap may also hold another thread's kernels queued on a shared stream meanwhile;
        # the transition cannot have cost more than the host's time in it and the waits.
        return bound if self.gap_seconds is None else min(self.gap_seconds, bound)

    @classmethod
    def from_move(
        cls,
        index: int,
        kind: str,
        roles_out: tuple[str, ...],
        role_in: str | None,
        move: MoveResult,
        host_reserved_bytes: int,
        *,
        measure_release: bool,
        note: str = "",
        host_seconds: float = 0.0,
    ) -> "TransitionRecord":
        freed = move.bytes_out + move.bytes_skipped
        expected_gain = freed - move.bytes_in
        seen_gain = move.driver_free_after - move.driver_free_before
        # A move that only queued its copies (a prefetch, a write-back) released nothing; one told
        # not to release (a streamed step's chunk) keeps its memory for the next chunk.
        measured = measure_release and freed and not move.queued and move.released
        unreleased = max(0, expected_gain - seen_gain) if measured else 0
        extra = []
        if move.bytes_skipped:
            extra.append(f"{format_bytes(move.bytes_skipped)} released without a copy (host copy still valid)")
        if move.bytes_prefetched:
            extra.append(f"{format_bytes(move.bytes_prefetched)} had arrived ahead (prefetched), not copied again")
        if move.queued:
            extra.append("copies queued behind compute; seconds = host time to queue them")
        note = "; ".join(([note] if note else []) + extra)
        return cls(
            index=index,
            kind=kind,
            roles_out=roles_out,
            role_in=role_in,
            move=move,
            host_reserved_bytes=host_reserved_bytes,
            unreleased_bytes=unreleased,
            note=note,
            host_seconds=host_seconds,
        )

    def as_dict(self) -> dict:
        """Flat: the record's fields with the move's inlined, and ``gbps``."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "move"}
        d.update(dataclasses.asdict(self.move))
        d["gbps"] = self.gbps
        return d


class TransitionLog:
    """The records of one timeshare's transitions (:attr:`records`) and the bookkeeping that times
    them: each verb's host time from :meth:`start_clock` (or the verb's previous record) to its
    record, and on an accelerator the compute stream's waits for the move's copies
    (``store.take_stalls()``: pairs of events) and its window around the verb (an event at each
    end), read into the records once they have run (:meth:`settle`).

    ``ops`` is the timeshare's :class:`~tidal.device.DeviceOps` (its streams, events and whether
    it is an accelerator), ``store`` its :class:`~tidal.state.store.OffloadStore` (the copies'
    waits, the host memory held). ``measure_release``: a record reads what the driver got back
    of the memory the move freed (``TransitionRecord.unreleased_bytes``), and warns once per kind
    of transition where that is more than ``release_tolerance_bytes`` short. Not thread-safe:
    the timeshare calls it under its lock. Memory cost: a record per transition, and until
    :meth:`settle` reads them, two device events per wait and per window."""

    def __init__(self, ops: Any, store: Any, *, measure_release: bool, release_tolerance_bytes: int) -> None:
        self.ops, self.store = ops, store
        self.measure_release, self.release_tolerance_bytes = measure_release, release_tolerance_bytes
        self.records: list[TransitionRecord] = []
        self._warned_unreleased: set[str] = set()  # transition kinds warned about unreleased memory
        self._verb_t0 = time.perf_counter()  # see start_clock
        self._verb_mark: tuple[Any, Any] | None = None  # (stream, event) where the verb started
        # (record index, compute-stream wait event pairs) not yet read (see settle)
        self._stalls: list[tuple[int, list]] = []
        # (record index, start, end): the compute stream's events around a record's window
        self._gaps: list[tuple[int, Any, Any]] = []

    def start_clock(self) -> None:
        """A verb starts: the host time of the records it makes counts from here, and on an
        accelerator their device gap from an event recorded now on the current stream."""
        self._verb_t0 = time.perf_counter()
        self._verb_mark = self._mark_stream()

    def _mark_stream(self) -> tuple[Any, Any] | None:
        """A timing event recorded on the current stream now (with the stream), or None on CPU."""
        if not self.ops.is_accelerator:
            return None
        stream = self.ops.current_stream()
        event = self.ops.new_event(timing=True)
        event.record(stream)
        return stream, event

    def _close_gap(self, index: int) -> None:
        """Record ``index`` ends its window now: pair the window's start event with one recorded
        here (same stream only), to be read by :meth:`settle`."""
        start, self._verb_mark = self._verb_mark, self._mark_stream()
        if start is not None and self._verb_mark is not None and start[0] == self._verb_mark[0]:
            self._gaps.append((index, start[1], self._verb_mark[1]))

    def record(
        self, kind: str, roles_out: tuple[str, ...], role_in: str | None, move: MoveResult, note: str = ""
    ) -> TransitionRecord:
        """Add a store move to :attr:`records` (and warn if the driver did not get the freed
        memory back). The record's host time runs from the verb's start, or the previous
        record of the same verb, to now."""
        now = time.perf_counter()
        host_seconds, self._verb_t0 = now - self._verb_t0, now
        self.settle()
        stalls = self.store.take_stalls()
        rec = TransitionRecord.from_move(
            len(self.records),
            kind,
            roles_out,
            role_in,
            move,
            self.store.host_reserved_bytes,
            measure_release=self.measure_release,
            note=note,
            host_seconds=host_seconds,
        )
        self.records.append(rec)
        if stalls:  # only once the record exists: an interrupt before leaves nothing to settle
            self._stalls.append((rec.index, stalls))
        self._close_gap(rec.index)
        if rec.unreleased_bytes > self.release_tolerance_bytes and kind not in self._warned_unreleased:
            # Once per kind of transition: a loop repeats the same cause every step; the records
            # (and report()) keep every transition's figure.
            self._warned_unreleased.add(kind)
            warnings.warn(
                f"transition {rec.index} ({kind}) freed {format_bytes(move.bytes_out)} but the driver "
                f"got back {format_bytes(rec.unreleased_bytes)} less than expected: caching-allocator "
                f"segments are shared with tensors outside the roles (activations, caches) and "
                f"cannot be released. Free those tensors before switching, or set "
                f"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True. Later {kind} transitions are not "
                f"warned about; each record's unreleased_bytes has its figure",
                stacklevel=4,
            )
        return rec

    def pending_ends(self) -> list[Any]:
        """The device events whose completion the records not yet settled wait for."""
        ends = [after for _, pairs in self._stalls for _, after in pairs]
        return ends + [end for _, _, end in self._gaps]

    def settle(self) -> None:
        """Fill in ``stall_seconds`` and ``gap_seconds`` of the records whose waits and windows
        have run on the device (a query of one event per record not yet read, and of two per
        wait); the others stay pending."""
        pending = []
        for index, pairs in self._stalls:
            if not all(after.query() for _, after in pairs):
                pending.append((index, pairs))
                continue
            stall = sum(before.elapsed_time(after) for before, after in pairs) / 1e3
            self.records[index] = dataclasses.replace(self.records[index], stall_seconds=stall)
        self._stalls = pending
        gaps = []
        for index, start, end in self._gaps:
            if not end.query():
                gaps.append((index, start, end))
                continue
            self.records[index] = dataclasses.replace(self.records[index], gap_seconds=start.elapsed_time(end) / 1e3)
        self._gaps = gaps


def _gbps_text(records: list[TransitionRecord]) -> str:
    """Aggregate GB/s of the records that waited for their copies ("-" if none did)."""
    timed = [r for r in records if not r.queued]
    seconds = sum(r.seconds for r in timed)
    return _rate(sum(r.bytes_out + r.bytes_in for r in timed) / seconds / 1e9) if seconds > 0 else "-"


def _rate(x: float) -> str:
    return format(x, ".1f") if x >= 10 else format(x, ".3g")


def format_report(
    records: list[TransitionRecord],
    roles: list[tuple[str, str, int, int]],
    host_reserved_bytes: int,
    offloaded_bytes: int,
    notes: list[str] = (),
    *,
    device: str = "cuda",
    detail: bool = False,
) -> str:
    """A plain-text report of roles and transitions, saying what was measured on ``device``.

    ``roles`` rows: (name, where, resident bytes, total bytes). Transitions are summed per kind
    and roles (count, bytes moved, seconds, GB/s, and on an accelerator the lowest driver-level
    free memory seen after them); ``detail=True`` lists every transition instead.
    """
    on_cpu = str(device).startswith("cpu")
    free_name = "RAM free" if on_cpu else "device free"
    if on_cpu:
        lines = [
            f"tidal timeshare on {device}: {len(records)} transitions. A CPU run: the 'device' is host RAM, so "
            "offloads copy within it and nothing is pinned; seconds are host copy time"
            + (", 'RAM free' the host's available memory." if detail else ".")
        ]
    else:
        lines = [
            f"tidal timeshare on {device}: {len(records)} transitions. Seconds run from the first copy queued to "
            "the last one done"
            + ("; 'device free' is driver-level free memory (what another process could get)." if detail else ".")
        ]
    lines += ["roles:", f"  {'name':<16} {'where':<10} {'state':>12}"]
    for name, where, _resident, total in roles:
        lines.append(f"  {name:<16} {where:<10} {format_bytes(total):>12}")
    pinned = "plain host memory: a CPU run pins nothing" if on_cpu else "pinned"
    lines.append(
        f"host: {format_bytes(host_reserved_bytes)} held ({pinned}) for {format_bytes(offloaded_bytes)} offloaded now"
    )
    lines += [f"note: {n}" for n in notes]
    if not records:
        lines += ["transitions: (none yet)"]
        return "\n".join(lines)
    if detail:
        lines.append("transitions, each:")
        lines.append(
            f"  {'#':>4} {'kind':<12} {'out':<18} {'in':<14} {'out':>10} {'in':>10} {'s':>8} {'GB/s':>6} "
            f"{free_name + ' before':>18} {free_name + ' after':>17}"
        )
        for r in records:
            lines.append(
                f"  {r.index:>4} {r.kind:<12} {','.join(r.roles_out) or '-':<18} {r.role_in or '-':<14} "
                f"{format_bytes(r.bytes_out):>10} {format_bytes(r.bytes_in):>10} {r.seconds:>8.4f} "
                f"{'-' if r.queued else _rate(r.gbps):>6} "
                f"{format_bytes(r.driver_free_before):>18} {format_bytes(r.driver_free_after):>17}"
                + (f"  ({r.note})" if r.note else "")
            )
        return "\n".join(lines)
    groups: dict[tuple[str, tuple[str, ...], str | None], list[TransitionRecord]] = {}
    for r in records:
        groups.setdefault((r.kind, r.roles_out, r.role_in), []).append(r)
    lines.append(
        "transitions, summed per kind and roles (report(detail=True) lists each; seconds: the copies, exposed: "
        "what the work around them waited):"
    )
    lines.append(
        f"  {'kind':<12} {'out':<18} {'in':<14} {'count':>5} {'moved':>10} {'skipped':>10} {'seconds':>8} "
        f"{'GB/s':>6} {'exposed s':>9}" + ("" if on_cpu else f" {'lowest free after':>17}")
    )
    for (kind, out, into), rs in groups.items():
        skipped = sum(r.bytes_skipped + r.bytes_prefetched for r in rs)
        lines.append(
            f"  {kind:<12} {','.join(out) or '-':<18} {into or '-':<14} {len(rs):>5} "
            f"{format_bytes(sum(r.bytes_out + r.bytes_in for r in rs)):>10} "
            f"{format_bytes(skipped) if skipped else '-':>10} {sum(r.seconds for r in rs):>8.3f} {_gbps_text(rs):>6} "
            f"{sum(r.exposed_seconds for r in rs):>9.3f}"
            + ("" if on_cpu else f" {format_bytes(min(r.driver_free_after for r in rs)):>17}")
        )
    queued = sum(r.queued for r in records)
    total = sum(r.bytes_out + r.bytes_in for r in records)
    lines.append(
        f"  {'all':<12} {'':<18} {'':<14} {len(records):>5} {format_bytes(total):>10} {'':>10} "
        f"{sum(r.seconds for r in records):>8.3f} {_gbps_text(records):>6} {sum(r.exposed_seconds for r in records):>9.3f}"
    )
    if queued:
        lines.append(
            f"  ({queued} of them queued their copies behind compute: their seconds are host time to queue, not in GB/s)"
        )
    skipped_any = any(r.bytes_skipped or r.bytes_prefetched for r in records)
    if skipped_any:
        lines.append(
            "  (skipped: released without a copy, the host copy still valid, or already brought in by a prefetch)"
        )
    return "\n".join(lines)
