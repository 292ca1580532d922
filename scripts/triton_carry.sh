#!/usr/bin/env bash
# Bring a Triton release the H200's image lacks (its python3 has torch 2.11 with triton 3.6),
# to run the GPU suite and the benchmark under it: the step that adds a release to
# versions.VALIDATED_TRITON. The card has no network and one device call carries at most
# 64 MiB, so the cp312 wheel is unpacked, repacked with xz and cut into parts of 57 MiB (beside the ~3 MiB tree), each
# carried by a call of its own. Run here, in the repo root:
#   bash scripts/triton_carry.sh 3.9.0
# It fills .triton/ (git-ignored) and prints the device calls.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION="${1:?usage: bash scripts/triton_carry.sh TRITON_VERSION}"
grep -qx '/.triton/' .git/info/exclude || echo '/.triton/' >> .git/info/exclude
rm -rf .triton && mkdir -p .triton/wheel .triton/unpacked
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  -d .triton/wheel "triton==$VERSION"
python3 -m zipfile -e .triton/wheel/*.whl .triton/unpacked
chmod +x .triton/unpacked/triton/backends/*/bin/*   # zipfile drops the modes: ptxas & co. run
tar -C .triton/unpacked -cf - . | xz -6 -T0 | split -b 57m -d - .triton/part-
rm -rf .triton/wheel .triton/unpacked
ls -l .triton
parts=$(ls .triton | tr '\n' ' ')
cat <<MSG
Device calls, one per part, back to back on one warm machine (the next within the idle
release after the last: status says how long), each carrying only its part:
  carry [".triton/part-NN"]:  mkdir -p /tmp/tparts && cp .triton/part-NN /tmp/tparts/
then, in the last part's call or after it:
  mkdir -p /tmp/site-triton && cat /tmp/tparts/part-* | xz -d | tar -x -C /tmp/site-triton && \\
    PYTHONPATH=/tmp/site-triton bash scripts/gpu_run.sh COMMIT \$OUT
(gpu_run.sh's env line prints the triton that ran.) The whole suite under triton 3.9 took
three calls of about 200 s each on an H100 at 2ad3ad0: PARTS=tests SHARD=i/3
TEST_WORKERS=16 TEST_TIMEOUT=560, and TEST_REST_OF=<their logs> for anything a time box cut.
Parts: $parts
MSG
