"""Errors tidal raises on purpose. User mistakes are ``ValueError``/``TypeError``; a
transition that cannot fit raises :class:`InsufficientMemoryError`."""

from __future__ import annotations

from tidal.units import format_bytes

__all__ = ["HostMemoryError", "InsufficientMemoryError", "StateCorruptionError"]


class InsufficientMemoryError(RuntimeError):
    """A reload or switch needs more device memory than is free. Nothing was moved: the
    state is intact where it was (on the host for what was offloaded)."""

    def __init__(self, what: str, *, needed_bytes: int, free_bytes: int, hint: str) -> None:
        self.needed_bytes = needed_bytes
        self.free_bytes = free_bytes
        super().__init__(
            f"{what} needs {format_bytes(needed_bytes)} ({needed_bytes} bytes) of device memory "
            f"but only {format_bytes(free_bytes)} ({free_bytes} bytes) is free; nothing was moved "
            f"and the state is intact. {hint}"
        )


class StateCorruptionError(RuntimeError):
    """State came back from the host with other bytes than it went out with
    (``TransferConfig(verify=...)``). The tensors named stay offloaded, so nothing computes on
    wrong values; their host copies are the corrupted ones, so restore them from a checkpoint."""

    def __init__(self, what: str, names: list[str]) -> None:
        self.names = names
        shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
        super().__init__(
            f"{what}: {len(names)} storage(s) came back with different bytes than they went out with "
            f"({shown}); the host copy or a transfer was corrupted. They stay offloaded; load a "
            f"checkpoint into the role (e.g. tidal.checkpoint.load) to restore them"
        )


class HostMemoryError(RuntimeError):
    """The host could not give (or pin) the memory for the host copies of a transition. Raised
    before anything of that move was copied or freed: the state is intact where it was."""

    def __init__(self, what: str, *, needed_bytes: int, available_bytes: int, cause: str) -> None:
        self.needed_bytes = needed_bytes
        self.available_bytes = available_bytes
        super().__init__(
            f"{what} needs {format_bytes(needed_bytes)} ({needed_bytes} bytes) of host memory for its host "
            f"copies, but the host could not give it: {format_bytes(available_bytes)} ({available_bytes} bytes) "
            f"available (the kernel's MemAvailable, or what this process's address-space limit, `ulimit -v`, "
            f"leaves, if lower; pinning is also bounded by `ulimit -l`). "
            f"Nothing was moved and the state is intact. Free host memory, or move less state out "
            f"(optimizer_residency='role' keeps the optimizer state with the role). Cause: {cause}"
        )
