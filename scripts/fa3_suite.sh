#!/usr/bin/env bash
# FlashAttention-3's own test file (hopper/test_flash_attn.py) run against triflash:
# `import flash_attn_interface` is triflash. Cases are sampled by a hash of their node id.
#
#   bash scripts/fa3_suite.sh FA3_HOPPER_DIR [pytest args...]
#     FA3_HOPPER_DIR: a flash-attention checkout's hopper/ (test_flash_attn.py, test_util.py, padding.py)
#     FA3_SAMPLE=N FA3_OFFSET=r: the cases whose zlib.crc32(node id) % N == r (default: all)
#     FA3_MAXSEQ=S: only cases whose first two parameters (seqlen_q, seqlen_k) are <= S
#     FA3 skips fp8 when FLASH_ATTENTION_DISABLE_FP8=TRUE; other FLASH_ATTENTION_DISABLE_* likewise
#   Without a GPU the file runs on the CPU under Triton's interpreter: its device "cuda"
#   becomes "cpu" (and its sm90 check for fp8 passes).
# e.g. FA3_SAMPLE=200 FA3_MAXSEQ=512 bash scripts/fa3_suite.sh ~/flash-attention/hopper -k "output and dtype2" -q
set -eu
SRC="$(realpath "$1")"; shift
REPO="$(cd "$(dirname "$0")/.." && pwd)"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
for f in test_flash_attn.py test_util.py padding.py; do cp "$SRC/$f" "$WORK/"; done
cat > "$WORK/flash_attn_interface.py" <<'EOF'
from triflash import *  # noqa: F401,F403
from triflash import _flash_attn_backward, _flash_attn_forward  # noqa: F401
EOF
cat > "$WORK/conftest.py" <<'EOF'
import os
import re
import zlib

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    n, r = int(os.environ.get("FA3_SAMPLE", "1")), int(os.environ.get("FA3_OFFSET", "0"))
    most = int(os.environ.get("FA3_MAXSEQ", "0"))

    def small(item):
        m = re.search(r"\[(\d+)-(\d+)", item.nodeid)
        return not most or not m or max(int(m.group(1)), int(m.group(2))) <= most
    items[:] = [it for it in items if zlib.crc32(it.nodeid.encode()) % n == r and small(it)]
EOF
if ! python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  sed -i 's/device = "cuda"/device = "cpu"/; s/or torch.cuda.get_device_capability("cuda")\[0\] < 9/or False/' \
    "$WORK/test_flash_attn.py"
fi
cd "$WORK"
PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" python3 -m pytest test_flash_attn.py -p no:cacheprovider "$@"
