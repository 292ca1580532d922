"""H200 probe of the query-tile launch order (``kernels.common.launch_order``): causal
forward and backward TFLOPS with sections of heads (the default) against one head after
another (``common.LAUNCH_SECTIONS = False``), Hopper and portable tiers, SDPA-cuDNN beside.
Non-causal launches are the same in both (one section per head), so only causal runs.

    python scripts/order_probe.py [--out DIR] [--cases 1x8192x36x256 ...]

Writes DIR/order-probe.json and a JSON line per case."""
import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import hopper_bwd_probe as B  # noqa: E402
import hopper_probe as F  # noqa: E402
from triflash.kernels import common  # noqa: E402

CASES = ["1x8192x36x256", "2x8192x16x128", "2x8192x32x64", "16x1024x16x128", "16x1024x8x256",
         "1x16384x8x256"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--cases", nargs="+", default=CASES)
    ap.add_argument("--impls", default="hopper,portable", help="triflash tiers to time")
    args = ap.parse_args()
    t0 = time.time()
    rows = []
    for case in args.cases:
        b, s, h, d = (int(x) for x in case.split("x"))
        row = dict(case=case, causal=True)
        fwd_flops = 4 * b * h * s * s * d * 0.5
        for impl in ["cudnn"] + args.impls.split(","):
            for sections in ((True,) if impl == "cudnn" else (True, False)):
                common.LAUNCH_SECTIONS = sections
                tag = impl if impl == "cudnn" else f"{impl}_{'sections' if sections else 'headwise'}"
                try:
                    row[f"fwd_{tag}"] = round(F._fwd_tflops(b, s, h, d, True, impl), 1)
                except Exception as e:
                    row[f"fwd_{tag}"] = f"{type(e).__name__}: {str(e)[:200]}"
                try:
                    ms = B._bwd_ms(b, s, h, d, True, impl, False)
                    row[f"bwd_{tag}"] = round(2.5 * fwd_flops / ms / 1e9, 1)
                except Exception as e:
                    row[f"bwd_{tag}"] = f"{type(e).__name__}: {str(e)[:200]}"
        common.LAUNCH_SECTIONS = True
        print(json.dumps(row), flush=True)
        rows.append(row)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "order-probe.json"), "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                       seconds=time.time() - t0, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
