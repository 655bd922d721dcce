#!/usr/bin/env bash
# One GPU pass for CPU Adam's device-side gradient accumulation (issue 17) and the single-GPU
# look at the transition stall bench_checkpoint showed (issue 18); logs go to $OUT.
#   bash scripts/gpu_accumulate.sh [tests] [demo] [ckpt] [host]   (default: tests demo ckpt)
# host: CPU Adam's host step throughput on this machine's cores, fp32 and bf16 moments, and
# what a 7.6 G-param step takes at those rates (issue 17).
# TIDAL_COMMIT names the commit in the logs (the device copy's git log may be stale).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
status=0
for part in ${*:-tests demo ckpt}; do
  t0=$(date +%s)
  case $part in
    tests) timeout ${TESTS_TIMEOUT:-200} python3 -m pytest -q -m gpu ${TESTS:-tests/optim} --durations=5 \
             -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1 || status=1
           tail -12 "$OUT/gpu_tests.log" ;;
    demo) for acc in host device; do
            timeout ${DEMO_TIMEOUT:-170} python3 -m tidal_recipes demo --steps ${STEPS:-5} --baseline-steps 2 \
              --grad-accumulation $acc --out "$OUT/demo-$acc" > "$OUT/demo_$acc.log" 2>&1 || status=1
            echo "== demo, gradients summed on the $acc"; grep -vE "GRPO:|Warning|warn|forward_call" "$OUT/demo_$acc.log" | tail -14
          done ;;
    host) timeout ${HOST_TIMEOUT:-300} python3 benchmarks/bench_cpu_adam.py --skip-train --throughput-params 1.5e9 \
            --extrapolate-params 7.6e9 --results "$OUT/RESULTS.md" > "$OUT/cpu_adam_host.log" 2>&1 || status=1
          tail -14 "$OUT/cpu_adam_host.log" ;;
    ckpt) timeout 120 python3 benchmarks/bench_checkpoint.py --world 1 --cycles 12 --budget-s 0 > "$OUT/ckpt1.log" 2>&1 || status=1
          grep -E "cycle|line rate|^\| .*transition" "$OUT/ckpt1.log" ;;
  esac
  echo "$part: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/timing.txt"
done
exit $status
