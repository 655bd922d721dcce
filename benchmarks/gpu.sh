#!/usr/bin/env bash
# Every GPU run of tidal from one command: the GPU tests, and the benchmark behind each published
# figure (benchmarks/RESULTS.md's "Current figures", the README's table), on a lent GPU machine
# (torch and transformers there, no network; tidal runs from this checkout).
#
#   bash benchmarks/gpu.sh <suite>[:<part>] ...     e.g.  bash benchmarks/gpu.sh core trl:7b
#   DRY=1 bash benchmarks/gpu.sh all                 print every command, run nothing
#   bash benchmarks/gpu.sh --help                    this text
#
# A suite named alone runs its parts marked *; suite:part runs that part (several may be given).
# `all` runs the marked parts of every suite, the suites' own test parts left to `tests`.
#   core        *tests       GPU tests of the transfer, state and timeshare paths (VMM regions: vmm)
#               *bench       tidal bench --preset qwen2-1.5b: offload / reload / switch
#               *offload     benchmarks/bench_offload.py (1.5B, then 7B if it fits), then 1.5B with
#                            freed blocks kept in torch's cache (--keep-cache)
#               *reliability benchmarks/bench_reliability.py: verified restore against verify off
#               *elision     benchmarks/bench_elision.py: offloads of frozen or unchanged roles
#                overhead    benchmarks/bench_overhead.py (and the copy in .before/, if there)
#                ckpt1       benchmarks/bench_checkpoint.py --world 1: an FSDP2 role's transitions
#                shapes      benchmarks/bench_shapes.py --trace: reload, offload and switch of a tied Llama
#                            actor (AdamW foreach) with its critic and reference, an untied one (AdamW
#                            fused), a role of small tensors, Qwen2-1.5B; beside plain pinned copies
#                            (first the checkout in .before/, if there: SHAPES_BEFORE, its shapes)
#   trl         *tests       GPU tests of tests/integrations, tests/timeshare, tests/state
#               *bench       bench_trl.py, Qwen2-1.5B fp32, 64 completions x 256 tokens (VARIANTS)
#               *7b          the same at Qwen2-7B bf16 (VARIANTS7B)
#                paired      1.5B fp32, 64 x 256: TRL alone and VARIANTS_PAIRED alternating in one process,
#                            PAIRED (6) pairs: the median step ratio and its 95% interval; PAIRED_GPUS=k:
#                            k such processes at once, one a GPU, their pairs pooled; with LOCKSTEP=1 and
#                            PAIRED_GPUS=2 the two start each step together, TRL alone beside tidal
#                            (TAKE_TURNS=1: both on GPU 0, taking turns step by step);
#                            PIN_CORES=1: each process on its own share of the host's cores;
#                            MAIN_CORES=A,B (or fast: the cores part's two fastest, name it first):
#                            the two main threads on A and B, swapped every step
#                cores       benchmarks/bench_host_cores.py: each core's speed at Python and its
#                            memory's distance, then a decode on the fastest and slowest (CORES_ARGS)
#                14b         Qwen2.5-14B shape bf16, 64 x 256 in micro-batches of MICRO14B (16), STEPS14B
#                            (11) steps (VARIANTS14B_ONE)
#                stress      16 x 32 at 1.5B and at 7B (VARIANTS_STRESS); stress-1.5b, stress-7b
#                ds          7B, DeepSpeed ZeRO-3 offload through TRL beside tidal (VARIANTSDS)
#                demo7b      tidal demo --preset qwen2-7b --async-transitions (DEMO_FLAGS)
#                profile     bench's workload with one steady step profiled, drawn to a PNG
#                contention  benchmarks/bench_copy_contention.py: a decode-like loop's small reads
#                            while GiBs are copied on a side stream, by copy size (CONTENTION_ARGS)
#                decode      benchmarks/bench_decode.py: one policy's token time in each state tidal
#                            puts it in, in one process (DECODE_ARGS)
#   vllm        *tests       GPU tests of tests/integrations (TRL, the vLLM engine) with vLLM on the path
#               *bench       bench_trl_vllm.py, Qwen2-1.5B bf16, 64 x 256: TRL + vLLM alone beside tidal
#                            (VLLM_VARIANTS, trl,tidal; VLLM_STEPS, 4)
#                7b          the same at Qwen2-7B bf16 (VLLM_VARIANTS7B)
#                7b80        7B with another process holding all but 80 GiB (VLLM_VARIANTS80)
#                demo        tidal demo --rollout-engine vllm (DEMO_VLLM_FLAGS: --preset qwen2-0.5b --steps 5)
#                14b         the Qwen2.5-14B shape bf16, 64 x 256 in micro-batches of VLLM_MICRO14B (16),
#                            VLLM_STEPS14B (10) steps (VLLM_VARIANTS14B: tidal+role+prefetch+kv=auto, then
#                            trl), vLLM's max model length VLLM_LEN14B (320)
#                paired      VLLM_PRESET (qwen2-1.5b), VLLM_ROUNDS (6) rounds of VLLM_VARIANTS_PAIRED
#                            (trl,tidal+prefetch), the order reversed every other round: the median
#                            step ratio and its 95% interval
#                turns       VLLM_PRESET (qwen2-1.5b): TRL + vLLM alone and VLLM_VARIANT_TURNS
#                            (tidal+role+prefetch+kv=auto) as two processes on the GPU at once, taking turns
#                            step by step, VLLM_TURN_ROUNDS (2) rounds (the processes swapped) of
#                            VLLM_STEPS_TURNS (10) steps: each tidal step against its pair's TRL step, the
#                            median ratio and its 95% interval
#                identity    VLLM_PRESET (qwen2-1.5b), VLLM_VARIANTS_ID (trl,trl,tidal+prefetch,tidal+role+
#                            prefetch+kv=auto), VLLM_STEPS_ID (3) steps: TRL's log lines and the final
#                            weights of each run against the first TRL + vLLM run's
#                long        a long rollout: Qwen2-7B bf16, 64 x VLLM_LONG (2048) in micro-batches of
#                            VLLM_MICRO_LONG (4), VLLM_STEPS_LONG (2) steps (VLLM_VARIANTS_LONG: trl,
#                            tidal+role+prefetch+kv=auto): each engine's KV cache and generation time
#               VLLM_ARGS: more bench_trl_vllm.py flags for each of these (e.g. --max-model-len 320)
#               vLLM arrives as parts (benchmarks/fetch_wheels.sh vllm; benchmarks/vllm_stage.sh):
#               each call carries one part of .vllm/, the call that completes them unpacks it
#   vmm         *tests       tests/vmm and the region-role tests
#               *bench       benchmarks/bench_vmm.py beside torch_memory_saver (VMM_ARGS)
#   demo        *tests       GPU tests of recipes, timeshare, state, optim, plan (EXTRA_TESTS)
#               *bench       benchmarks/bench_demo.py: the demo's GPU default, planner calibration
#               *plan-small  tidal demo with the planner's levers, Qwen2-0.5B (PLAN_STEPS)
#               *plan-7b     the same, Qwen2-7B full-parameter (BIG_STEPS)
#               *prefetch    benchmarks/bench_prefetch.py (PREFETCH_STEPS, PREFETCH_ARGS)
#               *timeline    $OUT/timeline.png for docs/timeline.png: the demo's GPU default, the smallest
#                            shape the GPU cannot hold with every role resident (TIMELINE_ARGS: demo flags)
#   activations *tests       GPU tests of tests/activations
#               *bench       benchmarks/bench_activations.py --configs qwen2-1.5b-16L (ACT_CONFIGS)
#   cpu_adam    *tests       GPU tests of tests/optim
#               *train       bench_cpu_adam.py --skip-throughput: the GPU train step (ADAM_ARGS)
#               *host        the host step's throughput, extrapolated to 7.6 G params
#               *accumulate  tidal demo, micro-batch gradients summed on the host, then the device
#                bench       bench_cpu_adam.py: host throughput and the train step in one run
#                precision   benchmarks/bench_cpu_adam_precision.py (a CPU benchmark)
#   lease       *tests       the lease's GPU tests (sequential and overlapped), evict="as_needed"
#               *bench       bench_lease.py --overlap at ROLE_GB (2 6): cross-process hand-overs
#                processes   tidal demo --roles processes: the GRPO roles as separate processes
#   deepspeed   *tests       DeepSpeed adapter tests (GPU, then CPU); needs the carried wheels
#               *bench       benchmarks/bench_deepspeed.py --preset qwen2-0.5b; bench-1.5b
#   guard       *tests       the storage guard's GPU tests and those of the transitions it touches
#               *bench       tidal bench with TIDAL_STORAGE_GUARD off and on, ROUNDS (2) each
#   two         *lease2      bench_lease.py --two-gpus: two processes, one GPU and lease each
#               *ckpt        bench_checkpoint.py at world 2: an FSDP2 role, saves, loads
#               *tests       the GPU tests, resumable (as `tests`), on the 2-GPU machine; SHARDS=2
#                            runs the one-GPU files as two shards at once, one GPU each, first
#   multi       *tests       the multi-process GPU tests (DDP, FSDP2, TRL under accelerate launch) and
#                            the TRL integration's one-GPU tests; needs 2 GPUs
#               *fsdp14b     bench_trl.py --nproc 2 --launch fsdp2, Qwen2.5-14B shape bf16, 64 x 256 a
#                            rank (VARIANTS14B); needs 2 GPUs. ONE14B=1: one GPU first, the same
#                            variants (VARIANTS14B_ONE); ONE14B=beside: one GPU (GPU 2) at the same
#                            time as the two, their generations compared (needs 3 GPUs)
#                ddp7b       bench_trl.py at Qwen2-7B bf16, 64 x 256: tidal on one GPU, then --nproc 4
#                            --launch ddp (VARIANTS_DDP); needs 4 GPUs
#                copies      benchmarks/bench_shared_copies.py: every GPU copying at once, plain and
#                            as tidal's transitions (COPY_GIB, 4; COPY_REPS, 3); needs 2 GPUs (all it finds)
#                decode      benchmarks/bench_fsdp_decode.py: FSDP2's gathered generation against the
#                            same model whole, alternating in each process (DECODE_GPUS, 2;
#                            FSDP_DECODE_ARGS, --preset qwen2.5-14b)
#                save        SAVE_PRESETS (qwen2.5-32b qwen2.5-14b) saved to /tmp/bench_models in the
#                            background on the last GPU, one after the other, while the next parts
#                            (or the next call, on a warm machine) run; the parts below wait for it
#                zero3       TRL alone under DeepSpeed ZeRO-3 offload on 4 GPUs (ZERO3_PRESET,
#                            qwen2.5-32b; ANCHOR_STEPS), stopped as out of host memory when the
#                            host's available memory falls below HOST_FLOOR_GIB (24); needs the
#                            DeepSpeed wheels
#                fsdp4       bench_trl.py --nproc 4 --launch fsdp2 (FSDP4_PRESET, qwen2.5-32b;
#                            VARIANTS4: stream+prefetch,trl; TRL_LOADING, every-rank); ANCHOR_JSON:
#                            a zero3 JSON its rows are set against (by default this call's zero3
#                            part's, for the same preset, where it ran). One
#                            micro-batch a rank unless BENCH_ARGS says --micro-batch (under
#                            accumulation FSDP2 holds every gradient unsharded: 61 GiB at 32B)
#   tests       *gpu         every GPU test (-m gpu tests), resumable across calls: see below
#
# Output, under $OUT (./out by default): env.txt (GPUs, driver, host, versions, the commit:
# TIDAL_COMMIT names it where the device copy's git log is stale), one log per command line
# (each command appended to its log with the line that ran it), the benchmarks' JSON, RESULTS.md
# (the rows the benchmarks wrote, each under its section's heading: a fragment to copy into
# benchmarks/RESULTS.md), timing.txt (each part's seconds and outcome) and summary.txt (the
# same with each log's last lines, which are also printed). The exit status is 1 if any part
# failed or was not run for lack of time, 2 for a usage error.
#
# Carried wheels (.whl/, built where there is network by benchmarks/fetch_wheels.sh, carried
# with carry=[".whl"]) are installed once by benchmarks/gpu_setup.sh. A part that needs what is
# not there (two GPUs, DeepSpeed, TRL) fails when named, and is skipped under `all`.
#
# Time: the `two` parts and the `tests` part end within BUDGET seconds of this command's start
# (570: a device call may run 600; no limit by default with `all`), each benchmark part has its
# own timeout; a bench_trl.py part's is cut to what is left of BUDGET where that is less. The tests record every outcome in a ledger (TESTS_LEDGER, by default
# /tmp/tidal-gpu/tests.ledger, kept while the machine stays warm, copied to $OUT/tests.ledger);
# the next call runs only the tests not in it, and tests.log ends with the tally over all calls.
# TESTS_FRESH=1 starts a new ledger; on a fresh machine carry the returned ledger and pass
# TESTS_LEDGER=<its path>.
#
# Knobs (environment): OUT, DRY, TAIL (log lines shown), BUDGET, TESTS (the paths of a tests
# part), TESTS_TIMEOUT; trl: VARIANTS, VARIANTS7B, VARIANTS_STRESS, VARIANTSDS, STEPS,
# BENCH_TIMEOUT, BENCH_ARGS (more bench_trl.py arguments), TAG (names the JSON), DEMO_FLAGS,
# BASE_STEPS (the demo's all-resident steps), DEMO_TAG (names its log and folder);
# CONTENTION_ARGS, DECODE_ARGS, DECODE_TIMEOUT; the others as named above, and SMALL_TIMEOUT,
# BIG_TIMEOUT, HOST_TIMEOUT, DEMO_TIMEOUT, ACC_STEPS, LEASE_TIMEOUT, TURNS, CHUNK_MB, DEMO_STEPS,
# LEASE2_TIMEOUT, CKPT_TIMEOUT, NOTE, SHAPES_TIMEOUT, SHAPES_ARGS, SHAPES_BEFORE.
#
# shellcheck disable=SC2086,SC2329  # knobs (TESTS, BENCH_ARGS) hold several words; parts run by name
set -uo pipefail
SELF="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")"
cd "$(dirname "$SELF")/.." || exit 2
DRY=${DRY:-0}

