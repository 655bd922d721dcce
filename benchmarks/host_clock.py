"""What the host gave a bench step: the main thread's CPU time, the process's involuntary
context switches, and the machine's CPU time stolen by the hypervisor (a virtual machine's
``steal`` in ``/proc/stat``) over the step. A host-bound decode runs as fast as its thread gets a
core: a step whose thread had the core less of its wall time, or on a machine losing more to
steal, shows why it was slower where the GPU's own time cannot."""

from __future__ import annotations

import gc
import os
import resource
import time

__all__ = ["HostClock"]


def _stat() -> tuple[int, int] | None:
    """(steal, total) jiffies of all CPUs since boot; None where /proc/stat is not Linux's."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 9:
        return None
    values = [int(x) for x in fields[1:]]
    # user nice system idle iowait irq softirq steal [guest guest_nice: inside user and nice]
    return values[7], sum(values[:8])


class HostClock:
    """``start()`` at a step's beginning, ``stop()`` at its end: a dict of what the host gave
    the step (see the module docstring), and what Python's cyclic garbage collector took of it
    (its seconds and passes by generation, the objects it tracks at the end: a process holding
    more long-lived objects spends longer in each full pass)."""

    def __init__(self) -> None:
        self._gc_s = 0.0
        self._gc_passes = [0, 0, 0]
        self._gc_t0: float | None = None
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        elif self._gc_t0 is not None:
            self._gc_s += time.perf_counter() - self._gc_t0
            self._gc_passes[info.get("generation", 0)] += 1
            self._gc_t0 = None

    def close(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def start(self) -> None:
        self._gc_s, self._gc_passes = 0.0, [0, 0, 0]
        self._wall = time.perf_counter()
        self._thread = time.thread_time()
        self._usage = resource.getrusage(resource.RUSAGE_SELF)
        self._stat = _stat()

    def stop(self) -> dict:
        wall = time.perf_counter() - self._wall
        usage = resource.getrusage(resource.RUSAGE_SELF)
        out = {
            "wall_s": wall,
            "thread_cpu_s": time.thread_time() - self._thread,
            "process_cpu_s": (usage.ru_utime + usage.ru_stime) - (self._usage.ru_utime + self._usage.ru_stime),
            "involuntary_switches": usage.ru_nivcsw - self._usage.ru_nivcsw,
            "voluntary_switches": usage.ru_nvcsw - self._usage.ru_nvcsw,
            "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "gc_s": self._gc_s,
            "gc_passes": list(self._gc_passes),
            "gc_tracked_objects": len(gc.get_objects()),
        }
        now = _stat()
        if now is not None and self._stat is not None and now[1] > self._stat[1]:
            out["machine_steal_share"] = (now[0] - self._stat[0]) / (now[1] - self._stat[1])
        return out
