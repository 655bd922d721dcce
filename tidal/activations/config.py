"""What the user sets and what a step reports, for activation offload.

:class:`ActivationOffloadConfig` holds every knob (keyword-only, units in the field names).
:class:`LayerMode` says what happens to one layer's saved activations. :class:`StepReport` is
what one forward + backward under the offloader measured.

Nothing here touches a device.
"""

from __future__ import annotations

import dataclasses
import enum

from tidal.units import format_bytes

__all__ = ["ActivationOffloadConfig", "LayerMode", "StepReport"]


class LayerMode(str, enum.Enum):
    """The fate of one layer's saved activations.

    * ``KEEP``: they stay on the device (what autograd does without tidal).
    * ``OFFLOAD``: copied to pinned host memory while the next layers compute, freed on the
      device, copied back (prefetched) during the backward pass.
    * ``RECOMPUTE``: the layer runs under non-reentrant ``torch.utils.checkpoint``; only its
      inputs are saved, on the device; the backward pass recomputes the rest.
    * ``RECOMPUTE_OFFLOAD``: both: the checkpointed inputs are offloaded.
    """

    KEEP = "keep"
    OFFLOAD = "offload"
    RECOMPUTE = "recompute"
    RECOMPUTE_OFFLOAD = "recompute+offload"

    @property
    def offloads(self) -> bool:
        return self in (LayerMode.OFFLOAD, LayerMode.RECOMPUTE_OFFLOAD)

    @property
    def recomputes(self) -> bool:
        return self in (LayerMode.RECOMPUTE, LayerMode.RECOMPUTE_OFFLOAD)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ActivationOffloadConfig:
    """How activations are offloaded.

    Attributes:
        min_offload_bytes: a saved tensor whose storage is smaller than this stays on the
            device: its copy would cost more in fixed overhead than it frees.
        budget_bytes: device memory budget for the whole step (what
            ``torch.cuda.max_memory_allocated`` reports). ``None``: no planner, every layer
            but the last is offloaded (``default_mode``). With a budget, the first step runs
            with every layer offloaded and measures; later steps follow the plan that
            :func:`tidal.activations.plan_layers` makes from it (keep / offload / recompute
            per layer, the fastest plan whose modelled peak fits).
        default_mode: the mode of every layer when there is no budget and no explicit plan.
        prefetch_groups: during backward, how many layers ahead of the one being consumed
            are copied back (when their backward starts, groups ``i-1 .. i-prefetch_groups``
            are prefetched). 1 keeps at most two offloaded groups resident.
        bucket_bytes / small_copy_bytes: storages below ``small_copy_bytes`` are gathered on
            the device into a staging bucket of at most ``bucket_bytes`` and moved in one
            copy (the transfer engine's bucketing); each direction holds one bucket.
        measure: record device events to report per-layer compute time, copy time and
            stalls (a few microseconds per layer). Needed by the planner.
        reset_peak: reset the allocator's peak counter when a step starts, so the report's
            ``peak_allocated_bytes`` is this step's peak (this resets
            ``torch.cuda.max_memory_allocated`` for everyone in the process). With a budget,
            the step the planner measures also resets it at each layer boundary to measure
            each layer's own peak (``StepReport.layer_forward_peak_bytes``); the planner needs
            that, so ``budget_bytes`` with ``reset_peak=False`` is refused.
        planner_margin_bytes: head-room the planner keeps under ``budget_bytes`` for what
            its memory model does not see (allocator fragmentation, workspaces).
        line_rate_bytes_per_s: host<->device copy rate the planner assumes; ``None``: measure
            it once with the offloader's own pinned buffers and streams.
    """

    min_offload_bytes: int = 1 << 20
    budget_bytes: int | None = None
    default_mode: LayerMode = LayerMode.OFFLOAD
    prefetch_groups: int = 1
    bucket_bytes: int = 16 << 20
    small_copy_bytes: int = 2 << 20
    measure: bool = True
    reset_peak: bool = True
    planner_margin_bytes: int = 256 << 20
    line_rate_bytes_per_s: float | None = None

    def __post_init__(self) -> None:
        if self.min_offload_bytes < 0:
            raise ValueError(f"min_offload_bytes must be >= 0, got {self.min_offload_bytes}")
        if self.budget_bytes is not None and self.budget_bytes <= 0:
            raise ValueError(
                f"budget_bytes must be > 0 (device bytes for the whole step) or None for no "
                f"planner, got {self.budget_bytes}"
            )
        if not isinstance(self.default_mode, LayerMode):
            try:
                object.__setattr__(self, "default_mode", LayerMode(self.default_mode))
            except ValueError:
                raise ValueError(
                    f"default_mode must be one of {[m.value for m in LayerMode]}, got {self.default_mode!r}"
                ) from None
        if self.prefetch_groups < 1:
            raise ValueError(
                f"prefetch_groups must be >= 1 (groups copied back ahead of the one in use), got {self.prefetch_groups}"
            )
        if self.bucket_bytes <= 0 or self.small_copy_bytes < 0 or self.small_copy_bytes > self.bucket_bytes:
            raise ValueError(
                f"need 0 <= small_copy_bytes <= bucket_bytes and bucket_bytes > 0, got "
                f"small_copy_bytes={self.small_copy_bytes}, bucket_bytes={self.bucket_bytes}"
            )
        if self.planner_margin_bytes < 0:
            raise ValueError(f"planner_margin_bytes must be >= 0, got {self.planner_margin_bytes}")
        if self.budget_bytes is not None and not self.reset_peak:
            raise ValueError(
                "budget_bytes needs reset_peak=True: the planner measures the step's peak and each "
                "layer's own peak through the allocator's peak counter; drop reset_peak=False or "
                "the budget (and pass plan=)"
            )
        if self.line_rate_bytes_per_s is not None and self.line_rate_bytes_per_s <= 0:
            raise ValueError(f"line_rate_bytes_per_s must be > 0, got {self.line_rate_bytes_per_s}")


