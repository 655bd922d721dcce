"""A phase of a TRL step as a ``with`` block: :class:`Phase` (its role on the device, where its
peak memory is attributed), and :func:`at_first_forward` (work started once a block's first
module forward runs)."""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Protocol

import torch

from tidal.integrations.trl.memory import PhaseMemory

__all__ = ["Phase", "PhaseOwner", "at_first_forward", "instead"]


@contextlib.contextmanager
def at_first_forward(fn: Callable[[], None]):
    """Run ``fn`` as the first module forward inside the block starts (by then the inputs the
    block prepared are on the device), or as the block ends if no module ran; not if it raised.

    A process-wide forward pre-hook (any module: a PEFT wrapper's generate() calls its base
    model's forward, not its own), removed when it fires: no cost for the rest of the block."""
    fired = False
    owner = threading.get_ident()  # another thread's modules do not start this block's work

    def hook(module, args):
        nonlocal fired
        if fired or threading.get_ident() != owner:
            return
        fired = True
        handle.remove()
        fn()

    handle = torch.nn.modules.module.register_module_forward_pre_hook(hook)
    try:
        yield
    finally:
        handle.remove()
    if not fired:
        fired = True
        fn()


@contextlib.contextmanager
def instead(obj: Any, name: str, value: Any):
    """``obj.name`` is ``value`` (an attribute of the instance) through the block; then what
    the instance had of its own under that name again, or none."""
    own = vars(obj).get(name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if own is None:
            delattr(obj, name)
        else:
            setattr(obj, name, own)


class PhaseOwner(Protocol):
    """What a :class:`Phase` reads and counts of the trainer it belongs to."""

    timeshare: Any  # the trainer's tidal.Timeshare
    _tidal_depth: int  # phases open now
    _tidal_memory: PhaseMemory | None  # the phases' readings (None off an accelerator)


class Phase:
    """``with``: the role resident for the block. The outermost phase also marks where the
    device's peak is attributed: from its start until the next outermost phase starts (so the
    loss phase's peak includes the backward and the optimizer step that follow it)."""

    def __init__(
        self, trainer: PhaseOwner, role: str | None, phase: str, *, keep_free_bytes: int | None = None
    ) -> None:
        self.trainer, self.role, self.phase = trainer, role, phase
        self.keep_free_bytes = keep_free_bytes
        self._ctx = None

    def __enter__(self) -> None:
        tr = self.trainer
        outermost = tr._tidal_depth == 0 and tr._tidal_memory is not None
        if outermost:
            tr._tidal_memory.start(self.phase)
        tr._tidal_depth += 1
        if self.role is not None:
            self._ctx = tr.timeshare.use(self.role, keep_free_bytes=self.keep_free_bytes)
            try:
                self._ctx.__enter__()
            except BaseException:
                tr._tidal_depth -= 1
                raise
            if outermost:
                # The phase's need is what it allocates beside what its switch left: the loss's
                # activations fill the room of the reference its switch dropped (read from before
                # the switch, they counted as nothing, and the next loss kept the reference where
                # they did not fit: out of memory at 7B 64 x 256 on an H100, 2026-11-26).
                tr._tidal_memory.rebase()

    def __exit__(self, *exc) -> None:
        self.trainer._tidal_depth -= 1
        if self._ctx is not None:
            self._ctx.__exit__(*exc)