usage() { awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$SELF" | sed '/^shellcheck/d'; }

# ---- suites: the parts run when a suite is named alone, then the others --------------------
declare -A DEFAULT=(
  [core]="tests bench offload reliability elision"
  [trl]="tests bench 7b"
  [vmm]="tests bench"
  [vllm]="tests bench"
  [demo]="tests bench plan-small plan-7b prefetch timeline"
  [activations]="tests bench"
  [cpu_adam]="tests train host accumulate"
  [lease]="tests bench"
  [deepspeed]="tests bench"
  [guard]="tests bench"
  [two]="lease2 ckpt tests"
  [multi]="tests fsdp14b"
  [tests]="gpu"
)
declare -A EXTRA=(
  [core]="overhead ckpt1 shapes"
  [trl]="14b paired cores stress stress-1.5b stress-7b ds demo7b profile contention decode"
  [demo]=""
  [cpu_adam]="bench precision"
  [lease]="processes"
  [deepspeed]="bench-1.5b"
  [multi]="ddp7b copies decode save zero3 fsdp4"
  [vllm]="7b 7b80 14b demo paired turns identity long"
)
ALL_ORDER="tests core activations cpu_adam vmm guard lease demo deepspeed trl two multi"

# ---- the command line --------------------------------------------------------------------
if [ $# = 0 ]; then usage >&2; exit 2; fi
QUEUE=()
queue() {  # queue SUITE PART VIA: once each
  local item
  for item in ${QUEUE[@]+"${QUEUE[@]}"}; do
    if [ "${item% *}" = "$1 $2" ]; then return; fi
  done
  QUEUE+=("$1 $2 $3")
}
has_part() { case " ${DEFAULT[$1]} ${EXTRA[$1]:-} " in *" $2 "*) return 0 ;; *) return 1 ;; esac; }
with_all=0
for arg in "$@"; do
  case $arg in
    -h | --help | help) usage; exit 0 ;;
    all)
      with_all=1
      for s in $ALL_ORDER; do
        for p in ${DEFAULT[$s]}; do
          if [ "$p" != tests ]; then queue "$s" "$p" all; fi
        done
      done ;;
    *:*)
      s=${arg%%:*} p=${arg#*:}
      if [ -z "${DEFAULT[$s]+x}" ] || ! has_part "$s" "$p"; then
        echo "gpu.sh: no part '$arg' (bash benchmarks/gpu.sh --help lists them)" >&2; exit 2
      fi
      queue "$s" "$p" named ;;
    *)
      if [ -z "${DEFAULT[$arg]+x}" ]; then
        echo "gpu.sh: no suite '$arg' (bash benchmarks/gpu.sh --help lists them)" >&2; exit 2
      fi
      for p in ${DEFAULT[$arg]}; do queue "$arg" "$p" named; done ;;
  esac
