"""The timeshare's settings: :class:`TimeshareConfig`."""

from __future__ import annotations

import dataclasses
from typing import Literal

from tidal.transfer.engine import TransferConfig

__all__ = ["TimeshareConfig"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class TimeshareConfig:
    """
    Attributes:
        budget_bytes: state bytes that may stay resident at once. ``None``: only the role
            being used is resident (every switch moves the others out), the usual setting for
            colocated RL roles. Optimizer state that ``"step"`` or ``"stream"`` residency keeps
            on the host between steps does not count; ``step()`` brings it in (whole, or a
            chunk at a time) beside every role the budget keeps, so leave room for that.
        evict: which resident roles bringing a role in moves out. ``"others"``: all those the
            budget cannot keep (without a budget, all of them). ``"as_needed"``: only as many
            (least recently used first; roles sharing storages together) as the incoming role's
            bytes need, with ``headroom_bytes`` and the copies' staging buckets left free, from
            the device's free memory now (and the budget, if set): when the device has room,
            nothing moves. Set ``headroom_bytes`` to what the phases need beside the roles
            (activations, KV cache, and the optimizer state a "step"/"stream" ``step()`` brings
            in), or a phase may run out of memory where "others" would have made room.
        headroom_bytes: device memory a reload must leave free (for activations, KV cache);
            with ``evict="as_needed"`` also what evictions make room for.
        switch_extra_bytes: caps how much a switch overlaps: while roles move out and in,
            their state never takes more than the larger side plus this many bytes (plus the
            staging: one bucket out, two in). ``None`` (default): as much as is free, the fastest. Set
            it where the peak matters more than a few percent of switch speed: the copies still
            run on both engines, one bucket apart.
        optimizer_chunk_bytes: with ``optimizer_residency="stream"``, the optimizer state
            moved in and out at a time during ``step()``.
        min_offload_bytes: storages smaller than this stay put (scalars such as Adam's step).
        verify_storage_sets: debug mode: every time a role's module tensors are read from
            their cached slots, check them against a full module walk and raise
            ``RuntimeError`` if the cache went stale (costs a walk per transition).
        release_tolerance_bytes: warn when the driver gets back less than the freed bytes
            minus this (memory stuck in allocator segments shared with live tensors).
        release_to_driver: after an offload, return the freed blocks to the driver
            (``empty_cache``) so another process (an inference engine) can use them. With
            ``False`` they stay in torch's caching allocator, where this process's other roles
            and activations reuse them, and a reload skips the driver's remapping (measured on
            an H200: reload 0.98 instead of 0.94-0.95 of the PCIe line rate). Use ``False``
            only when every role that takes turns lives in this process.
        wait_for_copies: ``False``: transitions return as soon as their copies are queued,
            the host waiting only where a move needs memory that an out-going copy still reads.
            The compute stream waits for what comes in (no kernel reads it before it landed),
            and out-going storages are released at once, the allocator handing their blocks out
            again only after their copy has read them; readers of host copies wait for them.
            The host can then queue the next phase's work while the bytes move. ``True``
            (default): every transition returns once all its copies have completed (its
            records' ``seconds`` are then copy time, for measuring the line rate). ``False``
            needs ``release_to_driver=False`` to matter: a release to the driver waits anyway.
        handover_chunk_bytes: an offload that hands memory over to another process
            (``offload_all(on_released=...)``, a lease's overlapped hand-over) gives it back
            to the driver this many bytes at a time; smaller chunks let the next holder start
            sooner but cost one device synchronisation each.
        transfer: how bytes move (buckets, pinning).
    """

    budget_bytes: int | None = None
    evict: Literal["others", "as_needed"] = "others"
    headroom_bytes: int = 0
    switch_extra_bytes: int | None = None
    optimizer_chunk_bytes: int = 256 << 20
    min_offload_bytes: int = 16
    verify_storage_sets: bool = False
    release_tolerance_bytes: int = 256 << 20
    release_to_driver: bool = True
    wait_for_copies: bool = True
    handover_chunk_bytes: int = 256 << 20
    transfer: TransferConfig = dataclasses.field(default_factory=TransferConfig)

    def __post_init__(self) -> None:
        if self.budget_bytes is not None and self.budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0 or None, got {self.budget_bytes}")
        if self.switch_extra_bytes is not None and self.switch_extra_bytes < 0:
            raise ValueError(f"switch_extra_bytes must be >= 0 or None, got {self.switch_extra_bytes}")
        if self.handover_chunk_bytes <= 0:
            raise ValueError(f"handover_chunk_bytes must be > 0, got {self.handover_chunk_bytes}")
        if self.evict not in ("others", "as_needed"):
            raise ValueError(f"evict must be 'others' or 'as_needed', got {self.evict!r}")
        if self.optimizer_chunk_bytes <= 0:
            raise ValueError(f"optimizer_chunk_bytes must be > 0, got {self.optimizer_chunk_bytes}")
        for name in ("headroom_bytes", "min_offload_bytes", "release_tolerance_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
