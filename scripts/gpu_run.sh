#!/usr/bin/env bash
# The GPU command: GPU test suite at realistic sizes, then the benchmark preset h200.
# Usage (repo root, on the H200):  [PARTS="tests bench"] bash scripts/gpu_run.sh COMMIT OUTDIR
#   IMPLS=a,b,...  the benchmark's implementations; BENCH_ARGS: extra benchmark flags
#   (e.g. "--seqlens 8192": the seed and 8k cases only, ~4 minutes); BENCH_ROUNDS:
#   interleaved timing rounds per case (default 3, the median kept); TEST_WORKERS: pytest
#   workers for the tests (default 12); SHARD=i/n: the i-th of n shards of the tests, i-j/n
#   shards i to j (tests/conftest.py; the whole suite, ~620 s at f985c04, passes one call's
#   limit: SHARD=1/2 and SHARD=2/2 in two calls); RESUME=path: a partial h200.json of the
#   same commit whose cases the benchmark keeps instead of measuring again (each case's rows
#   come from one process)
# Writes OUTDIR/{env.txt, gpu-tests.txt, bench.txt, h200.json, h200.png} (PARTS=headdims:
# headdims.json, headdims.png, bench-headdims.txt: --preset headdims; PARTS=decode:
# decode.json, decode.png, bench-decode.txt: --preset decode, published as
# benchmarks/results/h200-decode-latest.{json,png}; DECODE_IMPLS: its implementations,
# DECODE_RESUME=path: a partial decode.json of the same commit to resume; PARTS=decode-fp8: the same
# cases with fp8 caches, decode-fp8.json; PARTS=fa3: FA3's own test file, fa3-own.txt).
# The two parts take ~260-535 s each (tests at be2df44: 651 in 263 s with 12 workers, 430 s
# with 8 at 95274cf; the bench with 3 rounds and FA4 isolated: 453-534 s): one device call
# each, PARTS=tests (TEST_TIMEOUT default 560) and PARTS=bench (h200.json is rewritten after
# every case). The
# 1k-16k sweep runs triflash and the SDPA backends; the other variants and FlexAttention run
# at seqlen 8192 only.
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

PARTS="${PARTS:-tests bench}"
# 1. GPU tests: the same files as CI, sizes scaled up when CUDA is present (-v: each test's
#    worker and outcome, so a CUDA fault that poisons a worker can be traced to its test).
#    TEST_MARK: the pytest -m expression (default: the dispatched kernels, not the tests of
#    options: TEST_MARK="option and not sm90" runs those, tests/conftest.py); TEST_IDS=path:
#    only the node ids listed in the file (a stopped call's remainder).
#    TEST_REST_OF=path: a -v log of an earlier run (.gz or plain): only the collected tests it
#    has no outcome for (those its time box cut off, and tests added since; OUTDIR/rest.txt).
[[ -n "${SHARD:-}" ]] && export TRIFLASH_TEST_SHARD="$SHARD"
if [[ -n "${TEST_REST_OF:-}" ]]; then
  python3 -m pytest tests --collect-only -q -p no:cacheprovider -m "${TEST_MARK:-not sm90 and not option}" \
    --ignore=tests/test_bench_cpu.py 2>/dev/null | grep '::' | sort > "$OUT_DIR/collected.txt"
  zcat -f "$TEST_REST_OF" | python3 -c '
import re, sys
done = set()
for line in sys.stdin:  # "[gw3] [ 10%] PASSED tests/...::name[id] " (ids may hold spaces)
    m = re.search(r"\b(?:PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS) (tests/\S.*?)\s*$", line)
    if m:
        done.add(m.group(1).split(" - ")[0])
for test in open(sys.argv[1]).read().splitlines():
    if test not in done:
        print(test)' "$OUT_DIR/collected.txt" > "$OUT_DIR/rest.txt"
  echo "$(wc -l < "$OUT_DIR/rest.txt") of $(wc -l < "$OUT_DIR/collected.txt") collected tests have no outcome in $TEST_REST_OF"
  TEST_IDS="$OUT_DIR/rest.txt"
fi
[[ -n "${TEST_IDS:-}" ]] && export TRIFLASH_TEST_IDS="$(realpath "$TEST_IDS")"
[[ " $PARTS " == *" tests "* ]] && timeout "${TEST_TIMEOUT:-560}" python3 -m pytest tests -n "${TEST_WORKERS:-12}" -p no:cacheprovider \
  -m "${TEST_MARK:-not sm90 and not option}" -p no:logging --tb=short -v --ignore=tests/test_bench_cpu.py > "$OUT_DIR/gpu-tests.txt" 2>&1
