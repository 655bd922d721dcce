#!/usr/bin/env bash
# vLLM on a lent GPU machine, which has no network: the parts benchmarks/fetch_wheels.sh vllm
# made under .vllm/ (git-ignored) arrive one device call each (carry=[".vllm/part-aa"], then
# ".vllm/part-ab", ...; SHA256SUMS with each), kept in /tmp/vllm-parts while the machine stays
# warm between calls; .vllm/extra/*.whl (wheels the tarball's packages came to need since it was
# packed: httpx2 and its own for today's openai and anthropic) installed over it. Sourced (from
# the checkout's root):
#   source benchmarks/vllm_stage.sh      keeps the parts this call carried; once all of them are
#                                         there (SHA256SUMS), checks, joins and unpacks them into
#                                         /tmp/vsite and puts it on PYTHONPATH; VLLM_READY=1 then
set -u
VLLM_READY=0
mkdir -p /tmp/vllm-parts
for _p in .vllm/part-*; do
  [ -e "$_p" ] && cp --update=none "$_p" /tmp/vllm-parts/
done
[ -e .vllm/SHA256SUMS ] && cp .vllm/SHA256SUMS /tmp/vllm-parts/
if [ -d /tmp/vsite/vllm ]; then
  VLLM_READY=1
elif [ -e /tmp/vllm-parts/SHA256SUMS ] && (cd /tmp/vllm-parts && sha256sum -c --quiet SHA256SUMS 2>/dev/null); then
  cat /tmp/vllm-parts/part-* | xz -d | tar -xf - -C /tmp && VLLM_READY=1
  rm -f /tmp/vllm-parts/part-*
else
  echo "vllm_stage: parts here: $(cd /tmp/vllm-parts && ls part-* 2>/dev/null | tr '\n' ' ')(not all yet)"
fi
if [ "$VLLM_READY" = 1 ] && compgen -G ".vllm/extra/*.whl" >/dev/null; then
  # Wheels newer than the tarball's (carried beside a part: what its packages came to import)
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/vsite .vllm/extra/*.whl \
    2>&1 | grep -v WARNING | tail -2
fi
if [ "$VLLM_READY" = 1 ]; then
  export PYTHONPATH="/tmp/vsite${PYTHONPATH:+:$PYTHONPATH}"
  echo "vllm_stage: /tmp/vsite on PYTHONPATH"
fi
