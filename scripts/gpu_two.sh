#!/usr/bin/env bash
# Issue 18's pass on a lent 2-GPU machine: the whole GPU suite (FSDP2, DCP checkpoint, Hugging
# Face export and the DeepSpeed 2-rank tests included; DeepSpeed from the wheels that
# scripts/fetch_deepspeed_wheels.sh put in .whl/, carried), then bench_checkpoint and the FSDP2
# release probe. Logs to $OUT.
#   bash scripts/gpu_two.sh [tests] [ckpt]   (default: both)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-./out}
mkdir -p "$OUT"
source scripts/gpu_wheels.sh
# NVLink multicast stays off on the lent machines (KINDS.md)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, transformers, deepspeed; print('torch', torch.__version__, 'cuda', torch.version.cuda, '| transformers', transformers.__version__, '| deepspeed', deepspeed.__version__, '| GPUs', torch.cuda.device_count())" 2>&1 | tail -1
  python3 -c "import trl, datasets; print('trl', trl.__version__, '| datasets', datasets.__version__)" 2>&1 | tail -1
} 2>&1 | tee "$OUT/env.txt"
status=0
for part in ${*:-tests ckpt}; do
  t0=$(date +%s)
  case $part in
    tests) timeout ${TESTS_TIMEOUT:-570} python3 -m pytest -q -m gpu ${TESTS:-tests} -rs --durations=10 -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1 || status=1
           tail -25 "$OUT/gpu_tests.log" ;;
    ckpt) timeout 300 python3 benchmarks/bench_checkpoint.py --results "$OUT/RESULTS.md" --json "$OUT/ckpt.json" \
            > "$OUT/bench_checkpoint.log" 2>&1 || status=1
          tail -30 "$OUT/bench_checkpoint.log"
          timeout 200 python3 scripts/probe_fsdp_release.py qwen2-0.5b 3 > "$OUT/probe.log" 2>&1 || status=1
          tail -15 "$OUT/probe.log" ;;
  esac
  echo "$part: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/timing.txt"
done
exit $status
