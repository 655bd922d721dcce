"""Units, written once: byte counts for people, transfer rates, and the room a phase is left."""

from __future__ import annotations

__all__ = ["format_bytes", "gbps", "phase_need_bytes"]


def format_bytes(n: float) -> str:
    """``n`` bytes in binary units (``"1.50 GiB"``)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def gbps(nbytes: float, seconds: float) -> float:
    """Decimal GB per second (1e9 bytes, as PCIe line rates are quoted); 0.0 for no time."""
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def phase_need_bytes(growth_bytes: int) -> int:
    """The room left to a phase that allocated ``growth_bytes`` the last time it ran: 10% more
    and 256 MiB, for what varies between runs (what a prefetch leaves free beside it, what a
    turn keeps free)."""
    return int(1.1 * growth_bytes) + (256 << 20)
