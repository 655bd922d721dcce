"""CPU Adam's gradients: :class:`HostGradients`, the part of :class:`~tidal.CPUAdam` that takes
each parameter's gradient to pinned host memory as the backward produces it (a hook per
parameter, copies bounded in flight), sums micro-batches there or on the device, and runs the
update of finished parameters on a worker thread during the backward."""

from __future__ import annotations

import functools
import queue
import threading
import time
import warnings
import weakref
from typing import Any

import torch

__all__ = ["HostGradients", "HostParam", "grad_hook"]


STOP_WORKER = object()  # queued to end the gradient worker
UPDATE_CHUNK_BYTES = 64 << 20  # fp32 master bytes per update chunk: one H2D copy overlaps the next chunk's math
_BATCH_BYTES = 512 << 20  # fp32 bytes of gradients the worker takes into one in-backward update


class HostParam:
    """Host-side buffers of one parameter."""

    __slots__ = ("grad", "staging", "seen", "has_grad", "updated", "landed", "staging_free", "done_elems")

    def __init__(self, grad: torch.Tensor, staging: torch.Tensor | None) -> None:
        self.grad = grad  # fp32 accumulated gradient (pinned: the first micro-batch lands here)
        # pinned, param dtype: later micro-batches land here, then add (None: host_accumulation off)
        self.staging = staging
        self.seen = False  # a gradient copy was queued since the last step (set by the hook)
        self.has_grad = False  # the worker has it in `grad`
        self.updated = False  # the host master holds this step's update
        self.landed = False  # the update's copy into the parameter is queued
        self.done_elems = 0  # low-precision moments: elements of this step's update applied so far
        self.staging_free = threading.Event()
        self.staging_free.set()

    def reset(self) -> None:
        self.seen = self.has_grad = self.updated = self.landed = False
        self.done_elems = 0


