#!/usr/bin/env bash
# Issue 15's GPU pass on one lent GPU: the region tests, then bench_vmm (tidal's VMM region, its
# resize backend and torch_memory_saver side by side). torch_memory_saver's wheel is carried in
# .whl/ (pip download torch_memory_saver==0.0.10 -d .whl).
#   bash scripts/gpu_vmm.sh [tests] [probe] [elision] [bench]   (default: tests bench)
# elision: benchmarks/bench_elision.py (issue 16: offloads of unchanged state that copy nothing).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-./out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/env.txt"
ls .whl/torch_memory_saver-*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-deps --root-user-action=ignore .whl/torch_memory_saver-*.whl 2>&1 | tail -2; python3 -c "import torch_memory_saver" 2>&1 | tail -1
status=0
for part in ${*:-tests bench}; do
  t0=$(date +%s)
  case $part in
    tests) timeout 300 python3 -m pytest -q tests/vmm tests/timeshare/test_region_role_gpu.py tests/timeshare/test_region_role.py -p no:cacheprovider --durations=5 > "$OUT/vmm_tests.log" 2>&1 || status=1
           tail -5 "$OUT/vmm_tests.log" ;;
    probe) timeout 60 python3 benchmarks/probe_vmm_driver.py > "$OUT/probe.log" 2>&1 || status=1
           cat "$OUT/probe.log" ;;
    elision) timeout 300 python3 benchmarks/bench_elision.py --results "$OUT/RESULTS.md" > "$OUT/bench_elision.log" 2>&1 || status=1
           cat "$OUT/bench_elision.log" ;;
    bench) timeout 400 python3 benchmarks/bench_vmm.py --results "$OUT/RESULTS.md" ${BENCH_ARGS:-} > "$OUT/bench_vmm.log" 2>&1 || status=1
           cat "$OUT/bench_vmm.log" ;;
  esac
  echo "$part: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/timing.txt"
done
exit $status