@dataclasses.dataclass(kw_only=True)
class StepReport:
    """What one step (a forward under the offloader and its backward) measured.

    Times come from device events and are ``None`` on CPU or with ``measure=False``.

    Attributes:
        modes: the mode each layer group ran with, in forward order.
        bytes_offloaded: bytes copied device -> host (each storage once, views deduped).
        bytes_reloaded: bytes copied host -> device during backward.
        bytes_kept_referenced: bytes of saved storages left on the device because something
            besides autograd still referenced them when their group was offloaded.
        group_saved_bytes: per layer group, the bytes of the storages it saved through the
            hooks (offloaded or not): what keeping that layer would cost.
        group_input_bytes: per layer, bytes of its tensor inputs (what a checkpoint keeps).
        exposed_copy_s: time the compute stream waited on copies (forward + backward): the
            part of the copy time not hidden behind compute.
        forward_stall_s / backward_stall_s: that time, split by phase.
        d2h_busy_s / h2d_busy_s: time the copy streams spent copying.
        layer_forward_s / layer_backward_s: per layer group, device time of its forward and
            of its backward (from its first saved-tensor use to the next group's).
        forward_s: first layer start to the end of the forward (the context's exit).
        backward_s: backward start (first saved-tensor use) to the end of the backward.
        tail_forward_s / tail_backward_s: the part after the last layer (head, loss) in
            forward, and before the last layer's backward.
        peak_allocated_bytes: the allocator's peak during the step (``reset_peak``).
        layer_forward_peak_bytes / layer_backward_peak_bytes: per layer group, the peak of
            the allocator during that layer's forward (its backward), less what was allocated
            when it started: its saved activations, outputs, gradients and transient
            workspaces. Measured on the step the planner plans from only (``None`` otherwise).
        head_forward_peak_bytes: the same for the stretch from the last layer's end to the
            forward's exit (head and loss).
        head_backward_peak_allocated_bytes: the allocator's peak (not less anything) from the
            forward's exit, after the last offloaded group is released, to the last layer's
            backward (the head's backward).
        start_allocated_bytes: bytes allocated when the step started (parameters, optimizer
            state, kept gradients): the planner's static part.
        host_reserved_bytes: pinned host bytes the offloader's arena holds.
    """

    modes: list[LayerMode]
    bytes_offloaded: int = 0
    bytes_reloaded: int = 0
    bytes_kept_referenced: int = 0
    group_saved_bytes: list[int] = dataclasses.field(default_factory=list)
    group_input_bytes: list[int] = dataclasses.field(default_factory=list)
    exposed_copy_s: float | None = None
    forward_stall_s: float | None = None
    backward_stall_s: float | None = None
    d2h_busy_s: float | None = None
    h2d_busy_s: float | None = None
    layer_forward_s: list[float] | None = None
    layer_backward_s: list[float] | None = None
    forward_s: float | None = None
    backward_s: float | None = None
    tail_forward_s: float | None = None
    tail_backward_s: float | None = None
    peak_allocated_bytes: int | None = None
    layer_forward_peak_bytes: list[int] | None = None
    layer_backward_peak_bytes: list[int] | None = None
    head_forward_peak_bytes: int | None = None
    head_backward_peak_allocated_bytes: int | None = None
    start_allocated_bytes: int | None = None
    host_reserved_bytes: int = 0

    def summary(self) -> str:
        parts = [f"offloaded {format_bytes(self.bytes_offloaded)}", f"reloaded {format_bytes(self.bytes_reloaded)}"]
        if self.exposed_copy_s is not None:
            parts.append(f"exposed copy {self.exposed_copy_s * 1e3:.1f} ms")
        if self.peak_allocated_bytes is not None:
            parts.append(f"peak {format_bytes(self.peak_allocated_bytes)}")
        parts.append(f"host {format_bytes(self.host_reserved_bytes)}")
        return ", ".join(parts)
