"""DistributedDataParallel's gradient buckets held only while there are gradients.

DDP's reducer allocates, when the wrapper is built, flat bucket buffers as large as every
gradient together, and keeps them for the wrapper's life: the gradients are copied into them,
all-reduced there and (by default) copied back. With ``gradient_as_bucket_view=True`` each
parameter's ``.grad`` *is* a view of them from the first backward on (the same bits: the
reducer's ops on the values do not change), so DDP costs no second copy of the gradients.
But once ``zero_grad(set_to_none=True)`` drops the gradients (what ``transformers.Trainer``
does after every step), the buffers stay allocated and nothing in Python reaches them: a whole
gradient's worth of device memory held through generation and scoring, which no timeshare
role can move because no tensor of a role views it.

:class:`GradientBuckets` takes note of the buffers while the gradients view them, frees them
(:meth:`GradientBuckets.release`) while every gradient is ``None`` (their bytes are dead then:
the reducer writes every bucket view, or zeroes it for an unused parameter, before it reduces),
and gives them memory again (uninitialised) as soon as a forward with grad enabled returns
through the wrapper, before the backward that writes them. A released buffer keeps its size
and is guarded (:mod:`tidal.guard`): code that reads it anyway gets a clear error, not a crash.

DDP rebuilds its buckets once, in the second iteration's forward (unless
``find_unused_parameters=True``, which ``transformers.Trainer`` sets by default): the buffers
noted before then are dropped there, and the new ones are noted after the next backward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from tidal import guard

__all__ = ["GradientBuckets"]

_RELEASED = (
    b"tidal: this is one of DistributedDataParallel's gradient buckets, released by "
    b"tidal.distributed.GradientBuckets while every gradient is None (its bytes were dead). It gets memory "
    b"again when a forward with grad enabled returns through the DDP wrapper; code that reads DDP's buckets "
    b"between steps must call GradientBuckets.restore() first"
)


class GradientBuckets:
    """Frees a DDP wrapper's gradient buckets between steps (see the module docstring).

    Memory cost: none on the host; on the device it gives back, between
    ``zero_grad(set_to_none=True)`` and the next forward with grad enabled, as many bytes as
    the trained parameters hold (in their dtype), from the second step on (the first step's
    buffers are noted at its first ``optimizer.step()``).

    Call :meth:`note` where the gradients of a reduced backward exist (before an optimizer
    step: :meth:`watch` installs that as a step pre-hook), :meth:`release` where they may be
    ``None`` (the start of a phase that does not train). :meth:`close` removes the hooks and
    gives released buffers their memory back.

    Raises:
        TypeError: ``ddp`` is not a ``DistributedDataParallel``.
        ValueError: it was built without ``gradient_as_bucket_view=True`` (its buffers are
            then never reachable from Python).
    """

    def __init__(self, ddp: DistributedDataParallel) -> None:
        if not isinstance(ddp, DistributedDataParallel):
            raise TypeError(f"GradientBuckets needs a DistributedDataParallel, got {type(ddp).__name__}")
        if not ddp.gradient_as_bucket_view:
            raise ValueError(
                "GradientBuckets needs DistributedDataParallel(..., gradient_as_bucket_view=True): without it "
                "the gradients are copies and DDP's buckets are reachable from no tensor. Build the wrapper with "
                "gradient_as_bucket_view=True (the same results; one copy of the gradients less)"
            )
        self._ddp = ddp
        self._params = [p for p in ddp.module.parameters() if p.requires_grad]
        self._buffers: dict[int, tuple[torch.Tensor, int]] = {}  # storage key -> (a view of it, its bytes)
        self._released = False
        self._rebuilt = bool(getattr(ddp, "_has_rebuilt_buckets", False))
        self._handles: list[Any] = [ddp.register_forward_hook(self._after_forward)]

    @property
    def noted_bytes(self) -> int:
        """The bytes of the buffers noted (released or not)."""
        return sum(n for _, n in self._buffers.values())

    @property
    def released(self) -> bool:
        """Whether the noted buffers are released now."""
        return self._released

    def watch(self, optimizer: torch.optim.Optimizer) -> None:
        """Note the buffers before every ``optimizer.step()`` (the gradients of the reduced
        backward view them then)."""
        self._handles.append(optimizer.register_step_pre_hook(lambda *_: self.note()))

    def note(self) -> None:
        """Take note of the buffers the gradients view now: the flat 1-D tensors the
        reducer made them views of (a plain gradient, inside an accumulation before the
        reducer has run, views nothing and is not noted)."""
        if self._released:
            return
        for p in self._params:
            g = p.grad
            base = None if g is None else g._base
            if base is not None and base.dim() == 1:
                key = base.untyped_storage()._cdata
                if key not in self._buffers:
                    self._buffers[key] = (base, base.untyped_storage().nbytes())

    def release(self) -> int:
        """Free the noted buffers if every gradient is ``None``; returns the bytes freed (0
        where a gradient exists, or nothing is noted or everything is released already)."""
        if self._released or not self._buffers or any(p.grad is not None for p in self._params):
            return 0
        # Marked first: interrupted part-way (any exception, KeyboardInterrupt included), the
        # next restore() gives memory back to every buffer, released or not (it skips none).
        self._released = True
        freed = 0
        for t, nbytes in self._buffers.values():
            guard.release(t.untyped_storage(), _RELEASED)
            freed += nbytes
        return freed

    def restore(self) -> None:
        """Give the released buffers memory again (their bytes undefined: the reducer writes
        them before it reads them)."""
        if not self._released:
            return
        for t, nbytes in self._buffers.values():
            storage = t.untyped_storage()
            # Both a no-op for a buffer that has its memory (a release or restore interrupted
            # part-way): cleared only once every buffer has it, so a retry covers the rest.
            guard.unseal(storage, empty=True)
            storage.resize_(nbytes)
        self._released = False

    def _after_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        # After DDP's own pre-forward (where it may rebuild its buckets), before the backward
        # that writes them.
        if not torch.is_grad_enabled():
            return
        if not self._rebuilt and getattr(self._ddp, "_has_rebuilt_buckets", False):
            # The reducer dropped the buffers noted so far and allocated new ones (noted after
            # this backward): the old ones go with their last references, ours.
            self._rebuilt = True
            for t, _ in self._buffers.values():
                guard.unseal(t.untyped_storage(), empty=True)
            self._buffers.clear()
            self._released = False
            return
        self.restore()

    def close(self) -> None:
        """Remove the hooks and give released buffers their memory back."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.restore()

    def __iter__(self):
        """The noted buffers (flat 1-D tensors)."""
        return iter([t for t, _ in self._buffers.values()])