done
if [ $with_all = 1 ]; then BUDGET=${BUDGET:-1000000}; fi
BUDGET=${BUDGET:-570}
TAG=${TAG:-run}
LEDGER=${TESTS_LEDGER:-/tmp/tidal-gpu/tests.ledger}
T0=$(date +%s)

# shellcheck source=benchmarks/gpu_setup.sh
source benchmarks/gpu_setup.sh
if [ "${TESTS_FRESH:-0}" = 1 ] && [ "$DRY" != 1 ]; then rm -f "$LEDGER"; fi

# ---- helpers -----------------------------------------------------------------------------
q() {  # a command's words, each quoted for a shell where it needs to be
  local w line=""
  for w in "$@"; do
    if [[ $w =~ ^[A-Za-z0-9_./:=,+@%-]+$ ]]; then line+="$w "; else line+="$(printf '%q' "$w") "; fi
  done
  printf '%s' "${line% }"
}
PART_RC=0     # 1 once a command of the running part failed
PART_LOGS=()  # the logs the running part wrote, for their tails
SKIP=""       # why the running part did not run: what it needs is not here
FAIL=""       # why the running part did not run: no time left
TAILN=15      # lines of each log shown after the part
note_log() {
  local l
  for l in ${PART_LOGS[@]+"${PART_LOGS[@]}"}; do if [ "$l" = "$1" ]; then return; fi; done
  PART_LOGS+=("$1")
}
run() {  # run LOG CMD...: CMD's output appended to $OUT/LOG, after the line that ran it
  local log=$1 rc
  shift
  note_log "$log"
  if [ "$DRY" = 1 ]; then echo "  $(q "$@") >> $OUT/$log 2>&1"; return 0; fi
  echo "\$ $(q "$@")" >> "$OUT/$log"
  "$@" >> "$OUT/$log" 2>&1
  rc=$?
  if [ $rc != 0 ]; then PART_RC=1; echo "(exit status $rc)" >> "$OUT/$log"; fi
  return $rc
}
x() {  # x CMD...: a command whose output is not worth a log
  if [ "$DRY" = 1 ]; then echo "  $(q "$@")"; return 0; fi
  "$@" || PART_RC=1
}
pyrun() {  # pyrun LOG WHAT CODE ARGS...: a short Python program kept in this file
  local log=$1 what=$2 code=$3
  shift 3
  note_log "$log"
  if [ "$DRY" = 1 ]; then echo "  python3 -c <$what> $(q "$@") >> $OUT/$log 2>&1"; return 0; fi
  echo "\$ python3 -c <$what> $(q "$@")" >> "$OUT/$log"
  python3 -c "$code" "$@" >> "$OUT/$log" 2>&1 || PART_RC=1
}
TIMED=()  # host peak RSS of the demo runs, where /usr/bin/time exists
if [ -x /usr/bin/time ]; then TIMED=(/usr/bin/time -v); fi
left() { echo $(( T0 + BUDGET - $(date +%s) )); }
limit() { local l; l=$(left); echo $(( $1 < l ? $1 : l )); }  # a part's own limit, or what is left
in_budget() {
  if [ "$DRY" != 1 ] && [ "$(left)" -lt 30 ]; then
    FAIL="not run: $(left) s left of BUDGET=$BUDGET"; return 1
  fi
}
need_gpus() {
  local n
  if [ "$DRY" = 1 ]; then return 0; fi
  n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
  if [ "$n" -lt "$1" ]; then SKIP="needs $1 GPUs, $n here"; return 1; fi
}
need_module() {
  if [ "$DRY" = 1 ]; then return 0; fi
  if ! python3 -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$1') is None)" 2>/dev/null; then
    SKIP="needs $1: carry .whl/ from benchmarks/fetch_wheels.sh"; return 1
  fi
}
# Lines of a log not worth showing: progress bars, warnings, blank lines, /usr/bin/time's
# lines (a tab first) other than the peak RSS.
NOISE='it/s\]|s/it\]|Warning|warnings\.warn|forward_call|^\s*$|^'$'\t''(Command|User|System|Percent|Elapsed|Average|Major|Minor|Volun|Invol|Swaps|File|Socket|Signals|Page|Exit)'
tails() {
  local log
  for log in ${PART_LOGS[@]+"${PART_LOGS[@]}"}; do
    if [ -f "$OUT/$log" ]; then
      echo "-- $log"
      grep -vE "$NOISE" "$OUT/$log" | tail -n "${TAIL:-$TAILN}"
    fi
  done
}

# ---- what a suite sets up once, before its first part --------------------------------------
declare -A READY=()
setup_suite() {
  if [ -n "${READY[$1]+x}" ]; then return; fi
  READY[$1]=1
  case $1 in
    trl)
      if [ "$DRY" != 1 ]; then
        python3 -c "import trl, datasets; print('trl', trl.__version__, '| datasets', datasets.__version__)" 2>&1 \
          | tail -1 | tee -a "$OUT/env.txt"
      fi ;;
    vmm) if [ "$DRY" = 1 ]; then install_tms; else install_tms 2>&1 | tee -a "$OUT/env.txt"; fi ;;
    vllm)
      if [ "$DRY" != 1 ]; then
        # shellcheck source=benchmarks/vllm_stage.sh
        source benchmarks/vllm_stage.sh
        python3 -c "import vllm, trl; print('vllm', vllm.__version__, '| trl', trl.__version__)" 2>&1 | tail -1 \
          | tee -a "$OUT/env.txt"
      fi ;;
    deepspeed)
      if [ "$DRY" != 1 ]; then
        if command -v nvcc >/dev/null; then nvcc --version | tail -1
        else echo "no nvcc: DeepSpeed's FusedAdam (ZeRO-3 offload_states) cannot build"; fi | tee -a "$OUT/env.txt"
      fi ;;
  esac
}

# ---- core -------------------------------------------------------------------------------
p_core_tests() {
  run core_tests.log timeout "${TESTS_TIMEOUT:-420}" python3 -m pytest -q -m gpu ${TESTS:-tests/transfer tests/state tests/timeshare} \
    --ignore=tests/timeshare/test_region_role_gpu.py --durations=8 -p no:cacheprovider -rs
}
p_core_bench() {
  run tidal_bench.log timeout 240 python3 -m tidal_recipes bench --preset qwen2-1.5b --results "$OUT/RESULTS.md" \
    --json "$OUT/bench.json"
}
p_core_offload() {
  TAILN=25
  run bench_offload.log python3 benchmarks/bench_offload.py --results "$OUT/RESULTS.md" --json-dir "$OUT"
  run bench_offload.log python3 -m tidal_recipes bench --preset qwen2-1.5b --keep-cache --results "$OUT/RESULTS.md"
}
p_core_shapes() {
  TAILN=60
  if [ -d .before ]; then  # an earlier checkout (with this bench_shapes.py), measured first
    run bench_shapes_before.log env -C .before PYTHONPATH="$PWD/.before" timeout "${SHAPES_TIMEOUT:-540}" \
      python3 benchmarks/bench_shapes.py ${SHAPES_ARGS:-} ${SHAPES_BEFORE:+--shapes "$SHAPES_BEFORE"} \
      --json "$OUT/shapes_before_$TAG.json"
  fi
  run bench_shapes.log timeout "${SHAPES_TIMEOUT:-540}" python3 benchmarks/bench_shapes.py --trace ${SHAPES_ARGS:-} \
    --json "$OUT/shapes_$TAG.json"
}
p_core_reliability() {
  run bench_reliability.log timeout 250 python3 benchmarks/bench_reliability.py --results "$OUT/RESULTS.md"
}
p_core_elision() {
  run bench_elision.log timeout 300 python3 benchmarks/bench_elision.py --results "$OUT/RESULTS.md"
}
p_core_overhead() {
  if [ -d .before ]; then  # an earlier checkout, measured beside this one
    run overhead_before.log env -C .before PYTHONPATH="$PWD/.before" timeout 120 python3 benchmarks/bench_overhead.py \
      --results "$OUT/RESULTS.md" --note before
  fi
  run overhead.log timeout 120 python3 benchmarks/bench_overhead.py --results "$OUT/RESULTS.md" --note "${NOTE:-after}"
}
p_core_ckpt1() {
  run ckpt1.log timeout 120 python3 benchmarks/bench_checkpoint.py --world 1 --cycles 12 --budget-s 0
}

