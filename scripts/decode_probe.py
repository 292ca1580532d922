"""Decode tile probe on the GPU: K+V bytes read per second of flash_attn_with_kvcache for
the decode cases under a few DecodeConfigs and split counts, beside SDPA-cuDNN (dense) and a
device copy.

    python scripts/decode_probe.py [--cases 0,3] [--configs 64x4x4,32x4x4,...] [--splits 1,4]
                                   [--variant NAME:OLD=>NEW | NAME:@FILE] [--off NAME] [--json PATH]

``--variant``: the decode kernel with one passage of its source replaced (a backslash-n in OLD
or NEW stands for a line break), or the passages a file lists (``PAIRS``): a probe of a kernel
change without a second copy in the library; its rows carry the variant's name. ``--off``:
the library with ``decode.NAME`` (a dispatch choice, e.g. ``chained``) answering False; its
rows carry "no-NAME".
"""
import argparse
import json
import os
import random
import torch
import triflash
from triflash.kernels import decode

CASES = [  # batch, cache len, hq, hkv, d, page, seqlen_q
    (64, 8192, 32, 8, 128, None, 1), (64, 8192, 32, 8, 128, 64, 1), (128, 4096, 32, 8, 128, 16, 1),
    (1, 131072, 32, 8, 128, None, 1), (32, 8192, 16, 2, 256, None, 1), (64, 8192, 32, 8, 128, None, 4),
    (8, 32768, 32, 8, 128, None, 1), (64, 8192, 32, 8, 128, 1, 1), (64, 8192, 32, 8, 64, None, 1),
    (64, 8192, 32, 8, 128, None, 1, "ragged"), (64, 8192, 32, 8, 128, 64, 1, "ragged"),
    (256, 2048, 32, 8, 128, None, 1), (64, 8192, 32, 8, 128, 16, 1, "ragged"),
    (64, 8192, 32, 8, 128, 256, 1), (64, 8192, 32, 8, 64, 64, 1), (64, 8192, 32, 8, 64, 256, 1),
    (64, 8192, 32, 8, 64, None, 1, "ragged"),
]


GRAPH = True


def timeit(fn, reps=20):
    """Seconds per call: ``reps`` calls captured in one CUDA graph (how serving engines run a
    decoding step; no host overhead), best of 5 replays; GRAPH=False: eager calls."""
    fn(); torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if GRAPH:
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            for _ in range(reps):
                fn()
        run = g.replay
    else:
        def run():
            for _ in range(reps):
                fn()
    best = []
    for _ in range(5):
        start.record()
        run()
        end.record(); torch.cuda.synchronize()
        best.append(start.elapsed_time(end) / reps * 1e-3)
    return min(best)


