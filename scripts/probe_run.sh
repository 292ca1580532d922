#!/usr/bin/env bash
# One device call for the Hopper probe: check, speed, rounds, each under its own timeout.
set -u
OUT_DIR="${1:-probe-out}"; mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv | tee "$OUT_DIR/env.txt"
for part in ${PARTS:-check speed rounds}; do
  var="T_${part}"; t="${!var:-150}"
  echo "== $part (timeout $t s)"
  timeout "$t" python3 scripts/hopper_probe.py "$part" --out "$OUT_DIR" 2>&1 | tee "$OUT_DIR/$part.txt" | tail -n 60
  echo "rc=${PIPESTATUS[0]}"
done
