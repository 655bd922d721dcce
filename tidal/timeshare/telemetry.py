"""Per-transition telemetry: what moved, how fast, and what the driver saw."""

from __future__ import annotations

import dataclasses

from tidal.units import format_bytes
from tidal.state.store import MoveResult

__all__ = ["TransitionRecord", "format_report"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransitionRecord:
    """One transition of a timeshare: the store's :class:`MoveResult` (bytes, seconds, driver
    readings), with what the timeshare knows around it (which roles, the host memory held).

    ``unreleased_bytes`` is what tidal freed (net of what it loaded) that the driver did not
    get back: caching-allocator segments still shared with live tensors. Only meaningful on
    an accelerator.

    ``host_seconds`` is the host's wall time inside the verb that made the move (planning,
    queueing, any host wait, the release), since the previous record of the same verb;
    ``stall_seconds`` the time the compute stream then waited for the move's copies (device
    events; 0 until :meth:`Timeshare.settle_stalls` has read them, and for moves it did not
    wait for).
    Their sum, :attr:`exposed_seconds`, is what the transition cost the work around it.
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
        return self.host_seconds + self.stall_seconds

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
        # A move that only queued its copies (a prefetch, a write-back) released nothing.
        unreleased = max(0, expected_gain - seen_gain) if measure_release and freed and not move.queued else 0
        extra = []
        if move.bytes_skipped:
            extra.append(f"{move.bytes_skipped / 1e9:.3f} GB released without a copy (host copy still valid)")
        if move.bytes_prefetched:
            extra.append(f"{move.bytes_prefetched / 1e9:.3f} GB had arrived ahead (prefetched), not copied again")
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


def _gb(n: int) -> str:
    return f"{n / 1e9:.3f}"


def format_report(
    records: list[TransitionRecord],
    roles: list[tuple[str, str, int, int]],
    host_reserved_bytes: int,
    offloaded_bytes: int,
    notes: list[str] = (),
) -> str:
    """A plain-text table of roles and transitions. ``roles`` rows: (name, where, resident
    bytes, total bytes)."""
    lines = ["roles:", f"  {'name':<16} {'where':<10} {'state':>12}"]
    for name, where, _resident, total in roles:
        lines.append(f"  {name:<16} {where:<10} {format_bytes(total):>12}")
    lines.append(
        f"host: {format_bytes(host_reserved_bytes)} held (pinned on a GPU) for "
        f"{format_bytes(offloaded_bytes)} offloaded now"
    )
    lines += [f"note: {n}" for n in notes]
    lines.append("transitions:")
    head = (
        f"  {'#':>3} {'kind':<10} {'out':<18} {'in':<14} {'out GB':>7} {'in GB':>7} "
        f"{'s':>7} {'GB/s':>7} {'free before GB':>14} {'free after GB':>13}"
    )
    lines.append(head)
    for r in records:
        lines.append(
            f"  {r.index:>3} {r.kind:<10} {','.join(r.roles_out) or '-':<18} {r.role_in or '-':<14} "
            f"{_gb(r.bytes_out):>7} {_gb(r.bytes_in):>7} {r.seconds:>7.3f} "
            f"{'-' if r.queued else format(r.gbps, '.1f'):>7} "
            f"{_gb(r.driver_free_before):>14} {_gb(r.driver_free_after):>13}" + (f"  ({r.note})" if r.note else "")
        )
    if not records:
        lines.append("  (none yet)")
    return "\n".join(lines)
