#!/usr/bin/env bash
# One GPU pass of this session's work, for a lent 2-GPU machine; logs go to $OUT.
#   bash scripts/gpu_session.sh [probe] [tests] [demo] [deepspeed] [ckpt] [ray]   (default: the first four)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-./out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# NVLink multicast stays off on the lent machines (KINDS.md)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
parts=${*:-probe tests demo deepspeed}
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, '| transformers', transformers.__version__)"
} 2>&1 | tee "$OUT/env.txt"
status=0
for part in $parts; do
  t0=$(date +%s)
  case $part in
    probe) timeout 240 python3 scripts/probe_fsdp_release.py qwen2-0.5b 3 > "$OUT/probe.log" 2>&1 || status=1 ;;
    tests) timeout 540 python3 -m pytest -q -m gpu ${TESTS:-tests} --durations=8 -p no:cacheprovider \
             > "$OUT/gpu_tests.log" 2>&1 || status=1 ;;
    demo) timeout 300 python3 -m tidal_recipes demo --roles processes --steps ${DEMO_STEPS:-8} --baseline-steps 0 \
             --out "$OUT/demo-processes" > "$OUT/demo_processes.log" 2>&1 || status=1 ;;
    deepspeed) if [ -d .whl ]; then bash scripts/gpu_deepspeed.sh > "$OUT/deepspeed.log" 2>&1 || status=1; fi ;;
    ckpt) timeout 300 python3 benchmarks/bench_checkpoint.py --results "$OUT/RESULTS.md" --json "$OUT/ckpt.json" \
             > "$OUT/bench_checkpoint.log" 2>&1 || status=1 ;;
    ray) # the ray wheel travels in two halves (.rayA in an earlier call, kept in /tmp; .rayB now)
      if [ -d .rayA ]; then mkdir -p /tmp/rayparts && cp .rayA/* /tmp/rayparts/; fi
      if [ -d .rayB ]; then
        cat /tmp/rayparts/ray.part.aa .rayB/ray.part.ab > /tmp/ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/raysite \
          /tmp/ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl .rayB/*.whl > "$OUT/ray_install.log" 2>&1 || status=1
        PYTHONPATH=/tmp/raysite:$PYTHONPATH RAY_AUTH_MODE=disabled timeout 300 python3 -m tidal_recipes demo --roles ray \
          --steps ${DEMO_STEPS:-8} --baseline-steps 0 --out "$OUT/demo-ray" > "$OUT/demo_ray.log" 2>&1 || status=1
      fi ;;
  esac
  echo "$part: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/timing.txt"
done
echo "gpu_session exit status: $status"
exit $status
