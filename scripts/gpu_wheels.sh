# Sourced by GPU passes that need the wheels carried in .whl/ (scripts/fetch_deepspeed_wheels.sh;
# trl, datasets, dill and multiprocess fetched with `pip download`): everything but TRL goes to
# /tmp/site; TRL and datasets to /tmp/site-trl, used only if they import against that
# machine's pandas/pyarrow/hub (without them the TRL tests skip and bench_trl cannot run).
# On a machine still warm from an earlier call with the same wheels nothing is installed again.
# Sets PYTHONPATH (and PATH for the wheels' scripts); $OUT must exist (trl_import.txt lands
# there only if TRL does not import).
if ls .whl/*.whl >/dev/null 2>&1; then
  trl=$(ls .whl/*.whl | grep -E '/(trl|datasets|dill|multiprocess)-' || true)
  rest=$(ls .whl/*.whl | grep -vE '/(trl|datasets|dill|multiprocess)-' || true)
  stamp=/tmp/site/.tidal-wheels-$(ls .whl/*.whl | md5sum | cut -c1-12)
  if [ -e "$stamp" ]; then
    echo "wheels: already installed in /tmp/site (same .whl/ as an earlier call)"
  else
    installed=1
    if [ -n "$rest" ]; then
      python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site $rest >/tmp/tidal-pip.txt 2>&1 || installed=0
      grep -v "^WARNING" /tmp/tidal-pip.txt | tail -3
    fi
    if [ -n "$trl" ]; then
      python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site-trl $trl >/tmp/tidal-pip.txt 2>&1 || installed=0
      grep -v "^WARNING" /tmp/tidal-pip.txt | tail -3
    fi
    if [ $installed = 1 ]; then mkdir -p /tmp/site && touch "$stamp"; fi
  fi
  if [ -n "$trl" ]; then
    if PYTHONPATH=/tmp/site-trl:/tmp/site python3 -c "import trl, datasets" 2>/tmp/tidal-trl-import.txt; then
      extra=/tmp/site-trl:
    else
      cp /tmp/tidal-trl-import.txt "$OUT/trl_import.txt"
      echo "trl does not import there (see trl_import.txt); its tests skip"; tail -3 "$OUT/trl_import.txt"
    fi
  fi
fi
export PYTHONPATH=${extra:-}/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
