"""Quick H200 probe of the Hopper (Gluon) tier: correctness against the fp32 reference, then
forward speed beside the portable tier and SDPA-cuDNN, then tile variants in interleaved
rounds.

    python scripts/hopper_probe.py check|speed|rounds [--out DIR]

Each part is meant to run in its own process under `timeout` (a deadlocked kernel must not
eat the device call). Results: DIR/probe-<part>.json and lines on stdout.
"""
import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import triflash  # noqa: E402
from triflash import testing  # noqa: E402
from triflash.kernels import configs  # noqa: E402

# Shared by scripts/hopper_bwd_probe.py.
CHECK_CASES = [
    # b, sq, sk, h, hk, causal, window, softcap
    (2, 1, 1, 4, 4, False, (-1, -1), 0.0),
    (2, 113, 203, 4, 2, False, (-1, -1), 0.0),
    (2, 113, 203, 4, 2, True, (-1, -1), 0.0),
    (1, 239, 1, 2, 1, True, (-1, -1), 0.0),
    (1, 1, 239, 2, 1, True, (-1, -1), 0.0),
    (2, 799, 3, 2, 2, True, (-1, -1), 0.0),
    (2, 3, 799, 2, 2, False, (-1, -1), 0.0),
    (1, 1024, 1024, 4, 1, True, (-1, -1), 0.0),
    (2, 1000, 1300, 4, 4, False, (100, 30), 0.0),
    (2, 1000, 700, 4, 2, True, (64, -1), 0.0),
    (2, 777, 777, 4, 4, True, (-1, -1), 15.0),
    (2, 300, 500, 6, 2, False, (-1, -1), 30.0),
    (1, 2048, 2048, 8, 8, False, (-1, -1), 0.0),
    (1, 2048, 2048, 8, 2, True, (-1, -1), 0.0),
    # more tiles than SMs: persistent CTAs walk several tiles (ring phases carry over)
    (4, 1000, 1000, 16, 4, True, (-1, -1), 0.0),
    (3, 2000, 1500, 12, 12, False, (300, 100), 0.0),
    # ~15 tiles per persistent CTA (ring and Q-slot phases over many tiles), GQA, causal
    (8, 2048, 2048, 16, 4, True, (-1, -1), 0.0),
]
# check --quick: bf16, odd lengths, causal sq < sk, window, softcap, and the many-tile cases
QUICK_FWD = [1, 2, 4, 8, 9, 10, 14, 15, 16]


def _apply_overrides(spec):
    """'tree_max=1,q_slots=1,stages=3' applied to every SM90_HOPPER_FWD entry; an item
    'D:key=val' (e.g. '256:stages=3') to head dim D's tile only."""
    import dataclasses
    if not spec:
        return
    kw = {d: {} for d in configs.SM90_HOPPER_FWD}
    for item in spec.split(","):
        key, val = item.split("=")
        dims = list(configs.SM90_HOPPER_FWD)
        if ":" in key:
            d, key = key.split(":")
            dims = [int(d)]
        for d in dims:
            kw[d][key] = type(getattr(configs.SM90_HOPPER_FWD[d], key))(int(val))  # bool fields as bools
    for d in list(configs.SM90_HOPPER_FWD):
        configs.SM90_HOPPER_FWD[d] = dataclasses.replace(configs.SM90_HOPPER_FWD[d], **kw[d])


def check(args):
    torch.manual_seed(0)
    _apply_overrides(args.config)
    print("configs:", configs.SM90_HOPPER_FWD, flush=True)
    results = []
    cases = [CHECK_CASES[i] for i in QUICK_FWD] if args.quick else CHECK_CASES
    for d in args.headdims:
        for dtype in ((torch.bfloat16, torch.float16) if d == 128 and not args.quick else (torch.bfloat16,)):
            for (b, sq, sk, h, hk, causal, window, softcap) in cases:
                q = torch.randn(b, sq, h, d, device="cuda", dtype=dtype, requires_grad=True)
                k = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype, requires_grad=True)
                v = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype, requires_grad=True)
                kw = dict(causal=causal, window_size=window, softcap=softcap)
                name = f"d{d} {str(dtype)[6:]} b{b} sq{sq} sk{sk} h{h}/{hk} causal={causal} win={window} cap={softcap}"
                try:
                    with triflash.force_backend("hopper"):
                        out, lse = triflash.flash_attn_func(q, k, v, return_attn_probs=True, **kw)
                    torch.cuda.synchronize()
                    out_ref, lse_ref = testing.attention_ref(q, k, v, upcast=True, **kw)
                    out_lowp, _ = testing.attention_ref(q, k, v, upcast=False, **kw)
                    if args.grads:
                        testing.assert_matches_reference(out, lse, out_ref, lse_ref, out_lowp,
                                                         (q, k, v), torch.randn_like(out), softcap=softcap)
                    else:  # forward only: the backward is the portable one, tested elsewhere
                        testing.assert_forward_matches(out, lse, out_ref, lse_ref, out_lowp, softcap)
                    status = "ok"
                except Exception as e:  # report every case, keep going
                    status = f"FAIL {type(e).__name__}: {str(e)[:300]}"
                print(f"{status[:4]:4} {name} {status if status != 'ok' else ''}", flush=True)
                results.append(dict(case=name, status=status))
    return results


