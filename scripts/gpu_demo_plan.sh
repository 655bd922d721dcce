#!/usr/bin/env bash
# The demo with its levers from the planner on this GPU and host (issue 17): the 0.5B default,
# then Qwen2-7B and Llama-3-8B full-parameter (the planner puts the 8B all-resident loop over
# 80 GB). Logs to $OUT; host peak RSS from /usr/bin/time where it exists.
#   bash scripts/gpu_demo_plan.sh [small] [7b] [7b-prefetch] [8b]   (default: small 7b)
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
free -g | head -2 | tee -a "$OUT/env.txt"
timed() { if [ -x /usr/bin/time ]; then /usr/bin/time -v "$@"; else "$@"; fi; }
status=0
for part in ${*:-small 7b}; do
  t0=$(date +%s)
  case $part in
    small) timeout ${SMALL_TIMEOUT:-150} bash -c "$(declare -f timed); timed python3 -m tidal_recipes demo --steps ${STEPS:-5} \
             --baseline-steps 2 --out $OUT/demo-small" > "$OUT/demo_small.log" 2>&1 || status=1
           grep -vE "GRPO:|Warning|warn|forward_call" "$OUT/demo_small.log" | grep -vE "^\s+(Command|User|System|Percent|Elapsed|Average|Major|Minor|Volun|Invol|Swaps|File|Socket|Signals|Page|Exit)" | tail -24 ;;
    7b) timeout ${BIG_TIMEOUT:-300} bash -c "$(declare -f timed); timed python3 -m tidal_recipes demo --preset qwen2-7b \
          --steps ${BIG_STEPS:-4} --baseline-steps 1 --out $OUT/demo-7b" > "$OUT/demo_7b.log" 2>&1 || status=1
        grep -vE "GRPO:|Warning|warn|forward_call" "$OUT/demo_7b.log" | grep -vE "^\s+(Command|User|System|Percent|Elapsed|Average|Major|Minor|Volun|Invol|Swaps|File|Socket|Signals|Page|Exit)" | tail -26 ;;
    7b-prefetch) timeout ${BIG_TIMEOUT:-300} bash -c "$(declare -f timed); timed python3 -m tidal_recipes demo --preset qwen2-7b \
          --prefetch --steps ${BIG_STEPS:-6} --baseline-steps 0 --out $OUT/demo-7b-prefetch" > "$OUT/demo_7b_prefetch.log" 2>&1 || status=1
        grep -vE "GRPO:|Warning|warn|forward_call" "$OUT/demo_7b_prefetch.log" | grep -vE "^\s+(Command|User|System|Percent|Elapsed|Average|Major|Minor|Volun|Invol|Swaps|File|Socket|Signals|Page|Exit)" | tail -20 ;;
    8b) timeout ${BIG_TIMEOUT:-300} bash -c "$(declare -f timed); timed python3 -m tidal_recipes demo --preset llama3-8b \
          --steps ${BIG_STEPS:-6} --baseline-steps 1 --out $OUT/demo-8b" > "$OUT/demo_8b.log" 2>&1 || status=1
        grep -vE "GRPO:|Warning|warn|forward_call" "$OUT/demo_8b.log" | grep -vE "^\s+(Command|User|System|Percent|Elapsed|Average|Major|Minor|Volun|Invol|Swaps|File|Socket|Signals|Page|Exit)" | tail -26 ;;
  esac
  echo "$part: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/timing.txt"
done
exit $status
