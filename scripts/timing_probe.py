"""How much of a measured backward (the benchmark's do_bench: L2 flushed before each call,
events around each call) is kernel time, and how much is the host's latency to the first
launch? The seed backward timed four ways, triflash and SDPA-cuDNN side by side:

  do_bench        the benchmark's method (median ms)
  do_bench_graph  the same call captured in a CUDA graph and replayed (no host time inside)
  loop            n calls back to back between two events (host runs ahead; no flush)
  profiler        the sum of the call's kernel durations (torch.profiler)
  host            the CPU time to issue one call (median of 21, no sync)

    python scripts/timing_probe.py [--out DIR]
    python scripts/timing_probe.py --cases 16x1024x8x256 --causal true --impls fwd --rounds 5
        (the forward through the public API with autograd, as the benchmark times it, beside
        SDPA-cuDNN's forward, in interleaved rounds)
"""
import argparse
import json
import os
import sys
import time

import torch
import triton
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import triflash  # noqa: E402


def _methods(fn):
    res = {"do_bench": triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")}
    torch.cuda.synchronize()
    host = []
    for _ in range(21):  # the CPU time to issue one call (no sync), median
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    res["host"] = sorted(host)[10]
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


_SLOW_PLANS = {}


def _slow_host(fn):
    """``fn`` with every repeat validated and plans launching through ``compiled.run`` (the
    host path before the shortcuts), with plans of its own."""
    from triflash import interface
    from triflash.kernels.hopper import common as hc
    saved = hc._direct_launcher, interface._dense_signature, hc._PLANS
    hc._direct_launcher, interface._dense_signature = (lambda compiled: None), (lambda *args: None)
    hc._PLANS = _SLOW_PLANS
    try:
        return fn()
    finally:
        hc._direct_launcher, interface._dense_signature, hc._PLANS = saved


def _cudnn_fwd(qt, kt, vt, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--cases", default="1x8192x36x256,2x8192x16x128", help="BxSxHxD,...")
    ap.add_argument("--causal", choices=["both", "true", "false"], default="both")
    ap.add_argument("--impls", default="bwd,fwd", help="bwd: both backwards, fwd: both forwards")
    ap.add_argument("--rounds", type=int, default=1)
    a = ap.parse_args()
    rows = []
    cases = [tuple(int(x) for x in c.split("x")) for c in a.cases.split(",")]
    for b, s, h, d in cases:
        for causal in ((False, True) if a.causal == "both" else (a.causal == "true",)):
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
                "sdpa-cudnn fwd": lambda: _cudnn_fwd(qt, kt, vt, causal),
                # the host path without this session's shortcuts (validated signatures,
                # plans past Triton's launcher wrapper), for --impls fwd,slowhost
                "triflash slowhost": lambda: _slow_host(lambda: triflash.flash_attn_func(q, k, v, causal=causal)),
            }
            impls = {n: f for n, f in impls.items() if n.split()[1] in a.impls.split(",")}
            for name, fn in [x for _ in range(a.rounds) for x in impls.items()]:
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
