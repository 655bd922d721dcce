"""Per-transition telemetry: what moved, how fast, and what the driver saw."""

from __future__ import annotations

import dataclasses

from tidal.units import format_bytes
from tidal.state.result import MoveResult

__all__ = ["TransitionRecord", "format_report"]


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
