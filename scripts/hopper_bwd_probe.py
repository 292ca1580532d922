"""H200 probe of the Hopper (Gluon) backward, triflash/kernels/hopper/bwd.py: gradients
against the fp32 reference, then backward speed beside the portable backward and SDPA-cuDNN.

    python scripts/hopper_bwd_probe.py check|speed|rounds [--out DIR] [--deterministic]
                                       [--config stages=3,atomic_dq=1,...]
    python scripts/hopper_bwd_probe.py rounds --headdims 256 [--variants ';reg_a=0']
    python scripts/hopper_bwd_probe.py rounds --cases 2x8192x16x128 --variants ';api'
    python scripts/hopper_bwd_probe.py paths --cases 2x8192x16x128 --causal false

Run each part in its own process under `timeout` (a deadlocked kernel must not eat the
device call), e.g. `timeout 900 python scripts/hopper_bwd_probe.py check --out /tmp/p`.
Results: DIR/bwd-probe-<part>.json and one line per case on stdout (every case runs, a
failure is printed and the next case goes on). out / lse come from the regular forward
(`triflash.flash_attn_func(..., return_attn_probs=True)`); dq/dk/dv from
`hopper.bwd.bwd(...)` called directly with the tile of ``configs.SM90_HOPPER_BWD`` changed
by ``--config`` (e.g. ``atomic_dq=1`` for the in-kernel atomic dQ).
"""
import argparse
import json
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import triflash  # noqa: E402
from triflash import testing  # noqa: E402
from triflash.kernels.problem import AttnParams  # noqa: E402

from hopper_probe import CHECK_CASES, _bench, round_cases  # noqa: E402  (scripts/ is sys.path[0])


def _params(q, k, causal, window, softcap):
    left, right = window
    if causal:
        right = 0
    return AttnParams(q.shape[-1] ** -0.5, left, right, softcap, q.shape[1], k.shape[1])


def _cfg(args, d, spec=None):
    """The dispatched tile at head dim ``d`` with ``spec`` (default ``--config``) applied."""
    import dataclasses
    from triflash.kernels import configs
    cfg = configs.SM90_HOPPER_BWD[d]
    for item in filter(None, (args.config if spec is None else spec).split(",")):
        key, _, val = item.partition("=")
        cfg = dataclasses.replace(cfg, **{key: type(getattr(cfg, key))(int(val))})
    return cfg


# --quick: bf16 and these CHECK_CASES (tiny, odd lengths, causal sq < sk, GQA, window,
# softcap, MQA 1k, more CTAs than SMs)
QUICK = [0, 2, 4, 8, 9, 10, 11, 14]


def check(args):
    from triflash.kernels.hopper import bwd as hbwd
    torch.manual_seed(0)
    results = []
    pick = [int(i) for i in args.pick.split(",")] if args.pick else (QUICK if args.quick else None)
    cases = CHECK_CASES if pick is None else [CHECK_CASES[i] for i in pick]
    dtypes = (torch.bfloat16,) if args.quick else (torch.bfloat16, torch.float16)
    for d in args.headdims:
        for dtype in dtypes:
            for (b, sq, sk, h, hk, causal, window, softcap) in cases:
                name = (f"d{d} {str(dtype)[6:]} b{b} sq{sq} sk{sk} h{h}/{hk} causal={causal} "
                        f"win={window} cap={softcap} det={args.deterministic}")
                row = dict(case=name)
                t_case = time.time()
                try:
                    q = torch.randn(b, sq, h, d, device="cuda", dtype=dtype, requires_grad=True)
                    k = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype, requires_grad=True)
                    v = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype, requires_grad=True)
                    kw = dict(causal=causal, window_size=window, softcap=softcap)
                    with torch.no_grad():
                        out, lse = triflash.flash_attn_func(q, k, v, return_attn_probs=True, **kw)
                    dout = torch.randn_like(out)
                    dq, dk, dv = hbwd.bwd(dout, q.detach(), k.detach(), v.detach(), out, lse,
                                          _params(q, k, causal, window, softcap),
                                          deterministic=args.deterministic, cfg=_cfg(args, d))
                    torch.cuda.synchronize()
                    out_ref, _ = testing.attention_ref(q, k, v, upcast=True, **kw)
                    out_lowp, _ = testing.attention_ref(q, k, v, upcast=False, **kw)
                    g_ref = torch.autograd.grad(out_ref, (q, k, v), dout)
                    g_lowp = torch.autograd.grad(out_lowp, (q, k, v), dout)
                    testing.assert_grads_match((dq, dk, dv), g_ref, g_lowp, softcap)
                    status = "ok"
                except Exception as e:  # report every case, keep going
                    status = f"FAIL {type(e).__name__}: {str(e)[:300]}"
                    row["traceback"] = traceback.format_exc()[-2000:]
                row["status"] = status
                row["seconds"] = round(time.time() - t_case, 1)
                print(f"{status[:4]:4} {name} ({row['seconds']} s) {status if status != 'ok' else ''}",
                      flush=True)
                results.append(row)
    n_ok = sum(r["status"] == "ok" for r in results)
    print(f"{n_ok}/{len(results)} ok", flush=True)
    return results


