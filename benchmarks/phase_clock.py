"""How long each phase of a TRL step took on the device, without synchronising anything.

:class:`PhaseClock` wraps a trainer's phase methods (generation, the policy's and the
reference's log-probabilities, rewards, the loss forward, the backward, gradient clipping, the
optimizer step) so that each call records a timing event on the current stream at its entry
and at its exit; :meth:`PhaseClock.take`, called once the step's work has run (after the
bench's own synchronisation at the step's end), reads each pair's elapsed time. A phase called
inside another (the policy's log-probabilities inside the loss) counts for the outer one only.
Without CUDA the host's clock is read instead. The same wrapping serves TRL alone and tidal's
trainers, so their phases compare one to one; tidal's transitions count inside the phase that
runs them.

Used by ``bench_trl.py`` for every variant (the JSON's ``phase_s``).
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable

__all__ = ["PhaseClock"]


class PhaseClock:
    """Per-phase device seconds of each step (``cuda``: timing events; else host seconds)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self._open = 0  # phases running now: only the outermost is timed
        self._pairs: list[tuple[str, Any, Any]] = []

    def wrap(self, obj: Any, attr: str, label: str | Callable[..., str]) -> None:
        """Time ``obj.attr`` under ``label`` (or ``label(*args)``, chosen per call)."""
        fn = getattr(obj, attr, None)
        if fn is None or getattr(fn, "_phase_clock", False):
            return

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if self._open:
                return fn(*args, **kwargs)
            name = label(*args) if callable(label) else label
            start = self._mark()
            self._open += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._open -= 1
                self._pairs.append((name, start, self._mark()))

        timed._phase_clock = True
        setattr(obj, attr, timed)

    def _mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def take(self) -> dict[str, float]:
        """The seconds of each phase since the last call (the step's work must have run)."""
        out: dict[str, float] = {}
        for name, start, end in self._pairs:
            seconds = start.elapsed_time(end) / 1e3 if self.cuda else end - start
            out[name] = out.get(name, 0.0) + seconds
        self._pairs.clear()
        return out

    def wrap_trainer(self, trainer: Any) -> None:
        """The phases of a TRL ``GRPOTrainer`` (or a subclass), except the optimizer step,
        which exists once training has started (:meth:`wrap_optimizer`)."""
        ref = getattr(trainer, "ref_model", None)
        self.wrap(
            trainer,
            "_get_per_token_logps_and_entropies",
            lambda model, *a: "reference" if ref is not None and model is ref else "score",
        )
        self.wrap(trainer, "_generate", "generate")
        self.wrap(trainer, "_calculate_rewards", "reward")
        self.wrap(trainer, "compute_loss", "loss_forward")
        self.wrap(trainer.accelerator, "backward", "backward")
        self.wrap(trainer, "_clip_grad_norm", "clip")

    def wrap_optimizer(self, trainer: Any) -> None:
        if getattr(trainer, "optimizer", None) is not None:
            self.wrap(trainer.optimizer, "step", "optimizer")


class TokenGaps:
    """The host's time between the policy's forwards inside generation: one per generated token
    (the prefill first), so a token that waited (for a copy queued ahead of its ``.item()``, say)
    shows as one long gap beside the usual ones, within one process, whatever the process's own
    speed. :meth:`wrap_trainer` hooks a TRL trainer's ``_generate`` and its policy's forward;
    :meth:`take` returns the gaps since the last call, summarised."""

    def __init__(self) -> None:
        self._active = 0
        self._times: list[float] = []
        self._gaps: list[float] = []

    def wrap_trainer(self, trainer: Any) -> None:
        fn = trainer._generate

        @functools.wraps(fn)
        def generating(*args, **kwargs):
            self._active += 1
            self._times = []
            try:
                return fn(*args, **kwargs)
            finally:
                self._active -= 1
                self._gaps += [b - a for a, b in zip(self._times, self._times[1:])]

        trainer._generate = generating
        model = trainer.accelerator.unwrap_model(trainer.model)
        model.register_forward_pre_hook(self._forward)

    def _forward(self, module: Any, args: Any) -> None:
        if self._active:
            self._times.append(time.perf_counter())

    def take(self) -> dict[str, float] | None:
        """``longest``, ``median`` and ``count`` of the gaps since the last call (None if there
        were none), and ``excess``: the time of the gaps beyond twice the median."""
        gaps, self._gaps = self._gaps, []
        if not gaps:
            return None
        med = sorted(gaps)[len(gaps) // 2]
        return {
            "longest": max(gaps),
            "median": med,
            "count": len(gaps),
            "excess": sum(g - 2 * med for g in gaps if g > 2 * med),
        }
