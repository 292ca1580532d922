#!/usr/bin/env bash
# The test command: installs triflash with its test and transformers extras into a venv, with
# whatever torch and triton pip resolves (or a pinned pair), then runs the test suite. On a
# CPU the kernels run under Triton's interpreter and the Hopper kernels are compiled for
# sm_90a (no GPU needed); on a GPU the same tests run at realistic sizes.
#
#   bash scripts/test.sh [pytest args]
#   VENV=path               the venv (default .venv; created if missing)
#   TORCH=2.11.0 TRITON=3.6.0   pin a pair of the support matrix (triflash/versions.py)
#   WORKERS=n               pytest-xdist workers (default 2)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
pins=()
if [ -n "${TORCH:-}" ]; then pins+=("torch==$TORCH"); fi
if [ -n "${TRITON:-}" ]; then pins+=("triton==$TRITON"); fi
if [ ${#pins[@]} -gt 0 ]; then
  # A pinned pair is exact: a machine-wide pip constraint file (e.g. one capping torch below
  # the matrix's newest release) must not veto it.
  export PIP_CONSTRAINT=/dev/null
fi
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -e ".[test,transformers]" ${pins[@]+"${pins[@]}"}
"$VENV/bin/python" -c 'import torch, triton; print(f"torch {torch.__version__}, triton {triton.__version__}", flush=True)'
exec "$VENV/bin/python" -m pytest tests -q -n "${WORKERS:-2}" -p no:cacheprovider "$@"