SPEED_CASES = [(2, 8192, 16, 128), (2, 8192, 32, 64), (1, 8192, 36, 256)]


def _bwd_ms(b, s, h, d, causal, impl, deterministic, cfg=None, varlen=False):
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    if impl == "cudnn":
        from torch.nn.attention import SDPBackend, sdpa_kernel
        qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
            dout = torch.randn_like(out)
            return _bench(lambda: torch.autograd.grad(out, (qt, kt, vt), dout, retain_graph=True))
    if impl == "api":  # the benchmark's path: the public API and autograd, dispatched tile
        out = triflash.flash_attn_func(q, k, v, causal=causal, deterministic=deterministic)
        dout = torch.randn_like(out)
        return _bench(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
    if impl == "portable":
        with triflash.force_backend("portable"):
            out = triflash.flash_attn_func(q, k, v, causal=causal, deterministic=deterministic)
            dout = torch.randn_like(out)
            return _bench(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
    from triflash.kernels.hopper import bwd as hbwd
    p = _params(q, k, causal, (-1, -1), 0.0)
    if varlen:  # the same batch packed: b sequences of s tokens (flash_attn_varlen_func's layout)
        cu = torch.arange(0, (b + 1) * s, s, device="cuda", dtype=torch.int32)
        qd, kd, vd = (x.detach().flatten(0, 1) for x in (q, k, v))
        with torch.no_grad():
            out, lse = triflash.flash_attn_varlen_func(qd, kd, vd, cu, cu, s, s, causal=causal,
                                                      return_attn_probs=True)
        dout = torch.randn_like(out)
        return _bench(lambda: hbwd.bwd(dout, qd, kd, vd, out, lse, p, deterministic=deterministic, cfg=cfg,
                                       cu_seqlens_q=cu, cu_seqlens_k=cu))
    with torch.no_grad():
        out, lse = triflash.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    dout = torch.randn_like(out)
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    return _bench(lambda: hbwd.bwd(dout, qd, kd, vd, out, lse, p, deterministic=deterministic, cfg=cfg))


def speed(args):
    results = []
    for (b, s, h, d) in (c for c in SPEED_CASES if c[3] in args.headdims):
        for causal in (False, True):
            row = dict(case=f"{b}x{s}x{h}x{d}", causal=causal, deterministic=args.deterministic,
                       config=str(_cfg(args, d)))
            flops = 2.5 * 4 * b * h * s * s * d * (0.5 if causal else 1.0)
            for impl in args.impls.split(","):
                try:
                    ms = _bwd_ms(b, s, h, d, causal, impl, args.deterministic, _cfg(args, d), args.varlen)
                    row[impl] = round(flops / ms / 1e9, 1)
                    row[impl + "_ms"] = round(ms, 3)
                except Exception as e:
                    row[impl] = f"{type(e).__name__}: {str(e)[:200]}"
            print(json.dumps(row), flush=True)
            results.append(row)
    return results


def rounds(args):
    """Backward variants timed in interleaved rounds in one process (the card's clock drifts by
    a few percent within a minute): ``--variants 'A;B;...'`` (each a ``--config`` spec, ''
    = the dispatched tile, ``api`` = the dispatched tile through ``flash_attn_func`` and
    ``autograd.grad`` as the benchmark times it), ``--rounds`` rounds, median kept; cuDNN in
    the same rounds."""
    import statistics
    variants = args.variants.split(";")
    results = []
    for (b, s, h, d) in round_cases(args, SPEED_CASES):
        for causal in ((False, True) if args.causal == "both" else (args.causal == "true",)):
            flops = 2.5 * 4 * b * h * s * s * d * (0.5 if causal else 1.0)
            times = {v: [] for v in variants + ["cudnn"]}
            for _ in range(args.rounds):
                for v in times:
                    try:
                        ms = (_bwd_ms(b, s, h, d, causal, v, v == "api" and args.deterministic)
                              if v in ("cudnn", "api") else
                              _bwd_ms(b, s, h, d, causal, "hopper", args.deterministic, _cfg(args, d, v),
                                      args.varlen))
                        times[v].append(flops / ms / 1e9)
                    except Exception as e:  # report, keep going
                        times[v].append(float("nan"))
                        print(f"{v}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            row = dict(case=f"{b}x{s}x{h}x{d}", causal=causal, deterministic=args.deterministic,
                       **{(v or "dispatched"): round(statistics.median(t), 1) for v, t in times.items()},
                       rounds={(v or "dispatched"): [round(x, 1) for x in t] for v, t in times.items()})
            print(json.dumps(row), flush=True)
            results.append(row)
    return results


def paths(args):
    """The backward called directly (``hopper.bwd.bwd``), through the public API and
    ``autograd.grad`` (what the benchmark times) and cuDNN's, each profiled over 10 calls after
    a warm-up: per call the kernels (name, count, CUDA ms), their sum, and the span from the
    first kernel's start to the last one's end (a span longer than the sum: the GPU waited
    between kernels). Answers whether the two triflash paths run the same kernels for the
    same time (at 2x8192x16x128 they did, within 0.5%: ``benchmarks/NOTES.md`` at fb45c0d,
    section cd9e2c6, item 3)."""
    from torch.profiler import ProfilerActivity, profile
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triflash.kernels.hopper import bwd as hbwd
    results = []
    for (b, s, h, d) in round_cases(args, SPEED_CASES):
        for causal in ((False, True) if args.causal == "both" else (args.causal == "true",)):
            torch.manual_seed(0)
            q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                       for _ in range(3))
            out = triflash.flash_attn_func(q, k, v, causal=causal)
            with torch.no_grad():
                out2, lse = triflash.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
            dout = torch.randn_like(out)
            p = _params(q, k, causal, (-1, -1), 0.0)
            qd, kd, vd = q.detach(), k.detach(), v.detach()
            qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                out_c = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
            dout_c = dout.transpose(1, 2)
            calls = {
                "direct": lambda: hbwd.bwd(dout, qd, kd, vd, out2, lse, p),
                "api": lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True),
                "cudnn": lambda: torch.autograd.grad(out_c, (qt, kt, vt), dout_c, retain_graph=True),
            }
            row = dict(case=f"{b}x{s}x{h}x{d}", causal=causal)
            for name, fn in calls.items():
                for _ in range(3):
                    fn()
                torch.cuda.synchronize()
                n = 10
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(n):
                        fn()
                    torch.cuda.synchronize()
                events = [e for e in prof.events() if e.device_type.name == "CUDA"]
                kernels = {}
                for e in events:
                    kn = kernels.setdefault(e.name[:80], [0, 0.0])
                    kn[0] += 1
                    kn[1] += e.device_time_total / 1e3
                total = sum(t for _, t in kernels.values()) / n
                span = (max(e.time_range.end for e in events) - min(e.time_range.start for e in events)) / 1e3 / n
                row[name] = dict(kernel_ms=round(total, 4), span_ms=round(span, 4),
                                 do_bench_ms=round(_bench(fn), 4),
                                 kernels={kn: [c // n, round(t / n, 4)] for kn, (c, t) in kernels.items()})
            print(json.dumps(row), flush=True)
            results.append(row)
    return results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("part", choices=["check", "speed", "rounds", "paths"])
    ap.add_argument("--out", default=".")
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--varlen", action="store_true",
                    help="speed / rounds: the Hopper rows on the batch packed as varlen sequences")
    ap.add_argument("--config", default="", help="HopperBwdConfig fields to change, k=v,...")
    ap.add_argument("--impls", default="hopper,portable,cudnn")
    ap.add_argument("--quick", action="store_true", help="check: bf16 and 8 of the cases")
    ap.add_argument("--pick", default="", help="check: these CHECK_CASES indices (i,j,...)")
    ap.add_argument("--headdims", type=int, nargs="+", default=[64, 128],
                    help="head dims (64, 128, 256)")
    ap.add_argument("--variants", default="",
                    help="rounds: --config specs, ';'-separated ('' = the dispatched tile)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds: interleaved rounds per case")
    ap.add_argument("--causal", choices=["both", "true", "false"], default="both")
    ap.add_argument("--cases", default="", help="rounds: BxSxHxD,... instead of SPEED_CASES")
    ap.add_argument("--tag", default="", help="appended to the output file name")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    res = globals()[args.part](args)
    suffix = ("-d" + "-".join(map(str, args.headdims)) if args.headdims != [64, 128] else "") + (
        "-det" if args.deterministic else "") + ("-varlen" if args.varlen else "") + (
        "-" + args.config.replace("=", "").replace(",", "-") if args.config else "")
    with open(os.path.join(args.out, f"bwd-probe-{args.part}{suffix}{args.tag}.json"), "w") as f:
        json.dump(dict(part=args.part, gpu=torch.cuda.get_device_name(), seconds=time.time() - t0,
                       deterministic=args.deterministic, varlen=args.varlen, results=res), f, indent=1)


if __name__ == "__main__":
    main()
