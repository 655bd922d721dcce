"""TRL's GRPOTrainer alone against TRL with tidal (TidalGRPOTrainer), side by side on one GPU.

    python benchmarks/bench_trl.py [--preset qwen2-1.5b] [--steps 4] [--variants trl,step,stream,stream+prefetch]
        [--results PATH] [--json PATH]

The entry script of the ``trl_bench`` package beside it (``benchmarks/trl_bench/``: the
workload, the variants, the probes, the statistics, the report and the launch); every variant's
child process runs this script too. ``--help`` lists the flags.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from trl_bench.launch import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
