"""Where the host's time goes inside tidal's transitions: a sampler of one thread's Python stack.

A daemon thread reads the watched thread's frame every ``interval_s`` (``sys._current_frames``)
and, when one of the frames on its stack is a timeshare verb (a function of ``tidal/timeshare``
named in ``VERBS``), counts the sample under (verb, the innermost frame in tidal, the innermost
frame of all). A C call that releases the GIL (a driver call through ctypes, a stream or event
synchronisation) is sampled where Python made it, so the innermost frame names the call the
host blocked in. A sample counts ``interval_s`` of host time: the figures are estimates, good
to a few samples.

Used by ``bench_trl.py --sample-stacks``; costs the watched thread a GIL hand-over per sample.
"""

from __future__ import annotations

import collections
import os
import sys
import threading

__all__ = ["StackSampler", "VERBS"]

# The timeshare's verbs whose host time the TRL integration pays (see tidal/timeshare).
VERBS = frozenset(
    {
        "use",
        "load",
        "offload",
        "prefetch",
        "prefetch_optimizer",
        "streamed_step",
        "step_pre",
        "post",
        "reload_optimizer_state",
        "offload_optimizer_state",
    }
)


def _package_dir() -> str:
    """The directory of the tidal package imported here (a checkout may itself be named tidal:
    a path's last "/tidal/" is not enough to tell the package's files)."""
    import tidal

    return os.path.dirname(os.path.abspath(tidal.__file__)) + os.sep


_TIDAL = _package_dir()
_SHORT: dict[str, str | None] = {}  # a code file's path -> its path inside tidal (None: not tidal's)


def _in_package(path: str) -> str | None:
    """``tidal/...`` for a file of the tidal package, else None (cached per path)."""
    short = _SHORT.get(path, "")
    if short == "":
        full = os.path.abspath(path)
        short = "tidal" + os.sep + full[len(_TIDAL) :] if full.startswith(_TIDAL) else None
        _SHORT[path] = short
    return short


def _where(frame) -> str:
    code = frame.f_code
    short = _in_package(code.co_filename) or os.path.basename(code.co_filename)
    return f"{short}:{frame.f_lineno} {code.co_name}"


class StackSampler:
    """Samples ``thread_id``'s stack (default: the thread that makes the sampler) while started.

    ``counts`` maps (verb, innermost tidal frame, innermost frame) to the number of samples;
    :meth:`top` gives the heaviest as seconds."""

    def __init__(self, thread_id: int | None = None, *, interval_s: float = 0.002) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.thread_id = threading.get_ident() if thread_id is None else thread_id
        self.interval_s = interval_s
        self.counts: collections.Counter = collections.Counter()
        self.samples = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the sampler is running already")
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            frame = sys._current_frames().get(self.thread_id)
            if frame is None:
                continue
            self.samples += 1
            leaf = _where(frame)
            inner_tidal, verb = None, None
            f = frame
            while f is not None:
                path = f.f_code.co_filename
                if _in_package(path) is not None:
                    if inner_tidal is None:
                        inner_tidal = _where(f)
                    if f.f_code.co_name in VERBS and (os.sep + "timeshare" + os.sep) in path:
                        verb = f.f_code.co_name  # the outermost one wins: keep walking
                f = f.f_back
            if verb is not None:
                self.counts[(verb, inner_tidal, leaf)] += 1

    def top(self, n: int = 12) -> list[dict]:
        """The ``n`` heaviest (verb, tidal frame, innermost frame) with their estimated seconds."""
        return [
            {"verb": v, "tidal_frame": t, "frame": leaf, "samples": c, "seconds": round(c * self.interval_s, 4)}
            for (v, t, leaf), c in self.counts.most_common(n)
        ]

    def by_verb(self) -> dict[str, float]:
        """Estimated host seconds per verb."""
        out: dict[str, float] = collections.defaultdict(float)
        for (v, _, _), c in self.counts.items():
            out[v] += c * self.interval_s
        return {k: round(x, 4) for k, x in sorted(out.items(), key=lambda kv: -kv[1])}
