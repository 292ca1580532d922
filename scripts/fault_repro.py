"""Locate a CUDA fault: run flash_attn_func forward + backward over a grid of cases, with
CUDA_LAUNCH_BLOCKING=1 so the failing launch raises at its own line. A fault kills the CUDA
context, so the process prints the case and the traceback and exits 3; run it in a loop with
``--start N`` to go on after the failing case (scripts/fault_repro.sh does this).

    CUDA_LAUNCH_BLOCKING=1 python scripts/fault_repro.py --headdims 96 --start 0
"""
import argparse
import itertools
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import triflash  # noqa: E402

SEQLENS = [(1, 1), (113, 203), (128, 217), (239, 1), (1, 239), (799, 3), (64, 128), (217, 113),
           (1024, 1024), (1023, 2049), (2048, 2048)]
HEADS = [(8, 8), (8, 2), (8, 1)]
MASKS = {"causal": (True, (-1, -1), 0.0), "window": (False, (17, 5), 0.0), "none": (False, (-1, -1), 0.0)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--headdims", type=int, nargs="+", default=[96])
    ap.add_argument("--dtypes", nargs="+", default=["bf16", "fp16"])
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--deterministic", nargs="+", type=int, default=[1, 0])
    ap.add_argument("--masks", nargs="+", default=list(MASKS))
    ap.add_argument("--dq", default="", help="dq_block_m,dq_block_n,dq_warps,dq_stages for the "
                    "sm90 tile of every head-dim bucket (tries another dQ tile)")
    ap.add_argument("--list", action="store_true", help="print the cases and exit")
    args = ap.parse_args()
    if args.dq:
        import dataclasses
        from triflash.kernels import configs
        bm, bn, w, st = (int(x) for x in args.dq.split(","))
        for key, cfg in list(configs.SM90_BWD.items()):
            configs.SM90_BWD[key] = dataclasses.replace(cfg, dq_block_m=bm, dq_block_n=bn,
                                                        dq_warps=w, dq_stages=st)
        print(f"dQ tile {args.dq}", flush=True)
    cases = list(itertools.product(args.headdims, args.dtypes, args.masks, SEQLENS, HEADS, args.deterministic))
    for i, (d, dt, mask, (sq, sk), (h, hk), det) in enumerate(cases):
        if i < args.start:
            continue
        dtype = torch.bfloat16 if dt == "bf16" else torch.float16
        causal, window, softcap = MASKS[mask]
        name = f"#{i} d={d} {dt} {mask} sq={sq} sk={sk} h={h}/{hk} det={det}"
        try:
            g = torch.Generator(device="cpu").manual_seed(i)
            q, k, v = (torch.randn(4, s, hh, d, generator=g).to("cuda", dtype).requires_grad_()
                       for s, hh in ((sq, h), (sk, hk), (sk, hk)))
            out = triflash.flash_attn_func(q, k, v, causal=causal, window_size=window,
                                           softcap=softcap, deterministic=bool(det))
            out.backward(torch.randn_like(out))
            torch.cuda.synchronize()
        except Exception:
            print(f"FAULT {name}\n{traceback.format_exc()[-3000:]}", flush=True)
            print(f"NEXT {i + 1}", flush=True)
            sys.exit(3)
    print(f"DONE {len(cases)} cases from {args.start}", flush=True)


if __name__ == "__main__":
    main()
