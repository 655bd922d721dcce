#!/usr/bin/env bash
# Issue 12's GPU pass on a lent single-GPU machine; logs go to $OUT.
#   bash scripts/gpu_reliability.sh tests|bench
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
status=0
case ${1:-tests} in
  tests)
    timeout 560 python3 -m pytest -q -m gpu ${TESTS:-tests} --durations=10 -p no:cacheprovider -rs \
      2>&1 | tee "$OUT/gpu_tests.log" || status=1 ;;
  bench)
    timeout 250 python3 benchmarks/bench_reliability.py --results "$OUT/RESULTS.md" 2>&1 | tee "$OUT/bench_reliability.log" || status=1
    timeout 300 python3 -m tidal_recipes bench --preset qwen2-1.5b --results "$OUT/RESULTS.md" --json "$OUT/bench.json" \
      2>&1 | tail -25 | tee "$OUT/bench_offload.log" || status=1 ;;
esac
echo "gpu_reliability exit status: $status"
exit $status