[[ " $PARTS " == *" tests "* ]] && tail -n 30 "$OUT_DIR/gpu-tests.txt"

# 2. The benchmark: every installed peer, same run, correctness checked.
[[ " $PARTS " == *" bench "* ]] && timeout "${BENCH_TIMEOUT:-560}" python3 -m triflash.bench --preset h200 --commit "$COMMIT" \
  --impls "${IMPLS:-triflash,triflash-portable,triflash-varlen,triflash-deterministic,sdpa-cudnn,sdpa-flash,flex,fa2,fa3,fa4}" ${BENCH_ARGS:-} \
  --only-seqlens flex=8192 --only-seqlens triflash-portable=8192 --only-seqlens triflash-varlen=8192 \
  --only-seqlens triflash-deterministic=8192 ${RESUME:+--resume "$RESUME"} --warmup 25 --rep 100 --rounds "${BENCH_ROUNDS:-3}" --out "$OUT_DIR/h200.json" --plot "$OUT_DIR/h200.png" 2>&1 \
  | tee "$OUT_DIR/bench-full.txt" | tail -n 80 | tee "$OUT_DIR/bench.txt"

# 3. Every tuned head dim at 2 x 8192 (~215 s with FA4): PARTS=headdims, a call of its own.
[[ " $PARTS " == *" headdims "* ]] && timeout "${BENCH_TIMEOUT:-560}" python3 -m triflash.bench --preset headdims \
  --commit "$COMMIT" --impls "${IMPLS:-triflash,triflash-portable,sdpa-cudnn,sdpa-flash,fa2,fa3,fa4}" ${BENCH_ARGS:-} \
  --warmup 25 --rep 100 --rounds "${BENCH_ROUNDS:-3}" --out "$OUT_DIR/headdims.json" --plot "$OUT_DIR/headdims.png" 2>&1 \
  | tee "$OUT_DIR/bench-headdims-full.txt" | tail -n 40 | tee "$OUT_DIR/bench-headdims.txt"
# 4. Decoding: flash_attn_with_kvcache in K+V TB/s against a copy timed in the same process,
#    every installed peer (FA3 / FlashInfer skipped when absent): PARTS=decode, a call of its own.
[[ " $PARTS " == *" decode "* ]] && timeout "${BENCH_TIMEOUT:-560}" python3 -m triflash.bench --preset decode \
  --commit "$COMMIT" --impls "${DECODE_IMPLS:-triflash,triflash-dense,sdpa-cudnn,sdpa-flash,fa4,fa4-kvcache,fa3,flashinfer}" ${BENCH_ARGS:-} \
  ${DECODE_RESUME:+--resume "$DECODE_RESUME"} --warmup 25 --rep 100 --rounds "${BENCH_ROUNDS:-3}" \
  --out "$OUT_DIR/decode.json" --plot "$OUT_DIR/decode.png" 2>&1 \
  | tee "$OUT_DIR/bench-decode-full.txt" | tail -n 60 | tee "$OUT_DIR/bench-decode.txt"
# 5. fp8 KV caches (FA3's e4m3 forward): the decode cases with fp8 q and caches, the
#    implementations that take fp8 (PARTS=decode-fp8: decode-fp8.json, bench-decode-fp8.txt).
[[ " $PARTS " == *" decode-fp8 "* ]] && timeout "${BENCH_TIMEOUT:-560}" python3 -m triflash.bench --preset decode \
  --dtype fp8 --commit "$COMMIT" --impls "${DECODE_IMPLS:-triflash,triflash-dense,fa3}" ${BENCH_ARGS:-} \
  --warmup 25 --rep 100 --rounds "${BENCH_ROUNDS:-3}" --out "$OUT_DIR/decode-fp8.json" --plot "$OUT_DIR/decode-fp8.png" 2>&1 \
  | tee "$OUT_DIR/bench-decode-fp8-full.txt" | tail -n 60 | tee "$OUT_DIR/bench-decode-fp8.txt"
# 6. FlashAttention-3's own test file (PARTS=fa3: fa3-own.txt), FA3_HOPPER_DIR its hopper/ (carried),
#    FA3_SAMPLE / FA3_OFFSET / FA3_K the sample and the -k expression (scripts/fa3_suite.sh).
[[ " $PARTS " == *" fa3 "* ]] && timeout "${TEST_TIMEOUT:-560}" bash scripts/fa3_suite.sh "$FA3_HOPPER_DIR" \
  -n "${TEST_WORKERS:-12}" -q -rf ${FA3_K:+-k "$FA3_K"} > "$OUT_DIR/fa3-own.txt" 2>&1
[[ " $PARTS " == *" fa3 "* ]] && tail -n 20 "$OUT_DIR/fa3-own.txt"
exit 0
