#!/usr/bin/env bash
# One GPU pass for TRL's GRPOTrainer with tidal (issue 14), with trl and datasets carried as
# wheels in .whl/ (see scripts/gpu_wheels.sh); logs and rows ($OUT/RESULTS.md) go to $OUT.
#   bash scripts/gpu_trl.sh [tests] [bench] [reward] [7b]   (default: tests bench)
# reward: the same bench with a reward model of the policy's shape in every variant.
# bench: the Qwen2-1.5B shape, TRL alone beside tidal's variants, among them a budget that keeps
# the policy resident while the reference scores (VARIANTS overrides the list).
# TIDAL_COMMIT names the commit in the logs (the device copy's git log may be stale).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-./out}
mkdir -p "$OUT"
source scripts/gpu_wheels.sh
source scripts/gpu_env.sh
python3 -c "import trl, datasets; print('trl', trl.__version__, '| datasets', datasets.__version__)" 2>&1 | tail -1 | tee -a "$OUT/env.txt"
cp benchmarks/RESULTS.md "$OUT/RESULTS.md"
status=0
for part in ${*:-tests bench}; do
  t0=$(date +%s)
  case $part in
    tests) timeout ${TESTS_TIMEOUT:-200} python3 -m pytest -q -m gpu tests/integrations tests/timeshare -rs --durations=5 \
             -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1 || status=1
           tail -12 "$OUT/gpu_tests.log" ;;
    bench) timeout ${BENCH_TIMEOUT:-420} python3 benchmarks/bench_trl.py --preset qwen2-1.5b --steps 4 \
             --variants ${VARIANTS:-trl,stream,stream+prefetch,stream+budget=14,stream+prefetch+budget=14} \
             --results "$OUT/RESULTS.md" > "$OUT/bench_trl.log" 2>&1 || status=1
           tail -12 "$OUT/bench_trl.log" ;;
    reward) timeout ${BENCH_TIMEOUT:-420} python3 benchmarks/bench_trl.py --preset qwen2-1.5b --steps 4 --reward-model \
              --variants ${VARIANTS:-trl,stream,stream+prefetch} --results "$OUT/RESULTS.md" > "$OUT/bench_trl_reward.log" 2>&1 || status=1
            tail -8 "$OUT/bench_trl_reward.log" ;;
    7b) timeout ${BENCH_TIMEOUT:-420} python3 benchmarks/bench_trl.py --preset qwen2-7b --dtype bfloat16 --steps 4 \
          --variants trl,stream,stream+prefetch --results "$OUT/RESULTS.md" > "$OUT/bench_trl_7b.log" 2>&1 || status=1
        tail -8 "$OUT/bench_trl_7b.log" ;;
  esac
  echo "$part: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/timing.txt"
done
exit $status