def make(case, dtype=torch.bfloat16):
    b, n, hq, hk, d, page, sq = case[:7]
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=dtype)
    if page:
        nb = b * n // page
        kv = torch.randn(nb, page, 2, hk, d, device="cuda", dtype=dtype)
        kc, vc = kv[:, :, 0], kv[:, :, 1]
        pt = torch.randperm(nb, device="cuda", dtype=torch.int32).view(b, n // page)
    else:
        kc = torch.randn(b, n, hk, d, device="cuda", dtype=dtype)
        vc = torch.randn(b, n, hk, d, device="cuda", dtype=dtype)
        pt = None
    if case[7:] == ("ragged",):  # uniform in [1, n], as the benchmark's ragged rows (seed 0)
        rng = random.Random(0)
        lens = torch.tensor([rng.randint(1, n) for _ in range(b)], dtype=torch.int32, device="cuda")
    else:
        lens = torch.full((b,), n, dtype=torch.int32, device="cuda")
    return q, kc, vc, pt, lens


def variant(spec):
    """The decode module with one passage replaced (``NAME:OLD=>NEW``), or several
    (``NAME:@FILE``, a Python file whose ``PAIRS`` lists (old, new) passages), as a sibling
    module (Triton compiles from source files)."""
    name, change = spec.split(":", 1)
    if change.startswith("@"):
        scope = {}
        exec(open(change[1:]).read(), scope)
        pairs = scope["PAIRS"]
    else:
        pairs = [tuple(part.replace("\\n", "\n") for part in change.split("=>"))]  # (\n: a line break)
    src = open(decode.__file__).read()
    for old, new in pairs:
        assert src.count(old) == 1, f"variant {name}: {old!r} found {src.count(old)} times"
        src = src.replace(old, new)
    path = os.path.join(os.path.dirname(decode.__file__), f"_probe_{name}.py")
    open(path, "w").write(src)
    import importlib
    return name, importlib.import_module(f"triflash.kernels._probe_{name}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="")
    ap.add_argument("--json", default="")
    ap.add_argument("--splits", default="")
    ap.add_argument("--cases", default="")
    ap.add_argument("--variant", action="append", default=[])
    ap.add_argument("--off", action="append", default=[])
    a = ap.parse_args()
    variants = [variant(v) for v in a.variant] + [("no-" + name, name) for name in a.off]
    import triton  # (a variant's device-side tensor descriptors take their global scratch here)
    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    cfgs = [None] + [decode.DecodeConfig(*map(int, c.split("x"))) for c in a.configs.split(",") if c]
    global GRAPH
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda"); y = torch.empty_like(x)
    copy = 2 * x.numel() / timeit(lambda: y.copy_(x)) / 1e12
    print(f"copy {copy:.2f} TB/s", flush=True)
    del x, y
    rows = []
    orig = decode.config
    for case in CASES:
        if a.cases and str(CASES.index(case)) not in a.cases.split(","):
            continue
        b, n, hq, hk, d, page, sq = case[:7]
        q, kc, vc, pt, lens = make(case)
        nbytes = int(lens.sum()) * hk * d * 2 * 2
        line = {"case": case}
        # correctness against SDPA math on one sequence
        out = triflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, page_table=pt, causal=True)
        if pt is None:
            kd, vd = kc[:1], vc[:1]
        else:
            kd = kc[pt[0].long()].reshape(1, n, hk, d); vd = vc[pt[0].long()].reshape(1, n, hk, d)
        kd, vd = kd[:, :int(lens[0])], vd[:, :int(lens[0])]
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[:1].transpose(1, 2).float(), kd.transpose(1, 2).float(), vd.transpose(1, 2).float(),
            enable_gqa=True, is_causal=False if sq == 1 else False,
            attn_mask=None if sq == 1 else torch.ones(sq, kd.shape[1], dtype=torch.bool, device="cuda").tril(n - sq)).transpose(1, 2)
        line["max_err"] = (out[:1].float() - ref).abs().max().item()
        kernel = decode.decode_kernel
        splits = [0] + [int(x) for x in a.splits.split(",") if x]  # 0: the plan's heuristic
        for cfg in cfgs:
            decode.config = orig if cfg is None else (lambda *a, c=cfg, **kw: c)
            tag = "default" if cfg is None else f"{cfg.block_n}x{cfg.num_warps}x{cfg.num_stages}"
            for vname, mod in [("", None)] + variants:
                off = mod if isinstance(mod, str) else None
                if off:
                    choice, mod = getattr(decode, off), None
                    setattr(decode, off, lambda *args, **kw: False)
                decode.decode_kernel = kernel if mod is None else mod.decode_kernel
                for ns in splits:
                    decode.plan.cache_clear()
                    call = lambda: triflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, page_table=pt,
                                                                    causal=True, num_splits=ns)
                    key = f"{tag}{'/' + vname if vname else ''}/s{ns}"
                    try:
                        line[key] = round(nbytes / timeit(call) / 1e12, 3)
                        if (mod is not None or off) and ns == splits[-1]:  # the variant's answer against the library's
                            line[key + "/diff"] = (call().float() - out.float()).abs().max().item()
                    except Exception as e:  # noqa
                        line[key] = repr(e)[:100]
                if off:
                    setattr(decode, off, choice)
        decode.decode_kernel = kernel
        decode.config = orig
        decode.plan.cache_clear()
        GRAPH = False
        t = timeit(lambda: triflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, page_table=pt, causal=True))
        GRAPH = True
        line["eager"] = round(nbytes / t / 1e12, 3)
        if pt is None and sq == 1:
            from torch.nn.attention import sdpa_kernel, SDPBackend
            qt, kt, vt = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)
            for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
                try:
                    with sdpa_kernel(be):
                        t = timeit(lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True))
                    line[name] = round(b * n * hk * d * 2 * 2 / t / 1e12, 3)  # (its whole cache)
                except Exception as e:  # noqa
                    line[name] = repr(e)[:80]
        print(json.dumps(line), flush=True)
        rows.append(line)
        del q, kc, vc, pt
        torch.cuda.empty_cache()
    if a.json:
        json.dump({"copy_tb_s": copy, "rows": rows}, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
