"""Where the backward's time goes: per-kernel CUDA time of one backward call (torch.profiler,
averaged over several calls) for triflash's dispatched path and the portable path, on the
benchmark's 8k-token cases. Tells which kernel of a multi-kernel backward to work on.

    python scripts/bwd_breakdown.py --out DIR      ->  DIR/bwd-breakdown.json + a table
    python scripts/bwd_breakdown.py --fixed-cost --out DIR   (the head-dim-256 series below)

``--fixed-cost``: the seed's keys (1 x 8192 x 36 x 256) against 8192 / 4096 / 2048 / 1024 /
512 queries, non-causal (every key tile the same length: a line through per-tile times gives
the per-CTA fixed cost of the dK/dV kernel in query blocks), and the causal seed beside it
(its CTAs average 64.5 query blocks: the line predicts its time without the mask).
"""
import argparse
import json
import os
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import triflash  # noqa: E402

CASES = [(1, 8192, 36, 256), (2, 8192, 16, 128), (2, 8192, 32, 64)]


def breakdown(b, s, h, d, causal, backend, iters=5, sq=None):
    """``sq``: queries (default ``s``, the keys)."""
    torch.manual_seed(0)
    sq = sq or s
    q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    with triflash.force_backend(backend):
        out = triflash.flash_attn_func(q, k, v, causal=causal)
        dout = torch.randn_like(out)

        def call():
            torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        for _ in range(3):
            call()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                call()
            torch.cuda.synchronize()
    per_kernel = defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[ev.name[:60]] += ev.device_time_total / iters / 1000.0  # ms per call
    total = sum(per_kernel.values())
    flops = 2.5 * 4 * b * h * sq * s * d * (0.5 if causal else 1.0)
    return dict(case=f"{b}x{s}x{h}x{d}" + (f" sq={sq}" if sq != s else ""), causal=causal, backend=backend, kernel_ms=round(total, 3),
                tflops_of_kernel_time=round(flops / total / 1e9, 1),
                kernels={name: round(ms, 3) for name, ms in sorted(per_kernel.items(), key=lambda x: -x[1])})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--headdims", type=int, nargs="+", default=[c[3] for c in CASES])
    ap.add_argument("--backends", nargs="+", default=["auto", "portable"])
    ap.add_argument("--fixed-cost", action="store_true", help="the head-dim-256 series (docstring)")
    args = ap.parse_args()
    rows = []
    if args.fixed_cost:
        for sq, causal in [(8192, True)] + [(n, False) for n in (8192, 4096, 2048, 1024, 512)]:
            r = breakdown(1, 8192, 36, 256, causal, "auto", sq=sq)
            print(json.dumps(r), flush=True)
            rows.append(r)
    for (b, s, h, d) in ([] if args.fixed_cost else [c for c in CASES if c[3] in args.headdims]):
        for causal in (False, True):
            for backend in args.backends:
                try:
                    r = breakdown(b, s, h, d, causal, backend)
                except Exception as e:  # keep going, report it
                    r = dict(case=f"{b}x{s}x{h}x{d}", causal=causal, backend=backend,
                             error=f"{type(e).__name__}: {str(e)[:200]}")
                print(json.dumps(r), flush=True)
                rows.append(r)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bwd-breakdown.json"), "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
