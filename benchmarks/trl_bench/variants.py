"""What a variant string means: the trainer a run builds and how tidal is set for it.

    trl                         TRL's GRPOTrainer alone
    ds-zero3-offload            GRPOTrainer with DeepSpeed ZeRO-3, parameters and optimizer state on the CPU
    <residency>[+suffix...]     TidalGRPOTrainer, TidalConfig(optimizer_residency=<residency>): step, stream, role

Suffixes (any order): ``+prefetch`` (``TidalConfig(prefetch=True)``), ``+budget=<GiB>``,
``+headroom=<GiB>`` and ``+evict=others|as_needed`` (the timeshare's ``TimeshareConfig``),
``+peak=<GiB>`` (``TidalConfig.prefetch_peak_bytes``: what prefetches bring in), ``+unpaced``
(copies to the host queued whole: ``TransferConfig(paced_piece_bytes=0)``), and on any variant
``+expandable`` (the caching allocator's expandable segments, set for the variant's process by
its parent). The string stays the variant's name in the printed table and the JSON.
"""

from __future__ import annotations

import dataclasses

__all__ = ["RESIDENCIES", "Variant", "VariantError"]

RESIDENCIES = ("step", "stream", "role")
"""The optimizer residencies of tidal's variants (``TidalConfig.optimizer_residency``)."""
_TRL_ONLY = ("trl", "ds-zero3-offload")
_GIB_KEYS = ("budget", "headroom", "peak")
_FLAGS = ("prefetch", "unpaced")
_EVICT = ("others", "as_needed")
_GIB = 2**30

_SYNTAX = (
    "trl, ds-zero3-offload, or <residency> (step, stream, role) with any of '+prefetch', '+budget=<GiB>', "
    "'+headroom=<GiB>', '+evict=others|as_needed', '+peak=<GiB>', '+unpaced' (copies to the host queued whole); "
    "'+expandable' on any of them"
)


class VariantError(ValueError):
    """A variant string :meth:`Variant.parse` cannot read; its message names the string, the
    part at fault, and the syntax."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Variant:
    """One variant, parsed (:meth:`parse`). ``trainer``: ``"trl"``, ``"ds-zero3-offload"`` or
    ``"tidal"``; the other fields hold only for ``"tidal"`` (``residency`` is None otherwise),
    but ``expandable`` for any. GiB figures are as written (floats); None: not set."""

    name: str
    trainer: str
    residency: str | None = None
    prefetch: bool = False
    budget_gib: float | None = None
    headroom_gib: float | None = None
    evict: str | None = None
    peak_gib: float | None = None
    unpaced: bool = False
    expandable: bool = False

    @classmethod
    def parse(cls, name: str) -> Variant:
        """The variant ``name`` means. Raises :class:`VariantError` for an unknown trainer or
        residency, an unknown or repeated suffix, a GiB figure that is not a number >= 0, or
        an ``evict`` other than ``others`` / ``as_needed``."""

        def bad(why: str) -> VariantError:
            return VariantError(f"unknown variant {name!r}: {why}; a variant is {_SYNTAX}")

        head, *extras = name.split("+")
        expandable = "expandable" in extras
        extras = [e for e in extras if e != "expandable"]
        if head in _TRL_ONLY:
            if extras:
                raise bad(f"{head} takes only '+expandable', not {'+'.join(extras)!r}")
            return cls(name=name, trainer=head, expandable=expandable)
        if head not in RESIDENCIES:
            raise bad(f"{head!r} is neither trl, ds-zero3-offload nor a residency ({', '.join(RESIDENCIES)})")
        fields: dict = {}
        for e in extras:
            key, eq, value = e.partition("=")
            if key in fields:
                raise bad(f"'+{key}' given twice")
            if not eq and key in _FLAGS:
                fields[key] = True
            elif eq and key in _GIB_KEYS:
                try:
                    gib = float(value)
                except ValueError:
                    gib = -1.0
                if not gib >= 0:
                    raise bad(f"'+{e}': {key} takes a number of GiB >= 0")
                fields[key] = gib
            elif eq and key == "evict":
                if value not in _EVICT:
                    raise bad(f"'+{e}': evict takes others or as_needed")
                fields[key] = value
            else:
                raise bad(f"'+{e}' is no suffix of a tidal variant")
        return cls(
            name=name,
            trainer="tidal",
            residency=head,
            prefetch=fields.get("prefetch", False),
            budget_gib=fields.get("budget"),
            headroom_gib=fields.get("headroom"),
            evict=fields.get("evict"),
            peak_gib=fields.get("peak"),
            unpaced=fields.get("unpaced", False),
            expandable=expandable,
        )

    @property
    def is_tidal(self) -> bool:
        """Whether the run is ``TidalGRPOTrainer``'s."""
        return self.trainer == "tidal"

    @property
    def sets_timeshare(self) -> bool:
        """Whether the variant sets the timeshare itself (a budget, headroom, evict or
        ``+unpaced``) rather than keeping the trainer's own ``TimeshareConfig``."""
        return self.budget_gib is not None or self.headroom_gib is not None or self.evict is not None or self.unpaced

    def env(self) -> dict[str, str]:
        """The environment the variant's process adds to its parent's: the allocator's
        expandable segments for ``+expandable``, else nothing."""
        return {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"} if self.expandable else {}

    def tidal_config(self):
        """The ``TidalConfig`` of a tidal variant: its residency and prefetch; with
        :attr:`sets_timeshare`, a ``TimeshareConfig`` of its budget (None: the device's),
        headroom (0 unless given), evict (``others`` unless given) and, for ``+unpaced``,
        ``TransferConfig(paced_piece_bytes=0)``, the trainer's own defaults kept for the rest
        (``release_to_driver=False``, ``wait_for_copies=False``); with ``+peak``,
        ``prefetch_peak_bytes``. Raises ``ValueError`` for a variant that is not tidal's."""
        if not self.is_tidal:
            raise ValueError(f"{self.name!r} is not a tidal variant: it has no TidalConfig")
        from tidal import TimeshareConfig
        from tidal.integrations.trl import TidalConfig

        kw: dict = {}
        if self.sets_timeshare:
            ts_kw: dict = dict(
                budget_bytes=int(self.budget_gib * _GIB) if self.budget_gib is not None else None,
                headroom_bytes=int((self.headroom_gib or 0.0) * _GIB),
                evict=self.evict or "others",
                release_to_driver=False,
                wait_for_copies=False,
            )
            if self.unpaced:
                from tidal.transfer import TransferConfig

                ts_kw["transfer"] = TransferConfig(paced_piece_bytes=0)
            kw["timeshare"] = TimeshareConfig(**ts_kw)
        if self.peak_gib is not None:
            kw["prefetch_peak_bytes"] = int(self.peak_gib * _GIB)
        return TidalConfig(optimizer_residency=self.residency, prefetch=self.prefetch, **kw)
