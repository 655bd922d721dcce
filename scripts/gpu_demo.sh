#!/usr/bin/env bash
# One GPU pass for the RL loop: its GPU tests, then bench_demo (tidal demo's GPU default,
# two planner-calibration configs, a reward run). Logs and plots go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/tidal-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TQDM_DISABLE=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -m pytest -q -m gpu tests/recipes tests/timeshare tests/state tests/optim tests/plan ${EXTRA_TESTS:-} 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
python3 benchmarks/bench_demo.py --out "$OUT/demo" --results "$OUT/RESULTS_rows.md" "$@" 2>&1 | tee "$OUT/bench_demo.log" | tail -60
