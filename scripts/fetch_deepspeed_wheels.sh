#!/usr/bin/env bash
# Build what the GPU machine needs to run DeepSpeed (DeepSpeedCPUAdam in
# benchmarks/bench_cpu_adam.py; engines in tests/distributed/test_deepspeed_gpu.py and
# benchmarks/bench_deepspeed.py): it has no network and no deepspeed. DeepSpeed ships only an
# sdist, so a pure-Python wheel is built here (ops it needs are JIT-compiled there), plus every
# dependency its METADATA requires that torch and transformers do not bring (numpy, packaging,
# tqdm come with them), for that machine's Python 3.12: hjson, pydantic (+ its own), einops
# and msgpack (imported by `import deepspeed`), psutil and py-cpuinfo (imported by its
# accelerator and op builders), ninja (for JIT builds; its binary lands in /tmp/site/bin).
# Output: .whl/ (git-ignored), carried to the device with carry=[".whl"] and installed with
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site:$PWD
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
tmp=$(mktemp -d)
python3 -m pip download --no-deps --no-binary=:all: -d "$tmp" "deepspeed==${DEEPSPEED_VERSION:-0.19.8}"
DS_BUILD_OPS=0 python3 -m pip wheel --no-deps --no-build-isolation -w .whl "$tmp"/deepspeed-*.tar.gz
plat="--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $plat \
  -d .whl hjson pydantic pydantic-core annotated-types typing-inspection "typing_extensions>=4.16" \
  einops msgpack psutil py-cpuinfo ninja
# Every Requires-Dist of the built wheel must be here or come with torch/transformers.
python3 - <<'PY'
import glob, re, zipfile
have = {re.split(r"-\d", w.split("/")[-1])[0].lower().replace("_", "-") for w in glob.glob(".whl/*.whl")}
with_torch = {"torch", "numpy", "packaging", "tqdm"}
whl = glob.glob(".whl/deepspeed-*.whl")[0]
meta = zipfile.ZipFile(whl).read(next(n for n in zipfile.ZipFile(whl).namelist() if n.endswith("METADATA"))).decode()
need = {re.split(r"[ <>=!;\[]", l.split(":", 1)[1].strip())[0].lower().replace("_", "-")
        for l in meta.splitlines() if l.startswith("Requires-Dist:") and "extra ==" not in l}
missing = sorted(need - have - with_torch)
print("deepspeed requires:", sorted(need), "| missing from .whl:", missing or "none")
raise SystemExit(1 if missing else 0)
PY
ls -la .whl
