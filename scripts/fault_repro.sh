#!/usr/bin/env bash
# Run scripts/fault_repro.py to the end, restarting after each faulting case (at most 6).
# Usage: bash scripts/fault_repro.sh [args for fault_repro.py]
export CUDA_LAUNCH_BLOCKING=1 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
start=0
for attempt in 1 2 3 4 5 6; do
  log=$(python3 scripts/fault_repro.py --start "$start" "$@" 2>&1); rc=$?
  echo "$log" | grep -v "^NEXT"
  [[ $rc -ne 3 ]] && break
  start=$(echo "$log" | sed -n 's/^NEXT //p' | tail -n1)
done
