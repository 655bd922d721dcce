#!/usr/bin/env bash
# GPU passes for TRL's GRPOTrainer with tidal (issues 14, 26), with trl and datasets carried
# as wheels in .whl/ (see scripts/gpu_wheels.sh); logs, JSON and rows ($OUT/RESULTS.md) go to $OUT.
#   bash scripts/gpu_trl.sh [tests] [newtests] [final] [profile] [profile-stress] [bench] [stress] [7b] [ds] [demo7b] [reward]
# newtests: the GPU tests of the no-host-wait transitions, prefetch and TRL on a GPU.
# final:   the headline workload, TRL alone beside the code before the change (before:, from the
#          tidal package exported to .before/, carried) and after, one steady step profiled.
# profile: one steady step of the headline workload (qwen2-1.5b fp32, 64 completions x 256 tokens)
#          profiled for TRL alone and tidal's variants (VARIANTS), drawn to $OUT/profile_1.5b.png.
# profile-stress: the stress workload (16 x 32) the same way.
# bench:   the headline workload measured (no profiler), TRL alone beside tidal's variants.
# demo7b:  tidal demo --preset qwen2-7b --async-transitions --prefetch (DEMO_FLAGS) against its all-resident step.
# stress:  16 x 32 on both presets (stress-1.5b, stress-7b: one of them; VARIANTS_STRESS).   7b: qwen2-7b bf16 64 x 256.   reward: with a reward model.
# ds:      qwen2-7b bf16 64 x 256, DeepSpeed ZeRO-3 offload (through TRL) beside tidal (needs .whl).
# spread:  the headline workload, TRL alone first and last, a tidal variant that moves nothing,
#          stream and stream+prefetch, 6 steps each (what is noise, what is tidal).
# TIDAL_COMMIT names the commit in the logs (the device copy's git log may be stale).
# BENCH_ARGS: more bench_trl.py arguments for every bench part (e.g. --sample-stacks).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-./out}
mkdir -p "$OUT"
source scripts/gpu_wheels.sh
source scripts/gpu_env.sh
python3 -c "import trl, datasets; print('trl', trl.__version__, '| datasets', datasets.__version__)" 2>&1 | tail -1 | tee -a "$OUT/env.txt"
cp benchmarks/RESULTS.md "$OUT/RESULTS.md"
status=0
tag=${TAG:-run}
bench() {  # bench <log> <args...>: one bench_trl.py run, its log under $OUT, the tail printed
  local log=$1; shift
  timeout ${BENCH_TIMEOUT:-540} python3 benchmarks/bench_trl.py --results "$OUT/RESULTS.md" "$@" ${BENCH_ARGS:-} > "$OUT/$log" 2>&1 || status=1
  grep -vE "it/s\]|s/it\]|Warning|warnings.warn|^\s*$" "$OUT/$log" | tail -${TAIL:-40}
}
for part in ${*:-tests bench}; do
  t0=$(date +%s)
  case $part in
    tests) timeout ${TESTS_TIMEOUT:-200} python3 -m pytest -q -m gpu tests/integrations tests/timeshare tests/state -rs \
             --durations=5 -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1 || status=1
           tail -12 "$OUT/gpu_tests.log" ;;
    newtests) timeout ${TESTS_TIMEOUT:-150} python3 -m pytest -q -m gpu tests/timeshare/test_no_wait_gpu.py \
                tests/timeshare/test_prefetch_gpu.py tests/integrations/test_trl_gpu.py -rs --durations=5 \
                -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1 || status=1
              tail -15 "$OUT/gpu_tests.log" ;;
    final) bench final.log --preset qwen2-1.5b --dtype float32 --batch 64 --completion 256 --steps 4 --profile-step 4 \
             --variants ${VARIANTS:-trl,before:stream,stream,stream+prefetch} --picture "$OUT/trl_1.5b_64x256_$tag.png" \
             --json "$OUT/trl_1.5b_64x256_$tag.json" ;;
    spread) # Where the step's time goes besides the transitions: TRL alone first and last (the
            # run's drift), a tidal variant that moves nothing after its first steps (role
            # residency, evict=as_needed: only tidal's hooks and allocations), stream, stream+prefetch.
            bench spread.log --preset qwen2-1.5b --dtype float32 --batch 64 --completion 256 --steps ${STEPS:-6} \
              --variants ${VARIANTS:-trl,role+evict=as_needed,stream,stream+prefetch,trl} \
              --json "$OUT/trl_1.5b_64x256_spread_$tag.json" ;;
    profile) bench profile.log --preset qwen2-1.5b --dtype float32 --batch 64 --completion 256 --steps ${STEPS:-4} --profile-step ${STEPS:-4} \
               --variants ${VARIANTS:-trl,stream,stream+prefetch} --picture "$OUT/profile_1.5b_64x256_$tag.png" \
               --json "$OUT/profile_1.5b_64x256_$tag.json" ;;
    profile-stress) bench profile_stress.log --preset qwen2-1.5b --dtype float32 --batch 16 --completion 32 --steps 5 --profile-step 5 \
               --variants ${VARIANTS:-trl,stream,stream+prefetch} --picture "$OUT/profile_1.5b_16x32_$tag.png" \
               --json "$OUT/profile_1.5b_16x32_$tag.json" ;;
    bench) bench bench.log --preset qwen2-1.5b --dtype float32 --batch 64 --completion 256 --steps ${STEPS:-4} \
             --variants ${VARIANTS:-trl,stream,stream+prefetch} --json "$OUT/trl_1.5b_64x256_$tag.json" ;;
    stress|stress-1.5b|stress-7b)
            if [ $part != stress-7b ]; then
              bench stress.log --preset qwen2-1.5b --dtype float32 --batch 16 --completion 32 --steps 6 \
                --variants ${VARIANTS_STRESS:-trl,stream,stream+prefetch} --json "$OUT/trl_1.5b_16x32_$tag.json"
            fi
            if [ $part != stress-1.5b ]; then
              bench stress7b.log --preset qwen2-7b --dtype bfloat16 --batch 16 --completion 32 --steps 6 \
                --variants ${VARIANTS_STRESS:-trl,stream,stream+prefetch} --json "$OUT/trl_7b_16x32_$tag.json"
            fi ;;
    7b) bench bench7b.log --preset qwen2-7b --dtype bfloat16 --batch 64 --completion 256 --steps ${STEPS:-4} \
          --variants ${VARIANTS7B:-trl,stream,stream+prefetch} --json "$OUT/trl_7b_64x256_$tag.json" ;;
    ds) # The anchor a TRL user reaches for to fit 7B: DeepSpeed ZeRO-3 with optimizer and parameter
        # offload (its CPU Adam is JIT-built on first use, about a minute there), beside tidal.
        bench ds7b.log --preset qwen2-7b --dtype bfloat16 --batch 64 --completion 256 --steps 3 \
          --variants ${VARIANTSDS:-ds-zero3-offload,stream+prefetch} --json "$OUT/trl_7b_64x256_ds_$tag.json" ;;
    demo7b) # issue 26 item 7: the demo at 7B with the mechanisms TidalGRPOTrainer uses, against its
            # all-resident step (printed by the demo: step and peak beside the baseline)
            timeout ${BENCH_TIMEOUT:-540} python3 -m tidal_recipes demo --preset qwen2-7b --steps ${STEPS:-4} \
              --baseline-steps 1 --async-transitions ${DEMO_FLAGS:---prefetch} --out "$OUT/demo7b" \
              > "$OUT/demo7b.log" 2>&1 || status=1
            grep -vE "it/s\]|s/it\]|Warning|warnings.warn|^\s*$" "$OUT/demo7b.log" | tail -${TAIL:-40} ;;
    reward) bench reward.log --preset qwen2-1.5b --steps 4 --reward-model --variants ${VARIANTS:-trl,stream,stream+prefetch} ;;
  esac
  echo "$part: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/timing.txt"
done
exit $status
