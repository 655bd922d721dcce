"""CPU Adam: AdamW whose fp32 master weights, moments and gradients live in host memory.

The device keeps only the parameters (bf16/fp16/fp32). During backward, as each gradient is
accumulated, a post-accumulate-grad hook queues its copy to pinned host memory on the D2H
stream and frees the device gradient; a worker thread accumulates it into an fp32 host
buffer. ``step()`` runs torch's fused CPU AdamW kernel over the fp32 master weights and
copies the new weights back on the H2D stream, chunk by chunk, so the CPU update of one chunk
overlaps the copy of the previous one.

Gradient accumulation over micro-batches runs where memory allows. ``with opt.accumulate():
loss.backward()`` (like DDP's ``no_sync``) keeps the gradients on the device, summed by
autograd in ``p.grad`` as without this optimizer; the next backward outside the block sends
the sums, one copy per parameter per step. Micro-batches whose backward runs outside it are
summed on the host instead (fp32), which needs a pinned staging buffer of the parameter's size
(``host_accumulation=True``, the default).

With ``with opt.step_in_backward(): loss.backward()`` the host update of each parameter
starts as soon as its gradient is on the host, while backward continues (the biggest overlap).
The new weights are copied into the parameters only once the backward has been queued in
full (when the block ends), never during it: a later backward node may read a parameter whose
gradient is already done (``x @ w.detach()``, a weight read by two branches), and must read
the old value. That mode is only valid for the last micro-batch and without global-norm
clipping: clipping needs every gradient before the first update, so
:meth:`CPUAdam.clip_grad_norm_` refuses after such a backward, and without
``step_in_backward`` the grad copies still overlap backward while the updates run in
``step()``, after clipping.

Exceptions: an update is all-or-nothing per parameter; ``step()`` interrupted part-way (any
exception, ``KeyboardInterrupt`` included) leaves each parameter either stepped (its new
weights queued and published) or not (its gradient kept), so calling ``step()`` again
completes exactly that step. A gradient lost to a failed copy makes ``step()`` refuse until
``zero_grad()``.

Memory per parameter: device 0 bytes of optimizer state or gradient. Gradients leave the
device as they are produced; while their copies are in flight the device holds each one and
its fp32 cast, at most ``max_inflight_bytes`` of them (plus the one just produced): past that
the backward waits for the oldest copy, so a backward faster than PCIe cannot pile every
gradient up on the device. Inside ``accumulate()`` the device holds every gradient (the
parameter's size, as plain PyTorch does) until the backward that sends them. Host 16 bytes
(fp32 master and gradient, pinned; exp_avg, exp_avg_sq; +4 with amsgrad) plus, with
``host_accumulation=True``, the parameter's own size in pinned staging for host-side
accumulation; 12 bytes (+2) with ``state_dtype=torch.bfloat16`` (moments in bf16), plus fp32
scratch for one update slice.

The CPU does only the fused update (memory-bound: ~28 bytes per parameter): dtype casts run
on the device, and fp32 crosses PCIe, which has headroom next to the host's update.

Gradients live on the host: ``p.grad`` is None after backward (use :meth:`CPUAdam.grad`),
and ``step()`` consumes them (the next backward starts from zero, as after ``zero_grad``).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import queue
import threading
import weakref
from typing import Any, Callable, Iterable, Iterator

import torch

from tidal.device import DeviceOps
from tidal.transfer.arena import HostArena, HostSlot
from tidal.optim.host_grads import UPDATE_CHUNK_BYTES, STOP_WORKER, HostGradients, HostParam, grad_hook
from tidal.transfer.context import TransferContext

__all__ = ["CPUAdam"]


# Elements per update slice with low-precision moments: two fp32 moment temporaries of 4 MiB
# each stay in the last-level cache between the upcast, the fused update and the round back.
# On a 2-core EPYC VM over Qwen2-1.5B layer shapes, 1Mi elements ran the bf16-moment step at
# 1.07-1.17 G params/s against 0.70-0.80 with 4Mi (fp32 moments: 1.36-1.38).
_SLICE_ELEMS = 1 << 20
STATE_DTYPES = (torch.float32, torch.bfloat16)


class CPUAdam(HostGradients, torch.optim.Optimizer):
    """AdamW (decoupled weight decay, as ``torch.optim.AdamW``) computed on the CPU.

    Args:
        params, lr, betas, eps, weight_decay, amsgrad, maximize: as ``torch.optim.AdamW``.
        overlap: stream gradients to the host during backward (post-accumulate-grad hooks).
            ``False`` copies them in ``step()`` instead (the non-overlapped baseline).
        max_inflight_bytes: device bytes of gradients (and their fp32 casts) whose copy to
            the host may be pending at once during backward; beyond it the backward waits for
            the oldest copy. Bounds the optimizer's transient device memory.
        state_dtype: the dtype of the moments (``exp_avg``, ``exp_avg_sq``) on the host:
            ``torch.float32`` (default: AdamW exactly) or ``torch.bfloat16``, which halves
            their host memory (8 to 4 bytes per parameter; the fp32 master weights stay) for
            when host RAM is the limit. The update then runs in fp32 on slices of
            ``_SLICE_ELEMS`` elements (upcast, fused AdamW, rounded back to nearest): 0.69x the
            host throughput of the fp32 path on a 2-core VM over 64 Mi parameters, 0.78-0.86x over
            Qwen2-1.5B layer shapes; its effect on training and its rate are in
            benchmarks/RESULTS.md (``benchmarks/bench_cpu_adam_precision.py``).
        host_accumulation: reserve a pinned staging buffer of each parameter's size (its
            dtype) so that micro-batches whose backward runs outside :meth:`accumulate` are
            summed on the host. ``False`` saves that host memory (2 bytes per bf16 parameter)
            for a training loop that accumulates on the device (every micro-batch but the last
            inside ``accumulate()``, or one micro-batch per step); a second gradient reaching
            the host in one step is then still added, but synchronously (slow), with a warning.
    """

    # Read by the timeshare (duck-typed, no import): this optimizer's state is on the host
    # already, so a role switch has nothing of it to move.
    tidal_state_on_host = True

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        overlap: bool = True,
        max_inflight_bytes: int = 512 << 20,
        state_dtype: torch.dtype = torch.float32,
        host_accumulation: bool = True,
        context: TransferContext | None = None,
    ) -> None:
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        for i, b in enumerate(betas):
            if not 0.0 <= b < 1.0:
                raise ValueError(f"Invalid beta parameter at index {i}: {b}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if max_inflight_bytes < 0:
            raise ValueError(f"max_inflight_bytes must be >= 0, got {max_inflight_bytes}")
        if not isinstance(state_dtype, torch.dtype):
            raise TypeError(f"state_dtype must be a torch.dtype, got {type(state_dtype).__name__}")
        if state_dtype not in STATE_DTYPES:
            raise ValueError(
                f"state_dtype must be one of {[str(d) for d in STATE_DTYPES]}, got {state_dtype}; torch.float32 is "
                f"AdamW exactly, torch.bfloat16 halves the moments' host memory"
            )
        if not isinstance(host_accumulation, bool):
            raise TypeError(f"host_accumulation must be a bool, got {type(host_accumulation).__name__}")
        self.state_dtype = state_dtype
        self.host_accumulation = host_accumulation
        self._accumulating = False  # inside accumulate(): gradients stay on the device
        self._warned_sync_add = False
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize)
        self._host: dict[torch.Tensor, HostParam] = {}
        self._group_of: dict[torch.Tensor, dict] = {}
        self._hooks: list = []
        # Removes the gradient hooks when the optimizer is collected (close() does it now).
        self._finalizer = weakref.finalize(self, _remove_hooks, self._hooks)
        self._overlap = overlap
        self._max_inflight_bytes = max_inflight_bytes
        # (copied event, device bytes, device tensors) of gradient copies not yet known done.
        # Touched by the backward hooks and by _drain, which never run at the same time.
        self._inflight: collections.deque = collections.deque()
        self._inflight_bytes = 0
        self._ops: DeviceOps | None = None
        self._context = context
        super().__init__(params, defaults)  # calls add_param_group for each group
        self._queue: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._worker: threading.Thread | None = None
        self._worker_error: BaseException | None = None
        self._grads_lost: str | None = None  # why step() must refuse until zero_grad()
        self._in_backward_step = False
        # Params updated on the host inside step_in_backward() whose new weights wait for the
        # end of the backward; and, once it ended, the event the copies wait on.
        self._pending: list[torch.Tensor] = []
        self._backward_done: Any = None
        self._h2d_done: Any = None
        self.trace: list | None = None  # diagnostics: set to [] to record (event, time, numel)

    # ---- setup ----------------------------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        params = [p for p in group["params"] if p.requires_grad]
        devices = {p.device for p in params} | ({self._ops.device} if self._ops else set())
        if len({(d.type, d.index) for d in devices}) > 1:
            raise ValueError(f"CPUAdam needs every parameter on one device, got {sorted(map(str, devices))}")
        if not params:
            return
        if self._ops is None:
            # The device's transfer context: its copy streams and pinned arena, shared with
            # the timeshare and activation offload; this optimizer's slots carry its label.
            if self._context is None:
                self._context = TransferContext.of(params[0].device)
            self._ops = self._context.ops
            self._arena = self._context.arena(pin=True)
            self._d2h, self._h2d = self._context.d2h_stream, self._context.h2d_stream
            self._owner = self._context.label("CPUAdam")
            self._slots: list[HostSlot] = []  # gradient and staging slots, released when collected
            weakref.finalize(self, _release_host, self._arena, self._slots, self._owner)
        if params[0].device != self._ops.device:
            raise ValueError(
                f"CPUAdam's parameters are on {params[0].device} but its transfer context is for {self._ops.device}"
            )
        for p in params:
            if not p.is_floating_point():
                raise TypeError(f"CPUAdam updates floating-point parameters, got {p.dtype}")
        # Pinned: the fp32 masters (copied to the device after each update), each a tensor
        # with a storage of exactly its bytes, so saving the state writes exactly them
        # (torch.save writes a tensor's whole storage); its slot is released only once no
        # tensor uses it (a state_dict may outlive the optimizer). Then the fp32 gradients and
        # param-dtype staging.
        master_slots = self._arena.reserve([p.numel() * 4 for p in params], owner=self._owner)
        per_param = 2 if self.host_accumulation else 1
        staged = self._arena.reserve(
            [n for p in params for n in (p.numel() * 4, p.numel() * p.element_size())[:per_param]], owner=self._owner
        )
        self._slots.extend(staged)
        slots = iter(staged)
        for p, mslot in zip(params, master_slots):
            master = self._arena.slot_tensor(mslot, release_when_dead=True).view(torch.float32).view(p.shape)
            master.copy_(p.detach())
            grad = self._arena.view(next(slots)).view(torch.float32).view(p.shape)
            staging = self._arena.view(next(slots)).view(p.dtype).view(p.shape) if self.host_accumulation else None
            st = self.state[p]
            st["step"] = torch.tensor(0.0)
            st["master"] = master
            st["exp_avg"] = torch.zeros_like(master, dtype=self.state_dtype)
            st["exp_avg_sq"] = torch.zeros_like(master, dtype=self.state_dtype)
            if group["amsgrad"]:
                st["max_exp_avg_sq"] = torch.zeros_like(master, dtype=self.state_dtype)
            self._host[p] = HostParam(grad, staging)
            self._group_of[p] = group
            if self._overlap:
                # A weak reference: the params must not keep a discarded optimizer alive.
                hook = functools.partial(grad_hook, weakref.ref(self))
                self._hooks.append(p.register_post_accumulate_grad_hook(hook))

    # ---- the update --------------------------------------------------------------------------
    @contextlib.contextmanager
    def accumulate(self) -> Iterator[None]:
        """Within the block, gradients stay on the device: autograd sums every backward's into
        ``p.grad`` (in the parameter's dtype, as without this optimizer) and nothing is copied.
        The next backward outside the block (or ``step()``, ``clip_grad_norm_()``, ``grad()``)
        sends the sums to the host, one copy per parameter. Use it around every micro-batch's
        backward but the last, like DDP's ``no_sync``.

        Memory: the device holds one gradient per parameter from the first backward in the
        block until the copy after the last; with ``host_accumulation=False`` this is the way
        to accumulate without host staging. Raises ``ValueError`` inside ``step_in_backward()``
        or another ``accumulate()``."""
        if self._in_backward_step:
            raise ValueError(
                "accumulate() inside step_in_backward(): the parameters update as their gradients "
                "arrive there, so none can stay behind. Use accumulate() for the earlier "
                "micro-batches and step_in_backward() for the last one"
            )
        if self._accumulating:
            raise ValueError("accumulate() is already active; blocks do not nest")
        self._accumulating = True
        try:
            yield
        finally:
            self._accumulating = False

    @contextlib.contextmanager
    def step_in_backward(self) -> Iterator[None]:
        """Within the block, each parameter is updated as soon as its gradient reaches the
        host, overlapping backward. Use it around the last micro-batch's backward only; call
        ``step()`` after it as usual (it completes and publishes the updates)."""
        if not self._overlap:
            raise ValueError("step_in_backward() needs CPUAdam(overlap=True)")
        if self._accumulating:
            raise ValueError(
                "step_in_backward() inside accumulate(): its gradients would stay on the device. Run "
                "the last micro-batch's backward outside accumulate(), in step_in_backward()"
            )
        self._check_grads()
        self._drain()
        self._wait_previous_h2d()
        self._in_backward_step = True
        self._backward_done = None
        try:
            yield
        finally:
            self._in_backward_step = False  # gradients queued from now on are plain ones
            try:
                self._end_backward_step()
            finally:
                self._backward_done = None
                self._publish()

    def _end_backward_step(self) -> None:
        """The backward under step_in_backward() is queued in full (or raised): the weights
        updated during it may now change."""
        if self._ops is None:
            return
        done = None
        if self._ops.is_accelerator:
            done = self._ops.new_event()
            done.record(self._ops.current_stream())  # after every kernel the backward queued
        if self._worker is not None and self._worker.is_alive():
            self._queue.put(functools.partial(self._backward_over, done))
            self._drain()
        else:
            self._release_inflight(0)
        try:
            if self._pending:  # CPU path, or a worker that died before the barrier
                pending, self._pending = self._pending, []
                self._land(pending, after=done)
        finally:
            # Whatever an exception left updated on the host lands too: weights and masters
            # must agree whatever happens next.
            self._land([p for p, hp in self._host.items() if hp.updated and not hp.landed], after=done)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None and p not in self._host:
                    raise RuntimeError(
                        "a parameter that did not require grad when CPUAdam was built now has a "
                        "gradient; its host state was never allocated. Build the optimizer after "
                        "unfreezing, or pass the parameter through add_param_group()"
                    )
        if self._ops is None:  # no trainable parameters
            return loss
        self._check_grads()
        self._drain()
        self._collect_device_grads()  # overlap=False, or sums left on the device by accumulate()
        self._wait_previous_h2d()
        try:
            todo = [p for p, hp in self._host.items() if hp.has_grad and not hp.updated]
            for chunk in _chunks(todo):
                self._adam(chunk)
                self._land(chunk, after=None)
        finally:
            try:
                # Updated inside step_in_backward(), or in a chunk an exception interrupted:
                # their weights must match their masters whatever happens next.
                self._land([p for p, hp in self._host.items() if hp.updated and not hp.landed], after=None)
            finally:
                self._publish()  # whatever was queued, the next kernels read
        for hp in self._host.values():  # step() consumes the gradients
            hp.reset()
        return loss

    def _check_grads(self) -> None:
        if self._grads_lost is not None:
            raise RuntimeError(
                f"CPUAdam cannot step: {self._grads_lost} in an earlier backward, so the gradients "
                f"held are incomplete. Call zero_grad() and run the backward again"
            )

    def _adam(self, params: list[torch.Tensor]) -> None:
        """Fused AdamW on the host masters of ``params`` (one call per param group). All or
        nothing: the step counters go back if the update raises."""
        if self.state_dtype != torch.float32:
            for p in params:
                self._adam_sliced(p)
            return
        groups: dict[int, list[torch.Tensor]] = {}
        for p in params:
            groups.setdefault(id(self._group_of[p]), []).append(p)
        for ps in groups.values():
            g = self._group_of[ps[0]]
            sts = [self.state[p] for p in ps]
            steps = [s["step"] for s in sts]
            self._ops.point("cpu_adam_update")
            torch._foreach_add_(steps, 1)
            try:
                _fused_adamw(
                    g,
                    [s["master"] for s in sts],
                    [self._host[p].grad for p in ps],
                    [s["exp_avg"] for s in sts],
                    [s["exp_avg_sq"] for s in sts],
                    [s["max_exp_avg_sq"] for s in sts] if g["amsgrad"] else [],
                    steps,
                )
            except BaseException:
                torch._foreach_sub_(steps, 1)
                raise
            for p in ps:
                self._host[p].updated = True

    def _adam_sliced(self, p: torch.Tensor) -> None:
        """AdamW on one parameter whose moments are stored in a lower precision: per slice,
        upcast the moments, fused AdamW in fp32 (the master in place), round them back to
        nearest. All or nothing per parameter: an exception before the first slice undoes the
        step count; one after it finishes the remaining slices before it goes on (the update
        rolls forward, so the parameter is never half-stepped). Should a second exception stop
        that, ``done_elems`` keeps the progress and the next ``step()`` or ``zero_grad()``
        finishes it."""
        st, hp = self.state[p], self._host[p]
        if hp.done_elems == 0:
            self._ops.point("cpu_adam_update")
            st["step"].add_(1)
        try:
            self._update_slices(p)
        except BaseException:
            if hp.done_elems == 0:
                st["step"].sub_(1)  # nothing of this update applied
                raise
            self._update_slices(p, points=False)  # roll forward: the rest of this parameter
            raise
        finally:
            if hp.done_elems == st["master"].numel():
                hp.updated = True

    def _update_slices(self, p: torch.Tensor, *, points: bool = True) -> None:
        """The slices of ``p``'s update from ``done_elems`` on (see :meth:`_adam_sliced`)."""
        g, st, hp = self._group_of[p], self.state[p], self._host[p]
        names = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if g["amsgrad"] else [])
        master, grad = st["master"].view(-1), hp.grad.view(-1)
        moments = [st[n].view(-1) for n in names]
        scratch = self._scratch_fp32(len(moments))
        for a in range(hp.done_elems, master.numel(), _SLICE_ELEMS):
            b = min(a + _SLICE_ELEMS, master.numel())
            wide = [buf[: b - a].copy_(m[a:b]) for buf, m in zip(scratch, moments)]
            _fused_adamw(g, [master[a:b]], [grad[a:b]], [wide[0]], [wide[1]], wide[2:], [st["step"]])
            torch._foreach_copy_([m[a:b] for m in moments], wide)  # rounded to nearest
            hp.done_elems = b
            if points:
                self._ops.point("cpu_adam_slice")

    def _scratch_fp32(self, n: int) -> list[torch.Tensor]:
        """``n`` fp32 host buffers of ``_SLICE_ELEMS`` for the low-precision moments' update,
        made once (fresh memory each slice would pay its page faults every step). Memory:
        4 bytes x ``_SLICE_ELEMS`` each; the worker thread and ``step()`` never update at once."""
        bufs = getattr(self, "_scratch", None)
        if bufs is None or len(bufs) < n or bufs[0].numel() != _SLICE_ELEMS:
            bufs = self._scratch = [torch.empty(_SLICE_ELEMS, dtype=torch.float32) for _ in range(n)]
        return bufs[:n]

    def _land(self, params: list[torch.Tensor], *, after: Any) -> None:
        """Queue the new weights of updated ``params`` into the parameters (fp32 over PCIe,
        cast on the device: the CPU, the bottleneck, does nothing but the update). ``after``:
        the event that ends the backward they were updated in (None: the compute stream now)."""
        if not params:
            return
        if not self._ops.is_accelerator:
            for p in params:
                # detach(): this may run in the worker thread, where no_grad is not set.
                p.detach().copy_(self.state[p]["master"])
                self._host[p].landed = True
                self._ops.point("cpu_adam_landed")
            return
        if after is None:
            # New weights must not land while queued kernels (forward/backward) still read
            # the old ones.
            self._ops.wait_stream("weights_h2d_after_compute", self._h2d, self._ops.current_stream())
        else:
            # Every backward kernel (those reading the old weights included) is queued before it.
            self._ops.wait_event("weights_h2d_after_backward", self._h2d, after)
        with self._ops.on_stream(self._h2d):
            for p in params:
                master = self.state[p]["master"]
                if p.dtype == torch.float32:
                    p.detach().copy_(master, non_blocking=True)
                else:  # allocated on the H2D stream, freed in its order
                    p.detach().copy_(master.to(p.device, non_blocking=True))
                self._host[p].landed = True
                self._ops.point("cpu_adam_landed")

    def _wait_previous_h2d(self) -> None:
        # The last step's weights are copied out of the masters we are about to rewrite.
        self._ops.wait_host("masters_write_after_h2d", self._h2d_done)

    def _publish(self) -> None:
        if self._ops is None or not self._ops.is_accelerator:
            return
        done = self._ops.new_event()
        done.record(self._h2d)
        # Kernels queued from now on (the next forward) read the new weights.
        self._ops.wait_event("compute_after_weights_h2d", self._ops.current_stream(), done)
        self._h2d_done = done

    def zero_grad(self, set_to_none: bool = True) -> None:
        try:
            self._drain()
        finally:
            # Masters updated whose weights never landed (an exception ended the step) land
            # now: the parameters must always match the masters the next update starts from.
            if self._ops is not None:
                self._pending = []
                # An update that an exception stopped part-way through a parameter (low-precision
                # moments, updated slice by slice) is finished first: a master half old, half new
                # would be kept for good once its gradient is gone.
                for p, hp in self._host.items():
                    if hp.done_elems and not hp.updated:
                        self._adam_sliced(p)
                self._land([p for p, hp in self._host.items() if hp.updated and not hp.landed], after=None)
                self._publish()
            # Gradients are discarded either way, so a worker error is forgotten with them.
            for p, hp in self._host.items():
                hp.reset()
                p.grad = None
            self._grads_lost = None
        super().zero_grad(set_to_none=set_to_none)

    def close(self) -> None:
        """Stop taking gradients: remove the hooks and the worker. Gradients of later
        backwards stay in ``p.grad`` as usual. Called automatically when collected."""
        self._drain()
        self._finalizer()
        self._queue.put(STOP_WORKER)
        self._worker = None

    # ---- checkpointing -----------------------------------------------------------------------
    def load_state_dict(self, state_dict: dict) -> None:
        """Load into the existing host buffers (no device memory is touched). Accepts what
        :meth:`state_dict` produced, including from another process. The model's parameters
        are not touched: load the model's own state dict for those (the fp32 master weights
        restored here are what the next step updates)."""
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"state_dict has {len(saved_groups)} param groups, this optimizer {len(self.param_groups)}"
            )
        for i, (g, sg) in enumerate(zip(self.param_groups, saved_groups)):
            if len(g["params"]) != len(sg["params"]):
                raise ValueError(
                    f"param group {i} has {len(g['params'])} params here but {len(sg['params'])} in the state_dict"
                )
        ids = [i for g in saved_groups for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        self._drain()
        self._wait_previous_h2d()
        for pid, p in zip(ids, params):
            saved = state_dict["state"].get(pid)
            if saved is None or p not in self._host:
                continue
            st = self.state[p]
            if "max_exp_avg_sq" in saved and "max_exp_avg_sq" not in st:  # saved with amsgrad
                st["max_exp_avg_sq"] = torch.zeros_like(st["exp_avg_sq"])
            missing = [k for k in st if k not in saved and k != "max_exp_avg_sq"]
            if missing:
                raise ValueError(f"state for param {pid} lacks {missing}; was it saved by a CPUAdam?")
            for k, v in st.items():
                if k in saved:
                    v.copy_(saved[k])
        for g, sg in zip(self.param_groups, saved_groups):
            g.update({k: v for k, v in sg.items() if k != "params"})


def _fused_adamw(group: dict, masters, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps) -> None:
    """torch's fused AdamW kernel with ``group``'s hyperparameters (tensors updated in place)."""
    torch._fused_adamw_(
        masters,
        grads,
        exp_avgs,
        exp_avg_sqs,
        max_exp_avg_sqs,
        steps,
        lr=float(group["lr"]),
        beta1=group["betas"][0],
        beta2=group["betas"][1],
        weight_decay=group["weight_decay"],
        eps=group["eps"],
        amsgrad=group["amsgrad"],
        maximize=group["maximize"],
    )


def _release_host(arena: HostArena, slots: list[HostSlot], owner: str) -> None:
    """When the optimizer is collected: its gradient and staging slots go back to the arena
    and its chunks to whoever reserves next (the masters' slots follow their tensors)."""
    arena.release_later(slots)
    arena.disown(owner)


def _chunks(params: list[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    """``params`` in runs of about ``UPDATE_CHUNK_BYTES`` of fp32 master: one run's copy to the
    device overlaps the next run's update on the host."""
    chunk, nbytes = [], 0
    for p in params:
        chunk.append(p)
        nbytes += p.numel() * 4
        if nbytes >= UPDATE_CHUNK_BYTES:
            yield chunk
            chunk, nbytes = [], 0
    if chunk:
        yield chunk


def _remove_hooks(handles: list) -> None:
    for h in handles:
        h.remove()
    handles.clear()
