#!/usr/bin/env bash
# Issue 30's pass on a lent 2-GPU machine (DeepSpeed, TRL, datasets from the wheels carried in
# .whl/, see scripts/gpu_wheels.sh). Parts, run in the order given:
#   bash scripts/gpu_two.sh [lease2] [probe] [ckpt] [tests]      (default: all four, in this order)
# lease2  benchmarks/bench_lease.py --two-gpus (a Qwen2-1.5B role per process and GPU, each
#         through its own lease; alone, then both at once): lease2.json, rows in RESULTS.md
# probe   scripts/probe_fsdp_release.py: the warm-offload holdback of an FSDP2 role with and
#         without device clones beside it, measured against predicted
# ckpt    benchmarks/bench_checkpoint.py at world 2 (FSDP2 role, transitions against the line
#         rate, saves and loads 3 times each): ckpt.json, rows in RESULTS.md
# tests   python3 -m pytest -q -m gpu tests, until the pass's deadline: tests.log. Resumable:
#         every test that reaches an outcome goes to a ledger (TESTS_LEDGER, by default in /tmp,
#         kept while the machine stays warm; copied to $OUT/tests.ledger), and the same part in
#         the next call runs only the tests not in it; tests.log ends with the tally over all
#         calls. TESTS_FRESH=1 starts a new ledger. On a fresh machine, carry the returned
#         tests.ledger (e.g. as out/tests.ledger) and pass TESTS_LEDGER=out/tests.ledger.
# The pass ends within BUDGET seconds (570; a device call may run 600): each benchmark part has
# its own timeout, and the tests get what is left. In $OUT (7 files, 8 if TRL does not import):
# summary.txt (the machine, the versions, each part's time and the tail of its output),
# bench.log (the benchmarks' and the probe's whole output), tests.log, tests.ledger,
# lease2.json, ckpt.json, RESULTS.md (the rows the benchmarks appended).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-./out}
BUDGET=${BUDGET:-570}
LEDGER=${TESTS_LEDGER:-/tmp/tidal-gpu-two/tests.ledger}
mkdir -p "$OUT" "$(dirname "$LEDGER")"
T0=$(date +%s)
SUM="$OUT/summary.txt"
BENCH="$OUT/bench.log"
if [ "${TESTS_FRESH:-0}" = 1 ]; then rm -f "$LEDGER"; fi
# NVLink multicast stays off on the lent machines (KINDS.md)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PARTS=${*:-lease2 probe ckpt tests}
# A brace group with a redirection runs in this shell: gpu_wheels.sh's PYTHONPATH stays set.
{
  echo "== gpu_two.sh $PARTS | commit ${TIDAL_COMMIT:-$(git log --oneline -1 2>/dev/null || echo unknown)} | $(date -u '+%Y-%m-%d %H:%M UTC')"
  source scripts/gpu_wheels.sh
  nvidia-smi --query-gpu=index,name,pci.bus_id,driver_version,memory.total --format=csv,noheader
  nvidia-smi topo -m 2>/dev/null | head -4
  python3 -c "import torch, transformers, deepspeed; print('torch', torch.__version__, 'cuda', torch.version.cuda, '| NCCL', '.'.join(map(str, torch.cuda.nccl.version())), '| transformers', transformers.__version__, '| deepspeed', deepspeed.__version__, '| GPUs', torch.cuda.device_count())" 2>&1 | tail -1
  python3 -c "import trl, datasets; print('trl', trl.__version__, '| datasets', datasets.__version__)" 2>&1 | tail -1
  echo "setup: $(( $(date +%s) - T0 )) s"
} >> "$SUM" 2>&1
cat "$SUM"

left() { echo $(( T0 + BUDGET - $(date +%s) )); }
# timeout for a part: its own limit, or what is left of the pass if that is less
limit() { local l; l=$(left); echo $(( $1 < l ? $1 : l )); }

status=0
for part in $PARTS; do
  t=$(date +%s)
  if [ "$(left)" -lt 30 ]; then
    echo "$part: not run, $(left) s left of the pass's $BUDGET" | tee -a "$SUM"
    status=1
    continue
  fi
  case $part in
    ckpt)
      # ~170 s on 2x H200 (2026-11-24): 8 transition cycles, 3 saves and 3 loads per case
      echo "=== ckpt" >> "$BENCH"
      timeout -k 10 "$(limit ${CKPT_TIMEOUT:-230})" python3 benchmarks/bench_checkpoint.py --cycles 8 --repeats 3 \
        --budget-s 170 --results "$OUT/RESULTS.md" --json "$OUT/ckpt.json" >> "$BENCH" 2>&1 || status=1
      log="$BENCH"; tailn=34 ;;
    lease2)
      # ~60 s: two 12.3 GB roles built and pinned at once, 2 rounds x 3 phases x 6 turns
      echo "=== lease2" >> "$BENCH"
      timeout -k 10 "$(limit ${LEASE2_TIMEOUT:-170})" python3 benchmarks/bench_lease.py --two-gpus --cycles 6 \
        --rounds 2 --timeout-s 160 --json "$OUT/lease2.json" --results "$OUT/RESULTS.md" >> "$BENCH" 2>&1 || status=1
      log="$BENCH"; tailn=12 ;;
    probe)
      # ~25 s per variant (fresh ranks each), three variants
      echo "=== probe" >> "$BENCH"
      timeout -k 10 "$(limit ${PROBE_TIMEOUT:-150})" python3 scripts/probe_fsdp_release.py qwen2-0.5b 4 \
        >> "$BENCH" 2>&1 || status=1
      log="$BENCH"; tailn=12 ;;
    tests)
      before=0; if [ -f "$LEDGER" ]; then before=$(wc -l < "$LEDGER"); fi
      echo "== $(date -u '+%H:%M:%S') pytest, $(left) s left; ledger $LEDGER has $before lines" >> "$OUT/tests.log"
      # SIGINT at the deadline: pytest stops inside the running test, prints its summary, and
      # that test runs again in the next call.
      TIDAL_TESTS_LEDGER="$LEDGER" PYTHONPATH="$PWD/scripts:$PYTHONPATH" \
        timeout -s INT -k 20 "$(( $(left) - 25 ))" python3 -m pytest -q -m gpu ${TESTS:-tests} -rsfE \
        -p pytest_ledger -p no:cacheprovider --durations=30 >> "$OUT/tests.log" 2>&1
      rc=$?
      if [ $rc = 124 ]; then echo "== stopped at the pass's deadline: run the tests part again to go on" >> "$OUT/tests.log"; fi
      if [ $rc = 5 ]; then echo "== no test left to run: every gpu test is in the ledger" >> "$OUT/tests.log"; fi
      if [ $rc != 0 ] && [ $rc != 5 ]; then status=1; fi
      python3 scripts/pytest_ledger.py "$LEDGER" >> "$OUT/tests.log" 2>&1
      cp "$LEDGER" "$OUT/tests.ledger" 2>/dev/null
      log="$OUT/tests.log"; tailn=30 ;;
    *) echo "unknown part $part (ckpt, lease2, probe, tests)" | tee -a "$SUM"; status=1; continue ;;
  esac
  { echo "== $part: $(( $(date +%s) - t )) s"; tail -n $tailn "$log"; } | tee -a "$SUM"
done
echo "pass: $(( $(date +%s) - T0 )) s, status $status" | tee -a "$SUM"
exit $status
