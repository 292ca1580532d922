#!/usr/bin/env bash
# The benchmark command: installs triflash and its bench extra (matplotlib for the plot) into
# a venv with whatever torch and triton pip resolves, then runs triflash-bench. On a GPU: the
# h200 preset (the README's table) with every installed peer in the same run, each case
# checked against an fp32 reference; on a CPU: a tiny demo under Triton's interpreter whose
# timings mean nothing (it checks correctness only). Results: bench-out/results.json and .png.
#
#   bash scripts/bench.sh [triflash-bench args, e.g. --preset seed]
#   VENV=path  the venv (default .venv)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -e ".[bench,test]"
exec "$VENV/bin/python" -m triflash.bench "$@"
