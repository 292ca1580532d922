#!/usr/bin/env bash
# The one GPU command: GPU test suite at realistic sizes, then the benchmark preset h200.
# Usage (repo root, on the H200):  bash scripts/gpu_run.sh COMMIT OUTDIR
# Writes OUTDIR/{env.txt, gpu-tests.txt, bench.txt, h200.json, h200.png}.
set -u
COMMIT="${1:-unknown}"
OUT_DIR="${2:-gpu-out}"
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

{
  date -u +%FT%TZ
  echo "commit $COMMIT"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "cudnn", torch.backends.cudnn.version())'
} 2>&1 | tee "$OUT_DIR/env.txt"

# 1. GPU tests: the same files as CI, sizes scaled up when CUDA is present.
timeout "${TEST_TIMEOUT:-160}" python3 -m pytest tests -q -n 8 -p no:cacheprovider \
  -m "not sm90" -p no:logging --tb=short --ignore=tests/test_bench_cpu.py 2>&1 | tail -n 80 | tee "$OUT_DIR/gpu-tests.txt"

# 2. The benchmark: every installed peer, same run, correctness checked.
timeout "${BENCH_TIMEOUT:-330}" python3 -m triflash.bench --preset h200 --commit "$COMMIT" \
  --impls triflash,triflash-portable,triflash-varlen,triflash-deterministic,sdpa-cudnn,sdpa-flash,flex,fa2,fa3,fa4 \
  --warmup 25 --rep 100 --out "$OUT_DIR/h200.json" --plot "$OUT_DIR/h200.png" 2>&1 \
  | tee "$OUT_DIR/bench-full.txt" | tail -n 80 | tee "$OUT_DIR/bench.txt"
