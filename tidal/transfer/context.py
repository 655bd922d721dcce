"""One transfer context per device: the copy streams, the host arenas, and who holds what.

Everything in tidal that moves bytes between a device and the host (a timeshare's store,
activation offload, :class:`~tidal.CPUAdam`, :func:`~tidal.offload_optimizer`, the DeepSpeed
adapter) draws on the same context for that device:

* two copy streams, one per direction, so every D2H copy of the process queues on one copy
  engine and every H2D copy on the other, in one order, whoever asked for it;
* one host arena per pinning mode, so pinned memory freed by one user is reused by the next
  instead of pinned again (pinning costs about 0.4 s/GiB), with every slot labelled by its
  owner: :meth:`TransferContext.host_bytes` is the process's pinned-memory account;
* the claims: which object's state an owner manages (an optimizer registered with a
  timeshare role, a DeepSpeed engine, a model under activation offload), so two managers of
  one object are refused and a helper such as ``offload_optimizer`` finds the manager.

:meth:`TransferContext.of` returns the process's context for a device (made on first use;
importing tidal touches no device). A context built directly is private to whoever holds it:
tests and users who want isolated accounting pass it explicitly (``Timeshare(...,
context=ctx)``).

Memory cost: the arenas' host RAM (``host_bytes()``); three streams per device (the D2H
stream's pacer takes turns with a second stream, :mod:`tidal.transfer.pacing`).
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any, ClassVar

import torch

from tidal.device import DeviceOps
from tidal.transfer.arena import HostArena
from tidal.transfer.engine import TransferConfig, TransferEngine
from tidal.transfer.pacing import CopyPacer

__all__ = ["TransferContext"]


class TransferContext:
    """A device's copy streams, host arenas and claims (see the module docstring).

    Args:
        device: a device, or the :class:`~tidal.device.DeviceOps` to use for it.
    """

    _per_device: ClassVar[dict[tuple[str, int | None], "TransferContext"]] = {}
    _per_device_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, device: str | torch.device | DeviceOps = "cuda") -> None:
        self.ops = DeviceOps(device) if isinstance(device, (str, torch.device)) else device
        self.d2h_stream = self.ops.new_stream()
        self.h2d_stream = self.ops.new_stream()
        # Every engine's device-to-host pieces on the one D2H stream are chained as one.
        self.d2h_pacer = CopyPacer(self.ops, self.d2h_stream) if self.d2h_stream is not None else None
        self._arenas: dict[bool, HostArena] = {}
        self._labels = itertools.count(1)
        # object -> the owner managing its state (weak keys: a claim never keeps an object alive)
        self._claims: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()

    @classmethod
    def of(cls, device: str | torch.device) -> "TransferContext":
        """The process's context for ``device`` (created on first use)."""
        dev = torch.device(device)
        if dev.type == "cpu":
            dev = torch.device("cpu")  # "cpu:0" is the same device, and the same context
        elif dev.index is None:
            dev = DeviceOps(dev).device  # the current device of that type
        key = (dev.type, dev.index)
        with cls._per_device_lock:
            ctx = cls._per_device.get(key)
            if ctx is None:
                ctx = cls._per_device[key] = cls(dev)
            return ctx

    def __repr__(self) -> str:
        return f"TransferContext({self.ops.device}, host {self.host_bytes()})"

    # ---- arenas and engines --------------------------------------------------------------------
    def arena(self, *, pin: bool = True) -> HostArena:
        """The context's host arena, page-locked or not (pinning applies on accelerators)."""
        pinned = bool(pin and self.ops.is_accelerator)
        arena = self._arenas.get(pinned)
        if arena is None:
            arena = self._arenas[pinned] = HostArena(self.ops, pin=pinned)
        return arena

    def engine(self, config: TransferConfig | None = None) -> TransferEngine:
        """A transfer engine on the context's streams and arena (``config.pin_host`` picks the
        arena). Each engine has its own staging buffers and counters."""
        config = config or TransferConfig()
        return TransferEngine(
            self.ops,
            self.arena(pin=config.pin_host),
            config,
            streams=(self.d2h_stream, self.h2d_stream),
            pacer=self.d2h_pacer,
        )

    def label(self, kind: str) -> str:
        """A new owner label for the host-memory account, such as ``"Timeshare#2"``."""
        return f"{kind}#{next(self._labels)}"

    def host_bytes(self) -> dict[str, int]:
        """Owner label -> host bytes of the arena chunks serving it, over both arenas, plus
        ``"unowned"``: chunks of owners that closed (reused next, or freed by :meth:`trim`)."""
        total: dict[str, int] = {}
        for arena in self._arenas.values():
            for owner, n in arena.bytes_by_owner().items():
                total[owner] = total.get(owner, 0) + n
        return total

    def pinned_bytes(self) -> int:
        """Page-locked host bytes the context holds."""
        arena = self._arenas.get(True)
        return arena.reserved_bytes if arena is not None else 0

    def trim(self) -> int:
        """Free every arena chunk no slot uses (see :meth:`HostArena.trim`); returns the bytes."""
        return sum(a.trim() for a in self._arenas.values())

    # ---- claims ----------------------------------------------------------------------------------
    def owner_of(self, obj: Any) -> Any:
        """The owner managing ``obj``'s state in this context, or None."""
        return self._claims.get(obj)

    def claim(self, obj: Any, owner: Any, *, what: str) -> None:
        """Record that ``owner`` manages ``obj``'s state.

        Raises:
            ValueError: another owner manages it already (each would keep its own record of
                where the storages are). ``what`` names the object in the message.
        """
        held = self._claims.get(obj)
        if held is not None and held is not owner:
            raise ValueError(
                f"this {what} is already managed by {held}; its state can be moved by one manager "
                f"only (each keeps its own record of where every storage is). Use that one, or "
                f"close it first"
            )
        self._claims[obj] = owner

    def release(self, obj: Any, owner: Any = None) -> None:
        """Drop ``obj``'s claim (only if ``owner`` holds it, when given)."""
        if owner is None or self._claims.get(obj) is owner:
            self._claims.pop(obj, None)
