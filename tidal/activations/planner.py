"""Keep, offload or recompute, per layer: the fastest plan whose peak fits a memory budget.

Inputs, all measured in one warm-up step under the offloader (:func:`plan_from_report`):
per layer, the bytes it saves (``saved_bytes``, what KEEP costs), the bytes of its inputs
(``input_bytes``, what a checkpoint keeps), its forward and backward device time, the bytes of
its parameters' gradients, the allocator's peak inside its forward and inside its backward
(above what was allocated when each started: saved activations, gradients and the transient
workspaces nothing else accounts for); the head's forward/backward time and peak; the step's
measured peak; and the D2H / H2D line rate of the offloader's own pinned buffers and streams.

Model (:func:`simulate`), which mirrors what ``offload.py`` does:

* forward, layer by layer. When layer ``i`` starts, the group copied out since the previous
  layer start is released (the compute stream waits until its D2H copy is done), then group
  ``i - 1`` is offloaded if its mode says so; the D2H stream copies groups in order. The last
  layer is never offloaded. The forward ends by releasing the group still in flight.
* backward, from the last layer down. When layer ``b``'s backward starts, its own batch is
  reloaded if it was not prefetched, and the offloaded groups among ``b-1 .. b-prefetch_groups``
  are prefetched; the H2D stream copies in order, never before that group's D2H finished, and
  layer ``b`` waits for its own reload. A recomputed layer pays its forward again.
* memory: activation bytes resident (kept groups, groups not yet released, reloaded groups,
  checkpointed inputs), plus, inside a layer's forward, its own measured peak (at least its
  saved bytes), plus, inside its backward, a recomputed layer's activations and the layer's own
  measured backward peak (at least its parameters' gradients), plus the parameter gradients
  made so far; the model's peak is the maximum over all these points.

The model is calibrated on the measured step: predicted peak = bytes allocated when the step
started (parameters, optimizer state) + model(plan) + offset. The head's forward (logits,
loss) adds its measured peak at the end of the forward, the group in flight still resident;
its backward adds its measured peak less the static bytes and the layers' activations the
model has resident there under the warm-up plan (the group in flight released), so the model
reproduces the warm-up step's head exactly (without per-stretch peaks, the whole step's peak
is fitted at the head, applied with the group in flight); the offset is whatever the model still falls short
of the warm-up step's measured peak, added to every plan, so the prediction is never below
what was measured. Measured on an H200 before the per-layer peaks, a model without in-layer
workspaces under-predicted a small model's keep-heavy plan by 220 MB (1044 MB measured).
``margin_bytes`` covers what the model still leaves out (fragmentation, a peak that moves).

Search: start with every layer kept; while the predicted peak exceeds the budget, apply the
single-layer change with the least added step time per byte of peak it removes (counting only
the bytes still needed); then, while under budget, take any single change that makes the step
faster. Raises ``ValueError`` when even the most aggressive plan cannot fit.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, Sequence

import torch

from tidal.activations.config import ActivationOffloadConfig, LayerMode, StepReport
from tidal.activations.layers import user_checkpointed
from tidal.units import format_bytes

__all__ = ["ActivationPlan", "LayerProfile", "Measured", "plan_from_report", "plan_layers", "simulate"]


class Measured(Protocol):
    """What :func:`plan_from_report` reads of an offloader (an
    :class:`~tidal.activations.offload.ActivationOffloader` is one): its layers, its settings
    and the line rate it measured, (D2H, H2D) GB/s or None."""

    layers: Sequence[torch.nn.Module]
    config: ActivationOffloadConfig
    line_rate: tuple[float, float] | None


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerProfile:
    """What one layer costs, from a measured step."""

    saved_bytes: int
    input_bytes: int
    forward_s: float
    backward_s: float
    grad_bytes: int = 0
    user_checkpointed: bool = False
    # The allocator's peak inside the layer's forward / backward above what was allocated when
    # it started (0: unknown, the saved bytes / gradient bytes stand in). backward_peak_bytes
    # is without recomputation (a recomputed layer adds its activations on top).
    forward_peak_bytes: int = 0
    backward_peak_bytes: int = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class ActivationPlan:
    """The chosen mode per layer and what the model predicts for it."""

    modes: tuple[LayerMode, ...]
    budget_bytes: int
    predicted_peak_bytes: int
    predicted_step_s: float
    compute_s: float
    keep_all_peak_bytes: int
    keep_all_step_s: float

    def summary(self) -> str:
        counts = {m.value: sum(1 for x in self.modes if x is m) for m in LayerMode}
        parts = ", ".join(f"{v} {k}" for k, v in counts.items() if v)
        return (
            f"{parts}; predicted peak {format_bytes(self.predicted_peak_bytes)} (budget "
            f"{format_bytes(self.budget_bytes)}), step {self.predicted_step_s * 1e3:.1f} ms "
            f"(compute {self.compute_s * 1e3:.1f} ms)"
        )


@dataclasses.dataclass(frozen=True)
class _Sim:
    step_s: float
    memory_bytes: int
    compute_s: float
    tail_resident_bytes: int  # layers' activations resident after the forward (copies released)


def _moved_bytes(p: LayerProfile, mode: LayerMode) -> int:
    return p.input_bytes if mode.recomputes else p.saved_bytes


def simulate(
    profiles: Sequence[LayerProfile],
    modes: Sequence[LayerMode],
    *,
    d2h_bytes_per_s: float,
    h2d_bytes_per_s: float,
    tail_forward_s: float = 0.0,
    tail_backward_s: float = 0.0,
    prefetch_groups: int = 1,
    tail_bytes: int = 0,
    tail_backward_bytes: int = 0,
) -> _Sim:
    """Step time, modelled activation+gradient peak and pure compute time of ``modes``.
    ``tail_bytes``: what the head and loss hold at their peak, on top of the layers' resident
    activations at the end of the forward (the group in flight included);
    ``tail_backward_bytes``: what the head's backward holds at its peak, on top of the layers'
    activations resident after the forward (the group in flight released)."""
    n = len(profiles)
    off = [modes[i].offloads and i < n - 1 for i in range(n)]
    t = 0.0
    compute = 0.0
    resident = 0
    peak = 0
    d2h_free = 0.0
    inflight: tuple[int, float] | None = None  # (bytes, d2h done time)
    d2h_done: dict[int, float] = {}
    last_ended: int | None = None
    for i, p in enumerate(profiles):
        if inflight is not None:  # released at the layer start after the one that started it
            t = max(t, inflight[1])
            resident -= inflight[0]
            inflight = None
        if last_ended is not None and off[last_ended]:
            nbytes = _moved_bytes(profiles[last_ended], modes[last_ended])
            d2h_free = max(t, d2h_free) + nbytes / d2h_bytes_per_s
            d2h_done[last_ended] = d2h_free
            inflight = (nbytes, d2h_free)
        peak = max(peak, resident + max(p.saved_bytes, p.forward_peak_bytes))
        t += p.forward_s
        compute += p.forward_s
        resident += _moved_bytes(p, modes[i])
        last_ended = i
    t += tail_forward_s
    compute += tail_forward_s
    peak = max(peak, resident + tail_bytes)  # the head runs before the exit releases the last copy
    if inflight is not None:
        t = max(t, inflight[1])
        resident -= inflight[0]
    tail_resident = resident
    peak = max(peak, resident + tail_backward_bytes)
    t += tail_backward_s
    compute += tail_backward_s
    grads = 0
    h2d_free = 0.0
    reloaded: dict[int, float] = {}
    offloaded = [i for i in range(n) if off[i]]

    def reload(j: int) -> None:
        nonlocal h2d_free, resident
        if j in reloaded:
            return
        start = max(t, h2d_free, d2h_done[j])
        h2d_free = start + _moved_bytes(profiles[j], modes[j]) / h2d_bytes_per_s
        reloaded[j] = h2d_free
        resident += _moved_bytes(profiles[j], modes[j])

    for b in reversed(range(n)):
        p = profiles[b]
        if off[b]:
            reload(b)
        for j in reversed(offloaded):
            if j < b - prefetch_groups:
                break
            if j < b:
                reload(j)
        if off[b]:
            t = max(t, reloaded[b])
        transient = max(p.saved_bytes - p.input_bytes, 0) if modes[b].recomputes else 0
        peak = max(peak, resident + transient + grads + max(p.grad_bytes, p.backward_peak_bytes))
        work = p.backward_s + (p.forward_s if modes[b].recomputes else 0.0)
        t += work
        compute += work
        resident -= _moved_bytes(p, modes[b])
        grads += p.grad_bytes
    return _Sim(step_s=t, memory_bytes=peak, compute_s=compute, tail_resident_bytes=tail_resident)


def _allowed(i: int, n: int, p: LayerProfile) -> list[LayerMode]:
    if p.user_checkpointed:
        return [LayerMode.RECOMPUTE] if i == n - 1 else [LayerMode.RECOMPUTE, LayerMode.RECOMPUTE_OFFLOAD]
    if i == n - 1:  # the last group is never offloaded: its backward comes first
        return [LayerMode.KEEP, LayerMode.RECOMPUTE]
    return list(LayerMode)


def plan_layers(
    profiles: Sequence[LayerProfile],
    *,
    budget_bytes: int,
    reference_modes: Sequence[LayerMode],
    reference_peak_bytes: int,
    static_bytes: int = 0,
    d2h_bytes_per_s: float,
    h2d_bytes_per_s: float,
    tail_forward_s: float = 0.0,
    tail_backward_s: float = 0.0,
    prefetch_groups: int = 1,
    margin_bytes: int = 0,
    head_forward_peak_bytes: int | None = None,
    head_backward_peak_allocated_bytes: int | None = None,
) -> ActivationPlan:
    """The plan with the least modelled step time whose predicted peak fits ``budget_bytes``
    (greedy; see the module docstring). ``head_forward_peak_bytes``: the head's measured peak
    in the forward above what was allocated at the last layer's end;
    ``head_backward_peak_allocated_bytes``: the allocator's measured peak in the head's
    backward (both from :class:`StepReport`; ``None``: the head is fitted from the reference
    peak)."""
    n = len(profiles)
    if n == 0 or len(reference_modes) != n:
        raise ValueError(f"need one reference mode per layer profile, got {len(reference_modes)} for {n}")
    if d2h_bytes_per_s <= 0 or h2d_bytes_per_s <= 0:
        raise ValueError("line rates must be > 0 bytes/s")
    kw = dict(
        d2h_bytes_per_s=d2h_bytes_per_s,
        h2d_bytes_per_s=h2d_bytes_per_s,
        tail_forward_s=tail_forward_s,
        tail_backward_s=tail_backward_s,
        prefetch_groups=prefetch_groups,
    )
    ref = simulate(profiles, reference_modes, **kw)
    if head_backward_peak_allocated_bytes is not None:
        # The head's backward, fitted on its own measured peak: less what was allocated before
        # the step and the layers' activations resident after the forward.
        kw["tail_backward_bytes"] = max(head_backward_peak_allocated_bytes - static_bytes - ref.tail_resident_bytes, 0)
        kw["tail_bytes"] = head_forward_peak_bytes or 0
    else:
        # The head's share, fitted on the measured step: its peak, less what was allocated
        # before the step, less the layers' activations resident after the forward (the
        # smaller of the two head points, forward and backward), and applied at the larger one
        # (with the copy still in flight). So the prediction errs high by at most one in-flight
        # group whichever point the real peak is at; never low.
        kw["tail_bytes"] = max(reference_peak_bytes - static_bytes - ref.tail_resident_bytes, 0)
    # What the model still misses of the measured step, added to every plan.
    offset = max(reference_peak_bytes - static_bytes - simulate(profiles, reference_modes, **kw).memory_bytes, 0)
    allowed = [_allowed(i, n, p) for i, p in enumerate(profiles)]

    def predict(modes: list[LayerMode]) -> tuple[int, _Sim]:
        sim = simulate(profiles, modes, **kw)
        return static_bytes + offset + sim.memory_bytes, sim

    target = budget_bytes - margin_bytes
    modes = [a[0] for a in allowed]
    keep_peak, keep_sim = predict(modes)
    peak, sim = keep_peak, keep_sim
    while peak > target:
        best: tuple[float, int, int, LayerMode, int, _Sim] | None = None
        for i in range(n):
            for m in allowed[i]:
                if m is modes[i]:
                    continue
                cand = modes.copy()
                cand[i] = m
                p, s = predict(cand)
                gain = peak - p
                if gain <= 0:
                    continue
                score = (s.step_s - sim.step_s) / min(gain, peak - target)
                key = (score, -gain, i)
                if best is None or key < best[:3]:
                    best = (score, -gain, i, m, p, s)
        if best is None:
            floor = predict([a[-1] for a in allowed])[0]
            raise ValueError(
                f"no plan fits budget_bytes={budget_bytes} ({format_bytes(budget_bytes)}) with a "
                f"{format_bytes(margin_bytes)} margin: the lowest predicted peak is "
                f"{format_bytes(floor)} (every layer recomputed and offloaded). Raise the budget, "
                f"shorten the sequence or batch, or shard the model"
            )
        _, _, i, m, peak, sim = best
        modes[i] = m
    improved = True
    while improved:
        improved = False
        for i in range(n):
            for m in allowed[i]:
                if m is modes[i]:
                    continue
                cand = modes.copy()
                cand[i] = m
                p, s = predict(cand)
                if p <= target and s.step_s < sim.step_s * (1 - 1e-9):
                    modes, peak, sim, improved = cand, p, s, True
    return ActivationPlan(
        modes=tuple(modes),
        budget_bytes=budget_bytes,
        predicted_peak_bytes=int(peak),
        predicted_step_s=sim.step_s,
        compute_s=sim.compute_s,
        keep_all_peak_bytes=int(keep_peak),
        keep_all_step_s=keep_sim.step_s,
    )


def plan_from_report(off: Measured, report: StepReport) -> ActivationPlan:
    """Plan ``off``'s layers for ``off.config.budget_bytes`` from a step it measured."""
    n = len(off.layers)
    if len(report.modes) != n:
        raise ValueError(
            f"the planner needs each layer to run once per forward; the measured step ran "
            f"{len(report.modes)} layer calls for {n} layers"
        )
    if report.layer_forward_s is None or report.peak_allocated_bytes is None:
        raise ValueError("the planner needs a measured step (config.measure=True on an accelerator)")
    if off.line_rate is None:
        raise ValueError("the planner needs the line rate (config.line_rate_bytes_per_s or an accelerator)")
    fwd = report.layer_forward_s
    bwd = report.layer_backward_s or [2 * f for f in fwd]
    profiles = []
    for i, layer in enumerate(off.layers):
        grads = sum(getattr(p, "_local_tensor", p).nbytes for p in layer.parameters() if p.requires_grad)
        user = user_checkpointed(layer)
        recomputed = report.modes[i].recomputes
        saved, inputs = report.group_saved_bytes[i], report.group_input_bytes[i]
        fwd_peak = report.layer_forward_peak_bytes[i] if report.layer_forward_peak_bytes else 0
        bwd_peak = report.layer_backward_peak_bytes[i] if report.layer_backward_peak_bytes else 0
        if recomputed:  # its measured backward peak includes the recomputed activations
            bwd_peak = max(bwd_peak - max(saved - inputs, 0), 0)
        profiles.append(
            LayerProfile(
                saved_bytes=saved,
                input_bytes=inputs,
                forward_s=fwd[i],
                backward_s=max(bwd[i] - (fwd[i] if recomputed else 0.0), 0.0),
                grad_bytes=int(grads),
                user_checkpointed=user,
                forward_peak_bytes=fwd_peak,
                backward_peak_bytes=bwd_peak,
            )
        )
    d2h, h2d = off.line_rate
    return plan_layers(
        profiles,
        budget_bytes=off.config.budget_bytes,
        reference_modes=report.modes,
        reference_peak_bytes=report.peak_allocated_bytes,
        static_bytes=report.start_allocated_bytes or 0,
        d2h_bytes_per_s=d2h,
        h2d_bytes_per_s=h2d,
        tail_forward_s=report.tail_forward_s or 0.0,
        tail_backward_s=report.tail_backward_s or 0.0,
        prefetch_groups=off.config.prefetch_groups,
        margin_bytes=off.config.planner_margin_bytes,
        head_forward_peak_bytes=report.head_forward_peak_bytes,
        head_backward_peak_allocated_bytes=report.head_backward_peak_allocated_bytes,
    )
