"""PTX of the portable forward's and the decode kernels' dispatched launches (sm_90a, no GPU),
for an equivalence check of a source refactor that claims no kernel change:

    python tools/ptx_dump_portable.py DIR      # at each commit, then compare with
    diff <(grep -vE '^\s*\.b(8|16|32|64)\s|^\$L__tmp[0-9]+:$' A.ptx | sed -E 's/\$L__tmp[0-9]+/TMP/g') ...

(the filter drops the DWARF data and renumbered line-table labels; instructions stay).
Head dims 64, 128, 40 x the features plain, causal, all, kvcache, kvcache-varlen of the
forward, and every tools/decode_compile form."""
import os, re, sys, hashlib
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

n = 0
for job in R.all_dispatch_configs(headdims=(64, 128, 40), dtypes=("bf16",), features=("plain", "causal", "all", "kvcache", "kvcache-varlen")):
    if job.kernel != "flash_fwd_kernel":
        continue
    fn, args, kwargs = R._find_launch(job)
    open(f"{out}/{job.id}.ptx", "w").write(compile_ptx(fn, args, kwargs)); n += 1
for form in DC.FORMS:
    for i, (fn, args, kwargs) in enumerate(DC.launches(form)):
        open(f"{out}/{form}-{fn.__name__}.ptx", "w").write(compile_ptx(fn, args, kwargs)); n += 1
print(n, "kernels")
