#!/usr/bin/env bash
# Build what the GPU machine needs to run DeepSpeedCPUAdam in benchmarks/bench_cpu_adam.py:
# it has no network and no deepspeed. DeepSpeed ships only an sdist, so a pure-Python wheel is
# built here (its CPU Adam op is JIT-compiled there with the g++ and ninja it has), plus its
# missing dependencies for that machine's Python 3.12. Output: .whl/ (git-ignored), carried
# to the device with carry=[".whl"] and installed with
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
  -d .whl hjson pydantic pydantic-core annotated-types typing-inspection "typing_extensions>=4.16"
ls -la .whl
