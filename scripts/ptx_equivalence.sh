#!/usr/bin/env bash
# Do the dispatched Gluon kernels of this checkout compile (sm_90a, on the CPU) to the same
# instructions as those of commit REF (e.g. the last commit measured on the H200)?
# Usage: bash scripts/ptx_equivalence.sh REF [PYTHON]
#   PARTS="bwd dq"   compile only these parts (default: fwd bwd dq)
#   REF may also be a folder of REF's dumps (a-fwd/, a-bwd/, a-dq/), kept by an earlier run
#   with KEEP_REF=folder: repeated checks against one commit compile it once.
# The compile check is tools/compile_check.py, or in a REF from before tools/ existed
# triflash/kernels/hopper/compile_check.py: each side runs the one its tree has.
# Prints, per kernel configuration: identical, "params-only" (the same instructions, kernel
# parameters declared or numbered differently: added arguments the kernel does not read in
# that configuration), "numbers-only" (the same instructions with other immediates, e.g.
# shared-memory offsets after a buffer was declared differently: read the diff before
# trusting it), or REAL (different instructions), and a summary line.
set -u
cd "$(dirname "$0")/.."
REF="$1"; PY="${2:-python3}"; TMP=$(mktemp -d)
HERE=$(pwd)
if [ -d "$REF" ]; then for part in ${PARTS:-fwd bwd dq}; do cp -r "$REF/a-$part" "$TMP/"; done
else git worktree add -q "$TMP/ref" "$REF" || exit 1; fi
check() { [ -f "$1/tools/compile_check.py" ] && echo tools.compile_check || echo triflash.kernels.hopper.compile_check; }
for part in ${PARTS:-fwd bwd dq}; do
  flag=$([ $part = fwd ] || echo "--$part")
  [ -d "$REF" ] || (cd "$TMP/ref" && PYTHONPATH=. $PY -m "$(check .)" $flag --dump "$TMP/a-$part" > /dev/null 2>&1) \
    || echo "REF's compile check failed (--$part)"
  [ -n "${KEEP_REF:-}" ] && mkdir -p "$KEEP_REF" && rm -rf "$KEEP_REF/a-$part" && cp -r "$TMP/a-$part" "$KEEP_REF/"
  PYTHONPATH=. $PY -m "$(check "$HERE")" $flag --dump "$TMP/b-$part" > /dev/null 2>&1 \
    || echo "this checkout's compile check failed (--$part)"
done
norm() { grep -v '^\s*\.param' "$1" | sed -E 's/_kernel_param_[0-9]+/P/g' | grep -v '^\s*$'; }
numbers() { norm "$1" | sed -E 's/[0-9]+/N/g'; }
same=0; params=0; nums=0; real=0
for a in "$TMP"/a-*/*.ptx; do
  part=$(basename "$(dirname "$a")"); part=${part#a-}; b="$TMP/b-$part/$(basename "$a")"
  if [ ! -f "$b" ]; then echo "missing $(basename "$a")"; real=$((real+1))
  elif diff -q -B "$a" "$b" > /dev/null; then echo "identical $(basename "$a")"; same=$((same+1))
  elif diff <(norm "$a") <(norm "$b") > /dev/null; then echo "params-only $(basename "$a")"; params=$((params+1))
  elif diff <(numbers "$a") <(numbers "$b") > /dev/null; then
    echo "numbers-only $(basename "$a") ($(diff <(norm "$a") <(norm "$b") | grep -c '^<') lines)"; nums=$((nums+1))
  else echo "REAL $(basename "$a")"; real=$((real+1)); fi
done
echo "vs $REF (${PARTS:-fwd bwd dq}): $((same+params+nums+real)) kernels, $same identical, $params params-only, $nums numbers-only, $real different"
[ -d "$REF" ] || git worktree remove --force "$TMP/ref"; rm -rf "$TMP"
