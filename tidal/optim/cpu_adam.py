"""CPU Adam: AdamW whose fp32 master weights, moments and gradients live in host memory.

The device keeps only the parameters (bf16/fp16/fp32). During backward, as each gradient is
accumulated, a post-accumulate-grad hook queues its copy to pinned host memory on the D2H
stream and frees the device gradient; a worker thread accumulates it into an fp32 host
buffer. ``step()`` runs torch's fused CPU AdamW kernel over the fp32 master weights and
copies the new weights back on the H2D stream, chunk by chunk, so the CPU update of one chunk
overlaps the copy of the previous one.

With ``with opt.step_in_backward(): loss.backward()`` the update of each parameter starts as
soon as its gradient is on the host, while backward continues (the biggest overlap). That is
only valid for the last micro-batch and without global-norm clipping: clipping needs every
gradient before the first update, so :meth:`CPUAdam.clip_grad_norm_` refuses after such a
backward, and without ``step_in_backward`` the grad copies still overlap backward while the
updates run in ``step()``, after clipping.

Memory per parameter: device 0 bytes of optimizer state or gradient. Gradients leave the
device as they are produced; while their copies are in flight the device holds each one and
its fp32 cast, at most ``max_inflight_bytes`` of them (plus the one just produced): past that
the backward waits for the oldest copy, so a backward faster than PCIe cannot pile every
gradient up on the device. Host 16 bytes (fp32 master and gradient, pinned; exp_avg, exp_avg_sq; +4 with
amsgrad) plus the parameter's own size in pinned staging for gradient accumulation.

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
import time
import weakref
from typing import Any, Callable, Iterable, Iterator

import torch

from tidal.device import DeviceOps
from tidal.transfer.arena import HostArena

__all__ = ["CPUAdam"]

_STOP = object()
_CHUNK_BYTES = 64 << 20
_BATCH_BYTES = 512 << 20  # fp32 bytes of gradients the worker takes into one in-backward update  # fp32 master bytes per update chunk: one H2D copy overlaps the next chunk's math


class _HostParam:
    """Host-side buffers of one parameter."""

    __slots__ = ("grad", "staging", "seen", "has_grad", "updated", "staging_free")

    def __init__(self, grad: torch.Tensor, staging: torch.Tensor) -> None:
        self.grad = grad  # fp32 accumulated gradient (pinned: the first micro-batch lands here)
        self.staging = staging  # pinned, param dtype: later micro-batches land here, then add
        self.seen = False  # a gradient copy was queued since the last step (set by the hook)
        self.has_grad = False  # the worker has it in `grad`
        self.updated = False
        self.staging_free = threading.Event()
        self.staging_free.set()


class CPUAdam(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, as ``torch.optim.AdamW``) computed on the CPU.

    Args:
        params, lr, betas, eps, weight_decay, amsgrad, maximize: as ``torch.optim.AdamW``.
        overlap: stream gradients to the host during backward (post-accumulate-grad hooks).
            ``False`` copies them in ``step()`` instead (the non-overlapped baseline).
        max_inflight_bytes: device bytes of gradients (and their fp32 casts) whose copy to
            the host may be pending at once during backward; beyond it the backward waits for
            the oldest copy. Bounds the optimizer's transient device memory.
    """

    # Read by the timeshare (duck-typed, no import): this optimizer's state is on the host
    # already, so a role switch has nothing of it to move.
    tidal_state_on_host = True

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, *,
                 maximize: bool = False, overlap: bool = True, max_inflight_bytes: int = 512 << 20) -> None:
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
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize)
        self._host: dict[torch.Tensor, _HostParam] = {}
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
        super().__init__(params, defaults)  # calls add_param_group for each group
        self._queue: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._worker: threading.Thread | None = None
        self._worker_error: BaseException | None = None
        self._in_backward_step = False
        self._h2d_done: Any = None
        self._unsafe_skip_waits = False  # test-only: lets race tests show they catch a missing wait
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
            self._ops = DeviceOps(params[0].device)
            self._arena = HostArena(self._ops, pin=True)
            self._d2h, self._h2d = self._ops.new_stream(), self._ops.new_stream()
        for p in params:
            if not p.is_floating_point():
                raise TypeError(f"CPUAdam updates floating-point parameters, got {p.dtype}")
        # Pinned: the fp32 masters (copied to the device after each update) in a chunk of
        # their own, so saving the state writes exactly them (torch.save writes a view's whole
        # storage, once); the fp32 gradients and param-dtype staging in another.
        master_slots = self._arena.reserve([p.numel() * 4 for p in params])
        slots = iter(self._arena.reserve([n for p in params for n in (p.numel() * 4, p.numel() * p.element_size())]))
        for p, mslot in zip(params, master_slots):
            master = self._arena.view(mslot).view(torch.float32).view(p.shape)
            master.copy_(p.detach())
            grad = self._arena.view(next(slots)).view(torch.float32).view(p.shape)
            staging = self._arena.view(next(slots)).view(p.dtype).view(p.shape)
            st = self.state[p]
            st["step"] = torch.tensor(0.0)
            st["master"] = master
            st["exp_avg"] = torch.zeros_like(master)
            st["exp_avg_sq"] = torch.zeros_like(master)
            if group["amsgrad"]:
                st["max_exp_avg_sq"] = torch.zeros_like(master)
            self._host[p] = _HostParam(grad, staging)
            self._group_of[p] = group
            if self._overlap:
                # A weak reference: the params must not keep a discarded optimizer alive.
                hook = functools.partial(_grad_hook, weakref.ref(self))
                self._hooks.append(p.register_post_accumulate_grad_hook(hook))

    # ---- gradients ------------------------------------------------------------------------
    def _on_grad(self, p: torch.Tensor) -> None:
        """Runs in backward right after ``p.grad`` is complete for this backward."""
        hp = self._host[p]
        grad = p.grad
        if grad is None:  # another hook consumed it
            return
        if self._in_backward_step and hp.updated:
            raise RuntimeError(
                "a second backward reached a parameter already updated inside this "
                "step_in_backward() block; wrap only the last micro-batch's backward in it"
            )
        p.grad = None  # the device gradient is freed once its copy is done (we hold `grad`)
        first, hp.seen = not hp.seen, True
        if not self._ops.is_accelerator:
            self._accumulate(hp, grad, first)
            if self._in_backward_step:
                self._update([p])
            return
        if not first:
            hp.staging_free.wait()  # the worker still reads the previous micro-batch's copy
            hp.staging_free.clear()
        compute = self._ops.current_stream()
        grad_ready = self._ops.new_event()
        # Marks the point where the grad is written and every backward use of p is queued.
        grad_ready.record(compute)
        with self._ops.on_stream(self._d2h):
            if not self._unsafe_skip_waits:
                # The gradient kernels are queued on the compute stream; copy after them.
                self._d2h.wait_event(grad_ready)
            if first and grad.dtype != torch.float32 and grad.is_contiguous():
                # Cast on the device, land in the fp32 host gradient (no CPU work), a chunk at
                # a time so a big gradient (a tied embedding) never has a whole fp32 twin.
                flat, host_flat = grad.view(-1), hp.grad.view(-1)
                step = max(1, _CHUNK_BYTES // 4)
                for a in range(0, flat.numel(), step):
                    src = flat[a:a + step].float()
                    host_flat[a:a + step].copy_(src, non_blocking=True)
                    copied = self._ops.new_event()
                    copied.record(self._d2h)
                    self._hold(copied, src.numel() * 4, src)
            else:
                src = grad.float() if first and grad.dtype != torch.float32 else grad
                (hp.grad if first else hp.staging).copy_(src, non_blocking=True)
                copied = self._ops.new_event()
                copied.record(self._d2h)
                if src is not grad:
                    self._hold(copied, src.numel() * 4, src)
            # The device gradient lives until its last piece is copied (one stream: in order).
            self._hold(copied, grad.numel() * grad.element_size(), grad)
        self._start_worker()
        self._queue.put((p, None, copied, grad_ready, first))

    def _hold(self, copied: Any, nbytes: int, tensor: torch.Tensor) -> None:
        """Keep ``tensor`` (read by a pending D2H copy) alive until ``copied``; then keep the
        pending bytes within the bound."""
        self._inflight.append((copied, nbytes, tensor))
        self._inflight_bytes += nbytes
        self._release_inflight(self._max_inflight_bytes)

    def _release_inflight(self, limit: int) -> None:
        """Drop the device gradients whose copies are done, waiting for the oldest ones
        while more than ``limit`` bytes are pending."""
        while self._inflight and (self._inflight_bytes > limit or self._inflight[0][0].query()):
            copied, nbytes, _refs = self._inflight.popleft()
            if not self._unsafe_skip_waits:
                copied.synchronize()  # the D2H copy must have read the block before it is reused
            self._inflight_bytes -= nbytes

    def _accumulate(self, hp: _HostParam, grad: torch.Tensor | None, first: bool) -> None:
        """Fold a gradient into ``hp.grad``. ``grad`` None: it was copied there already."""
        if grad is not None:
            if first:
                hp.grad.copy_(grad)
            else:
                hp.grad.add_(grad)
        hp.has_grad = True

    def _start_worker(self) -> None:
        if self._worker is None or not self._worker.is_alive():
            # The thread holds only a weak reference, so the optimizer (and through its
            # param_groups the model's device memory) can still be freed; the finalizer
            # then stops the thread.
            self._worker = threading.Thread(target=_worker_loop, args=(self._queue, weakref.ref(self)),
                                            name="tidal-cpu-adam", daemon=True)
            self._worker.start()
            weakref.finalize(self, self._queue.put, _STOP)

    def _work(self, items: list[tuple]) -> None:
        """Bring a batch of queued gradients into the host accumulators and, inside
        step_in_backward(), update those parameters with one fused call (one call per
        parameter would spend the CPU on call overhead instead of the update)."""
        trace = self.trace
        ready, last_grad_ready = [], None
        for p, device_refs, copied, grad_ready, first in items:
            hp = self._host[p]
            try:
                if trace is not None:
                    trace.append(("dequeued", time.perf_counter(), p.numel()))
                if not self._unsafe_skip_waits:
                    copied.synchronize()  # the bytes must be on the host before we read them
                if trace is not None:
                    trace.append(("on_host", time.perf_counter(), p.numel()))
                del device_refs  # the backward hooks hold the device gradients (see _release_inflight)
                self._accumulate(hp, None if first else hp.staging, first)
                ready.append(p)
                last_grad_ready = grad_ready
            except BaseException as e:  # surfaced by the next drain
                self._worker_error = e
            finally:
                hp.staging_free.set()
        if self._in_backward_step and ready:
            try:
                # grad_ready events are recorded in order on the compute stream: the last one
                # covers every earlier parameter of the batch.
                self._update(ready, after=last_grad_ready)
            except BaseException as e:
                self._worker_error = e
            if trace is not None:
                now = time.perf_counter()
                trace.extend(("updated", now, p.numel()) for p in ready)

    def _drain(self) -> None:
        """Wait until every queued gradient is on the host (and in-backward updates ran)."""
        if self._worker is not None and self._worker.is_alive():
            done = threading.Event()
            self._queue.put(done)
            done.wait()
        self._release_inflight(0)
        if self._worker_error is not None:
            err, self._worker_error = self._worker_error, None
            raise RuntimeError("CPUAdam's gradient worker failed; the step was not taken") from err

    def _collect_device_grads(self) -> None:
        """overlap=False: copy every ``p.grad`` to the host now (cast to fp32 on the device)."""
        pending = []
        if self._ops.is_accelerator and not self._unsafe_skip_waits:
            # Gradients were written by kernels queued on the compute stream.
            self._d2h.wait_stream(self._ops.current_stream())
        for p, hp in self._host.items():
            if p.grad is None:
                continue
            if not self._ops.is_accelerator:
                self._accumulate(hp, p.grad, not hp.has_grad)
                p.grad = None
                continue
            first = not hp.has_grad
            with self._ops.on_stream(self._d2h):
                src = p.grad.float() if first and p.grad.dtype != torch.float32 else p.grad
                (hp.grad if first else hp.staging).copy_(src, non_blocking=True)
                ev = self._ops.new_event()
                ev.record(self._d2h)
            pending.append((p, hp, ev, src, first))
        for p, hp, ev, src, first in pending:
            if not self._unsafe_skip_waits:
                ev.synchronize()  # the host reads it next
            self._accumulate(hp, None if first else hp.staging, first)
            p.grad = None
        del pending

    def grad(self, p: torch.Tensor) -> torch.Tensor | None:
        """The fp32 host gradient of ``p`` accumulated so far (None if it has none)."""
        self._drain()
        hp = self._host.get(p)
        return hp.grad if hp is not None and hp.has_grad else None

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale the host gradients so their global norm is at most ``max_norm``, like
        ``torch.nn.utils.clip_grad_norm_`` (whose ``p.grad`` would be None here). Returns the
        total norm before clipping."""
        if self._in_backward_step or any(hp.updated for hp in self._host.values()):
            raise RuntimeError(
                "clip_grad_norm_ after a backward inside step_in_backward(): the parameters were "
                "already updated with unclipped gradients. Global-norm clipping needs every "
                "gradient before the first update: run that backward without step_in_backward() "
                "(gradient copies still overlap it), then clip, then step()"
            )
        if self._ops is None:
            return torch.tensor(0.0)
        self._drain()
        if not self._overlap:
            self._collect_device_grads()
        grads = [hp.grad for hp in self._host.values() if hp.has_grad]
        if not grads:
            return torch.tensor(0.0)
        norms = torch._foreach_norm(grads, norm_type)
        total = torch.linalg.vector_norm(torch.stack(norms), norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        torch._foreach_mul_(grads, coef)
        return total

    # ---- the update --------------------------------------------------------------------------
    @contextlib.contextmanager
    def step_in_backward(self) -> Iterator[None]:
        """Within the block, each parameter is updated as soon as its gradient reaches the
        host, overlapping backward. Use it around the last micro-batch's backward only; call
        ``step()`` after it as usual (it completes and publishes the updates)."""
        if not self._overlap:
            raise ValueError("step_in_backward() needs CPUAdam(overlap=True)")
        self._drain()
        self._wait_previous_h2d()
        self._in_backward_step = True
        try:
            yield
        finally:
            self._drain()
            self._in_backward_step = False
            self._publish()

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
        self._drain()
        if not self._overlap:
            self._collect_device_grads()
        self._wait_previous_h2d()
        if self._ops is not None and self._ops.is_accelerator and not self._unsafe_skip_waits:
            # New weights must not land while queued kernels (forward/backward) still read
            # the old ones.
            self._h2d.wait_stream(self._ops.current_stream())
        todo = [p for p, hp in self._host.items() if hp.has_grad and not hp.updated]
        chunk, chunk_bytes = [], 0
        for p in todo:
            chunk.append(p)
            chunk_bytes += p.numel() * 4
            if chunk_bytes >= _CHUNK_BYTES:
                self._update(chunk)
                chunk, chunk_bytes = [], 0
        if chunk:
            self._update(chunk)
        self._publish()
        for hp in self._host.values():  # step() consumes the gradients
            hp.seen = hp.has_grad = hp.updated = False
        return loss

    def _update(self, params: list[torch.Tensor], *, after: Any = None) -> None:
        """Fused AdamW on the host for ``params``, then queue their new weights to the device
        (fp32 over PCIe, cast there: the CPU, the bottleneck, does nothing but the update)."""
        groups: dict[int, list[torch.Tensor]] = {}
        for p in params:
            groups.setdefault(id(self._group_of[p]), []).append(p)
        for ps in groups.values():
            g = self._group_of[ps[0]]
            sts = [self.state[p] for p in ps]
            steps = [s["step"] for s in sts]
            torch._foreach_add_(steps, 1)
            torch._fused_adamw_(
                [s["master"] for s in sts], [self._host[p].grad for p in ps],
                [s["exp_avg"] for s in sts], [s["exp_avg_sq"] for s in sts],
                [s["max_exp_avg_sq"] for s in sts] if g["amsgrad"] else [], steps,
                lr=float(g["lr"]), beta1=g["betas"][0], beta2=g["betas"][1], weight_decay=g["weight_decay"],
                eps=g["eps"], amsgrad=g["amsgrad"], maximize=g["maximize"],
            )
            for p, s in zip(ps, sts):
                self._host[p].updated = True
                if not self._ops.is_accelerator:
                    # detach(): this may run in the worker thread, where no_grad is not set.
                    p.detach().copy_(s["master"])
                    continue
                with self._ops.on_stream(self._h2d):
                    if after is not None and not self._unsafe_skip_waits:
                        # In backward: the kernels that read p's old value are queued before it.
                        self._h2d.wait_event(after)
                    if p.dtype == torch.float32:
                        p.detach().copy_(s["master"], non_blocking=True)
                    else:  # allocated on the H2D stream, freed in its order
                        master_dev = s["master"].to(p.device, non_blocking=True)
                        p.detach().copy_(master_dev)

    def _wait_previous_h2d(self) -> None:
        if self._h2d_done is not None and not self._unsafe_skip_waits:
            # The last step's weights are copied out of the masters we are about to rewrite.
            self._h2d_done.synchronize()

    def _publish(self) -> None:
        if self._ops is None or not self._ops.is_accelerator:
            return
        done = self._ops.new_event()
        done.record(self._h2d)
        if not self._unsafe_skip_waits:
            # Kernels queued from now on (the next forward) read the new weights.
            self._ops.current_stream().wait_event(done)
        self._h2d_done = done

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._drain()
        for p, hp in self._host.items():
            hp.seen = hp.has_grad = hp.updated = False
            p.grad = None
        super().zero_grad(set_to_none=set_to_none)

    def close(self) -> None:
        """Stop taking gradients: remove the hooks and the worker. Gradients of later
        backwards stay in ``p.grad`` as usual. Called automatically when collected."""
        self._drain()
        self._finalizer()
        self._queue.put(_STOP)
        self._worker = None

    # ---- checkpointing -----------------------------------------------------------------------
    def load_state_dict(self, state_dict: dict) -> None:
        """Load into the existing host buffers (no device memory is touched). Accepts what
        :meth:`state_dict` produced, including from another process. The model's parameters
        are not touched: load the model's own state dict for those (the fp32 master weights
        restored here are what the next step updates)."""
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"state_dict has {len(saved_groups)} param groups, this optimizer {len(self.param_groups)}")
        for i, (g, sg) in enumerate(zip(self.param_groups, saved_groups)):
            if len(g["params"]) != len(sg["params"]):
                raise ValueError(f"param group {i} has {len(g['params'])} params here but "
                                 f"{len(sg['params'])} in the state_dict")
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


def _worker_loop(work: "queue.SimpleQueue[Any]", opt_ref: "weakref.ref[CPUAdam]") -> None:
    """Gradient worker: host-side accumulation (and in-backward updates) off the autograd
    thread. It takes every gradient queued so far as one batch (up to a barrier), so it
    keeps up with backward; barriers are answered in order, so a drain sees every earlier
    item done."""
    while True:
        item = work.get()
        batch: list[tuple] = []
        while isinstance(item, tuple):
            batch.append(item)
            if sum(x[0].numel() for x in batch) * 4 >= _BATCH_BYTES:
                break
            try:
                item = work.get_nowait()
            except queue.Empty:
                item = None
        if batch:
            opt = opt_ref()
            if opt is None:
                return
            opt._work(batch)
            del opt, batch
        if item is _STOP:
            return
        if isinstance(item, threading.Event):
            item.set()


def _grad_hook(opt_ref: "weakref.ref[CPUAdam]", p: torch.Tensor) -> None:
    opt = opt_ref()
    if opt is not None:
        opt._on_grad(p)


def _remove_hooks(handles: list) -> None:
    for h in handles:
        h.remove()
    handles.clear()
