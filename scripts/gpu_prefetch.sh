#!/usr/bin/env bash
# One GPU pass of the prefetch work (issue 16, item 2); logs and result rows go to $OUT.
#   bash scripts/gpu_prefetch.sh [tests] [bench] [demo]   (default: tests bench)
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
parts=${*:-tests bench}
status=0
for part in $parts; do
  t0=$(date +%s)
  case $part in
    tests) timeout ${TESTS_TIMEOUT:-420} python3 -m pytest -q -m gpu ${TESTS:-tests/timeshare tests/state tests/recipes/grpo} \
             --durations=8 -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -40 || status=1 ;;
    bench) timeout ${BENCH_TIMEOUT:-540} python3 benchmarks/bench_prefetch.py --steps ${STEPS:-6} ${BENCH_ARGS:-} \
             --results "$OUT/RESULTS.md" > "$OUT/bench_prefetch.log" 2>&1 || status=1
           tail -30 "$OUT/bench_prefetch.log" ;;
    demo) timeout 300 python3 -m tidal_recipes demo --prefetch --steps ${STEPS:-6} --baseline-steps 2 \
             --out "$OUT/demo-prefetch" > "$OUT/demo_prefetch.log" 2>&1 || status=1
          tail -20 "$OUT/demo_prefetch.log" ;;
  esac
  echo "$part: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/timing.txt"
done
echo "gpu_prefetch exit status: $status"
exit $status
