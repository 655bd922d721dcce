"""TRL's ``GRPOTrainer`` alone against TRL with tidal (``TidalGRPOTrainer``), side by side on one GPU.

The package behind ``benchmarks/bench_trl.py`` (its entry script), by concept:

- :mod:`trl_bench.workload`: the model shapes, the random model saved for TRL to load, the char
  task, the prompts and the ``GRPOConfig`` of a run.
- :mod:`trl_bench.variants`: what a variant string (``trl``, ``stream+prefetch+peak=17``) means.
- :mod:`trl_bench.probes`: what a run measures per step (trainer callbacks, the profiler, the
  line rate).
- :mod:`trl_bench.run`: one variant's training run in this process, to a JSON file.
- :mod:`trl_bench.stats`: the median's 95% interval, the pairing of runs with TRL alone's.
- :mod:`trl_bench.report`: the printed table, the RESULTS.md rows and the JSON.
- :mod:`trl_bench.host_watch`: a child process's host memory, watched while it runs.
- :mod:`trl_bench.launch`: the flags and ``main``: a process per variant (or one for a paired
  sequence), under ``accelerate launch`` for several GPUs.

Importable with ``benchmarks/`` on ``sys.path`` (as the scripts beside it put it); importing it
puts the repository root there too, so ``tidal`` resolves to this checkout, and imports neither
torch nor tidal.
"""

from __future__ import annotations

import os
import sys

BENCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
"""``benchmarks/``: the modules this package uses beside it (``lockstep``, ``host_clock``, ...)."""
ROOT = os.path.dirname(BENCH_DIR)
"""The repository root (``tidal``, ``tidal_recipes``)."""
ENTRY_SCRIPT = os.path.join(BENCH_DIR, "bench_trl.py")
"""The script each variant's child process runs (``accelerate launch`` needs a script path)."""

for _path in (BENCH_DIR, ROOT):
    if _path not in sys.path:
        sys.path.insert(0, _path)
