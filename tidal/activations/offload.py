"""Activation offload: saved tensors grouped by layer, copied to host while the next layers
compute, copied back one group ahead during backward.

Contract::

    off = ActivationOffloader(model, layers=model.model.layers)     # once
    with off:                                                       # every step
        loss = model(input_ids=x, labels=x).loss
    loss.backward()                                                 # inside or outside
    print(off.report().summary())

or ``with tidal.offload_activations(model, layers=..., ...)`` (the model's offloader, reused
across steps, so its pinned host memory is allocated once). Results are bit-identical to no
offload: only bytes move, and every view is rebuilt from its storage.

How it works. ``torch.autograd.graph.saved_tensors_hooks`` sees every tensor autograd saves.
A forward pre-hook on each layer opens a *group*; tensors saved between two layers (a
checkpoint's saved inputs, inter-layer ops) belong to the group that starts next; what is saved
after the last layer (final norm, head, loss) stays on the device. When layer ``i+1`` starts,
group ``i`` is offloaded (if its mode says so): its storages go to host on the D2H stream. The
group offloaded at the previous layer start is *released* first (the compute stream waits for
its copy, which had one layer of compute to hide behind, then its device memory is dropped),
so at most two offloaded groups are resident in forward: one being copied, one being computed. The last group is never offloaded (its backward comes first).
In backward, the first use of a saved tensor of group ``i`` reloads group ``i`` if it is not
already there and prefetches groups ``i-1 .. i-prefetch_groups`` (those offloaded) on the H2D
stream. Stream ordering: see ``mover.py``.

Which saved tensors are offloaded (``saved.py`` for the static rules): a storage is offloaded
only if, when its group is offloaded, nothing but tidal's own alias holds it
(``torch._C._storage_Use_Count``): no other tensor, view, parameter or caller variable.
Offloading a storage that something else keeps frees nothing and costs a copy. The check runs
one layer late on purpose: when layer ``i+1`` starts, layer ``i``'s input is no longer the
loop variable of the model, so it is free unless the model keeps it (``output_hidden_states``).
A storage still held then (e.g. layer ``i``'s output, which is layer ``i+1``'s input) is
checked once more at the next layer; if still held, it stays (rotary tables, masks). Several
saved views of one storage are copied once.

Composition with checkpointing. Non-reentrant ``torch.utils.checkpoint`` and Hugging Face
``gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})`` push
their own hooks inside the layer, so only the checkpoint's saved inputs reach tidal's hooks:
those are what is offloaded. Reentrant checkpointing is refused with a ``ValueError`` naming
the fix. The planner's RECOMPUTE modes checkpoint a layer themselves (``layers.py``).

Not supported (each refused or documented): ``torch.compile`` (models or layers: ``TypeError``),
nested offloaders or other saved-tensor hooks around the context (``ValueError``), a new forward
while the previous forward's saved activations are still alive (``ValueError``), saving tensors
during backward under the context (``create_graph``: those stay on the device), tensor-subclass
activations (DTensor under tensor parallelism: kept on the device), CUDA graphs. In-place
modification of an activation after autograd saved it is not detected: PyTorch skips its
version check for every saved-tensor hook (``save_on_cpu`` included). FSDP2-wrapped layers work:
their (unsharded) parameters are ``nn.Parameter`` and are never offloaded.

Memory cost: device, at most two offloaded groups plus the kept ones, one staging bucket per
direction; host, the pinned arena: the largest bytes any step offloaded, allocated on first
use and reused.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Iterable, Sequence

import torch
import torch.nn as nn

from tidal.activations.config import ActivationOffloadConfig, LayerMode, StepReport
from tidal.activations.layers import (
    REENTRANT_HELP,
    RecomputePatch,
    check_checkpointing,
    resolve_layers,
    user_checkpointed,
)
from tidal.activations.mover import GroupMover, Timer
from tidal.activations.planner import plan_from_report
from tidal.activations.saved import (
    SavedStorage,
    SavedView,
    skip_reason,
    static_storage_keys,
)
from tidal.activations.step import Group, PeakWindows, Step
from tidal.transfer.context import TransferContext

__all__ = ["ActivationOffloader", "offload_activations"]

_TLS = threading.local()


class ActivationOffloader:
    """Offloads the saved activations of ``layers`` of ``model``; a context manager entered
    once per forward. See the module docstring for the contract.

    Args:
        model: the eager model (not ``torch.compile``'d).
        layers: its transformer blocks, in any iterable; or
        layer_cls: their class, a tuple of classes, or class names.
        config: :class:`ActivationOffloadConfig`.
        plan: a per-layer plan (a sequence of :class:`LayerMode`, or an
            :class:`~tidal.activations.planner.ActivationPlan`); overrides ``budget_bytes``.
        device: where the activations live (default: the device of the layers' parameters).
        context: the transfer context whose copy streams and host arena to use (default: the
            process's one for ``device``, shared with the timeshare and CPUAdam).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        layers: Iterable[nn.Module] | None = None,
        layer_cls: Any = None,
        config: ActivationOffloadConfig | None = None,
        plan: Any = None,
        device: str | torch.device | None = None,
        context: TransferContext | None = None,
    ) -> None:
        if config is not None and not isinstance(config, ActivationOffloadConfig):
            raise TypeError(f"config must be an ActivationOffloadConfig, got {type(config).__name__}")
        self.config = config or ActivationOffloadConfig()
        self.layers = resolve_layers(model, layers, layer_cls)
        self._model_ref = weakref.ref(model)
        if device is None:
            device = _layers_device(model, self.layers)
        self.context = context if context is not None else TransferContext.of(device)
        self.ops = self.context.ops
        if self.config.budget_bytes is not None and not self.ops.is_accelerator:
            raise ValueError(
                "budget_bytes needs an accelerator: the planner measures device memory and copy "
                "time; on CPU pass plan= (a list of LayerMode) or no budget"
            )
        if self.config.budget_bytes is not None and not self.config.measure:
            raise ValueError("budget_bytes needs measure=True: the planner plans from measured times")
        self._mover = GroupMover(
            self.context,
            bucket_bytes=self.config.bucket_bytes,
            small_copy_bytes=self.config.small_copy_bytes,
            measure=self.config.measure,
        )
        self._lock = threading.RLock()
        self._explicit_plan = self._check_plan(plan) if plan is not None else None
        self.plan: Any = plan if plan is not None else None
        self._reference: StepReport | None = None  # the measured step the planner starts from
        self._step: Step | None = None
        self._hooks: list[Any] = []
        self._patch: RecomputePatch | None = None
        self._saved_hooks: Any = None
        self._static_keys: set[int] = set()
        self._grad_at_entry = False
        self._closed = False
        self.line_rate: tuple[float, float] | None = None  # (D2H, H2D) bytes/s once measured
        self._cache_key: Any = None

    def __repr__(self) -> str:
        return f"ActivationOffloader({len(self.layers)} layers on {self.ops.device}, {self.config})"

    # ---- public --------------------------------------------------------------------------------
    @property
    def arena(self):
        """The (shared) pinned host arena holding offloaded activations."""
        return self._mover.arena

    @property
    def host_reserved_bytes(self) -> int:
        """Host bytes of the arena chunks serving this offloader (its RAM, kept between steps)."""
        return self._mover.arena.owner_bytes(self._mover.owner)

    def step(self) -> "ActivationOffloader":
        """The context for one forward (same as using the offloader itself)."""
        return self

    def modes(self) -> list[LayerMode]:
        """The per-layer modes the next step will use."""
        return self._modes_for_step(planning=False)

    def report(self) -> StepReport:
        """What the last step measured. Call after its backward; blocks until the events it
        reads have completed."""
        step = self._step
        if step is None:
            raise ValueError("no step has run under this offloader yet")
        return self._build_report(step)

    def close(self) -> None:
        """Free the pinned host memory. Refused while a step's saved activations are alive."""
        if self._step is not None and self._step.live_records > 0:
            raise ValueError(
                "this offloader still holds saved activations of a forward whose backward has "
                "not run; run backward (or drop the graph) before close()"
            )
        if not self._closed:
            self._mover.close()
            self._closed = True

    # ---- context --------------------------------------------------------------------------------
    def __enter__(self) -> "ActivationOffloader":
        if self._closed:
            raise ValueError("this ActivationOffloader was closed; create a new one")
        if getattr(_TLS, "active", None) is not None:
            raise ValueError(
                "offload_activations is already active in this thread: nesting is not supported "
                "(saved-tensor hooks form one stack and only the innermost would see the layers); "
                "use one offloader around the whole forward"
            )
        if torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
            raise ValueError(
                "other saved-tensor hooks are active (torch.autograd.graph.save_on_cpu, a "
                "checkpointed region, or another hook context); tidal's hooks would shadow them. "
                "Enter offload_activations outside of them, around the whole forward"
            )
        prev = self._step
        if prev is not None and prev.live_records > 0 and prev.aborted:
            prev.abandon()  # its forward or backward raised: its graph will not run again
        if prev is not None and prev.live_records > 0:
            raise ValueError(
                f"the activations saved by the previous forward under this offloader are still "
                f"alive ({prev.live_records} storages): its backward has not run, or its graph is "
                f"kept (e.g. backward(retain_graph=True) with the loss still referenced). Run "
                f"loss.backward() and drop the graph before the next forward, or use one "
                f"offloader per graph kept alive"
            )
        model = self._model_ref()
        if model is None:
            raise ValueError("the model of this offloader no longer exists")
        check_checkpointing(self.layers)
        if prev is not None and prev.peak is None:
            prev.peak = self._step_peak(prev)
        modes = self._modes_for_step(planning=True)
        step = Step(self._mover, self.ops, modes, prefetch_groups=self.config.prefetch_groups, lock=self._lock)
        if self._is_planner_reference():
            # The step the planner will plan from: it also measures each layer's own peak.
            step.windows = PeakWindows(self.ops)
        self._mover.stalls = step.stalls
        self._mover.d2h_intervals = step.d2h_intervals
        self._mover.h2d_intervals = step.h2d_intervals
        self._static_keys = static_storage_keys(model)
        self._grad_at_entry = torch.is_grad_enabled()
        if self.config.reset_peak and self.ops.is_accelerator and self.ops.module is not None:
            self.ops.module.reset_peak_memory_stats(self.ops.device)
        patch_layers = [l for l, m in zip(self.layers, modes) if m.recomputes and not user_checkpointed(l)]
        try:
            self._patch = RecomputePatch(patch_layers)
            for li, layer in enumerate(self.layers):
                self._hooks.append(
                    layer.register_forward_pre_hook(
                        lambda mod, args, kwargs, li=li: self._on_layer_start(li, args, kwargs), with_kwargs=True
                    )
                )
                self._hooks.append(layer.register_forward_hook(lambda mod, args, out, li=li: self._on_layer_end(li)))
            self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self._saved_hooks.__enter__()
        except BaseException:
            self._teardown()
            raise
        self._step = step
        _TLS.active = self
        return self

    def __exit__(self, *exc: Any) -> None:
        step = self._step
        if exc[0] is not None and step is not None:
            step.aborted = True
        try:
            with self._lock:
                if step is not None and step.forward_open:
                    if step.windows is not None:
                        step.windows.close()  # the head's forward ends before the last copy is released
                    step.close_forward()
                    step.fwd_exit = self._mover.timer.mark()
                    if step.windows is not None:
                        step.windows.open(("head_backward", 0))
        finally:
            self._teardown()

    def _teardown(self) -> None:
        if self._saved_hooks is not None:
            self._saved_hooks.__exit__(None, None, None)
            self._saved_hooks = None
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._patch is not None:
            self._patch.restore()
            self._patch = None
        _TLS.active = None

    # ---- layer hooks ------------------------------------------------------------------------------
    def _on_layer_start(self, li: int, args: tuple, kwargs: dict) -> None:
        if torch._C._current_graph_task_id() != -1:
            return  # a checkpoint recomputing this layer during backward
        step = self._step
        if step is None or not step.forward_open:
            return
        if self._grad_at_entry and not torch.is_grad_enabled():
            raise ValueError(
                f"layer {li} ({type(self.layers[li]).__name__}) runs under no_grad inside a "
                f"grad-enabled forward: that is reentrant checkpointing (use_reentrant=True), "
                f"which cannot compose with activation offload (its activations are recomputed "
                f"inside a nested backward the hooks cannot order). {REENTRANT_HELP}. If the "
                f"layer runs without grad on purpose, leave it out of layers="
            )
        with self._lock:
            if step.windows is not None:
                step.windows.close()  # the offload point's releases belong to no layer
            step.offload_point()
            group = Group(len(step.groups), li, step.modes[li])
            for rec in step.gap:
                rec.group = group
            group.records.extend(step.gap)
            step.gap = []
            prev_keys = step.groups[-1].input_keys if step.groups else set()
            for t in list(args) + list(kwargs.values()):
                if (
                    isinstance(t, torch.Tensor)
                    and skip_reason(t, self.ops.device, self.config.min_offload_bytes, self._static_keys) is None
                ):
                    key = t.untyped_storage()._cdata
                    if key not in group.input_keys:
                        group.input_keys.add(key)
                        if key not in prev_keys:
                            group.input_bytes += t.untyped_storage().nbytes()
            step.groups.append(group)
            step.current = group
            group.fwd_start = self._mover.timer.mark()
            if step.windows is not None:
                step.windows.open(("forward", li))
            if step.fwd_first is None:
                step.fwd_first = group.fwd_start

    def _on_layer_end(self, li: int) -> None:
        if torch._C._current_graph_task_id() != -1:
            return
        step = self._step
        if step is None or not step.forward_open or step.current is None:
            return
        step.current.fwd_end = self._mover.timer.mark()
        step.current = None
        if step.windows is not None:
            step.windows.open(("after", li))  # after the last layer: the head and the loss

    # ---- saved-tensor hooks -------------------------------------------------------------------------
    def _pack(self, t: torch.Tensor) -> Any:
        step = self._step
        if step is None or not step.forward_open or torch._C._current_graph_task_id() != -1:
            return t.detach()  # saved during backward (create_graph): stays on the device
        reason = skip_reason(t, self.ops.device, self.config.min_offload_bytes, self._static_keys)
        if reason is not None:
            # What autograd would keep; detached so the packed value holds no grad_fn (an
            # output saved by its own node would otherwise form a reference cycle).
            return t.detach()
        group = step.current
        storage = t.untyped_storage()
        key = storage._cdata
        if group is not None and not group.mode.offloads:
            group.kept_bytes[key] = storage.nbytes()
            return t.detach()
        with self._lock:
            rec = step.live.get(key)
            if rec is None or rec.disposed or rec.x_gpu is None:
                rec = SavedStorage(storage, group)
                step.live[key] = rec
                (group.records if group is not None else step.gap).append(rec)
                step.live_records += 1
            index = group.index if group is not None else len(step.groups)
            return SavedView(rec, t, index, step)

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        view: SavedView = packed
        try:
            return self._unpack_view(view)
        except BaseException:
            view.owner.aborted = True  # the backward stops here: this graph will not run again
            raise

    def _unpack_view(self, view: SavedView) -> torch.Tensor:
        rec = view.storage
        step: Step = view.owner
        with self._lock:
            pid = torch._C._current_graph_task_id()
            if pid != -1:
                step.on_backward_use(view.group_index, pid)
            if rec.x_gpu is None:
                if rec.disposed or rec.batch is None:
                    raise RuntimeError("tidal: a saved activation was lost (its storage was disposed)")
                step.reload(rec.batch, None)
            step.mover.consume(rec, view.group_index)
            out = view.rebuild(rec.x_gpu)
            if pid != -1 and rec.batch is not None and rec.batch.released:
                # A host copy exists: once every live view was unpacked in this pass, autograd
                # alone keeps the device copy (a retained graph's next pass reloads it).
                if rec.pass_id != pid:
                    rec.pass_id = pid
                    rec.unpacked_views = set()
                rec.unpacked_views.add(id(view))
                if len(rec.unpacked_views) >= rec.live_views:
                    rec.x_gpu = None
        return out

    # ---- modes and plans ------------------------------------------------------------------------------
    def _check_plan(self, plan: Any) -> list[LayerMode]:
        modes = getattr(plan, "modes", plan)
        try:
            modes = [m if isinstance(m, LayerMode) else LayerMode(m) for m in modes]
        except (TypeError, ValueError):
            raise TypeError(f"plan must be a sequence of LayerMode (or an ActivationPlan), got {plan!r}") from None
        if len(modes) != len(self.layers):
            raise ValueError(f"plan has {len(modes)} modes for {len(self.layers)} layers; give one per layer")
        return modes

    def _modes_for_step(self, *, planning: bool) -> list[LayerMode]:
        n = len(self.layers)
        if self._explicit_plan is not None:
            modes = list(self._explicit_plan)
        elif self.config.budget_bytes is not None:
            if self.plan is None and planning and self._step is not None and self._reference is None:
                self._reference = self._build_report(self._step)
                self._make_plan()
            modes = list(self.plan.modes) if self.plan is not None else [LayerMode.OFFLOAD] * n
        else:
            modes = [self.config.default_mode] * n
        for i, layer in enumerate(self.layers):
            if user_checkpointed(layer) and not modes[i].recomputes:
                # The user's checkpointing stays on; the mode only says whether its saved
                # inputs are offloaded.
                modes[i] = LayerMode.RECOMPUTE_OFFLOAD if modes[i].offloads else LayerMode.RECOMPUTE
        return modes

    def _make_plan(self) -> None:
        if self.line_rate is None:
            rate = self.config.line_rate_bytes_per_s
            self.line_rate = (rate, rate) if rate else self._mover.measure_line_rate()
        self.plan = plan_from_report(self, self._reference)

    def _peak(self) -> int | None:
        if self.ops.is_accelerator and self.ops.module is not None:
            return int(self.ops.module.max_memory_allocated(self.ops.device))
        return None

    def _is_planner_reference(self) -> bool:
        """Whether the step about to run is the one the planner will plan from."""
        return (
            self.config.budget_bytes is not None
            and self._explicit_plan is None
            and self.plan is None
            and self._reference is None
            and self.ops.is_accelerator
        )

    def _step_peak(self, step: Step) -> int | None:
        if step.windows is not None:
            step.windows.close()
            return step.windows.step_peak
        return self._peak()

    def _build_report(self, step: Step) -> StepReport:
        if step.report is not None:
            return step.report
        sec = Timer.seconds
        measured = self._mover.timer.enabled
        stall_f = sum(sec(a, b) for ph, _, a, b in step.stalls if ph == "forward")
        stall_b = sum(sec(a, b) for ph, _, a, b in step.stalls if ph == "backward")
        groups = step.groups
        rep = StepReport(
            modes=[g.mode for g in groups],
            bytes_offloaded=step.bytes_offloaded,
            bytes_reloaded=step.bytes_reloaded,
            bytes_kept_referenced=step.bytes_kept_referenced,
            group_saved_bytes=[g.saved_bytes for g in groups],
            group_input_bytes=[g.input_bytes for g in groups],
            peak_allocated_bytes=step.peak if step.peak is not None else self._step_peak(step),
            start_allocated_bytes=step.start_allocated,
            host_reserved_bytes=self.host_reserved_bytes,
        )
        if step.windows is not None and groups:
            layers = [g.layer_index for g in groups]
            rep.layer_forward_peak_bytes = [step.windows.excess.get(("forward", li), 0) for li in layers]
            rep.layer_backward_peak_bytes = [step.windows.excess.get(("backward", li), 0) for li in layers]
            rep.head_forward_peak_bytes = step.windows.excess.get(("after", layers[-1]))
            rep.head_backward_peak_allocated_bytes = step.windows.peak.get(("head_backward", 0))
        if measured and groups:
            rep.exposed_copy_s = stall_f + stall_b
            rep.forward_stall_s, rep.backward_stall_s = stall_f, stall_b
            rep.d2h_busy_s = sum(sec(a, b) for a, b in step.d2h_intervals)
            rep.h2d_busy_s = sum(sec(a, b) for a, b in step.h2d_intervals)
            rep.layer_forward_s = [sec(g.fwd_start, g.fwd_end) for g in groups]
            rep.forward_s = sec(step.fwd_first, step.fwd_exit)
            rep.tail_forward_s = sec(groups[-1].fwd_end, step.fwd_exit)
            if step.bwd_start is not None and step.bwd_end is not None:
                marks = [g.bwd_mark for g in groups]
                rep.backward_s = sec(step.bwd_start, step.bwd_end)
                rep.tail_backward_s = sec(step.bwd_start, marks[-1]) if marks[-1] is not None else None
                per_group_stall = [0.0] * len(groups)
                for ph, gi, a, b in step.stalls:
                    if ph == "backward" and 0 <= gi < len(groups):
                        per_group_stall[gi] += sec(a, b)
                bwd = []
                for i, g in enumerate(groups):
                    nxt = next((m for m in reversed(marks[:i]) if m is not None), step.bwd_end)
                    bwd.append(max(sec(g.bwd_mark, nxt) - per_group_stall[i], 0.0) if g.bwd_mark is not None else 0.0)
                rep.layer_backward_s = bwd
        if step.bwd_end is not None or not measured:
            step.report = rep
        return rep


def _layers_device(model: nn.Module, layers: Sequence[nn.Module]) -> torch.device:
    params = [p for layer in layers for p in layer.parameters()] or list(model.parameters())
    device = params[0].device if params else torch.device("cpu")
    if device.type == "meta":
        raise ValueError("the model is on the meta device; materialise it before offloading")
    return device


def offload_activations(
    model: nn.Module,
    *,
    layers: Iterable[nn.Module] | None = None,
    layer_cls: Any = None,
    config: ActivationOffloadConfig | None = None,
    plan: Sequence[LayerMode] | Any = None,
    **config_fields: Any,
) -> ActivationOffloader:
    """The offload context for one forward of ``model``::

        with tidal.offload_activations(model, layers=model.model.layers, min_offload_bytes=1 << 20):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()

    The model's :class:`ActivationOffloader` is made on first use and reused while ``layers``,
    the config and the plan stay the same, so its pinned host memory (and its plan, with
    ``budget_bytes``) carry over from step to step. It is found again through the claim it
    holds on ``model`` in the device's :class:`~tidal.transfer.TransferContext`. Config
    fields may be given as keywords or as ``config=``, not both.
    """
    if config is not None and config_fields:
        raise TypeError("give config= or config fields as keywords, not both")
    cfg = config if config is not None else ActivationOffloadConfig(**config_fields)
    resolved = resolve_layers(model, layers, layer_cls)
    plan_key = None if plan is None else tuple(LayerMode(m) for m in getattr(plan, "modes", plan))
    key = (tuple(id(m) for m in resolved), cfg, plan_key)
    context = TransferContext.of(_layers_device(model, resolved))
    off = context.owner_of(model)
    if not isinstance(off, ActivationOffloader) or off._cache_key != key:
        if isinstance(off, ActivationOffloader):
            off.close()  # refuses while its activations are alive
            context.release(model, off)
        off = ActivationOffloader(model, layers=resolved, config=cfg, plan=plan, context=context)
        off._cache_key = key
        context.claim(model, off, what="model (for activation offload)")
    return off
