"""A memory timeline: samples of device memory over a run, with named phases and marks,
written as JSONL and drawn as a PNG.

On an accelerator a sample holds the allocator's allocated and reserved bytes and the
driver-level used bytes (``total - free`` from the driver, which is what another process
sees). On the CPU there is no device memory to ask, so a sample holds what the caller's
``state_bytes`` callable reports (tidal's trainer counts the bytes of role state held in
device storages), which still shows roles moving out and in.

Sampling is explicit (``sample()`` at points the caller chooses) so it costs nothing between
samples and never races the run; ``phase()`` samples at its start and end and keeps each
phase's allocator peak.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from typing import Callable, Iterator

from tidal.device import DeviceOps

__all__ = ["MemoryTimeline", "PhaseSpan"]


@dataclasses.dataclass(kw_only=True)
class PhaseSpan:
    """One phase: its name, start and end (seconds from the timeline's start), and the
    highest allocated bytes seen in it (the allocator's own peak on an accelerator)."""

    name: str
    start_s: float
    end_s: float = 0.0
    peak_allocated_bytes: int = 0
    peak_driver_used_bytes: int = 0
    step: int = -1
    error: str | None = None  # the exception that ended it, if one did


class MemoryTimeline:
    """Records memory samples, phases and marks (transitions) of one run.

    Args:
        ops: the device whose memory is sampled.
        state_bytes: on the CPU, a callable returning the bytes to plot as "allocated".
    """

    def __init__(self, ops: DeviceOps, *, state_bytes: Callable[[], int] | None = None) -> None:
        self.ops = ops
        self._state_bytes = state_bytes
        self._t0 = time.perf_counter()
        self.samples: list[dict] = []
        self.phases: list[PhaseSpan] = []
        self.marks: list[dict] = []
        self._open: PhaseSpan | None = None
        # The device's memory, drawn as a line where set (the demo sets it on an accelerator).
        self.capacity_bytes: int | None = None

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def sample(self, label: str = "") -> dict:
        """Take one sample now (no device synchronisation: allocator counters are host-side)."""
        s = {"t": self.now(), "label": label, "allocated": self._allocated()}
        if self.ops.is_accelerator:
            free, total = self.ops.driver_free_bytes()
            s["reserved"] = self.ops.reserved_bytes()
            s["driver_used"] = total - free
        self.samples.append(s)
        if self._open is not None:
            self._open.peak_allocated_bytes = max(self._open.peak_allocated_bytes, s["allocated"])
            self._open.peak_driver_used_bytes = max(self._open.peak_driver_used_bytes, s.get("driver_used", 0))
        return s

    def mark(self, label: str, **fields) -> None:
        """A point event (a transition), drawn as a vertical line."""
        self.marks.append({"t": self.now(), "label": label, **fields})

    def out_of_memory(self, error: BaseException, **fields) -> None:
        """Mark where the run ran out of device memory (the open phase, if any, is named), drawn
        as a cross at the top of the memory panel. Takes a last sample first."""
        self.sample("out of memory")
        phase = self._open.name if self._open is not None else None
        if phase is None and self.phases and self.phases[-1].error:  # the phase it ended
            phase = self.phases[-1].name
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        self.marks.append(
            {"t": self.now(), "label": "out of memory", "kind": "oom", "phase": phase, "error": first, **fields}
        )

    @contextlib.contextmanager
    def phase(self, name: str, *, step: int = -1) -> Iterator[PhaseSpan]:
        """Time a phase and keep its peak. On an accelerator the allocator's peak counter is
        reset at the start, so the peak includes moments between samples."""
        if self._open is not None:
            raise RuntimeError(f"phase {name!r} started inside phase {self._open.name!r}; phases do not nest")
        span = PhaseSpan(name=name, start_s=self.now(), step=step)
        if self.ops.is_accelerator:
            self.ops.synchronize()  # the peak must not include the previous phase's queued work
            self.ops.reset_peak()
        self._open = span
        self.sample(f"{name} start")
        try:
            yield span
        except BaseException as e:
            span.error = type(e).__name__
            raise
        finally:
            if self.ops.is_accelerator:
                self.ops.synchronize()  # the phase's time and peak include its queued kernels
                span.peak_allocated_bytes = max(span.peak_allocated_bytes, self.ops.peak_allocated_bytes())
            self.sample(f"{name} end")
            span.end_s = self.now()
            self._open = None
            self.phases.append(span)

    def _allocated(self) -> int:
        if self.ops.is_accelerator:
            return self.ops.allocated_bytes()
        return self._state_bytes() if self._state_bytes is not None else 0

    @classmethod
    def merge(cls, ops: DeviceOps, dumps: dict[str, dict]) -> "MemoryTimeline":
        """One timeline from the timelines of several processes on one host and device
        (``{"t0": absolute perf_counter start, "samples", "phases", "marks"}`` each, as the
        role workers report them). ``allocated`` becomes the sum over the processes of each
        one's latest sample (each allocator sees only its own process); ``driver_used`` is
        the device's, whichever process read it."""
        tl = cls(ops)
        t0 = min(d["t0"] for d in dumps.values())
        tl._t0 = t0
        events = sorted(
            ((d["t0"] - t0 + s["t"], name, s) for name, d in dumps.items() for s in d["samples"]), key=lambda e: e[0]
        )
        latest: dict[str, int] = {}
        for t, name, s in events:
            latest[name] = s["allocated"]
            tl.samples.append({**s, "t": t, "allocated": sum(latest.values()), "process": name})
        for name, d in dumps.items():
            shift = d["t0"] - t0
            for p in d["phases"]:
                tl.phases.append(PhaseSpan(**{**p, "start_s": p["start_s"] + shift, "end_s": p["end_s"] + shift}))
            for m in d["marks"]:
                tl.marks.append({**m, "t": m["t"] + shift, "label": f"{name}: {m['label']}"})
        tl.phases.sort(key=lambda p: p.start_s)
        tl.marks.sort(key=lambda m: m["t"])
        return tl

    # ---- output -----------------------------------------------------------------------------
    def write_jsonl(self, path: str, *, extra: list[dict] = ()) -> None:
        """One JSON object a line: ``{"type": "sample"|"phase"|"mark"|..., ...}``."""
        with open(path, "w") as f:
            for s in self.samples:
                f.write(json.dumps({"type": "sample", **s}) + "\n")
            for p in self.phases:
                f.write(json.dumps({"type": "phase", **dataclasses.asdict(p)}) + "\n")
            for m in self.marks:
                f.write(json.dumps({"type": "mark", **m}, default=str) + "\n")
            for e in extra:
                f.write(json.dumps(e, default=str) + "\n")

    def plot(
        self,
        path: str,
        *,
        title: str = "",
        last_steps: int = 3,
        rewards: list[float] | None = None,
        beside: list[tuple[str, "MemoryTimeline"]] = (),
    ) -> None:
        """Draw the timeline to a PNG (needs matplotlib: ``pip install tidal[demo]``).

        The top panel shows memory over the last ``last_steps`` steps (phases shaded,
        transitions as dotted lines), so each phase is readable however long the run; with
        ``rewards`` (one per step) a bottom panel shows the reward over the whole run.
        ``beside``: other runs, as ``(title, timeline)``, drawn to the right on the same memory
        scale (the demo puts the same loop with every role resident there).
        """
        try:
            import matplotlib  # noqa: PLC0415 (optional dependency)

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt  # noqa: PLC0415
        except ImportError as e:
            raise ImportError("the memory timeline PNG needs matplotlib: pip install 'tidal[demo]'") from e
        runs = [(title or f"device memory on {self.ops.device}", self), *beside]
        windows = [tl._window(last_steps) for _, tl in runs]
        peak = max([w[3] for w in windows] + [tl.capacity_bytes or 0 for _, tl in runs])
        unit, scale = ("GiB", float(1 << 30)) if peak >= 1 << 30 else ("MiB", float(1 << 20))
        rows, cols = (2 if rewards else 1), len(runs)
        fig = plt.figure(figsize=(11 if cols == 1 else 7.5 * cols, 3.6 * rows), dpi=110)
        grid = fig.add_gridspec(rows, cols)
        for c, ((name, tl), window) in enumerate(zip(runs, windows)):
            ax = fig.add_subplot(grid[0, c])
            tl._draw_memory(ax, window, unit=unit, scale=scale, ymax=peak / scale * 1.25)
            ax.set_title(name, fontsize=10)
        if rewards:
            ax2 = fig.add_subplot(grid[1, :])
            ax2.plot(range(len(rewards)), rewards, color="#2a9d8f", lw=1.2)
            ax2.set_xlabel("step")
            ax2.set_ylabel("mean reward")
            ax2.set_ylim(0, 1.05)
            ax2.grid(alpha=0.25)
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)

    def _window(self, last_steps: int) -> tuple[list[PhaseSpan], list[dict], tuple[float, float], int, int]:
        """The phases and samples of the last ``last_steps`` steps, their time span, their
        highest memory reading and how many steps they cover."""
        steps = sorted({p.step for p in self.phases})
        shown = set(steps[-last_steps:]) if last_steps > 0 else set(steps)
        phases = [p for p in self.phases if p.step in shown]
        t_lo = min((p.start_s for p in phases), default=0.0)
        t_hi = max((p.end_s for p in phases), default=self.now())
        t_hi = max([t_hi] + [m["t"] for m in self.marks if m.get("kind") == "oom"])  # a run that failed: to its end
        samples = [x for x in self.samples if t_lo <= x["t"] <= t_hi]
        peak = max([x["allocated"] for x in samples] + [x.get("driver_used", 0) for x in samples] + [1])
        return phases, samples, (t_lo, t_hi), peak, len(shown)

    def _draw_memory(self, ax, window, *, unit: str, scale: float, ymax: float) -> None:
        from matplotlib.patches import Patch  # noqa: PLC0415 (optional dependency)

        phases, samples, (t_lo, t_hi), _peak, n_steps = window
        for p in phases:
            ax.axvspan(p.start_s - t_lo, p.end_s - t_lo, color=_COLORS.get(p.name, "#dddddd"), alpha=0.35, lw=0)
        t = [x["t"] - t_lo for x in samples]
        alloc_label = "allocated (torch)" if self.ops.is_accelerator else "role state on the device"
        ax.plot(
            t,
            [x["allocated"] / scale for x in samples],
            color="#023047",
            lw=1.4,
            label=alloc_label,
            drawstyle="steps-post",
        )
        if self.ops.is_accelerator:
            ax.plot(
                t,
                [x["driver_used"] / scale for x in samples],
                color="#d62828",
                lw=1.0,
                ls="--",
                drawstyle="steps-post",
                label="used (driver)",
            )
        if self.capacity_bytes:
            ax.axhline(self.capacity_bytes / scale, color="#9d0208", lw=1.0, label="the device's memory")
        marks = [m for m in self.marks if t_lo <= m["t"] <= t_hi + 1e-9]
        moves = [m for m in marks if m.get("kind") != "oom"]
        for i, m in enumerate(moves):
            ax.axvline(m["t"] - t_lo, color="#6c757d", lw=0.8, ls=":", label="transition" if i == 0 else None)
        for m in (m for m in marks if m.get("kind") == "oom"):
            top = (self.capacity_bytes or _peak) / scale
            where = f" in {m['phase']}" if m.get("phase") else ""
            ax.plot([m["t"] - t_lo], [top], marker="X", ms=11, color="#9d0208", ls="", label=f"out of memory{where}")
        handles, labels = ax.get_legend_handles_labels()
        names = [n for n in _COLORS if any(p.name == n for p in phases)]
        handles += [Patch(color=_COLORS[n], alpha=0.35) for n in names]
        labels += names
        # a run that failed has its cross at the top right, where the legend would cover it
        failed = any(m.get("kind") == "oom" for m in marks)
        ax.legend(handles, labels, loc="upper left" if failed else "upper right", fontsize=8, ncol=2, framealpha=0.9)
        ax.set_xlabel(f"seconds (last {n_steps} step{'s' if n_steps != 1 else ''})")
        ax.set_ylabel(unit)
        ax.set_ylim(0, ymax)
        ax.grid(alpha=0.25)


_COLORS = {"rollout": "#8ecae6", "reference": "#ffb703", "train": "#90be6d"}
