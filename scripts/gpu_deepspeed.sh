#!/usr/bin/env bash
# The DeepSpeed adapter on a lent GPU machine (no network, no deepspeed installed): install the
# carried wheels, run the DeepSpeed tests (GPU, then CPU), then benchmarks/bench_deepspeed.py.
# The wheels are built on a machine with network by scripts/fetch_deepspeed_wheels.sh into
# .whl/ and carried with carry=[".whl"]. Logs and JSON go to $OUT (or ./out).
#   bash scripts/gpu_deepspeed.sh [tests|bench|full]
# default: tests, then the benchmark at qwen2-0.5b; tests / bench: that part only;
# full: tests, then the benchmark at qwen2-0.5b and at qwen2-1.5b.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-./out}
mkdir -p "$OUT"
mode=${1:-default}
case "$mode" in default|tests|bench|full) ;; *) echo "usage: $0 [tests|bench|full]"; exit 2 ;; esac
if ! ls .whl/deepspeed-*.whl >/dev/null 2>&1; then
  echo "no .whl/deepspeed-*.whl: run scripts/fetch_deepspeed_wheels.sh where there is network and carry .whl"
  exit 2
fi
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .whl/*.whl 2>&1 | grep -v "^WARNING" | tail -5
# /tmp/site/bin: ninja, for the CUDA ops DeepSpeed JIT-builds (its FusedAdam, for ZeRO-3's offload_states).
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, transformers, deepspeed; print('torch', torch.__version__, 'cuda', torch.version.cuda, '| transformers', transformers.__version__, '| deepspeed', deepspeed.__version__)" 2>&1 | tail -1
  command -v nvcc >/dev/null && nvcc --version | tail -1 || echo "no nvcc: DeepSpeed's FusedAdam (ZeRO-3 offload_states) cannot build"
} 2>&1 | tee "$OUT/env_deepspeed.txt"
status=0
if [ "$mode" != bench ]; then
  # -s: the spawned test processes print what they measured (bytes, GB/s, driver memory).
  python3 -m pytest -q -s -m gpu tests/distributed/test_deepspeed_gpu.py --durations=5 2>&1 | tee "$OUT/deepspeed_gpu_tests.log" || status=1
  python3 -m pytest -q tests/distributed/test_deepspeed.py 2>&1 | tail -5 | tee "$OUT/deepspeed_cpu_tests.log" || status=1
fi
if [ "$mode" != tests ]; then
  python3 benchmarks/bench_deepspeed.py --preset qwen2-0.5b --out "$OUT/bench_deepspeed_qwen2-0.5b.json" 2>&1 | tee "$OUT/bench_deepspeed.log" || status=1
  if [ "$mode" = full ]; then
    python3 benchmarks/bench_deepspeed.py --preset qwen2-1.5b --out "$OUT/bench_deepspeed_qwen2-1.5b.json" 2>&1 | tee -a "$OUT/bench_deepspeed.log" || status=1
  fi
fi
echo "gpu_deepspeed exit status: $status"
exit $status
