"""Tile sweep for the portable kernels on one GPU: times candidate tiles and writes JSON,
from which ``triflash/kernels/configs.py``'s sm90 tables are chosen.

    python scripts/sweep.py --out sweep.json [--headdims 256 128 64] [--budget-s 150] [--causal]

Shapes follow the benchmark: the seed case at head dim 256 (1 x 8192 x 36), 16k tokens at
seqlen 8192 otherwise; bf16, non-causal (``--causal``: bottom-right causal). Candidates were
pre-screened on the CPU with ``python -m triflash.kernels.sm90_report`` (no or few spilled
bytes), so the sweep spends GPU time only on tiles that fit. Each row: kind, tile, deterministic, ms, TFLOPS.
"""
import argparse
import json
import time

import torch
import triton

from triflash.kernels import portable
from triflash.kernels.configs import BwdConfig as B, FwdConfig as F
from triflash.kernels.portable import AttnParams
from triflash.testing import flops

SHAPES = {64: (2, 8192, 32), 128: (2, 8192, 16), 256: (1, 8192, 36)}
# (config, deterministic); deterministic=False uses the tile's atomic_dq setting
CANDIDATES = {
    256: [
        (F(128, 64, 8, 2), None), (F(128, 32, 8, 2), None), (F(64, 64, 8, 2), None),
        (B(64, 64, 8, 1, 64, 64, 8, 1), False),                         # before the sweep
        (B(64, 64, 8, 1, 64, 64, 8, 1), True),
        (B(16, 128, 8, 2, 128, 32, 8, 2, False, True), True),
        (B(32, 128, 8, 2, 128, 32, 8, 2, False, True), True),
        (B(32, 128, 8, 1, 128, 32, 8, 2, False, True), True),
        (B(16, 128, 8, 2, 128, 32, 8, 2, True, True), False),
        (B(16, 64, 8, 3, 128, 32, 8, 2), True),
        (B(16, 128, 8, 2, 64, 64, 8, 2, False, True), True),
        (B(16, 128, 8, 2, 32, 64, 4, 2, False, True), True),
    ],
    128: [
        (F(128, 128, 8, 3), None), (F(128, 64, 8, 3), None),
        (B(64, 128, 8, 2, 128, 64, 8, 2), False),                       # before the sweep
        (B(16, 128, 8, 3, 128, 32, 8, 2), False),
        (B(16, 128, 8, 3, 128, 32, 8, 2), True),
        (B(32, 64, 8, 3, 128, 32, 8, 2), False),
        (B(32, 128, 8, 2, 128, 32, 8, 2, True, True), False),
        (B(32, 128, 8, 2, 128, 32, 8, 2, True, True), True),
        (B(16, 128, 8, 3, 128, 64, 8, 2), True),
    ],
    64: [
        (F(128, 128, 4, 3), None), (F(128, 128, 8, 3), None), (F(128, 64, 4, 3), None),
        (B(64, 128, 8, 3, 128, 64, 8, 3), False),                       # before the sweep
        (B(32, 128, 8, 3, 128, 64, 8, 3), False),
        (B(32, 128, 8, 3, 128, 64, 8, 3), True),
    ],
}


def bench(fn):
    try:
        return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")
    except Exception as e:  # out of resources, compile failure: record and go on
        return f"{type(e).__name__}: {str(e)[:300]}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="sweep.json")
    ap.add_argument("--headdims", type=int, nargs="+", default=[256, 128, 64])
    ap.add_argument("--budget-s", type=float, default=150)
    ap.add_argument("--causal", action="store_true")
    args = ap.parse_args()
    t0 = time.time()
    rows = []
    for d in args.headdims:
        b, s, h = SHAPES[d]
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
                         for _ in range(4))
        p = AttnParams(d ** -0.5, -1, 0 if args.causal else -1, 0.0, s, s)
        out, lse = portable.fwd(q, k, v, None, None, None, None, p, CANDIDATES[d][0][0], False)
        for cfg, det in CANDIDATES[d]:
            if time.time() - t0 > args.budget_s:
                print(f"budget reached before {cfg}", flush=True)
                break
            if isinstance(cfg, F):
                ms = bench(lambda: portable.fwd(q, k, v, None, None, None, None, p, cfg, False))
                f = flops(b, h, s, s, d, causal=args.causal, mode="fwd")
            else:
                sep = det or not cfg.atomic_dq
                ms = bench(lambda: portable.bwd(dout, q, k, v, out, lse, None, None, None, None,
                                                p, cfg, sep, False))
                f = flops(b, h, s, s, d, causal=args.causal, mode="bwd")
            row = dict(headdim=d, shape=[b, s, h], causal=args.causal, kind=type(cfg).__name__,
                       cfg=repr(cfg), deterministic=det)
            row.update(dict(ms=ms, tflops=f / ms * 1e-9) if isinstance(ms, float) else dict(error=ms))
            rows.append(row)
            print(json.dumps(row), flush=True)
        del q, k, v, dout, out, lse
        torch.cuda.empty_cache()
    with open(args.out, "w") as fh:
        json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                       triton=triton.__version__, rows=rows), fh, indent=1)
    print(f"sweep done in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
