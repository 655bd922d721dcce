# shellcheck shell=bash
# Sourced once by benchmarks/gpu.sh (from the checkout's root) on a lent GPU machine, which has
# torch and transformers but no network. It
#   - sets OUT (./out unless given; made absolute) and makes it;
#   - installs the wheels carried in .whl/ (built where there is network by
#     benchmarks/fetch_wheels.sh, carried to the device with carry=[".whl"]):
#       TRL and datasets (trl, datasets, dill, multiprocess) into /tmp/site-trl, put on the path
#       only if they import against that machine's pandas, pyarrow and hub (if not, the reason
#       lands in $OUT/trl_import.txt; the TRL tests then skip and bench_trl cannot run);
#       torch_memory_saver not here: the vmm suite installs it (install_tms, below);
#       everything else (DeepSpeed and its dependencies, xxhash, ninja) into /tmp/site, with
#       /tmp/site/bin (ninja, for the ops DeepSpeed JIT-builds) on PATH.
#     A machine still warm from an earlier call with the same .whl/ installs nothing again;
#   - exports PYTHONPATH (the checkout first, so its tidal is the one imported), PATH,
#     PYTHONUNBUFFERED=1, and NVLink multicast off (the lent machines' KINDS.md);
#   - writes $OUT/env.txt: the date, the commit (TIDAL_COMMIT, since the device copy's git log
#     may be stale), each GPU with its driver and memory, the host's memory and cores, and the
#     versions of torch, CUDA, NCCL, transformers and of each carried package that imports.
# With DRY=1 nothing is installed or measured: it only says what it would do.

OUT=$(realpath -m "${OUT:-./out}")  # absolute: a part may run from another folder (.before/)
if [ "${DRY:-0}" != 1 ]; then mkdir -p "$OUT"; fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

_site_extra=
_trl_wheels=()   # TRL and what only it needs: /tmp/site-trl
_rest_wheels=()  # the rest but torch_memory_saver: /tmp/site
for _w in .whl/*.whl; do
  [ -e "$_w" ] || continue
  case ${_w##*/} in
    trl-* | datasets-* | dill-* | multiprocess-*) _trl_wheels+=("$_w") ;;
    torch_memory_saver-*) ;;
    *) _rest_wheels+=("$_w") ;;
  esac
done
if [ ${#_trl_wheels[@]} -gt 0 ] || [ ${#_rest_wheels[@]} -gt 0 ]; then
  if [ "${DRY:-0}" = 1 ]; then
    echo "setup: would install ${#_rest_wheels[@]} wheels from .whl/ into /tmp/site, ${#_trl_wheels[@]} into /tmp/site-trl"
  else
    _stamp=/tmp/site/.tidal-wheels-$(printf '%s\n' .whl/*.whl | md5sum | cut -c1-12)
    if [ -e "$_stamp" ]; then
      echo "setup: wheels already installed in /tmp/site (same .whl/ as an earlier call)"
    else
      _installed=1
      if [ ${#_rest_wheels[@]} -gt 0 ]; then
        python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site "${_rest_wheels[@]}" \
          >/tmp/tidal-pip.txt 2>&1 || _installed=0
        grep -v "^WARNING" /tmp/tidal-pip.txt | tail -3
      fi
      if [ ${#_trl_wheels[@]} -gt 0 ]; then
        python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site-trl "${_trl_wheels[@]}" \
          >/tmp/tidal-pip.txt 2>&1 || _installed=0
        grep -v "^WARNING" /tmp/tidal-pip.txt | tail -3
      fi
      if [ $_installed = 1 ]; then mkdir -p /tmp/site && touch "$_stamp"; fi
    fi
    if [ ${#_trl_wheels[@]} -gt 0 ]; then
      if PYTHONPATH=/tmp/site-trl:/tmp/site python3 -c "import trl, datasets" 2>/tmp/tidal-trl-import.txt; then
        _site_extra=/tmp/site-trl:
      else
        cp /tmp/tidal-trl-import.txt "$OUT/trl_import.txt"
        echo "setup: trl does not import here (see $OUT/trl_import.txt); its tests skip"
        tail -3 "$OUT/trl_import.txt"
      fi
    fi
  fi
fi
export PYTHONPATH=$PWD:${_site_extra}/tmp/site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1

install_tms() {  # torch_memory_saver from .whl/, into the interpreter's own site (as bench_vmm ran it)
  if ls .whl/torch_memory_saver-*.whl >/dev/null 2>&1; then
    if [ "${DRY:-0}" = 1 ]; then
      echo "  python3 -m pip install -q --no-deps --root-user-action=ignore .whl/torch_memory_saver-*.whl"
    else
      python3 -m pip install -q --no-deps --root-user-action=ignore .whl/torch_memory_saver-*.whl 2>&1 | tail -2
    fi
  fi
  if [ "${DRY:-0}" != 1 ]; then
    python3 -c "import torch_memory_saver" 2>&1 | tail -1
  fi
}

if [ "${DRY:-0}" = 1 ]; then
  echo "setup: OUT=$OUT, PYTHONPATH=$PYTHONPATH (env.txt not written: DRY=1)"
else
  {
    echo "date $(date -u '+%Y-%m-%d %H:%M UTC') | commit ${TIDAL_COMMIT:-$(git log --oneline -1 2>/dev/null || echo unknown)}"
    nvidia-smi --query-gpu=index,name,pci.bus_id,driver_version,memory.total --format=csv,noheader
    echo "host: $(nproc) cores, $(free -g | awk '/^Mem:/ {print $2 " GiB memory, " $7 " GiB available"}')"
    python3 - <<'PY'
from importlib import metadata
import torch
import transformers
nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "-"
print("torch", torch.__version__, "cuda", torch.version.cuda, "| NCCL", nccl,
      "| transformers", transformers.__version__, "| GPUs", torch.cuda.device_count())
found = []
for name in ("accelerate", "deepspeed", "trl", "datasets", "torch_memory_saver"):
    try:
        found.append(f"{name} {metadata.version(name)}")
    except metadata.PackageNotFoundError:
        found.append(f"{name}: not installed")
print(" | ".join(found))
PY
  } 2>&1 | tee "$OUT/env.txt"
fi
