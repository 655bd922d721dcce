#!/usr/bin/env bash
# The whole GPU pass in one command, for a lent GPU machine (torch + transformers
# preinstalled there; tidal runs from the checkout). Logs go to $OUT (or ./out).
#   bash scripts/gpu_suite.sh [quick]
# quick: tests only; default: tests, then the benchmarks.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
status=0
python3 -m pytest -q -m gpu tests --durations=5 2>&1 | tee "$OUT/gpu_tests.log" || status=1
python3 -m pytest -q -m "not gpu" tests 2>&1 | tail -3 | tee "$OUT/cpu_tests.log" || status=1
if [ "${1:-}" != "quick" ]; then
  python3 benchmarks/bench_offload.py --results "$OUT/RESULTS.md" --json-dir "$OUT" 2>&1 | tee "$OUT/bench_offload.log" || status=1
  python3 benchmarks/bench_cpu_adam.py --results "$OUT/RESULTS.md" 2>&1 | tee "$OUT/bench_cpu_adam.log" || status=1
  # The same 1.5B run with freed blocks kept in torch's cache (single-process timeshare).
  python3 -m tidal_recipes bench --preset qwen2-1.5b --keep-cache --results "$OUT/RESULTS.md" 2>&1 | tail -20 | tee -a "$OUT/bench_offload.log" || status=1
fi
echo "gpu_suite exit status: $status"
exit $status
