"""Work started once a block's first module forward runs (:func:`at_first_forward`). A phase of
a TRL step as a ``with`` block is the library's
:meth:`tidal.timeshare.schedule.PhaseSchedule.phase`."""

from __future__ import annotations

import contextlib
import threading
from typing import Callable

import torch

__all__ = ["at_first_forward"]


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
