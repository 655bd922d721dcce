#!/usr/bin/env bash
# Run where there is network (not on the GPU machine): fills .whl/ (git-ignored) with the wheels
# that benchmarks/gpu.sh needs on a lent GPU machine, which has no network and only torch and
# transformers; carry them there with carry=[".whl"] and benchmarks/gpu_setup.sh installs them.
# Every wheel is for that machine's CPython 3.12 on x86-64 Linux (manylinux).
#
#   bash benchmarks/fetch_wheels.sh [deepspeed] [trl] [vmm]      (default: all three)
#
# deepspeed: DeepSpeed (DEEPSPEED_VERSION, 0.19.8) for the deepspeed suite, DeepSpeedCPUAdam in
#            bench_cpu_adam.py and the ds part of the trl suite. It ships only an sdist, so a
#            pure-Python wheel is built here (the ops it needs are JIT-compiled there), plus each
#            dependency its METADATA requires that torch and transformers do not bring (numpy,
#            packaging, tqdm come with them): hjson, pydantic (and its own), einops and msgpack
#            (imported by `import deepspeed`), psutil and py-cpuinfo (its accelerator and op
#            builders), ninja (for the JIT builds; its binary lands in /tmp/site/bin there).
#            Ends by checking that every Requires-Dist of the built wheel is here.
# trl:       TRL 1.16.0 and datasets 5.2.0 with what they need beyond that machine's packages
#            (dill, multiprocess, xxhash), for the trl suite and the TRL tests.
# vmm:       torch_memory_saver 0.0.10, the anchor of bench_vmm.py (vmm suite).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
binary=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl)
parts=("$@")
if [ ${#parts[@]} = 0 ]; then parts=(deepspeed trl vmm); fi
for part in "${parts[@]}"; do
  case $part in
    deepspeed)
      tmp=$(mktemp -d)
      python3 -m pip download --no-deps --no-binary=:all: -d "$tmp" "deepspeed==${DEEPSPEED_VERSION:-0.19.8}"
      DS_BUILD_OPS=0 python3 -m pip wheel --no-deps --no-build-isolation -w .whl "$tmp"/deepspeed-*.tar.gz
      rm -rf "$tmp"
      python3 -m pip download "${binary[@]}" hjson pydantic pydantic-core annotated-types typing-inspection \
        "typing_extensions>=4.16" einops msgpack psutil py-cpuinfo ninja
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
      ;;
    trl)
      python3 -m pip download "${binary[@]}" trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 xxhash ;;
    vmm)
      python3 -m pip download "${binary[@]}" torch_memory_saver==0.0.10 ;;
    *)
      echo "usage: bash benchmarks/fetch_wheels.sh [deepspeed] [trl] [vmm]" >&2
      exit 2 ;;
  esac
done
ls -la .whl
