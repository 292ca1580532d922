"""Host (CPU) time per call of triflash's forward and backward on the seed shape, against the
GPU time of the same calls: when the host time approaches the GPU time, a benchmark that
times single calls (do_bench) counts launch overhead as kernel time.

    python scripts/host_overhead.py [--out DIR]    ->  one JSON line (+ DIR/host-overhead.json)
"""
import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import triflash  # noqa: E402


def _times(fn, n=20):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t0) / n
    torch.cuda.synchronize()
    total = (time.perf_counter() - t0) / n
    return round(host * 1e3, 3), round(total * 1e3, 3)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args()
    b, s, h, d = 1, 8192, 36, 256
    rows = {}
    for causal in (False, True):
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        out = triflash.flash_attn_func(q, k, v, causal=causal)
        dout = torch.randn_like(out)
        host, total = _times(lambda: triflash.flash_attn_func(q, k, v, causal=causal))
        rows[f"fwd causal={causal}"] = dict(host_ms=host, per_call_ms=total)
        host, total = _times(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
        rows[f"bwd causal={causal}"] = dict(host_ms=host, per_call_ms=total)
    print(json.dumps(rows), flush=True)
    if args.out:
        with open(os.path.join(args.out, "host-overhead.json"), "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), shape=[b, s, h, d], rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
