#!/usr/bin/env bash
# Issue 27 on a lent GPU machine (logs under $OUT, see gpu_env.sh):
#   bash scripts/gpu_guard.sh tests   the storage guard's GPU tests (foreign access raises tidal's
#                                     error and the CUDA context stays usable; a region role and a
#                                     CUDA graph replayed after restores) and the GPU tests of the
#                                     transitions it touches (bit-exact round trips, races, faults)
#   bash scripts/gpu_guard.sh bench   the transition cost, guard off against on, interleaved in one
#                                     session: ROUNDS (default 2) of `tidal bench` at the Qwen2-1.5B
#                                     shape each way, then the medians side by side
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
status=0
case "${1:-tests}" in
tests)
  python3 -c "from tidal import guard; print('storage guard:', guard.status())" 2>&1 | tee "$OUT/guard.txt"
  python3 -m pytest -q -m gpu --durations=5 \
    tests/timeshare/test_foreign_access_gpu.py tests/timeshare/test_region_role_gpu.py \
    tests/vmm/test_region_gpu.py tests/timeshare/test_timeshare_gpu.py tests/timeshare/test_prefetch_gpu.py \
    tests/timeshare/test_no_wait_gpu.py tests/timeshare/test_interrupt_gpu.py tests/state/test_release_gpu.py \
    2>&1 | tee "$OUT/gpu_guard_tests.log" || status=1
  ;;
bench)
  for i in $(seq 1 "${ROUNDS:-2}"); do
    for mode in off on; do
      TIDAL_STORAGE_GUARD=$mode python3 -m tidal_recipes bench --preset qwen2-1.5b \
        --json "$OUT/guard_${mode}_$i.json" 2>&1 | tail -4 | tee -a "$OUT/gpu_guard_bench.log" || status=1
    done
  done
  python3 - "$OUT" <<'PY' 2>&1 | tee -a "$OUT/gpu_guard_bench.log"
import glob, json, statistics, sys

out = sys.argv[1]
runs = {m: [json.load(open(p)) for p in sorted(glob.glob(f"{out}/guard_{m}_*.json"))] for m in ("off", "on")}
print("median over", {m: len(r) for m, r in runs.items()}, "runs; time ratio on/off (1.00 = same, < 1.01 the target)")
for key in ("offload_cold_gbps", "offload_warm_gbps", "reload_cold_gbps", "reload_warm_gbps"):
    off = statistics.median(r["tidal"][key] for r in runs["off"])
    on = statistics.median(r["tidal"][key] for r in runs["on"])
    print(f"  {key:20s} off {off:7.2f} GB/s  on {on:7.2f} GB/s  time on/off {off / on:.4f}")
off = statistics.median(r["switch"]["switch_s"] for r in runs["off"])
on = statistics.median(r["switch"]["switch_s"] for r in runs["on"])
print(f"  {'switch_s':20s} off {off:7.3f} s     on {on:7.3f} s     time on/off {on / off:.4f}")
print("bit_exact:", [r.get("bit_exact") for m in ("off", "on") for r in runs[m]])
PY
  ;;
*)
  echo "usage: bash scripts/gpu_guard.sh tests|bench" >&2
  exit 2
  ;;
esac
echo "gpu_guard exit status: $status"
exit $status
