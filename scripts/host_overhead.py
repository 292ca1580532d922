"""Host (CPU) time per call of triflash's forward and backward on the seed shape, against the
GPU time of the same calls: when the host time approaches the GPU time, a benchmark that
times single calls (do_bench) counts launch overhead as kernel time. Each is measured
through the public API (eager: an autograd.Function) and through the torch.library op
(what torch.compile traces), so the two paths' Python cost can be compared.

    python scripts/host_overhead.py [--out DIR]     on an sm90 GPU
    python scripts/host_overhead.py --cpu-mock      no GPU: CPU tensors, the sm90 dispatch
        with every kernel launch stubbed out (the Python side alone; launches not counted)
    python scripts/host_overhead.py --breakdown [--out DIR]   on an sm90 GPU, 16x1024x16x128
        causal: host time per call of each layer of the forward (public API, dispatch, the
        Hopper host code, building the arguments, Triton's JIT launch, the compiled kernel's
        launcher alone) and of the backward, to see where a 1k-token call spends its time

One JSON line on stdout (+ DIR/host-overhead[-cpu-mock].json).
"""
import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import triflash  # noqa: E402
from triflash import ops  # noqa: E402


def _mock_sm90():
    """CPU tensors through the sm90 dispatch, launches replaced by no-ops."""
    from triflash import dispatch, validation
    from triflash.kernels.hopper import bwd, bwd256, bwd_dq, bwd_stats, fwd
    from triflash.kernels.hopper import common as hopper_common

    class _Compiled:  # a compiled kernel whose launcher does nothing
        function = packed_metadata = None

        def run(self, *args):
            pass

    class _NoLaunch:  # a JIT function: hopper.common.launch / planned_launch keep its result
        def __init__(self, params):
            self.device_caches, self.params, self.__name__ = {}, params, "mock"

        def __getitem__(self, grid):
            return lambda *args, **kwargs: _Compiled()

    class _Driver:
        class active:
            get_current_device = staticmethod(lambda: 0)
            get_current_stream = staticmethod(lambda device: 0)
    for mod, name in ((fwd, "hopper_fwd_kernel"), (bwd, "hopper_bwd_kernel"),
                      (bwd_stats, "bwd_stats_kernel"), (bwd, "_scale_cast_kernel"), (bwd_dq, "hopper_dq_kernel"),
                      (bwd256, "hopper_bwd256_kernel")):
        setattr(mod, name, _NoLaunch(getattr(mod, name).params))
    hopper_common.driver = _Driver
    hopper_common._capturing = lambda: False
    hopper_common._NUM_SMS[torch.device("cpu")] = 132  # the H200's count (no CUDA here)
    dispatch.target_of = lambda device: "sm90"
    validation.check_device = lambda *tensors: None


def _time(fn, cuda, n=50, trials=5):
    """(host ms, per-call ms): best of ``trials`` runs of ``n`` calls."""
    fn()
    best_host = best_total = float("inf")
    for _ in range(trials):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        host = (time.perf_counter() - t0) / n
        if cuda:
            torch.cuda.synchronize()
        total = (time.perf_counter() - t0) / n
        best_host, best_total = min(best_host, host), min(best_total, total)
    return round(best_host * 1e3, 3), round(best_total * 1e3, 3)


