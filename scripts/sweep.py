"""Tile sweep for the portable kernels on one GPU: times candidate tiles and writes JSON,
from which ``triflash/kernels/configs.py``'s sm90 tables are chosen.

    python scripts/sweep.py --out sweep.json [--headdims 256 128 64] [--budget-s 150]
                            [--masks full causal] [--jobs 8] [--kinds fwd bwd]

Shapes follow the benchmark: the seed case at head dim 256 (1 x 8192 x 36), 16k tokens at
seqlen 8192 otherwise; bf16; every candidate is timed non-causal and bottom-right causal.
``--jobs N`` first compiles every candidate in N worker processes (Triton's on-disk cache),
so the timed loop spends its budget on the GPU, not on the compiler. Candidates were
pre-screened on the CPU with ``python -m tools.sm90_report``. Each row: head dim,
mask, kind, tile, ms, TFLOPS (or the error: out of resources, compile failure).
"""
import argparse
import json
import multiprocessing as mp
import time

import torch
import triton

from triflash.kernels import portable
from triflash.kernels.configs import BwdConfig as B, FwdConfig as F
from triflash.kernels.problem import AttnParams
from triflash.testing import flops

SHAPES = {64: (2, 8192, 32), 128: (2, 8192, 16), 256: (1, 8192, 36)}
# B(dkdv m, n, warps, stages, dq m, n, warps, stages, atomic_dq, split_dkdv); the first
# candidate of each kind is the tile configs.py ships. Every backward runs deterministic
# (separate dQ kernel), as configs.SM90_BWD dispatches it.
CANDIDATES = {
    256: [
        F(128, 64, 8, 2), F(128, 32, 8, 3), F(64, 32, 4, 2), F(64, 64, 4, 1), F(64, 32, 4, 1),
        B(32, 128, 8, 2, 128, 32, 8, 2, False, True),
        B(32, 128, 8, 3, 128, 32, 8, 2, False, True), B(32, 128, 8, 3, 128, 32, 8, 3, False, True),
        B(16, 128, 8, 4, 128, 32, 8, 3, False, True), B(32, 128, 8, 3, 64, 32, 4, 3, False, True),
    ],
    128: [
        F(128, 128, 8, 3), F(128, 64, 8, 3),
        B(64, 128, 8, 2, 128, 64, 8, 2, False), B(64, 128, 8, 2, 128, 64, 8, 3, False),
        B(64, 128, 8, 3, 128, 64, 8, 3, False), B(64, 128, 8, 2, 128, 64, 8, 4, False),
        B(32, 128, 8, 3, 128, 64, 8, 3, False),
    ],
    64: [
        F(128, 128, 4, 3),
        B(64, 128, 8, 3, 128, 64, 8, 3, False), B(64, 128, 8, 3, 64, 128, 4, 3, False),
        B(64, 128, 8, 3, 64, 128, 4, 4, False), B(64, 128, 8, 3, 128, 64, 4, 4, False),
        B(64, 128, 8, 4, 64, 128, 4, 3, False),
    ],
}
# Measured (TFLOPS full / causal): round 1, benchmarks/results/sweep-h200-4cf91bc.json.gz, and
# round 2, sweep-h200-25aaea1.json.gz (configs.py has the choices).


def _inputs(d, causal):
    b, s, h = SHAPES[d]
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
                     for _ in range(4))
    p = AttnParams(d ** -0.5, -1, 0 if causal else -1, 0.0, s, s)
    out, lse = portable.fwd(q, k, v, None, None, None, None, p, CANDIDATES[d][0], False)
    return (b, s, h), (q, k, v, dout, out, lse), p


def _call(cfg, tensors, p):
    q, k, v, dout, out, lse = tensors
    if isinstance(cfg, F):
        return lambda: portable.fwd(q, k, v, None, None, None, None, p, cfg, False)
    return lambda: portable.bwd(dout, q, k, v, out, lse, None, None, None, None, p, cfg, True, False)


def _compile(job):
    """Worker: run one candidate once per mask so its kernels land in Triton's cache."""
    d, i, masks = job
    for causal in masks:
        try:
            _, tensors, p = _inputs(d, causal)
            _call(CANDIDATES[d][i], tensors, p)()
            torch.cuda.synchronize()
        except Exception as e:  # recorded again, with its message, by the timed loop
            return f"{d}/{i}: {type(e).__name__}"
    return None


def bench(fn):
    try:
        return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")
    except Exception as e:  # out of resources, compile failure: record and go on
        return f"{type(e).__name__}: {str(e)[:300]}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="sweep.json")
    ap.add_argument("--headdims", type=int, nargs="+", default=[256, 128, 64])
    ap.add_argument("--masks", nargs="+", default=["full", "causal"], choices=["full", "causal"])
    ap.add_argument("--kinds", nargs="+", default=["fwd", "bwd"], choices=["fwd", "bwd"])
    ap.add_argument("--budget-s", type=float, default=150)
    ap.add_argument("--jobs", type=int, default=0)
    args = ap.parse_args()
    masks = [m == "causal" for m in args.masks]
    kinds = {"fwd": F, "bwd": B}
    wanted = lambda cfg: any(isinstance(cfg, kinds[k]) for k in args.kinds)
    t0 = time.time()
    if args.jobs:
        jobs = [(d, i, masks) for d in args.headdims for i, c in enumerate(CANDIDATES[d]) if wanted(c)]
        with mp.get_context("spawn").Pool(args.jobs) as pool:
            failed = [r for r in pool.map(_compile, jobs, chunksize=1) if r]
        print(f"compiled {len(jobs)} candidates in {time.time() - t0:.0f} s; failed: {failed}", flush=True)
    rows = []
    for d in args.headdims:
        for causal in masks:
            (b, s, h), tensors, p = _inputs(d, causal)
            for cfg in CANDIDATES[d]:
                if not wanted(cfg):
                    continue
                if time.time() - t0 > args.budget_s:
                    print(f"budget reached before {d} {cfg}", flush=True)
                    break
                mode = "fwd" if isinstance(cfg, F) else "bwd"
                ms = bench(_call(cfg, tensors, p))
                row = dict(headdim=d, shape=[b, s, h], causal=causal, kind=mode, cfg=repr(cfg))
                if isinstance(ms, float):
                    row.update(ms=ms, tflops=flops(b, h, s, s, d, causal=causal, mode=mode) / ms * 1e-9)
                else:
                    row.update(error=ms)
                rows.append(row)
                print(json.dumps(row), flush=True)
            del tensors
            torch.cuda.empty_cache()
    with open(args.out, "w") as fh:
        json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                       triton=triton.__version__, rows=rows), fh, indent=1)
    print(f"sweep done in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
