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
import statistics
import time
from typing import Any, Callable

__all__ = ["HostProbe", "PhaseClock", "TokenGaps"]


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


class HostProbe:
    """The host's speed at queueing device work, read beside each generation: seconds per op of
    a fixed loop (``rounds`` of ``ops`` in-place adds on a one-element tensor of the device, each
    round then waited for), the median round. A host-bound decode (each token's forward takes
    as long on the device as the host takes to queue it) costs in proportion to it, so a
    generation's time over the probe's reading beside it compares runs whose host ran at
    different speeds (the host's per-token time drifted 2.2x within one process on an H100
    machine, 2026-11-27). About ``rounds * ops`` launches a reading (1000: a few ms)."""

    def __init__(self, device: Any = "cpu", *, ops: int = 200, rounds: int = 5) -> None:
        import torch

        self.x = torch.zeros(1, device=device)
        self.ops, self.rounds = ops, rounds
        self.cuda = self.x.is_cuda

    def read(self) -> float:
        import torch

        times = []
        for _ in range(self.rounds):
            t = time.perf_counter()
            for _ in range(self.ops):
                self.x.add_(1.0)
            if self.cuda:
                torch.cuda.current_stream(self.x.device).synchronize()  # the round's ops have run
            times.append((time.perf_counter() - t) / self.ops)
        return statistics.median(times)


class TokenGaps:
    """The host's time between the policy's forwards inside generation: one per generated token
    (the prefill first), so a token that waited (for a copy queued ahead of its ``.item()``, say)
    shows as one long gap beside the usual ones, within one process, whatever the process's own
    speed. :meth:`wrap_trainer` hooks a TRL trainer's ``_generate`` and its policy's forward;
    :meth:`take` returns the gaps since the last call, summarised.

    Each token's gap splits into the host's time inside the policy's forward (``launch``:
    queueing its kernels) and after it (sampling, and the ``.item()`` that waits for the
    device); with ``cuda``, timing events at the forward's two ends also give the device's time
    from one forward's start to the next (``device``) and inside the forward (``device_forward``).
    A token slower on the host alone shows in ``launch``; one slower on the device in
    ``device_forward`` with ``launch`` unchanged."""

    def __init__(self, cuda: bool = False, probe: "HostProbe | None" = None) -> None:
        self.cuda = cuda
        self.probe = probe  # read before and after each generate() call (``probe``: their mean)
        self._probes: list[float] = []
        self._active = 0
        self._open: tuple[float, Any] | None = None  # the forward running now: host time, event
        self._marks: list[tuple[float, float, Any, Any]] = []  # per forward: host start, end; events
        self._done: list[list[tuple[float, float, Any, Any]]] = []  # per generate() call

    def wrap_trainer(self, trainer: Any) -> None:
        fn = trainer._generate

        @functools.wraps(fn)
        def generating(*args, **kwargs):
            before = self.probe.read() if self.probe is not None and not self._active else None
            self._active += 1
            self._marks, self._open = [], None
            try:
                return fn(*args, **kwargs)
            finally:
                self._active -= 1
                self._done.append(self._marks)
                self._marks = []
                if before is not None:
                    self._probes.append((before + self.probe.read()) / 2)

        trainer._generate = generating
        model = trainer.accelerator.unwrap_model(trainer.model)
        model.register_forward_pre_hook(self._forward)
        model.register_forward_hook(self._forward_end)

    def _event(self) -> Any:
        if not self.cuda:
            return None
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _forward(self, module: Any, args: Any) -> None:
        if self._active:
            self._open = (time.perf_counter(), self._event())

    def _forward_end(self, module: Any, args: Any, out: Any) -> None:
        if self._active and self._open is not None:
            start, event = self._open
            self._marks.append((start, time.perf_counter(), event, self._event()))
            self._open = None

    def take(self) -> dict[str, float] | None:
        """``longest``, ``median`` and ``count`` of the gaps since the last call (None if there
        were none), ``excess``: the time of the gaps beyond twice the median, and the medians of
        ``launch`` (host) and, with ``cuda``, ``device`` and ``device_forward`` (see the class;
        the device's work must have run); with a ``probe``, ``probe``: its reading beside the
        calls (the median of each call's mean of before and after)."""
        calls, self._done = self._done, []
        probes, self._probes = self._probes, []
        gaps: list[float] = []
        launch: list[float] = []
        device: list[float] = []
        device_forward: list[float] = []
        for marks in calls:
            gaps += [b[0] - a[0] for a, b in zip(marks, marks[1:])]
            launch += [m[1] - m[0] for m in marks]
            if self.cuda:
                device += [a[2].elapsed_time(b[2]) / 1e3 for a, b in zip(marks, marks[1:])]
                device_forward += [m[2].elapsed_time(m[3]) / 1e3 for m in marks]
        if not gaps:
            return None
        med = statistics.median(gaps)
        out = {
            "longest": max(gaps),
            "median": med,
            "count": len(gaps),
            "excess": sum(g - 2 * med for g in gaps if g > 2 * med),
            "total": sum(gaps),
            "launch": statistics.median(launch),
        }
        if device:
            out["device"] = statistics.median(device)
            out["device_forward"] = statistics.median(device_forward)
        if probes:
            out["probe"] = statistics.median(probes)
        return out