def _bench(fn):
    import triton
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


SPEED_CASES = [(1, 8192, 36, 256), (2, 8192, 16, 128), (2, 8192, 32, 64), (2, 8192, 8, 256),
               (16, 1024, 8, 256), (4, 4096, 8, 256), (1, 16384, 8, 256), (16, 1024, 16, 128),
               (1, 16384, 16, 128)]


def _fwd_tflops(b, s, h, d, causal, impl):
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    if impl == "cudnn":
        from torch.nn.attention import SDPBackend, sdpa_kernel
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            ms = _bench(lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal))
    else:
        with triflash.force_backend(impl):
            ms = _bench(lambda: triflash.flash_attn_func(q, k, v, causal=causal))
    return testing.flops(b, h, s, s, d, causal=causal) / ms / 1e9


def speed(args):
    _apply_overrides(args.config)
    results = []
    for (b, s, h, d) in SPEED_CASES:
        if d not in args.headdims:
            continue
        for causal in (False, True):
            row = dict(case=f"{b}x{s}x{h}x{d}", causal=causal)
            for impl in args.impls.split(","):
                try:
                    row[impl] = round(_fwd_tflops(b, s, h, d, causal, impl), 1)
                except Exception as e:
                    row[impl] = f"{type(e).__name__}: {str(e)[:200]}"
            print(json.dumps(row), flush=True)
            results.append(row)
    return results


def round_cases(args, default):
    """The shapes of a ``rounds`` part: ``--cases`` (BxSxHxD,...), else ``default`` at
    ``--headdims`` (shared by scripts/hopper_bwd_probe.py)."""
    if args.cases:
        return [tuple(int(x) for x in c.split("x")) for c in args.cases.split(",")]
    return [c for c in default if c[3] in args.headdims]


def rounds(args):
    """Forward variants timed in interleaved rounds in one process (the card's clock drifts
    by a few percent over a minute: one variant after another would measure the drift):
    ``--variants 'A;B;...'`` (each an override spec as ``--config``, '' = as dispatched),
    ``--rounds`` rounds, median kept; cuDNN in the same rounds."""
    import dataclasses
    import statistics
    base = dict(configs.SM90_HOPPER_FWD)
    variants = args.variants.split(";")
    results = []
    for (b, s, h, d) in round_cases(args, SPEED_CASES):
        for causal in ((False, True) if args.causal == "both" else (args.causal == "true",)):
            times = {v: [] for v in variants + ["cudnn"]}
            for _ in range(args.rounds):
                for v in variants + ["cudnn"]:
                    configs.SM90_HOPPER_FWD.update(base)
                    if v != "cudnn":
                        _apply_overrides(v)
                        if d == 256 and "q_slots" in v:  # two Q slots do not fit at 256
                            configs.SM90_HOPPER_FWD[d] = dataclasses.replace(configs.SM90_HOPPER_FWD[d], q_slots=1)
                    try:
                        times[v].append(_fwd_tflops(b, s, h, d, causal, "cudnn" if v == "cudnn" else "hopper"))
                    except Exception as e:
                        times[v].append(float("nan"))
                        print(f"{v}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            configs.SM90_HOPPER_FWD.update(base)
            row = dict(case=f"{b}x{s}x{h}x{d}", causal=causal,
                       **{(v or "dispatched"): round(statistics.median(t), 1) for v, t in times.items()},
                       rounds={(v or "dispatched"): [round(x, 1) for x in t] for v, t in times.items()})
            print(json.dumps(row), flush=True)
            results.append(row)
    return results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("part", choices=["check", "speed", "rounds"])
    ap.add_argument("--out", default=".")
    ap.add_argument("--config", default=os.environ.get("HOPPER_FWD_CONFIG", ""),
                    help="overrides for every SM90_HOPPER_FWD entry, e.g. tree_max=1,q_slots=1")
    ap.add_argument("--grads", action="store_true", help="check dq/dk/dv too (slow: compiles the bwd)")
    ap.add_argument("--headdims", type=int, nargs="+", default=[64, 128, 256],
                    help="check / speed: only these head dims")
    ap.add_argument("--tag", default="", help="appended to the output file name")
    ap.add_argument("--quick", action="store_true", help="check: bf16 and 9 of the cases")
    ap.add_argument("--impls", default="hopper,portable,cudnn", help="speed: these, in this order")
    ap.add_argument("--variants", default=";q_slots=1", help="rounds: override specs, ';'-separated")
    ap.add_argument("--rounds", type=int, default=3, help="rounds: interleaved rounds per case")
    ap.add_argument("--causal", choices=["both", "true", "false"], default="both")
    ap.add_argument("--cases", default="", help="rounds: BxSxHxD,... instead of SPEED_CASES")
    args = ap.parse_args()
    t0 = time.time()
    res = globals()[args.part](args)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"probe-{args.part}{args.tag}.json"), "w") as f:
        json.dump(dict(part=args.part, gpu=torch.cuda.get_device_name(), seconds=time.time() - t0,
                       config=args.config, results=res), f, indent=1)


if __name__ == "__main__":
    main()
