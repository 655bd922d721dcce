#!/usr/bin/env bash
# Run where there is network (not on the GPU machine): fills .whl/ (git-ignored) with the wheels
# that benchmarks/gpu.sh needs on a lent GPU machine, which has no network and only torch and
# transformers; carry them there with carry=[".whl"] and benchmarks/gpu_setup.sh installs them.
# Every wheel is for that machine's CPython 3.12 on x86-64 Linux (manylinux).
#
#   bash benchmarks/fetch_wheels.sh [deepspeed] [trl] [vmm] [vllm]    (default: the first three)
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
# vllm:      vLLM 0.25.0 (built for that machine's torch 2.11 and CUDA 13) with what it imports beyond
#            that machine's packages, TRL and datasets, unpacked into one folder (vsite/) less what a
#            dense bf16 model on an H200 never loads (the FA2 kernels, vllm-rs, the sm100 FMHA and
#            DeepGEMM headers, DeepGEMM for other Pythons), packed as one xz tarball and split into
#            parts of 45 MiB under .vllm/ (with SHA256SUMS): a device call carries a working tree of
#            at most 64 MiB, so each part travels in its own call (benchmarks/vllm_stage.sh).
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
    vllm)
      tmp=$(mktemp -d)
      python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 \
        --platform manylinux_2_35_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
        --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d "$tmp" vllm==0.25.0 \
        pydantic==2.12.5 pydantic-core==2.41.5 annotated-types typing-inspection msgspec pyzmq blake3 cbor2 \
        cachetools "openai>=2.0.0" distro jiter sniffio "fastapi<0.137.0,>=0.133.0" "starlette>=1.0.1" \
        "mistral_common>=1.11.5" pydantic-extra-types pycountry jsonschema jsonschema-specifications referencing \
        rpds-py compressed-tensors==0.17.0 loguru frozendict depyf==0.20.0 astor dill==0.4.1 \
        "xgrammar>=0.2.1,<1.0" "apache-tvm-ffi>=0.1.11" "llguidance>=1.7.0,<1.8.0" outlines_core==0.2.14 \
        lm-format-enforcer==0.11.3 interegular partial-json-parser "openai-harmony>=0.0.3" "anthropic>=0.71.0" \
        docstring-parser flashinfer-python==0.6.13 diskcache==5.6.3 lark==1.2.2 pybase64 ijson setproctitle \
        watchfiles python-json-logger prometheus-fastapi-instrumentator nvtx==0.2.15 model-hosting-container-standards \
        trl==1.16.0 datasets==5.2.0 multiprocess==0.70.19 xxhash
      rm -rf "$tmp/vsite"
      python3 -m pip install -q --no-deps --no-compile --target "$tmp/vsite" --python-version 3.12 --implementation cp \
        --only-binary=:all: --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 \
        --platform manylinux_2_35_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
        --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 "$tmp"/*.whl
      (cd "$tmp/vsite" && rm -rf vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/vllm-rs vllm/third_party/fmha_sm100 \
        vllm/third_party/deep_gemm/include vllm/third_party/deep_gemm/_C.cpython-31[0134]-*.so)
      find "$tmp/vsite" -name __pycache__ -prune -exec rm -rf {} +
      rm -rf .vllm && mkdir -p .vllm
      tar -cf - -C "$tmp" vsite | xz -6 -T2 | split -b 45M - .vllm/part-
      (cd .vllm && sha256sum part-* > SHA256SUMS)
      # openai and anthropic of 2026-12 import httpx2, which needs newer anyio and idna than the
      # GPU machine's: installed over the tarball by vllm_stage.sh
      mkdir -p .vllm/extra
      python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .vllm/extra \
        httpx2 httpcore2 truststore h11 "anyio>=4.10" "idna>=3.18"
      rm -rf "$tmp"
      ls -la .vllm ;;
    *)
      echo "usage: bash benchmarks/fetch_wheels.sh [deepspeed] [trl] [vmm] [vllm]" >&2
      exit 2 ;;
  esac
done
ls -la .whl
