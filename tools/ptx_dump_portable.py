"""PTX of the portable tier's and the decode kernels' dispatched launches (sm_90a, no GPU),
for an equivalence check of a source refactor that claims no kernel change:

    python tools/ptx_dump_portable.py DIR      # at each commit, then compare with
    diff <(grep -vE '^\s*\.b(8|16|32|64)\s|^\$L__tmp[0-9]+:$' A.ptx | sed -E 's/\$L__tmp[0-9]+/TMP/g') ...

(the filter drops the DWARF data and renumbered line-table labels; instructions stay).
Head dims 64, 128, 40 x the features plain, causal, all, kvcache, kvcache-varlen of the
forward and the backward (preprocess, dK/dV in each mode, dQ: every launch
tools/sm90_report.all_dispatch_configs lists), the KV-cache append (APPEND_FORMS: dense,
cache_batch_idx, paged, packed new tokens) and every tools/decode_compile form."""
import os, sys
sys.path.insert(0, os.getcwd())
import triton
from triton.backends.compiler import GPUTarget
from tools import sm90_report as R
from tools import decode_compile as DC
out = sys.argv[1]
os.makedirs(out, exist_ok=True)

def compile_ptx(fn, args, kwargs):
    signature, constexprs, attrs, options = R._specialize(fn, args, kwargs)
    spec = dict(module=fn.fn.__module__, name=fn.__name__, signature=signature,
                constexprs=sorted(constexprs.items()), attrs=sorted(attrs.items()), options=options)
    c = triton.compile(R._ast_source(spec), target=GPUTarget("cuda", 90, 32), options=dict(options))
    ptx = c.asm["ptx"]
    return "\n".join(l for l in ptx.splitlines() if not l.strip().startswith((".loc", ".file", "//")) and "debug_" not in l)

# name: (head dim, head dim v, batch_idx, paged, packed new tokens)
APPEND_FORMS = {
    "dense": (128, 128, False, False, False),
    "batch-idx": (64, 64, True, False, False),
    "paged": (128, 128, False, True, False),
    "paged-packed": (40, 40, False, True, True),
    "batch-idx-packed": (128, 64, True, False, True),
}

def append_launches(form):
    """[(JIT fn, args, kwargs)] of kvcache.append_kv on meta tensors."""
    import torch
    from triflash.kernels import kvcache
    d, dv, with_idx, paged, packed = APPEND_FORMS[form]
    b, new, cap, h, page = 4, 37, 4096, 8, 64
    meta = dict(device="meta", dtype=torch.bfloat16)
    i32 = dict(device="meta", dtype=torch.int32)
    shape = (b * new,) if packed else (b, new)
    k_new, v_new = torch.empty(*shape, h, d, **meta), torch.empty(*shape, h, dv, **meta)
    rows = (b * cap // page, page) if paged else (b, cap)
    k_cache, v_cache = torch.empty(*rows, h, d, **meta), torch.empty(*rows, h, dv, **meta)
    with R._recording() as log:
        kvcache.append_kv(k_new, v_new, k_cache, v_cache, torch.empty(b, **i32),
                          batch_idx=torch.empty(b, **i32) if with_idx else None,
                          page_table=torch.empty(b, cap // page, **i32) if paged else None,
                          cu_seqlens_new=torch.empty(b + 1, **i32) if packed else None)
    return list(log)

n = 0
for job in R.all_dispatch_configs(headdims=(64, 128, 40), dtypes=("bf16",), features=("plain", "causal", "all", "kvcache", "kvcache-varlen")):
    if job.kernel not in ("flash_fwd_kernel", "bwd_preprocess_kernel", "bwd_dkdv_kernel", "bwd_dq_kernel"):
        continue
    fn, args, kwargs = R._find_launch(job)
    open(f"{out}/{job.id}.ptx", "w").write(compile_ptx(fn, args, kwargs)); n += 1
for form in APPEND_FORMS:
    for fn, args, kwargs in append_launches(form):
        open(f"{out}/append-{form}-{fn.__name__}.ptx", "w").write(compile_ptx(fn, args, kwargs)); n += 1
for form in DC.FORMS:
    for i, (fn, args, kwargs) in enumerate(DC.launches(form)):
        open(f"{out}/{form}-{fn.__name__}.ptx", "w").write(compile_ptx(fn, args, kwargs)); n += 1
print(n, "kernels")
