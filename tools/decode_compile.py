"""sm_90a compile check of the decode kernels (kernels/decode.py) on a machine without a
GPU: each decode form's launches (decode kernel, and the combine when the plan splits)
recorded from ``decode.fwd`` on meta tensors, compiled for sm_90a, run through ``ptxas -v``.
Reports shared memory, registers and spills per launch.

    python -m tools.decode_compile [--json]
"""
import argparse
import json
import os
import sys

# name: (batch, cache len, hq, hkv, head dim, page size, seqlen_q, causal, window)
FORMS = {
    "d64-dense": (64, 8192, 32, 8, 64, None, 1, True, -1),
    "d128-dense": (64, 8192, 32, 8, 128, None, 1, True, -1),
    "d128-split": (1, 131072, 32, 8, 128, None, 1, True, -1),
    "d128-paged16": (128, 4096, 32, 8, 128, 16, 1, True, -1),
    "d128-paged64": (64, 8192, 32, 8, 128, 64, 1, True, -1),
    "d128-paged1": (64, 8192, 32, 8, 128, 1, 1, True, -1),
    "d128-paged256": (64, 8192, 32, 8, 128, 256, 1, True, -1),
    "d128-q4": (64, 8192, 32, 8, 128, None, 4, True, -1),
    "d128-window": (8, 8192, 32, 8, 128, 64, 2, True, 256),
    "d256-dense": (32, 8192, 16, 2, 256, None, 1, True, -1),
    "d256-split": (1, 65536, 16, 1, 256, 256, 1, True, -1),
    "d128-chunk": (64, 8192, 32, 8, 128, None, 1, True, -1),
    "mla-paged64": (64, 8192, 16, 1, 64, 64, 1, True, -1),
    "d128-dense-fp8": (64, 8192, 32, 8, 128, None, 1, True, -1),
    "d128-paged64-fp8": (64, 8192, 32, 8, 128, 64, 1, True, -1),
    "d128-paged1-fp8": (2, 8192, 32, 8, 128, 1, 1, True, -1),
    "d128-split-fp8": (1, 131072, 32, 8, 128, None, 1, True, -1),
    "d256-dense-fp8": (32, 8192, 16, 2, 256, None, 1, True, -1),
}
# FA3's extras of a form: attention_chunk, headdim_v (MLA: 64 / 512), fp8 (e4m3 q and caches,
# expanded descales as serving engines pass them)
EXTRAS = {"d128-chunk": dict(chunk=2048), "mla-paged64": dict(headdim_v=512),
          **{form: dict(fp8=True) for form in FORMS if form.endswith("-fp8")}}


def launches(form):
    """[(JIT fn, args, kwargs)] of ``form`` as sm90 launches it."""
    import torch
    from tools.sm90_report import _recording
    from triflash.kernels import decode, problem
    b, n, hq, hk, d, page, sq, causal, window = FORMS[form]
    extras = EXTRAS.get(form, {})
    dv, chunk = extras.get("headdim_v", d), extras.get("chunk", 0)
    meta = dict(device="meta", dtype=torch.float8_e4m3fn if extras.get("fp8") else torch.bfloat16)
    descale = None
    if extras.get("fp8"):
        descale = tuple(torch.empty((), device="meta", dtype=torch.float32).expand(b, hk) for _ in range(3))
    i32 = dict(device="meta", dtype=torch.int32)
    q = torch.empty(b, sq, hq, d, **meta)
    if page:
        if dv == d:  # K and V as views of one tensor, as serving engines lay them out
            kv = torch.empty(b * n // page, page, 2, hk, d, **meta)
            k, v = kv[:, :, 0], kv[:, :, 1]
        else:
            k, v = torch.empty(b * n // page, page, hk, d, **meta), torch.empty(b * n // page, page, hk, dv, **meta)
        cache = problem.CacheAddressing(page_table=torch.empty(b, n // page, **i32))
    else:
        k, v = torch.empty(b, n, hk, d, **meta), torch.empty(b, n, hk, dv, **meta)
        cache = None
    p = problem.AttnParams(softmax_scale=d ** -0.5, window_left=window, window_right=0 if causal else -1,
                            softcap=0.0, max_seqlen_q=sq, max_seqlen_k=n, chunk=chunk)
    orig = decode._num_sms
    decode._num_sms = lambda device: 132
    try:
        with _recording() as log:
            decode.fwd(q, k, v, None, torch.empty(b, **i32), cache, p, "sm90", descale=descale)
    finally:
        decode._num_sms = orig
    return list(log)


def _block_mn(fn, kwargs):
    """(rows, keys) per tile of a launch: the decode kernel's ``META``, the combine's BLOCK_M."""
    if "META" in kwargs:
        return kwargs["META"].BLOCK_M, kwargs["META"].BLOCK_N
    return kwargs.get("BLOCK_M"), None


def report(forms=tuple(FORMS)):
    from tools import sm90_report as R
    rows = []
    for form in forms:
        for fn, args, kwargs in launches(form):
            signature, constexprs, attrs, options = R._specialize(fn, args, kwargs)
            spec = dict(module=fn.fn.__module__, name=fn.__name__, signature=signature,
                        constexprs=sorted(constexprs.items()), attrs=sorted(attrs.items()), options=options)
            r = R._compile_spec(spec)
            rows.append(dict(form=form, kernel=fn.__name__, shared=r["shared"], registers=r["registers"],
                             spill_bytes=r["spill_stores"] + r["spill_loads"],
                             tile=(*_block_mn(fn, kwargs), options.get("num_warps"), options.get("num_stages"))))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET: this compiles for sm_90a")
    rows = report()
    if a.json:
        print(json.dumps(rows, indent=1))
    else:
        for r in rows:
            print(f"{r['form']:14s} {r['kernel']:22s} tile {r['tile']} shared {r['shared']:6d} B "
                  f"regs {r['registers']:3d} spills {r['spill_bytes']} B")


if __name__ == "__main__":
    main()
