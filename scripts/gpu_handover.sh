#!/usr/bin/env bash
# One GPU pass for the overlapped cross-process hand-over (issue 16, item 3); logs go to $OUT.
#   bash scripts/gpu_handover.sh [tests] [bench]   (default: tests bench)
# tests: the lease's GPU tests (sequential and overlapped hand-overs between two processes) and
# evict="as_needed" against the driver's free memory.
# bench: bench_lease.py --overlap at two role sizes (about 3.8 GB and 12 GB moved per
# hand-over), sequential and overlapped side by side with the in-process switch; rows go to
# $OUT/RESULTS.md (a copy of benchmarks/RESULTS.md).
# TIDAL_COMMIT names the commit in the logs (the device copy's git log may be stale).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
status=0
for part in ${*:-tests bench}; do
  t0=$(date +%s)
  case $part in
    tests) timeout ${TESTS_TIMEOUT:-240} python3 -m pytest -q -m gpu ${TESTS:-tests/distributed/test_lease_gpu.py \
             tests/distributed/test_lease_overlap_gpu.py tests/timeshare/test_evict_gpu.py} --durations=5 \
             -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1 || status=1
           tail -12 "$OUT/gpu_tests.log" ;;
    bench) cp benchmarks/RESULTS.md "$OUT/RESULTS.md"
           for gb in ${ROLE_GB:-2 6}; do
             timeout ${BENCH_TIMEOUT:-200} python3 benchmarks/bench_lease.py --overlap --role-gb $gb --turns ${TURNS:-6} \
               --chunk-mb ${CHUNK_MB:-256} --results "$OUT/RESULTS.md" > "$OUT/bench_lease_$gb.log" 2>&1 || status=1
             echo "== role $gb GB"; tail -9 "$OUT/bench_lease_$gb.log"
           done ;;
  esac
  echo "$part: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/timing.txt"
done
exit $status
