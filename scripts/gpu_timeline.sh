#!/usr/bin/env bash
# docs/timeline.png from the current `tidal demo` on one GPU, with the same loop run with every
# role resident drawn beside it on the same memory scale (the demo draws both: its PNG's left
# panel is the timeshare, the right one the all-resident baseline, the bottom one the reward).
#
#   TIDAL_COMMIT=$(git rev-parse --short HEAD) bash scripts/gpu_timeline.sh [more tidal demo flags]
#
# Writes $OUT/timeline.png (copy it to docs/timeline.png and name the GPU and commit in the
# commit message), $OUT/demo.jsonl, $OUT/demo.log and $OUT/env.txt. STEPS (default 10) and
# BASELINE_STEPS (default 3) set the two runs' lengths; the picture shows the last 3 steps of
# each. Extra flags go to `tidal demo` (e.g. `--evict others` to move every role out at each
# switch where the planner would keep all of them resident).
set -euo pipefail
. "$(dirname "$0")/gpu_env.sh"
export TQDM_DISABLE=1
python3 -m tidal_recipes demo --steps "${STEPS:-10}" --baseline-steps "${BASELINE_STEPS:-3}" --out "$OUT/demo" "$@" \
  2>&1 | tee "$OUT/demo.log"
cp "$OUT/demo/timeline.png" "$OUT/timeline.png"
mv "$OUT/demo/demo.jsonl" "$OUT/demo.jsonl"
rm -rf "$OUT/demo"
echo "wrote $OUT/timeline.png (from $(grep '^commit' "$OUT/env.txt"))"
