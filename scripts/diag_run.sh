#!/usr/bin/env bash
# One device call of diagnostics, each part under its own timeout, results under OUTDIR:
# GPU tests, the dQ-tile fault search (scripts/fault_repro.py), the backward's per-kernel
# time (scripts/bwd_breakdown.py), Hopper backward tile variants (scripts/hopper_bwd_probe.py),
# portable tiles (sweep: scripts/sweep.py --jobs SWEEP_JOBS with SWEEP_ARGS).
# tier: the Hopper-tier GPU tests only (TIER_K: a pytest -k filter); check / speed: scripts/hopper_bwd_probe.py with
# CHECK_ARGS / SPEED_ARGS; order: scripts/order_probe.py (ORDER_ARGS); fwdprobe:
# scripts/hopper_probe.py FWDPROBE_ARGS (default: check). Parts in BG_PARTS run first, concurrently (compiling is CPU-bound).
# Usage: [BG_PARTS="tier check"] [PARTS="tests fault breakdown probe"] bash scripts/diag_run.sh COMMIT OUTDIR
set -u
COMMIT="${1:-unknown}"; OUT_DIR="${2:-diag-out}"; mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PARTS="${PARTS:-tests fault breakdown probe}"
run_part() {
  local part=$1
  echo "== $part $(date -u +%T)"
  case $part in
    tier)  timeout "${TIER_TIMEOUT:-280}" python3 -m pytest tests/test_hopper_tier.py -n "${TIER_WORKERS:-6}" \
             ${TIER_K:+-k "$TIER_K"} -p no:cacheprovider -p no:logging --tb=short -v > "$OUT_DIR/tier-tests.txt" 2>&1
           echo "== tier done $(date -u +%T)"; tail -n 12 "$OUT_DIR/tier-tests.txt" ;;
    check) timeout "${CHECK_TIMEOUT:-200}" python3 scripts/hopper_bwd_probe.py check ${CHECK_ARGS:-} --out "$OUT_DIR" 2>&1 \
             | tee "$OUT_DIR/check.txt"; echo "== check done $(date -u +%T)" ;;
    speed) timeout "${SPEED_TIMEOUT:-150}" python3 scripts/hopper_bwd_probe.py speed ${SPEED_ARGS:-} --out "$OUT_DIR" 2>&1 \
             | tee -a "$OUT_DIR/speed.txt" ;;
    tests) PARTS=tests TEST_TIMEOUT="${TEST_TIMEOUT:-280}" bash scripts/gpu_run.sh "$COMMIT" "$OUT_DIR" > /dev/null 2>&1
           tail -n 15 "$OUT_DIR/gpu-tests.txt" ;;
    fault) { which compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer; } 2>&1 | head -2
           for dq in ${DQ_TILES:-128,64,8,2 128,64,8,1 64,64,4,2 128,32,8,2}; do
             CUDA_LAUNCH_BLOCKING=1 timeout 60 python3 scripts/fault_repro.py --headdims 96 72 \
               --dtypes bf16 --masks causal --deterministic 1 --dq "$dq" 2>&1 | grep -E "dQ tile|FAULT|DONE|Error" | head -3
           done 2>&1 | tee "$OUT_DIR/fault-tiles.txt" ;;
    sweep) timeout "${SWEEP_TIMEOUT:-400}" python3 scripts/sweep.py --out "$OUT_DIR/sweep.json" --jobs "${SWEEP_JOBS:-12}" \
             ${SWEEP_ARGS:-} > "$OUT_DIR/sweep.txt" 2>&1; echo "== sweep done $(date -u +%T)"; tail -n 3 "$OUT_DIR/sweep.txt" ;;
    order) timeout "${ORDER_TIMEOUT:-240}" python3 scripts/order_probe.py --out "$OUT_DIR" ${ORDER_ARGS:-} 2>&1 \
             | tee "$OUT_DIR/order.txt"; echo "== order done $(date -u +%T)" ;;
    fwdprobe) timeout "${FWDPROBE_TIMEOUT:-150}" python3 scripts/hopper_probe.py ${FWDPROBE_ARGS:-check} --out "$OUT_DIR" 2>&1 \
             | tail -n 40 | tee -a "$OUT_DIR/fwdprobe.txt"; echo "== fwdprobe done $(date -u +%T)" ;;
    breakdown) timeout 150 python3 scripts/bwd_breakdown.py --out "$OUT_DIR" 2>&1 | tail -n 14 ;;
    probe) for c in ${PROBE_CONFIGS:-stages=3}; do
             timeout 90 python3 scripts/hopper_bwd_probe.py speed --impls hopper --config "$c" --out "$OUT_DIR" 2>&1 | tail -n 4
           done ;;
  esac
}
for part in ${BG_PARTS:-}; do run_part "$part" & done
wait
for part in $PARTS; do run_part "$part"; done
echo "== end $(date -u +%T)"
