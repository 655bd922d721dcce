# Sourced by GPU passes that need the wheels carried in .whl/ (scripts/fetch_deepspeed_wheels.sh;
# trl, datasets, dill and multiprocess fetched with `pip download`): everything but TRL goes to
# /tmp/site; TRL and datasets to /tmp/site-trl, used only if they import against that
# machine's pandas/pyarrow/hub (without them the TRL tests skip and bench_trl cannot run).
# Sets PYTHONPATH (and PATH for the wheels' scripts); $OUT must exist.
if ls .whl/*.whl >/dev/null 2>&1; then
  trl=$(ls .whl/*.whl | grep -E '/(trl|datasets|dill|multiprocess)-' || true)
  rest=$(ls .whl/*.whl | grep -vE '/(trl|datasets|dill|multiprocess)-' || true)
  if [ -n "$rest" ]; then
    python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site $rest 2>&1 | grep -v "^WARNING" | tail -3
  fi
  if [ -n "$trl" ]; then
    python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site-trl $trl 2>&1 | grep -v "^WARNING" | tail -3
    if PYTHONPATH=/tmp/site-trl:/tmp/site python3 -c "import trl, datasets" 2>"$OUT/trl_import.txt"; then
      extra=/tmp/site-trl:
    else
      echo "trl does not import there (see trl_import.txt); its tests skip"; tail -3 "$OUT/trl_import.txt"
    fi
  fi
fi
export PYTHONPATH=${extra:-}/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
