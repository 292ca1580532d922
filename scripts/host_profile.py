"""Where the host time of one triflash call goes: cProfile over N back-to-back calls of the
forward (public API, autograd on, as the benchmark times it) and of the backward, on one
shape. Complements scripts/host_overhead.py (which only totals it).

    python scripts/host_profile.py [--shape 16x1024x16x128] [--causal] [--n 300] [--out DIR]

Prints the top functions by own time and writes DIR/host-profile-<shape>.txt."""
import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import triflash  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="16x1024x16x128")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--out")
    args = ap.parse_args()
    b, s, h, d = (int(x) for x in args.shape.split("x"))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v = (torch.randn(b, s, h, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    out = triflash.flash_attn_func(q, k, v, causal=args.causal)
    dout = torch.randn_like(out)
    calls = {
        "fwd": lambda: triflash.flash_attn_func(q, k, v, causal=args.causal),
        "bwd": lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True),
    }
    report = io.StringIO()
    for name, fn in calls.items():
        for _ in range(20):
            fn()
        if dev == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.n):
            fn()
        host = (time.perf_counter() - t0) / args.n * 1e3
        if dev == "cuda":
            torch.cuda.synchronize()
        total = (time.perf_counter() - t0) / args.n * 1e3
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(args.n):
            fn()
        pr.disable()
        if dev == "cuda":
            torch.cuda.synchronize()
        print(f"== {name} {args.shape} causal={args.causal}: host {host:.3f} ms/call, "
              f"with the GPU {total:.3f} ms/call", file=report)
        pstats.Stats(pr, stream=report).sort_stats("tottime").print_stats(args.top)
        pstats.Stats(pr, stream=report).sort_stats("cumulative").print_stats(args.top)
    text = report.getvalue()
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"host-profile-{args.shape}.txt"), "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
