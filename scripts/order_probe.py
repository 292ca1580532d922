"""H200 probe of the query-tile launch order (``kernels.common.launch_order``): causal
forward and backward TFLOPS for several L2 budgets per section of heads
(``common.L2_SECTION_BYTES``; 0 = one head after another), Hopper and portable tiers,
SDPA-cuDNN beside. Variants are measured interleaved, ``--reps`` rounds, and the median kept
(back-to-back runs of one kernel differ by a few percent on this card). Non-causal launches
do not depend on it (one head after another), so only causal runs.

    python scripts/order_probe.py [--out DIR] [--cases 1x8192x36x256 ...] [--mb 0 16 32]

Writes DIR/order-probe.json and a JSON line per case."""
import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import hopper_bwd_probe as B  # noqa: E402
import hopper_probe as F  # noqa: E402
from triflash.kernels import common  # noqa: E402

CASES = ["1x8192x36x256", "2x8192x16x128", "2x8192x32x64", "16x1024x16x128"]


def _measure(kind, impl, b, s, h, d):
    try:
        if kind == "fwd":
            return F._fwd_tflops(b, s, h, d, True, impl)
        ms = B._bwd_ms(b, s, h, d, True, impl, False)
        return 2.5 * 4 * b * h * s * s * d * 0.5 / ms / 1e9
    except Exception as e:
        return f"{type(e).__name__}: {str(e)[:200]}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--cases", nargs="+", default=CASES)
    ap.add_argument("--mb", type=int, nargs="+", default=[0, 16, 32], help="L2_SECTION_BYTES in MiB")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--kinds", default="fwd_hopper,fwd_portable,bwd_hopper")
    args = ap.parse_args()
    t0 = time.time()
    default = common.L2_SECTION_BYTES
    rows = []
    for case in args.cases:
        b, s, h, d = (int(x) for x in case.split("x"))
        samples = {}
        for kind in ("fwd", "bwd"):
            samples[f"{kind}_cudnn"] = [_measure(kind, "cudnn", b, s, h, d)]
        for _ in range(args.reps):
            for mb in args.mb:
                common.L2_SECTION_BYTES = mb << 20
                for kk in args.kinds.split(","):
                    kind, impl = kk.split("_")
                    samples.setdefault(f"{kk}_{mb}mb", []).append(_measure(kind, impl, b, s, h, d))
        common.L2_SECTION_BYTES = default
        row = dict(case=case, causal=True)
        for key, vals in samples.items():
            nums = [v for v in vals if isinstance(v, float)]
            row[key] = round(statistics.median(nums), 1) if nums else vals[0]
            row[key + "_all"] = [round(v, 1) if isinstance(v, float) else v for v in vals]
        print(json.dumps({k: v for k, v in row.items() if not k.endswith("_all")}), flush=True)
        rows.append(row)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "order-probe.json"), "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                       seconds=time.time() - t0, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
