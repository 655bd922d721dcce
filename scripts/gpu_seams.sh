#!/usr/bin/env bash
# Issue 13's GPU pass on one lent GPU: the GPU tests, then the benchmarks the redesign can move
# (offload/reload/switch, host overhead, activation offload and CPU Adam on the shared transfer
# context), with "before" runs of an earlier commit beside them when .before/ holds one.
#   bash scripts/gpu_seams.sh [tests] [bench] [overhead] [act] [adam]   (default: all)
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
parts=${*:-tests bench overhead act adam}
status=0
for part in $parts; do
  t0=$(date +%s)
  case $part in
    tests) timeout 420 python3 -m pytest -q -m gpu tests --durations=8 -p no:cacheprovider \
             > "$OUT/gpu_tests.log" 2>&1 || status=1 ;;
    bench) timeout 240 python3 -m tidal_recipes bench --preset qwen2-1.5b --results "$OUT/RESULTS.md" \
             --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1 || status=1 ;;
    overhead)
      if [ -d .before ]; then
        (cd .before && PYTHONPATH=$PWD timeout 120 python3 benchmarks/bench_overhead.py --results "$OUT/RESULTS.md" \
           --note before > "$OUT/overhead_before.log" 2>&1) || status=1
      fi
      timeout 120 python3 benchmarks/bench_overhead.py --results "$OUT/RESULTS.md" \
        --note "${NOTE:-after}" > "$OUT/overhead.log" 2>&1 || status=1 ;;
    act) timeout 300 python3 benchmarks/bench_activations.py --configs qwen2-1.5b-16L --results "$OUT/RESULTS.md" \
           > "$OUT/bench_activations.log" 2>&1 || status=1 ;;
    adam) timeout 300 python3 benchmarks/bench_cpu_adam.py --skip-throughput --results "$OUT/RESULTS.md" \
            > "$OUT/bench_cpu_adam.log" 2>&1 || status=1 ;;
  esac
  echo "$part: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/timing.txt"
done
echo "gpu_seams exit status: $status"
exit $status
