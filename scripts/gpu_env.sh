# Sourced by the scripts/gpu_*.sh passes: run from the checkout's root with tidal importable,
# logs under $OUT (./out by default), and $OUT/env.txt saying which GPU, driver, torch and
# transformers ran, and the commit (TIDAL_COMMIT, since the device copy's git log may be stale).
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-./out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, '| transformers', transformers.__version__)"
  echo "commit ${TIDAL_COMMIT:-$(git log --oneline -1 2>/dev/null || echo unknown)}"
} 2>&1 | tee "$OUT/env.txt"