# ---- trl --------------------------------------------------------------------------------
trl_bench() {  # trl_bench LOG ARGS...: one bench_trl.py run
  local log=$1
  shift
  TAILN=40
  # The limit: BENCH_TIMEOUT, or what is left of BUDGET if less (a part before it, a wait for
  # a background save, took some). The bench ends its training where another step would pass
  # it (30 s kept to write the results): a run cut short still yields the steps it ran.
  local limit=${BENCH_TIMEOUT:-540}
  if [ "$DRY" != 1 ] && [ "$(left)" -lt "$limit" ]; then limit=$(left); fi
  if [ "$limit" -lt 60 ]; then limit=60; fi
  run "$log" timeout "$limit" python3 benchmarks/bench_trl.py --results "$OUT/RESULTS.md" "$@" \
    --deadline-s "$(( limit - 30 ))" ${BENCH_ARGS:-}
}
# ---- vllm -------------------------------------------------------------------------------
need_vllm() {
  if [ "$DRY" = 1 ]; then return 0; fi
  if [ "${VLLM_READY:-0}" != 1 ]; then SKIP="vLLM not staged yet (carry the next part of .vllm/)"; return 1; fi
}
p_vllm_tests() {
  need_vllm || return 0
  run vllm_tests.log timeout "${TESTS_TIMEOUT:-300}" python3 -m pytest -q -m gpu tests/integrations -rs --durations=5 \
    -p no:cacheprovider
}
vllm_bench() {  # vllm_bench LOG PRESET VARIANTS TAGNAME [ARGS...]
  local log=$1 preset=$2 variants=$3 name=$4
  shift 4
  need_vllm || return 0
  run "$log" timeout "$(limit "${BENCH_TIMEOUT:-590}")" python3 benchmarks/bench_trl_vllm.py --preset "$preset" \
    --variants "$variants" --steps "${VLLM_STEPS:-4}" --warmup 1 --json "$OUT/vllm_${name}_$TAG.json" "$@" \
    ${VLLM_ARGS:-}
}
p_vllm_bench() { vllm_bench vllm_bench.log qwen2-1.5b "${VLLM_VARIANTS:-trl,tidal}" 1.5b; }
p_vllm_7b() { vllm_bench vllm_bench7b.log qwen2-7b "${VLLM_VARIANTS7B:-trl,tidal}" 7b; }
p_vllm_paired() {
  vllm_bench vllm_paired.log "${VLLM_PRESET:-qwen2-1.5b}" "${VLLM_VARIANTS_PAIRED:-trl,tidal+prefetch}" paired \
    --rounds "${VLLM_ROUNDS:-6}"
}
p_vllm_turns() {
  VLLM_STEPS="${VLLM_STEPS_TURNS:-10}" vllm_bench vllm_turns.log "${VLLM_PRESET:-qwen2-1.5b}" \
    "trl,${VLLM_VARIANT_TURNS:-tidal+role+prefetch+kv=auto}" turns --turns --rounds "${VLLM_TURN_ROUNDS:-2}"
}
p_vllm_demo() {  # tidal demo rolling out with vLLM (DEMO_VLLM_FLAGS)
  need_vllm || return 0
  run vllm_demo.log timeout "$(limit "${BENCH_TIMEOUT:-590}")" python3 -m tidal_recipes demo --device cuda \
    --rollout-engine vllm --out "$OUT/demo_vllm" ${DEMO_VLLM_FLAGS:---preset qwen2-0.5b --steps 5}
}
p_vllm_14b() {
  VLLM_STEPS="${VLLM_STEPS14B:-10}" vllm_bench vllm_bench14b.log qwen2.5-14b \
    "${VLLM_VARIANTS14B:-tidal+role+prefetch+kv=auto,trl}" 14b --micro "${VLLM_MICRO14B:-16}" \
    --max-model-len "${VLLM_LEN14B:-320}"
}
p_vllm_identity() {
  VLLM_STEPS="${VLLM_STEPS_ID:-3}" vllm_bench vllm_identity.log "${VLLM_PRESET:-qwen2-1.5b}" \
    "${VLLM_VARIANTS_ID:-trl,trl,tidal+prefetch,tidal+role+prefetch+kv=auto}" identity --warmup 0
}
p_vllm_long() {
  local n="${VLLM_LONG:-2048}"
  VLLM_STEPS="${VLLM_STEPS_LONG:-2}" vllm_bench vllm_long.log qwen2-7b \
    "${VLLM_VARIANTS_LONG:-trl,tidal+role+prefetch+kv=auto}" "long$n" --completion "$n" \
    --max-model-len "$((n + 64))" --micro "${VLLM_MICRO_LONG:-4}"
}
p_vllm_7b80() { vllm_bench vllm_bench7b80.log qwen2-7b "${VLLM_VARIANTS80:-trl,tidal+kv=4}" 7b80 --cap-gib 80; }

p_trl_tests() {
  run trl_tests.log timeout "${TESTS_TIMEOUT:-200}" python3 -m pytest -q -m gpu tests/integrations tests/timeshare tests/state -rs \
    --durations=5 -p no:cacheprovider
}
p_trl_bench() {
  need_module trl || return 0
  trl_bench trl_bench.log --preset qwen2-1.5b --dtype float32 --batch 64 --completion 256 --steps "${STEPS:-4}" \
    --variants "${VARIANTS:-trl,stream,stream+prefetch}" --json "$OUT/trl_1.5b_64x256_$TAG.json"
}
p_trl_7b() {
  need_module trl || return 0
  trl_bench trl_bench7b.log --preset qwen2-7b --dtype bfloat16 --batch 64 --completion 256 --steps "${STEPS:-4}" \
    --variants "${VARIANTS7B:-trl,role+prefetch,stream+prefetch,trl}" --json "$OUT/trl_7b_64x256_$TAG.json"
}
p_trl_14b() {  # the Qwen2.5-14B shape on one GPU, 64 x 256 in micro-batches (MICRO14B, 16)
  need_module trl || return 0
  trl_bench trl_bench14b.log --preset qwen2.5-14b --dtype bfloat16 --batch 64 --completion 256 \
    --micro-batch "${MICRO14B:-16}" --steps "${STEPS14B:-11}" --variants "${VARIANTS14B_ONE:-stream+prefetch}" \
    --json "$OUT/trl_14b_64x256_$TAG.json"
}
FASTEST_CORES='
import json, sys

