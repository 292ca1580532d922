"""How much of a measured backward (the benchmark's do_bench: L2 flushed before each call,
events around each call) is kernel time, and how much is the host's latency to the first
launch? The seed backward timed four ways, triflash and SDPA-cuDNN side by side:

  do_bench        the benchmark's method (median ms)
  do_bench_graph  the same call captured in a CUDA graph and replayed (no host time inside)
  loop            n calls back to back between two events (host runs ahead; no flush)
  profiler        the sum of the call's kernel durations (torch.profiler)

    python scripts/timing_probe.py [--out DIR]
"""
import argparse
import json
import os
import sys

import torch
import triton
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import triflash  # noqa: E402


def _methods(fn):
    res = {"do_bench": triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")}
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    res["do_bench_graph"] = triton.testing.do_bench(g.replay, warmup=25, rep=100, return_mode="median")
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    n = 20
    a.record()
    for _ in range(n):
        fn()
    b.record()
    torch.cuda.synchronize()
    res["loop"] = a.elapsed_time(b) / n
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    res["profiler"] = sum(e.device_time_total for e in prof.key_averages()) / 1000 / 5
    return {k: round(v, 4) for k, v in res.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    rows = []
    for b, s, h, d in [(1, 8192, 36, 256), (2, 8192, 16, 128)]:
        for causal in (False, True):
            torch.manual_seed(0)
            q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                       for _ in range(3))
            out = triflash.flash_attn_func(q, k, v, causal=causal)
            dout = torch.randn_like(out)
            qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
            from torch.nn.attention import SDPBackend, sdpa_kernel
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                ot = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
            dot = dout.transpose(1, 2)
            impls = {
                "triflash bwd": lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True),
                "sdpa-cudnn bwd": lambda: torch.autograd.grad(ot, (qt, kt, vt), dot, retain_graph=True),
                "triflash fwd": lambda: triflash.flash_attn_func(q, k, v, causal=causal),
            }
            for name, fn in impls.items():
                try:
                    r = _methods(fn)
                except Exception as e:  # a method that cannot run (e.g. capture) is reported
                    r = {"error": repr(e)[:300]}
                row = dict(case=f"{b}x{s}x{h}x{d}", causal=causal, impl=name, **r)
                print(json.dumps(row), flush=True)
                rows.append(row)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "timing-probe.json"), "w") as f:
        json.dump(dict(rows=rows, device=torch.cuda.get_device_name(), torch=torch.__version__), f, indent=1)


if __name__ == "__main__":
    main()