def breakdown():
    """{layer: host ms per call} of the forward's layers and the backward (sm90 GPU)."""
    from triflash import dispatch
    from triflash.kernels import configs, problem
    from triflash.kernels.hopper import common as hopper_common
    from triflash.kernels.hopper import fwd as H
    b, s, h, d = 16, 1024, 16, 128
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    params = problem.AttnParams(d ** -0.5, -1, 0, 0.0, s, s)
    cfg = configs.SM90_HOPPER_FWD[d]
    out, lse = problem.alloc_fwd_outputs(q, v, False)
    grid, kargs = H.kernel_args(q, k, v, out, lse, params, cfg)
    compiled = H.hopper_fwd_kernel[grid](*kargs, num_warps=4)
    layers = {
        "fwd api (grad)": lambda: triflash.flash_attn_func(q, k, v, causal=True),
        "fwd api (no_grad)": lambda: _no_grad(lambda: triflash.flash_attn_func(q, k, v, causal=True)),
        "fwd dispatch.run_fwd": lambda: dispatch.run_fwd(q, k, v, None, None, None, None, params),
        "fwd alloc out+lse": lambda: problem.alloc_fwd_outputs(q, v, False),
        "fwd hopper.fwd": lambda: H.fwd(q, k, v, out, lse, params, cfg),
        "fwd kernel_args": lambda: H.kernel_args(q, k, v, out, lse, params, cfg),
        "fwd jit launch": lambda: H.hopper_fwd_kernel[grid](*kargs, num_warps=4),
        # the CompiledKernel's own launcher (no argument binding / specialization); it wants
        # a 3-tuple grid (at bb86392 a 1-tuple made this row an IndexError)
        "fwd compiled launch": lambda: compiled[(grid[0], 1, 1)](*kargs),
        # hopper.common.launch on a repeat: the key, then the compiled kernel's launcher
        "fwd common.launch": lambda: hopper_common.launch(H.hopper_fwd_kernel, grid, kargs),
    }
    rows = {}
    for name, fn in layers.items():
        try:
            rows[name] = _time(fn, True, n=200)[0]
        except Exception as e:  # e.g. the compiled kernel's runner wants other arguments
            rows[name] = f"{type(e).__name__}: {str(e)[:200]}"
    o = triflash.flash_attn_func(q, k, v, causal=True)
    do = torch.randn_like(o)
    rows["bwd autograd.grad"] = _time(lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True),
                                      True, n=100)[0]
    # the backward's layers: the Hopper host code without autograd, its statistics kernel,
    # and autograd's own cost around a backward that launches nothing
    from triflash.kernels.hopper import bwd as HB
    from triflash.kernels.hopper.common import Problem
    with torch.no_grad():
        o2, lse2 = triflash.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    bcfg = configs.SM90_HOPPER_BWD[d]
    pb = Problem(qd, kd, params)
    extra = {
        "bwd hopper.bwd": lambda: HB.bwd(do, qd, kd, vd, o2, lse2, params, False, bcfg),
        "bwd stats": lambda: HB.stats(pb, o2, do, lse2),
        "bwd 3 x torch.empty": lambda: [torch.empty(qd.shape, dtype=qd.dtype, device="cuda") for _ in range(3)],
    }

    class _Nothing(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, y, z):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            return g, g, g
    x0 = _Nothing.apply(q, k, v)
    extra["autograd.grad, empty backward"] = lambda: torch.autograd.grad(x0, (q, k, v), do, retain_graph=True)
    for name, fn in extra.items():
        try:
            rows[name] = _time(fn, True, n=100)[0]
        except Exception as e:
            rows[name] = f"{type(e).__name__}: {str(e)[:200]}"
    return dict(shape=[b, s, h, d], causal=True, host_ms=rows)


def _no_grad(fn):
    with torch.no_grad():
        return fn()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--cpu-mock", action="store_true")
    ap.add_argument("--breakdown", action="store_true")
    args = ap.parse_args()
    if args.breakdown:
        res = breakdown()
        print(json.dumps(res), flush=True)
        if args.out:
            with open(os.path.join(args.out, "host-breakdown.json"), "w") as f:
                json.dump(dict(res, device=torch.cuda.get_device_name(), torch=torch.__version__), f, indent=1)
        return
    cuda = not args.cpu_mock
    if args.cpu_mock:
        _mock_sm90()
    device = "cuda" if cuda else "cpu"
    b, s, h, d = (1, 8192, 36, 256) if cuda else (1, 1024, 8, 256)
    rows = {}
    for causal in (False, True):
        q, k, v = (torch.randn(b, s, h, d, device=device, dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        ints, floats = ops.pack_scalars(s, s, d ** -0.5, -1, 0 if causal else -1, 0.0, False)
        paths = {
            "api": lambda: triflash.flash_attn_func(q, k, v, causal=causal),
            "op": lambda: ops.fwd(q, k, v, None, None, None, None, ints, floats)[0],
        }
        for path, fwd in paths.items():
            out = fwd()
            dout = torch.randn_like(out)
            rows[f"fwd {path} causal={causal}"] = dict(zip(("host_ms", "per_call_ms"), _time(fwd, cuda)))
            rows[f"bwd {path} causal={causal}"] = dict(zip(("host_ms", "per_call_ms"), _time(
                lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True), cuda)))
    print(json.dumps(rows), flush=True)
    if args.out:
        name = "host-overhead-cpu-mock.json" if args.cpu_mock else "host-overhead.json"
        meta = dict(device=torch.cuda.get_device_name() if cuda else "cpu (launches stubbed)",
                    shape=[b, s, h, d], torch=torch.__version__)
        with open(os.path.join(args.out, name), "w") as f:
            json.dump(dict(meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