class HostGradients:
    """The gradient side of :class:`~tidal.CPUAdam` (a mixin; its ``__init__`` sets what these
    methods read)."""

    def _on_grad(self, p: torch.Tensor) -> None:
        """Runs in backward right after ``p.grad`` is complete for this backward."""
        if self._accumulating:
            return  # inside accumulate(): autograd keeps summing into p.grad on the device
        hp = self._host[p]
        grad = p.grad
        if grad is None:  # another hook consumed it
            return
        in_step = self._in_backward_step
        if in_step and hp.updated:
            raise RuntimeError(
                "a second backward reached a parameter already updated inside this "
                "step_in_backward() block; wrap only the last micro-batch's backward in it"
            )
        p.grad = None  # the device gradient is freed once its copy is done (we hold `grad`)
        first, hp.seen = not hp.seen, True
        if grad.numel() == 0:  # nothing to copy or update; the step just counts it
            hp.has_grad = True
            return
        if not self._ops.is_accelerator:
            try:
                self._accumulate(hp, grad, first)
            except BaseException as e:
                self._grads_lost = f"the gradient of a parameter of shape {tuple(p.shape)} was lost ({e!r})"
                raise
            if in_step:
                self._adam([p])
                self._pending.append(p)  # its weights change when the backward is over
            return
        if not first and hp.staging is None:
            # No host staging: bring this gradient over synchronously and let the worker add
            # it after the copies queued before it (it takes the queue in order).
            self._warn_sync_add()
            self._start_worker()
            self._queue.put((p, None, grad.to("cpu", torch.float32), in_step))
            return
        if not first:
            hp.staging_free.wait()  # the worker still reads the previous micro-batch's copy
            hp.staging_free.clear()
        compute = self._ops.current_stream()
        grad_ready = self._ops.new_event()
        # Marks the point where the grad is written.
        grad_ready.record(compute)
        with self._ops.on_stream(self._d2h):
            # The gradient kernels are queued on the compute stream; copy after them.
            self._ops.wait_event("grad_d2h_after_backward", self._d2h, grad_ready)
            if first and grad.dtype != torch.float32 and grad.is_contiguous():
                # Cast on the device, land in the fp32 host gradient (no CPU work), a chunk at
                # a time so a big gradient (a tied embedding) never has a whole fp32 twin.
                flat, host_flat = grad.view(-1), hp.grad.view(-1)
                step = max(1, UPDATE_CHUNK_BYTES // 4)
                for a in range(0, flat.numel(), step):
                    src = flat[a : a + step].float()
                    host_flat[a : a + step].copy_(src, non_blocking=True)
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
        self._queue.put((p, copied, first, in_step))

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
            copied, nbytes, _refs = self._inflight[0]
            # The D2H copy must have read the block before it is reused.
            self._ops.wait_host("grad_free_after_d2h", copied)
            self._inflight.popleft()
            self._inflight_bytes -= nbytes

    def _accumulate(self, hp: HostParam, grad: torch.Tensor | None, first: bool) -> None:
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
            self._worker = threading.Thread(
                target=_worker_loop, args=(self._queue, weakref.ref(self)), name="tidal-cpu-adam", daemon=True
            )
            self._worker.start()
            weakref.finalize(self, self._queue.put, STOP_WORKER)

    def _work(self, items: list[tuple]) -> None:
        """Bring a batch of queued gradients into the host accumulators and, for those queued
        inside step_in_backward(), update those parameters with one fused call (one call per
        parameter would spend the CPU on call overhead instead of the update)."""
        trace = self.trace
        ready = []
        for p, copied, first, in_step in items:
            hp = self._host[p]
            try:
                if trace is not None:
                    trace.append(("dequeued", time.perf_counter(), p.numel()))
                if copied is None:  # `first` is a host tensor copied synchronously: add it
                    self._accumulate(hp, first, False)
                else:
                    # The bytes must be on the host before we read them.
                    self._ops.wait_host("grad_host_read_after_d2h", copied)
                    self._accumulate(hp, None if first else hp.staging, first)
                if trace is not None:
                    trace.append(("on_host", time.perf_counter(), p.numel()))
                if in_step:
                    ready.append(p)
            except BaseException as e:  # surfaced by the next drain
                self._worker_error = e
                self._grads_lost = f"the gradient of a parameter of shape {tuple(p.shape)} was lost ({e!r})"
            finally:
                hp.staging_free.set()
        if ready:
            try:
                self._adam(ready)
            except BaseException as e:
                self._worker_error = e
                return
            if self._backward_done is not None:
                self._land(ready, after=self._backward_done)
            else:
                self._pending.extend(ready)
            if trace is not None:
                now = time.perf_counter()
                trace.extend(("updated", now, p.numel()) for p in ready)

    def _backward_over(self, done: Any) -> None:
        """Worker side of the end of a step_in_backward() backward: copy the weights updated
        so far, and from now on each right after its update."""
        self._backward_done = done
        pending, self._pending = self._pending, []
        try:
            self._land(pending, after=done)
        except BaseException as e:
            self._pending = pending + self._pending
            self._worker_error = e

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

    def _warn_sync_add(self) -> None:
        if not self._warned_sync_add:
            self._warned_sync_add = True
            warnings.warn(
                "CPUAdam(host_accumulation=False) got a second gradient of a parameter in one step; "
                "with no host staging it is copied and added synchronously (slow). Run every "
                "micro-batch's backward but the last inside `with optimizer.accumulate():` to sum "
                "them on the device, or build CPUAdam(host_accumulation=True)",
                stacklevel=4,
            )

    def _collect_device_grads(self) -> None:
        """Copy every ``p.grad`` still on the device to the host now (cast to fp32 on the
        device): all of them with ``overlap=False``; with it, those summed inside
        :meth:`accumulate` that no later backward sent."""
        pending = []
        with_grad = [(p, hp) for p, hp in self._host.items() if p.grad is not None]
        if not with_grad:
            return  # the usual case with overlap=True: every gradient left during backward
        if self._ops.is_accelerator:
            # Gradients were written by kernels queued on the compute stream.
            self._ops.wait_stream("grads_d2h_after_compute", self._d2h, self._ops.current_stream())
        for p, hp in with_grad:
            if not self._ops.is_accelerator:
                self._accumulate(hp, p.grad, not hp.has_grad)
                p.grad = None
                continue
            first = not hp.has_grad
            if not first and hp.staging is None:
                self._warn_sync_add()
                with self._ops.on_stream(self._d2h):
                    hp.grad.add_(p.grad.to("cpu", torch.float32))  # synchronous on the D2H stream
                p.grad = None
                continue
            with self._ops.on_stream(self._d2h):
                src = p.grad.float() if first and p.grad.dtype != torch.float32 else p.grad
                (hp.grad if first else hp.staging).copy_(src, non_blocking=True)
                ev = self._ops.new_event()
                ev.record(self._d2h)
            pending.append((p, hp, ev, src, first))
        for p, hp, ev, src, first in pending:
            self._ops.wait_host("grads_host_read_after_d2h", ev)  # the host reads it next
            self._accumulate(hp, None if first else hp.staging, first)
            p.grad = None
        del pending

    def grad(self, p: torch.Tensor) -> torch.Tensor | None:
        """The fp32 host gradient of ``p`` accumulated so far (None if it has none)."""
        self._drain()
        if self._ops is not None:
            self._collect_device_grads()
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
        self._collect_device_grads()  # overlap=False, or sums left on the device by accumulate()
        grads = [hp.grad for hp in self._host.values() if hp.has_grad]
        if not grads:
            return torch.tensor(0.0)
        norms = torch._foreach_norm(grads, norm_type)
        total = torch.linalg.vector_norm(torch.stack(norms), norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        torch._foreach_mul_(grads, coef)
        return total


def _worker_loop(work: "queue.SimpleQueue[Any]", opt_ref: "weakref.ref[HostGradients]") -> None:
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
        if item is STOP_WORKER:
            return
        if isinstance(item, functools.partial):  # the end of a step_in_backward() backward
            item()
        elif isinstance(item, threading.Event):
            item.set()


def grad_hook(opt_ref: "weakref.ref[HostGradients]", p: torch.Tensor) -> None:
    opt = opt_ref()
    if opt is not None:
        opt._on_grad(p)
