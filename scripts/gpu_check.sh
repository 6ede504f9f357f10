#!/usr/bin/env bash
# The GPU check in one call on a bare GPU machine (torch preinstalled, no network): install the
# wheelhouse that `make gpu-wheelhouse` built (.whl/, carried with the working tree) without
# touching torch, then run scripts/gpu_check.py, which writes ONE JSON: $OUT/gpu_check.json ($OUT:
# the device tool's output folder; ./gpu_check_out without it), beside gpu_check.log (all output)
# and gpu_check_profile.yaml (what `fleetwise calibrate` wrote).
#
# This workplace's device tool -- first, here: make gpu-wheelhouse -- then:
#   run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=540)
# One step again (a fresh machine installs again, ~20 s):
#   run(command="GPU_CHECK_ONLY=zero3_offload bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=300)
#
# Environment: OUT; GPU_CHECK_BUDGET_S (default 450: the whole script, install included, ends within
# 8 minutes); GPU_CHECK_ONLY (steps, comma-separated); PYTHON (default python3, the one with torch).
# Nothing asks for input; a second run into the same OUT overwrites it.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
started=$(date +%s)
OUT=${OUT:-$PWD/gpu_check_out}
export OUT
mkdir -p "$OUT"
PY=${PYTHON:-python3}
ROOT=/tmp/fleetwise-gpu-check
SITE=$ROOT/site
MLSITE=$ROOT/site-mlflow
export PIP_NO_INPUT=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore PYTHONUNBUFFERED=1 \
  PYTHONDONTWRITEBYTECODE=1

install() {  # $1: folder of wheels, $2: target; --no-deps: only these wheels, torch is never touched
  rm -rf "$2"
  timeout 180 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$2" "$1"/*.whl
}

main() {
  echo "gpu_check.sh: $(date -u +%FT%TZ) on $(hostname); $(timeout 60 "$PY" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__)' 2>&1)"
  timeout 20 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -8
  if compgen -G ".whl/*.whl" >/dev/null; then
    if install .whl "$SITE"; then
      export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
      echo "installed $(ls .whl/*.whl | wc -l) wheels into $SITE"
    else
      echo "✗ installing .whl failed: the steps will say what is missing"
    fi
    if compgen -G ".whl/mlflow/*.whl" >/dev/null && install .whl/mlflow "$MLSITE"; then
      export FLEETWISE_GPU_CHECK_MLFLOW_SITE="$MLSITE"  # only the tracking step puts it on its path
      echo "installed $(ls .whl/mlflow/*.whl | wc -l) MLflow wheels into $MLSITE"
    fi
  else
    echo "no .whl/ here: the fleetwise that $PY imports is checked (build the wheels: make gpu-wheelhouse; carry .whl)"
  fi
  local budget=$(( ${GPU_CHECK_BUDGET_S:-450} - ($(date +%s) - started) ))
  "$PY" scripts/gpu_check.py --out "$OUT/gpu_check.json" --work "$ROOT/work" --budget-s "$budget" \
    ${GPU_CHECK_ONLY:+--only "$GPU_CHECK_ONLY"} "$@"
}

main "$@" 2>&1 | tee "$OUT/gpu_check.log"
exit "${PIPESTATUS[0]}"