# The two fastest cores of bench_host_cores.py (its "calls": Python on the core), as A,B.
calls = json.load(open(sys.argv[1]))["summary"]["calls"]["per_cpu_s"]
print(",".join(sorted(calls, key=calls.get)[:2]))
'
main_cores() {  # MAIN_CORES=A,B as given, or MAIN_CORES=fast: the two fastest of this call's cores part
  if [ "$MAIN_CORES" != fast ]; then echo "$MAIN_CORES"; return; fi
  if [ "$DRY" = 1 ]; then echo "<the two fastest cores of $OUT/host_cores_$TAG.json>"; return; fi
  python3 -c "$FASTEST_CORES" "$OUT/host_cores_$TAG.json"
}
p_trl_cores() {  # each core's Python speed and memory distance, then a 1.5B decode on the fastest and slowest
  run trl_cores.log timeout "${CORES_TIMEOUT:-240}" python3 benchmarks/bench_host_cores.py ${CORES_ARGS:---decode qwen2-1.5b} \
    --json "$OUT/host_cores_$TAG.json"
}
p_trl_paired() {  # TRL alone and tidal alternating in one process, PAIRED (6) pairs: the step ratio's 95% interval
  need_module trl || return 0
  local args=(--preset qwen2-1.5b --dtype float32 --batch 64 --completion 256 --steps "${STEPS:-3}"
    --variants "${VARIANTS_PAIRED:-trl,stream+prefetch+peak=17}" --paired "${PAIRED:-6}" --in-process)
  local k=${PAIRED_GPUS:-1} i pids=() files=()
  if [ "$k" = 1 ]; then
    trl_bench trl_paired.log "${args[@]}" --json "$OUT/trl_1.5b_paired_$TAG.json"
    return
  fi
  # PAIRED_GPUS=k: k such processes at once, one a GPU, their pairs pooled (pool_paired.py):
  # k times the pairs in a call's time. They share the host (cores, memory, PCIe fabric).
  # LOCKSTEP=1 (k = 2): the two start every step together, one running TRL alone while the
  # other runs tidal (lockstep.py): each tidal step is paired with the TRL step beside it too.
  # TAKE_TURNS=1 (with LOCKSTEP=1): the two share GPU 0 and take turns step by step instead.
  local pool_args=() port=${LOCKSTEP_PORT:-29611} turns=${TAKE_TURNS:-0}
  if [ "$turns" = 1 ] && [ "${LOCKSTEP:-0}" != 1 ]; then
    echo "TAKE_TURNS=1 makes the LOCKSTEP=1 processes take turns on one GPU: set LOCKSTEP=1" >&2; PART_RC=1; return 0
  fi
  if [ "$turns" = 1 ]; then need_gpus 1 || return 0; else need_gpus "$k" || return 0; fi
  if [ "${LOCKSTEP:-0}" = 1 ]; then
    if [ "$k" != 2 ]; then echo "LOCKSTEP=1 pairs two processes: set PAIRED_GPUS=2" >&2; PART_RC=1; return 0; fi
    pool_args=(--lockstep)
  fi
  for (( i = 0; i < k; i++ )); do
    note_log "trl_paired.gpu$i.log"  # here: the background shell's own note would be lost
    local gpu=$i
    if [ "$turns" = 1 ]; then gpu=0; fi
    if [ "$DRY" = 1 ]; then echo "  (in the background, GPU $gpu:)"; fi
    local more=()
    if [ "${LOCKSTEP:-0}" = 1 ]; then more=(--lockstep "127.0.0.1:$port" --lockstep-rank "$i"); fi
    if [ "$turns" = 1 ]; then more+=(--turns); fi
    if [ "${LOCKSTEP:-0}" = 1 ] && [ -n "${MAIN_CORES:-}" ]; then more+=(--main-cores "$(main_cores)"); fi
    { export CUDA_VISIBLE_DEVICES=$gpu
      if [ "${PIN_CORES:-0}" = 1 ] && [ "$DRY" != 1 ]; then
        # PIN_CORES=1: each process (and what it starts) on its own k-th of the host's cores,
        # with as many intra-op threads: the host-bound decodes do not meet on a core.
        local n per
        n=$(nproc); per=$(( n / k ))
        taskset -cp "$(( i * per ))-$(( (i + 1) * per - 1 ))" $BASHPID >> "$OUT/trl_paired.gpu$i.log"
        export OMP_NUM_THREADS=$per
      fi
      trl_bench "trl_paired.gpu$i.log" "${args[@]}" "${more[@]}" --json "$OUT/trl_1.5b_paired_$TAG.gpu$i.json"; } &
    pids+=($!)
    files+=("$OUT/trl_1.5b_paired_$TAG.gpu$i.json")
  done
  for i in "${pids[@]}"; do wait "$i" || PART_RC=1; done  # each one's PART_RC was set in its own shell
  # A process that died wrote no JSON: the others' pairs are still pooled (its log says why).
  local have=() f
  for f in "${files[@]}"; do
    if [ "$DRY" = 1 ] || [ -f "$f" ]; then have+=("$f"); else echo "== no $f: pooled without it" >> "$OUT/trl_paired.log"; fi
  done
  note_log trl_paired.log
  if [ ${#have[@]} = 0 ]; then PART_RC=1; return 0; fi
  if [ ${#pool_args[@]} -gt 0 ] && [ ${#have[@]} != 2 ]; then pool_args=(); fi  # a partner died: in-process pairs only
  run trl_paired.log python3 benchmarks/pool_paired.py "${have[@]}" "${pool_args[@]}" --json "$OUT/trl_1.5b_paired_$TAG.json"
}
p_trl_stress_1_5b() {
  need_module trl || return 0
  trl_bench trl_stress.log --preset qwen2-1.5b --dtype float32 --batch 16 --completion 32 --steps 6 \
    --variants "${VARIANTS_STRESS:-trl,stream,stream+prefetch,role+prefetch}" --json "$OUT/trl_1.5b_16x32_$TAG.json"
}
p_trl_stress_7b() {
  need_module trl || return 0
  trl_bench trl_stress7b.log --preset qwen2-7b --dtype bfloat16 --batch 16 --completion 32 --steps 6 \
    --variants "${VARIANTS_STRESS:-trl,stream,stream+prefetch,role+prefetch}" --json "$OUT/trl_7b_16x32_$TAG.json"
}
p_trl_stress() {
  p_trl_stress_1_5b
  p_trl_stress_7b
}
p_trl_ds() {  # DeepSpeed ZeRO-3 with optimizer and parameter offload; its CPU Adam JIT-builds first (~1 min)
  need_module trl && need_module deepspeed || return 0
  trl_bench trl_ds7b.log --preset qwen2-7b --dtype bfloat16 --batch 64 --completion 256 --steps 3 \
    --variants "${VARIANTSDS:-ds-zero3-offload,stream+prefetch}" --json "$OUT/trl_7b_64x256_ds_$TAG.json"
}
p_trl_decode() {
  run trl_decode.log timeout "${DECODE_TIMEOUT:-300}" python3 benchmarks/bench_decode.py ${DECODE_ARGS:---preset qwen2-7b} \
    --json "$OUT/decode_$TAG.json"
}
p_trl_contention() {
  run trl_contention.log timeout "${CONTENTION_TIMEOUT:-300}" python3 benchmarks/bench_copy_contention.py ${CONTENTION_ARGS:---gib 16} \
    --json "$OUT/contention_$TAG.json"
}
p_trl_demo7b() {  # the demo at 7B with the mechanisms TidalGRPOTrainer uses, against its all-resident step
  TAILN=40
  # Two all-resident steps: AdamW creates its state in the first one's step(), after the
  # forward and backward; only the second holds it beside the activations.
  run "trl_demo7b${DEMO_TAG:-}.log" timeout "${BENCH_TIMEOUT:-540}" python3 -m tidal_recipes demo --preset qwen2-7b \
    --steps "${STEPS:-4}" --baseline-steps "${BASE_STEPS:-2}" --async-transitions ${DEMO_FLAGS:---prefetch} \
    --out "$OUT/demo7b${DEMO_TAG:-}"
}
p_trl_profile() {
  need_module trl || return 0
  trl_bench trl_profile.log --preset qwen2-1.5b --dtype float32 --batch 64 --completion 256 --steps "${STEPS:-4}" \
    --profile-step "${STEPS:-4}" --variants "${VARIANTS:-trl,stream,stream+prefetch}" \
    --picture "$OUT/profile_1.5b_64x256_$TAG.png" --json "$OUT/profile_1.5b_64x256_$TAG.json"
}

# ---- vmm --------------------------------------------------------------------------------
p_vmm_tests() {
  run vmm_tests.log timeout 300 python3 -m pytest -q tests/vmm tests/timeshare/test_region_role_gpu.py \
    tests/timeshare/test_region_role.py -p no:cacheprovider --durations=5
}
p_vmm_bench() {
  TAILN=40
  run bench_vmm.log timeout 400 python3 benchmarks/bench_vmm.py --results "$OUT/RESULTS.md" ${VMM_ARGS:-}
}

# ---- demo -------------------------------------------------------------------------------
p_demo_tests() {
  run demo_tests.log env TQDM_DISABLE=1 python3 -m pytest -q -m gpu tests/recipes tests/timeshare tests/state tests/optim \
    tests/plan ${EXTRA_TESTS:-}
}
p_demo_bench() {
  TAILN=60
  run bench_demo.log env TQDM_DISABLE=1 python3 benchmarks/bench_demo.py --out "$OUT/demo" --results "$OUT/RESULTS.md"
}
p_demo_plan_small() {
  TAILN=24
  run demo_small.log timeout "${SMALL_TIMEOUT:-150}" ${TIMED[@]+"${TIMED[@]}"} python3 -m tidal_recipes demo \
    --preset qwen2-0.5b --steps "${PLAN_STEPS:-5}" --baseline-steps 2 --out "$OUT/demo-small"
}
p_demo_plan_7b() {
  TAILN=26
  run demo_7b.log timeout "${BIG_TIMEOUT:-300}" ${TIMED[@]+"${TIMED[@]}"} python3 -m tidal_recipes demo --preset qwen2-7b \
    --steps "${BIG_STEPS:-4}" --baseline-steps 1 --out "$OUT/demo-7b"
}
p_demo_prefetch() {
  TAILN=30
  run bench_prefetch.log timeout "${BENCH_TIMEOUT:-540}" python3 benchmarks/bench_prefetch.py --steps "${PREFETCH_STEPS:-6}" \
    ${PREFETCH_ARGS:-} --results "$OUT/RESULTS.md"
}
p_demo_timeline() {  # both panels on one memory scale: the timeshare, then every role resident
  run timeline.log env TQDM_DISABLE=1 python3 -m tidal_recipes demo --steps "${TIMELINE_STEPS:-10}" \
    --baseline-steps "${TIMELINE_BASELINE_STEPS:-3}" --out "$OUT/demo-timeline" ${TIMELINE_ARGS:-} || return 0
  x cp "$OUT/demo-timeline/timeline.png" "$OUT/timeline.png"
  x mv "$OUT/demo-timeline/demo.jsonl" "$OUT/timeline.jsonl"
  x rm -rf "$OUT/demo-timeline"
  if [ "$DRY" != 1 ]; then
    echo "wrote $OUT/timeline.png: copy it to docs/timeline.png, naming the GPU and $(grep -o 'commit .*' "$OUT/env.txt")" \
      >> "$OUT/timeline.log"
  fi
}

# ---- activations ------------------------------------------------------------------------
p_activations_tests() {
  run activations_tests.log timeout "${TESTS_TIMEOUT:-300}" python3 -m pytest -q -m gpu tests/activations --durations=5 \
    -p no:cacheprovider -rs
}
p_activations_bench() {
  TAILN=30
  run bench_activations.log timeout 300 python3 benchmarks/bench_activations.py --configs "${ACT_CONFIGS:-qwen2-1.5b-16L}" \
    --results "$OUT/RESULTS.md"
}

# ---- cpu_adam ---------------------------------------------------------------------------
p_cpu_adam_tests() {
  run cpu_adam_tests.log timeout "${TESTS_TIMEOUT:-200}" python3 -m pytest -q -m gpu ${TESTS:-tests/optim} --durations=5 \
    -p no:cacheprovider
}
p_cpu_adam_train() {
  TAILN=25
  run bench_cpu_adam_train.log timeout 300 python3 benchmarks/bench_cpu_adam.py --skip-throughput ${ADAM_ARGS:-} \
    --results "$OUT/RESULTS.md"
}
p_cpu_adam_host() {
  run cpu_adam_host.log timeout "${HOST_TIMEOUT:-300}" python3 benchmarks/bench_cpu_adam.py --skip-train \
    --throughput-params 1.5e9 --extrapolate-params 7.6e9 --results "$OUT/RESULTS.md"
}
p_cpu_adam_accumulate() {
  local acc
  for acc in host device; do
    run demo_$acc.log timeout "${DEMO_TIMEOUT:-170}" python3 -m tidal_recipes demo --preset qwen2-0.5b --steps "${ACC_STEPS:-5}" --baseline-steps 2 \
      --grad-accumulation $acc --out "$OUT/demo-$acc"
  done
}
p_cpu_adam_bench() {
  TAILN=25
  run bench_cpu_adam.log python3 benchmarks/bench_cpu_adam.py --results "$OUT/RESULTS.md"
}
p_cpu_adam_precision() {
  run bench_cpu_adam_precision.log python3 benchmarks/bench_cpu_adam_precision.py --steps 400 --results "$OUT/RESULTS.md"
}

# ---- lease ------------------------------------------------------------------------------
p_lease_tests() {
  run lease_tests.log timeout "${TESTS_TIMEOUT:-240}" python3 -m pytest -q -m gpu ${TESTS:-tests/distributed/test_lease_gpu.py \
    tests/distributed/test_lease_overlap_gpu.py tests/timeshare/test_evict_gpu.py} --durations=5 -p no:cacheprovider
}
p_lease_bench() {  # about 3.8 GB and 12 GB moved per hand-over, sequential and overlapped
  local gb
  for gb in ${ROLE_GB:-2 6}; do
    run bench_lease_$gb.log timeout "${LEASE_TIMEOUT:-200}" python3 benchmarks/bench_lease.py --overlap --role-gb "$gb" \
      --turns "${TURNS:-6}" --chunk-mb "${CHUNK_MB:-256}" --results "$OUT/RESULTS.md"
  done
}
p_lease_processes() {
  run demo_processes.log timeout 300 python3 -m tidal_recipes demo --roles processes --steps "${DEMO_STEPS:-8}" \
    --baseline-steps 0 --out "$OUT/demo-processes"
}

# ---- deepspeed --------------------------------------------------------------------------
p_deepspeed_tests() {
  need_module deepspeed || return 0
  # -s: the spawned test processes print what they measured (bytes, GB/s, driver memory)
  run deepspeed_gpu_tests.log python3 -m pytest -q -s -m gpu tests/distributed/test_deepspeed_gpu.py --durations=5
  run deepspeed_cpu_tests.log python3 -m pytest -q tests/distributed/test_deepspeed.py
}
p_deepspeed_bench() {
  need_module deepspeed || return 0
  run bench_deepspeed.log python3 benchmarks/bench_deepspeed.py --preset qwen2-0.5b --out "$OUT/bench_deepspeed_qwen2-0.5b.json"
}
p_deepspeed_bench_1_5b() {
  need_module deepspeed || return 0
  run bench_deepspeed.log python3 benchmarks/bench_deepspeed.py --preset qwen2-1.5b --out "$OUT/bench_deepspeed_qwen2-1.5b.json"
}

# ---- guard ------------------------------------------------------------------------------
p_guard_tests() {
  pyrun guard_tests.log "the guard's status" "from tidal import guard; print('storage guard:', guard.status())"
  run guard_tests.log python3 -m pytest -q -m gpu --durations=5 \
    tests/timeshare/test_foreign_access_gpu.py tests/timeshare/test_region_role_gpu.py \
    tests/vmm/test_region_gpu.py tests/timeshare/test_timeshare_gpu.py tests/timeshare/test_prefetch_gpu.py \
    tests/timeshare/test_no_wait_gpu.py tests/timeshare/test_interrupt_gpu.py tests/state/test_release_gpu.py
}
GUARD_MEDIANS='
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
key = "switch_s"
print(f"  {key:20s} off {off:7.3f} s     on {on:7.3f} s     time on/off {on / off:.4f}")
print("bit_exact:", [r.get("bit_exact") for m in ("off", "on") for r in runs[m]])
'
p_guard_bench() {  # interleaved in one session, then the medians side by side
  local i mode
  for i in $(seq 1 "${ROUNDS:-2}"); do
    for mode in off on; do
      run guard_bench.log env TIDAL_STORAGE_GUARD=$mode python3 -m tidal_recipes bench --preset qwen2-1.5b \
        --json "$OUT/guard_${mode}_$i.json"
    done
  done
  pyrun guard_bench.log "medians of guard_{off,on}_*.json" "$GUARD_MEDIANS" "$OUT"
}

# ---- two (a 2-GPU machine) and tests --------------------------------------------------
p_two_lease2() {  # ~60 s: two 12.3 GB roles built and pinned at once, 2 rounds x 3 phases x 6 turns
  need_gpus 2 && in_budget || return 0
  TAILN=12
  run two_bench.log timeout -k 10 "$(limit "${LEASE2_TIMEOUT:-170}")" python3 benchmarks/bench_lease.py --two-gpus --cycles 6 \
    --rounds 2 --timeout-s 160 --json "$OUT/lease2.json" --results "$OUT/RESULTS.md"
}
p_two_ckpt() {  # ~170 s on 2x H200: 8 transition cycles, 3 saves and 3 loads per case
  need_gpus 2 && in_budget || return 0
  TAILN=34
  run two_bench.log timeout -k 10 "$(limit "${CKPT_TIMEOUT:-230}")" python3 benchmarks/bench_checkpoint.py --cycles 8 \
    --repeats 3 --budget-s 170 --results "$OUT/RESULTS.md" --json "$OUT/ckpt.json"
}
p_multi_tests() {  # ONE_GPU_ON=k: the one-GPU tests on GPU k (absolute), beside the others, not after them
  need_gpus 2 || return 0
  need_module trl || return 0
  # One process, one GPU: TRL loads a model it is given by path with device_map="auto", over every GPU it sees.
  local one=(timeout "${TESTS_TIMEOUT:-300}" python3 -m pytest -q -m gpu tests/integrations/test_trl_gpu.py -rsfE \
    -p no:cacheprovider) pid=""
  if [ -n "${ONE_GPU_ON:-}" ]; then
    note_log multi_tests_one.log  # here: the background shell's own note would be lost
    run multi_tests_one.log env CUDA_VISIBLE_DEVICES="$ONE_GPU_ON" "${one[@]}" &
    pid=$!
  fi
  run multi_tests.log timeout "${TESTS_TIMEOUT:-300}" python3 -m pytest -q -m gpu tests/distributed/test_ddp_gpu.py \
    tests/distributed/test_fsdp_gpu.py tests/integrations/test_trl_launch_gpu.py -rsfE -p no:cacheprovider --durations=10
  if [ -n "$pid" ]; then
    wait "$pid" || PART_RC=1  # its PART_RC was set in the background shell
  else
    run multi_tests.log env CUDA_VISIBLE_DEVICES=0 "${one[@]}"
  fi
}
GENERATION_BESIDE='
import json, statistics, sys

# The generation of the FSDP2 run against that of the one-GPU run that ran at the same time
# (ONE14B=beside): per variant, the medians of their steps generate phase (device seconds) and
# of a token, and the generation per unit of the host probe beside it (the host speed then).
one, many = (json.load(open(path)) for path in sys.argv[1:3])
rows = {}
for v in many["variants"]:
    name = v["variant"]
    o = next((x for x in one["variants"] if x["variant"] == name and not x.get("error")), None)
    g = [s["generate"] for s in v.get("phase_s_steps") or [] if "generate" in s]
    g1 = [s["generate"] for s in (o or {}).get("phase_s_steps") or [] if "generate" in s]
    if v.get("error") or not g or not g1:
        continue
    t, t1 = v.get("token_gap_s") or {}, o.get("token_gap_s") or {}
    ratio = statistics.median(g) / statistics.median(g1)
    row = {"generate_s": g, "one_gpu_generate_s": g1, "ratio": ratio}
    if t.get("median") and t1.get("median"):
        row["token_ratio"] = t["median"] / t1["median"]
    if t.get("probe") and t1.get("probe"):
        row["per_probe_ratio"] = ratio * t1["probe"] / t["probe"]
    rows[name] = row
    nproc, tok, probe = many.get("nproc"), row.get("token_ratio", float("nan")), row.get("per_probe_ratio", float("nan"))
    print(
        f"{name}: generation {statistics.median(g):.2f} s a step on each of {nproc} GPUs against "
        f"{statistics.median(g1):.2f} s on one GPU at the same time: {ratio:.3f}x (target <= 1.15x); "
        f"a token {tok:.3f}x; per unit of the host probe {probe:.3f}x"
    )
json.dump({"beside": rows, "one_gpu": sys.argv[1], "several": sys.argv[2]}, open(sys.argv[3], "w"))
if not rows:
    sys.exit("no variant ran in both: see their logs")
'
p_multi_fsdp14b() {  # ONE14B=1: one GPU first (STEPS_ONE steps); ONE14B=beside: at the same time, on the GPU after them
  need_gpus 2 && need_module trl || return 0
  local one=()
  if [ "${ONE14B:-0}" = beside ]; then
    # The one-GPU run beside the FSDP2 run, at the same time: both see the host's speed of the
    # moment, which sets a host-bound decode's pace (it drifted 2x within one process).
    need_gpus 3 || return 0
    wait_saved qwen2.5-14b
    if [ "$DRY" != 1 ] && ! [ -f /tmp/bench_models/qwen2.5-14b/bench_trl_saved ]; then
      # Two benches saving one model into one folder at once would write over each other.
      echo "== ONE14B=beside needs the model saved first: name multi:save before this part" >> "$OUT/multi_fsdp14b.log"
      note_log multi_fsdp14b.log; PART_RC=1; return 0
    fi
    local bench=(--preset qwen2.5-14b --dtype bfloat16 --batch 64 --completion 256 --model-cache /tmp/bench_models)
    if [ "$DRY" = 1 ]; then echo "  (in the background, GPU 2:)"; fi
    { export CUDA_VISIBLE_DEVICES=2; trl_bench multi_fsdp14b_one.log "${bench[@]}" --steps "${STEPS_ONE:-${STEPS:-4}}" \
      --variants "${VARIANTS14B_ONE:-stream+prefetch}" --json "$OUT/trl_14b_one_$TAG.json"; } &
    local pid=$!
    CUDA_VISIBLE_DEVICES=0,1 trl_bench multi_fsdp14b.log "${bench[@]}" --steps "${STEPS:-4}" --nproc 2 --launch fsdp2 \
      --variants "${VARIANTS14B:-stream+prefetch}" --json "$OUT/trl_14b_fsdp2x2_$TAG.json"
    wait "$pid" || PART_RC=1
    pyrun multi_fsdp14b.log "generation beside one GPU" "$GENERATION_BESIDE" "$OUT/trl_14b_one_$TAG.json" \
      "$OUT/trl_14b_fsdp2x2_$TAG.json" "$OUT/trl_14b_beside_$TAG.json"
    return
  fi
  if [ "${ONE14B:-0}" = 1 ]; then
    trl_bench multi_fsdp14b.log --preset qwen2.5-14b --dtype bfloat16 --batch 64 --completion 256 \
      --steps "${STEPS_ONE:-${STEPS:-4}}" --variants "${VARIANTS14B_ONE:-stream+prefetch}" \
      --json "$OUT/trl_14b_one_$TAG.json" --model-cache /tmp/bench_models
    one=(--one-gpu-json "$OUT/trl_14b_one_$TAG.json")
  fi
  trl_bench multi_fsdp14b.log --preset qwen2.5-14b --dtype bfloat16 --batch 64 --completion 256 --steps "${STEPS:-4}" \
    --nproc 2 --launch fsdp2 --variants "${VARIANTS14B:-trl,stream+prefetch}" --json "$OUT/trl_14b_fsdp2x2_$TAG.json" \
    --model-cache /tmp/bench_models ${one[@]+"${one[@]}"}
}
p_multi_ddp7b() {  # one GPU, then four: the throughput ratio in the same call
  need_gpus 4 && need_module trl || return 0
  trl_bench multi_ddp7b.log --preset qwen2-7b --dtype bfloat16 --batch 64 --completion 256 --steps "${STEPS:-4}" \
    --variants "${VARIANTS_ONE:-role+prefetch}" --json "$OUT/trl_7b_one_$TAG.json"
  trl_bench multi_ddp7b.log --preset qwen2-7b --dtype bfloat16 --batch 64 --completion 256 --steps "${STEPS:-4}" \
    --nproc 4 --launch ddp --variants "${VARIANTS_DDP:-role+prefetch,trl}" --json "$OUT/trl_7b_ddpx4_$TAG.json" \
    --one-gpu-json "$OUT/trl_7b_one_$TAG.json"
}
p_multi_copies() {
  need_gpus 2 || return 0
  local n
  n=$(python3 -c 'import torch; print(torch.cuda.device_count())')
  run multi_copies.log timeout "${COPIES_TIMEOUT:-240}" python3 -m torch.distributed.run --standalone --nproc_per_node "$n" \
    benchmarks/bench_shared_copies.py --gib "${COPY_GIB:-4}" --reps "${COPY_REPS:-3}" --json "$OUT/shared_copies_$TAG.json"
}
p_multi_decode() {  # FSDP2's gathered generation against the same model whole, in one process a GPU
  need_gpus 2 || return 0
  run multi_decode.log timeout "${FSDP_DECODE_TIMEOUT:-300}" python3 -m torch.distributed.run --standalone \
    --nproc_per_node "${DECODE_GPUS:-2}" benchmarks/bench_fsdp_decode.py ${FSDP_DECODE_ARGS:---preset qwen2.5-14b} \
    --json "$OUT/fsdp_decode_$TAG.json"
}
p_multi_save() {  # in the background: the parts that need a model wait for it (wait_saved)
  need_gpus 2 || return 0
  local presets=${SAVE_PRESETS:-qwen2.5-32b qwen2.5-14b} last
  note_log multi_save.log
  if [ "$DRY" = 1 ]; then echo "  (background) save $presets on the last GPU"; return 0; fi
  last=$(( $(nvidia-smi -L | grep -c '^GPU') - 1 ))
  mkdir -p /tmp/bench_models
  echo "== $(date -u '+%H:%M:%S') saving $presets on GPU $last in the background" >> "$OUT/multi_save.log"
  # setsid: it outlives this call (the next one, on the same warm machine, finds the models).
  # shellcheck disable=SC2016  # expanded by the inner shell
  setsid nohup env CUDA_VISIBLE_DEVICES="$last" bash -c '
    for p in $0; do echo $$ > /tmp/bench_models/$p.saving; done  # all at once: a wait finds each
    for p in $0; do
      python3 benchmarks/bench_trl.py --_prepare --preset $p --_model /tmp/bench_models/$p \
        --_out /tmp/bench_models/$p.prepared.json > /tmp/bench_models/$p.save.log 2>&1
      echo "exit $? at $(date -u +%H:%M:%S)" >> /tmp/bench_models/$p.save.log
      rm -f /tmp/bench_models/$p.saving
    done' "$presets" > /dev/null 2>&1 < /dev/null &
}
wait_saved() {  # wait_saved PRESET: until the background save of PRESET (if one runs) ends
  local p=$1 t=0
  if [ "$DRY" = 1 ]; then return 0; fi
  while [ -f "/tmp/bench_models/$p.saving" ] && kill -0 "$(cat "/tmp/bench_models/$p.saving")" 2>/dev/null; do
    sleep 2; t=$(( t + 2 ))
  done
  if [ -f "/tmp/bench_models/$p.save.log" ]; then
    { echo "== $p: waited $t s for its background save; its log:"; cat "/tmp/bench_models/$p.save.log"; } >> "$OUT/multi_save.log"
  fi
}
p_multi_zero3() {  # the anchor of the fsdp4 rows: TRL alone under DeepSpeed ZeRO-3 with parameters and optimizer on the CPU
  need_gpus 4 && need_module trl && need_module deepspeed || return 0
  local p=${ZERO3_PRESET:-qwen2.5-32b}
  wait_saved "$p"
  trl_bench multi_zero3.log --preset "$p" --dtype bfloat16 --batch 64 --completion 256 --steps "${ANCHOR_STEPS:-2}" \
    --nproc 4 --launch zero3-offload --variants trl --json "$OUT/trl_${p}_zero3offloadx4_$TAG.json" \
    --model-cache /tmp/bench_models --host-floor-gib "${HOST_FLOOR_GIB:-24}"
}
p_multi_fsdp4() {
  need_gpus 4 && need_module trl || return 0
  local p=${FSDP4_PRESET:-qwen2.5-32b} anchor=()
  wait_saved "$p"
  # The anchor: ANCHOR_JSON, else the zero3 part's JSON of this call (same preset), if it ran.
  if [ -n "${ANCHOR_JSON:-}" ]; then
    anchor=(--anchor-json "$ANCHOR_JSON")
  elif [ -f "$OUT/trl_${p}_zero3offloadx4_$TAG.json" ]; then
    anchor=(--anchor-json "$OUT/trl_${p}_zero3offloadx4_$TAG.json")
  fi
  trl_bench multi_fsdp4.log --preset "$p" --dtype bfloat16 --batch 64 --completion 256 --steps "${STEPS:-5}" \
    --nproc 4 --launch fsdp2 --variants "${VARIANTS4:-stream+prefetch,trl}" --json "$OUT/trl_${p}_fsdp2x4_$TAG.json" \
    --model-cache /tmp/bench_models --trl-loading "${TRL_LOADING:-every-rank}" --host-floor-gib "${HOST_FLOOR_GIB:-24}" \
    ${anchor[@]+"${anchor[@]}"}
}
gpu_tests() {  # gpu_tests LOG: the GPU tests not yet in the ledger, until the pass's deadline
  local log=$1 before=0 rc
  in_budget || return 0
  TAILN=30
  x mkdir -p "$(dirname "$LEDGER")"
  if [ -f "$LEDGER" ]; then before=$(wc -l < "$LEDGER"); fi
  if [ "$DRY" != 1 ]; then
    echo "== $(date -u '+%H:%M:%S') pytest, $(left) s left; ledger $LEDGER has $before lines" >> "$OUT/$log"
  fi
  # SIGINT at the deadline: pytest stops inside the running test, prints its summary, and that
  # test runs again in the next call.
  run "$log" env TIDAL_TESTS_LEDGER="$LEDGER" PYTHONPATH="$PWD/benchmarks:$PYTHONPATH" \
    timeout -s INT -k 20 "$(( $(left) - 25 ))" python3 -m pytest -q -m gpu ${TESTS:-tests} -rsfE \
    -p pytest_ledger -p no:cacheprovider --durations=30
  rc=$?
  if [ "$DRY" != 1 ]; then
    if [ $rc = 124 ]; then echo "== stopped at the pass's deadline: run the tests part again to go on" >> "$OUT/$log"; fi
    if [ $rc = 5 ]; then echo "== no test left to run: every gpu test is in the ledger" >> "$OUT/$log"; PART_RC=0; fi
  fi
  run "$log" python3 benchmarks/pytest_ledger.py "$LEDGER"
  if [ "$DRY" = 1 ] || { [ -f "$LEDGER" ] && ! [ "$LEDGER" -ef "$OUT/tests.ledger" ]; }; then
    x cp "$LEDGER" "$OUT/tests.ledger"
  fi
}
SHARD_FILES='
import collections, subprocess, sys

# The -m gpu tests outside the whole-machine files, as file lists for N one-GPU shards, balanced
# by test count (greedy, largest file first): one line of space-separated paths per shard.
n, whole = int(sys.argv[1]), set(sys.argv[2:])
ids = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-m", "gpu", "tests"],
                     capture_output=True, text=True).stdout.splitlines()
per_file = collections.Counter(i.split("::")[0] for i in ids if "::" in i)
shards = [[0, []] for _ in range(n)]
for path, count in sorted(per_file.items(), key=lambda kv: -kv[1]):
    if path in whole:
        continue
    shard = min(shards, key=lambda s: s[0])
    shard[0] += count
    shard[1].append(path)
for count, files in shards:
    print(" ".join(sorted(files)))
'
gpu_tests_sharded() {  # gpu_tests_sharded LOG N: the one-GPU test files in N shards at once, one GPU
  # each, then the files whose tests need every GPU (a skipif on device_count) with all of them.
  # One ledger for all (each outcome is a line appended on its own), so a later call goes on.
  local log=$1 n=$2 k whole shard_log
  in_budget || return 0
  TAILN=30
  whole=$(grep -rlE 'device_count\(\) *< *[2-9]' tests --include='test_*.py' | sort | tr '\n' ' ')
  x mkdir -p "$(dirname "$LEDGER")"
  if [ "$DRY" = 1 ]; then
    echo "  $n shards of the one-GPU test files at once (CUDA_VISIBLE_DEVICES=k), then with every GPU: $whole"
    return 0
  fi
  mapfile -t SHARDS_OF < <(PYTHONPATH="$PWD:$PYTHONPATH" python3 -c "$SHARD_FILES" "$n" $whole)
  echo "== $(date -u '+%H:%M:%S') $n shards, $(left) s left; ledger $LEDGER" >> "$OUT/$log"
  for k in $(seq 0 $((n - 1))); do
    shard_log="${log%.log}_shard$k.log"
    note_log "$shard_log"
    echo "\$ CUDA_VISIBLE_DEVICES=$k pytest -q -m gpu ${SHARDS_OF[$k]}" >> "$OUT/$shard_log"
    env CUDA_VISIBLE_DEVICES=$k TIDAL_TESTS_LEDGER="$LEDGER" PYTHONPATH="$PWD/benchmarks:$PYTHONPATH" \
      timeout -s INT -k 20 "$(( $(left) - 120 ))" python3 -m pytest -q -m gpu ${SHARDS_OF[$k]} -rsfE \
      -p pytest_ledger -p no:cacheprovider --durations=15 >> "$OUT/$shard_log" 2>&1 &
  done
  wait  # every shard, before the tests that take every GPU
  TESTS="$whole" gpu_tests "$log"
}
p_two_tests() {
  need_gpus 2 || return 0
  if [ "${SHARDS:-1}" -gt 1 ]; then gpu_tests_sharded tests.log "$SHARDS"; else gpu_tests tests.log; fi
}
p_tests_gpu() { gpu_tests tests.log; }

# ---- the pass ---------------------------------------------------------------------------
FAILED=()
for item in "${QUEUE[@]}"; do
  read -r s p via <<< "$item"
  PART_RC=0 PART_LOGS=() SKIP="" FAIL="" TAILN=15
  if [ "$DRY" = 1 ]; then echo "== $s:$p"; else echo "== $s:$p, $(date -u '+%H:%M:%S'), $(left) s left of BUDGET"; fi
  setup_suite "$s"
  t=$(date +%s)
  "p_${s}_${p//[-.]/_}"
  secs=$(( $(date +%s) - t ))
  if [ -n "$FAIL" ]; then
    result=$FAIL
  elif [ -n "$SKIP" ]; then
    if [ "$via" = all ]; then result="skipped: $SKIP"; else result="not run: $SKIP"; PART_RC=1; fi
  elif [ $PART_RC != 0 ]; then
    result=failed
  else
    result=ok
  fi
  if [ -n "$FAIL" ] || [ $PART_RC != 0 ]; then FAILED+=("$s:$p"); fi
  if [ "$DRY" = 1 ]; then continue; fi
  echo "$s:$p: $secs s, $result" >> "$OUT/timing.txt"
  { echo "== $s:$p: $secs s, $result"; tails; } | tee -a "$OUT/summary.txt"
done
status=0
if [ ${#FAILED[@]} -gt 0 ]; then status=1; fi
echo "gpu.sh $*: ${#QUEUE[@]} parts, $(( $(date +%s) - T0 )) s, failed: ${FAILED[*]:-none}; exit status $status" \
  | if [ "$DRY" = 1 ]; then cat; else tee -a "$OUT/timing.txt" "$OUT/summary.txt"; fi
exit $status
