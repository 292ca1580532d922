#!/usr/bin/env bash
# Prepare FlashAttention-4 (CuTe DSL) so the H200 run can measure it beside triflash.
# The card has no network, and one device call carries at most 64 MiB, so FA4 travels in
# two calls (this script prints both). Run here, in the repo root:
#   bash scripts/fa4_carry.sh
# It fills .whl/ (small wheels) and .fa4/part-aa, part-ab (the 92 MB libs-cu13 wheel
# repacked, ~63.5 MB, in two parts); both are git-ignored.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl .fa4 && mkdir -p .whl .fa4/unpacked
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform any -d .whl \
  flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
  nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 \
  quack-kernels==0.6.5 apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5
big=$(ls .whl/nvidia_cutlass_dsl_libs_cu13-*.whl)
python3 -m zipfile -e "$big" .fa4/unpacked
rm -rf .fa4/unpacked/*.dist-info
# xz -9e: ~63.5 MB, which leaves room for the repo under the 64 MiB a call carries
# (the default level gives ~65.5 MB, too close); takes a few minutes on 2 cores
tar -C .fa4/unpacked -cf - . | xz -9e -T0 > .fa4/libs-cu13.tar.xz
# in two parts, one per call: the tarball and the tracked tree together pass a call's 64 MiB
split -b 34000000 .fa4/libs-cu13.tar.xz .fa4/part-
rm -rf .fa4/unpacked "$big" .fa4/libs-cu13.tar.xz
du -sh .whl .fa4/part-*
cat <<'MSG'
Device calls (the second within 30 s of the first, same machine; the tree travels with each
call beside one part of ~34 MB). Used at 15a7781:
  1. carry [".whl", ".fa4/part-aa"]:  python3 -m pip install -q --no-index --no-deps --no-compile \
       --target /tmp/site .whl/*.whl && mkdir -p /tmp/fa4 && cp .fa4/part-aa /tmp/fa4/
       (plus anything that needs no FA4, e.g. PARTS=tests bash scripts/gpu_run.sh COMMIT $OUT)
  2. carry [".fa4/part-ab"]:  cp .fa4/part-ab /tmp/fa4/ && cat /tmp/fa4/part-* | tar -xJ -C /tmp/site && \
       PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages PARTS=bench bash scripts/gpu_run.sh COMMIT $OUT
  FA4 stays installed while the machine is warm (30 s between calls): a third call can
  benchmark with it again under the same PYTHONPATH.
MSG
