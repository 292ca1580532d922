#!/usr/bin/env bash
# One device call that measures tile options against the dispatched tiles (the variants
# are --config specs, '' = as dispatched):
# their GPU tests first, then forward and backward variants in interleaved rounds beside
# cuDNN. Each step under its own timeout; results under OUT_DIR.
# Usage (repo root, on the H200):  [STEPS="tests same bwd256 bwd128 bwd64 fwd fixed"] bash scripts/variants_run.sh COMMIT OUT_DIR
# (all six take ~10 minutes: two device calls, e.g. STEPS="tests bwd256 fixed", then
# STEPS="bwd128 bwd64 fwd")
set -u
# (COMMIT: a plain name; the device brings back no file with "+" in its name)
COMMIT="${1:-unknown}"; OUT_DIR="${2:-variants-out}"; mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# (the default steps bring back 7 files; bwd64 adds 2, fixed 1: the device returns 8 at most,
# so split the steps over two calls, or PACK=1: one archive)
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv; echo "commit $COMMIT"
step() {  # step NAME TIMEOUT CMD...
  local name="$1" t="$2"; shift 2
  echo "== $name (timeout $t s)"
  local t0=$SECONDS
  timeout "$t" "$@" > "$OUT_DIR/$name.txt" 2>&1
  echo "rc=$? in $((SECONDS - t0)) s"; tail -n 12 "$OUT_DIR/$name.txt"
}
STEPS=" ${STEPS:-tests bwd256 bwd128 fwd} "
[[ -n "${SKIP_TESTS:-}" ]] && STEPS="${STEPS/ tests / }"
[[ -n "${FIXED_COST:-}" ]] && STEPS="$STEPS fixed "
has() { [[ "$STEPS" == *" $1 "* ]]; }
has tests && step tests "${T_TESTS:-240}" python3 -m pytest tests/test_hopper_tier.py -n 12 -p no:cacheprovider -q --tb=short \
  -k "${TEST_K:-reg_a or q_regs}"
# forward options that must not change the outputs (SAME_VARIANTS): bitwise against the dispatched tiles
[[ -n "${SAME_VARIANTS:-}" ]] && has same && step same "${T_SAME:-120}" python3 scripts/same_outputs.py \
  --variants "$SAME_VARIANTS"
BV="${BWD_VARIANTS:-;reg_a=0}"
has bwd256 && step bwd256 "${T_BWD256:-150}" python3 scripts/hopper_bwd_probe.py rounds --headdims 256 --rounds 5 \
  --cases "${BWD256_CASES:-1x8192x36x256,16x1024x8x256}" --variants "$BV" --out "$OUT_DIR" --tag="-$COMMIT" \
  ${BWD256_ARGS:-}  # e.g. BWD256_ARGS=--varlen: the Hopper rows on the batch packed as varlen
has bwd128 && step bwd128 "${T_BWD128:-80}" python3 scripts/hopper_bwd_probe.py rounds --headdims 128 --rounds 5 \
  --cases "${BWD128_CASES:-2x8192x16x128}" --variants "${BWD128_VARIANTS:-;reg_a=1}" --out "$OUT_DIR" --tag="-$COMMIT"
has bwd64 && step bwd64 "${T_BWD64:-80}" python3 scripts/hopper_bwd_probe.py rounds --headdims 64 --rounds 5 \
  --cases "${BWD64_CASES:-2x8192x32x64}" --variants "${BWD64_VARIANTS:-;reg_a=1;reg_a=2}" --out "$OUT_DIR" --tag="-$COMMIT"
has fwd && step fwd "${T_FWD:-120}" python3 scripts/hopper_probe.py rounds --rounds 5 \
  --cases "${FWD_CASES:-2x8192x32x64,2x8192x16x128,1x8192x36x256,16x1024x16x128}" --variants "${FWD_VARIANTS:-;q_regs=1}" \
  --out "$OUT_DIR" --tag="-$COMMIT"
# the dK/dV kernel's per-CTA fixed cost (scripts/bwd_breakdown.py --fixed-cost)
# (its log to stdout only: with its JSON that makes the 8th file)
has fixed && timeout "${T_FIXED:-120}" python3 scripts/bwd_breakdown.py --fixed-cost --out "$OUT_DIR"
# PACK=1: everything in one archive (the device brings back 8 files at most)
if [[ -n "${PACK:-}" ]]; then
  (cd "$OUT_DIR" && tar czf "variants-$COMMIT.tar.gz" --exclude="variants-$COMMIT.tar.gz" . \
     && find . -type f ! -name "variants-$COMMIT.tar.gz" -delete)
fi
exit 0
