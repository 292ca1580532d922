"""What the innermost loops of a Hopper kernel do per iteration, from its SASS (CPU only).

Compiles a dispatched kernel (``compile_check.compile_fwd`` / ``compile_bwd``, sm_90a, bf16)
with optional ``HopperFwdConfig`` / ``HopperBwdConfig`` overrides, disassembles the cubin
with Triton's ``nvdisasm`` and, for every innermost loop (a backward branch with no other
loop inside; the key-block / query-block loops of each consumer), counts ``BAR.SYNC``
(warpgroup syncs), ``STL`` / ``LDL`` (spill stores / loads), ``MUFU.EX2``, ``HGMMA`` and
``EX2async``: the exponentials issued while a wgmma group is still in flight (after a
``WARPGROUP.DEPBAR.LE gsb0, N`` with N > 0 and before the next one with N = 0).

    python scripts/sass_loops.py fwd 128 plain [q_regs=0 ...]
    python scripts/sass_loops.py --table   # the dispatched 64 / 128 / 256 forward, 64 / 128 backward
"""
import dataclasses
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PATTERNS = dict(BAR=r"BAR\.SYNC", STL=r"\bSTL", LDL=r"\bLDL", EX2=r"MUFU\.EX2", HGMMA=r"\bHGMMA")


def compile_sass(kind, d, feature, overrides):
    import triton
    from triflash.kernels import configs
    from tools import compile_check as cc
    seen = {}
    real = triton.compile

    def spy(*a, **k):
        seen["c"] = real(*a, **k)
        return seen["c"]
    triton.compile = spy
    try:
        base = (configs.SM90_HOPPER_FWD if kind == "fwd" else configs.SM90_HOPPER_BWD)[d]
        cfg = dataclasses.replace(base, **{k: type(getattr(base, k))(int(v)) for k, v in overrides.items()})
        row = (cc.compile_fwd(d, "bf16", feature, cfg=cfg) if kind == "fwd"
               else cc.compile_bwd(d, "bf16", feature, True, cfg=cfg))
    finally:
        triton.compile = real
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(seen["c"].asm["cubin"])
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/nvdisasm")
    sass = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout
    os.unlink(f.name)
    return row["spill_bytes"], sass


def innermost_loops(sass):
    """[(counts per PATTERNS)] of each innermost loop, in address order."""
    ins, labels, pending = [], {}, None
    for line in sass.splitlines():
        m = re.match(r"\s*\.(L_x_\d+):", line)
        if m:
            pending = m.group(1)
            continue
        m = re.search(r"/\*([0-9a-f]{4,})\*/\s+(.*)", line)
        if m:
            addr = int(m.group(1), 16)
            if pending:
                labels[pending], pending = addr, None
            ins.append((addr, m.group(2)))
    loops = []
    for addr, text in ins:
        m = re.search(r"BRA\s+(?:`\()?\.?(L_x_\d+)", text)
        if m and labels.get(m.group(1), addr) < addr:
            loops.append((labels[m.group(1)], addr))
    inner = [(lo, hi) for lo, hi in loops
             if not any((a, b) != (lo, hi) and lo <= a and b <= hi for a, b in loops)]
    out = []
    for lo, hi in sorted(inner):
        body = [t for a, t in ins if lo <= a <= hi]
        counts = {k: sum(1 for t in body if re.search(p, t)) for k, p in PATTERNS.items()}
        in_flight, counts["EX2async"] = False, 0
        for t in body:
            m = re.search(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x([0-9a-f]+)", t)
            if m:
                in_flight = int(m.group(1), 16) > 0
            elif in_flight and re.search(PATTERNS["EX2"], t):
                counts["EX2async"] += 1
        if counts["HGMMA"]:
            out.append(counts)
    return out


def report(kind, d, feature, overrides):
    spill, sass = compile_sass(kind, d, feature, overrides)
    loops = innermost_loops(sass)
    sig = sorted({" ".join(f"{k}={v}" for k, v in c.items()) for c in loops})
    name = " ".join(f"{k}={v}" for k, v in overrides.items()) or "dispatched"
    return f"{kind} {d} {feature:6s} {name:18s} spill {spill:4d} B  loops {len(loops)}: " + " | ".join(sig)


TABLE = ([("fwd", d, f, {}) for d in (64, 128, 256) for f in ("plain", "causal")]
         + [("bwd", d, f, {}) for d in (64, 128) for f in ("plain", "causal")])


if __name__ == "__main__":
    if sys.argv[1:] == ["--table"]:
        for kind, d, f, o in TABLE:
            print(report(kind, d, f, o), flush=True)
    else:
        kind, d, feature = sys.argv[1], int(sys.argv[2]), sys.argv[3]
        print(report(kind, d, feature, dict(kv.split("=") for kv in sys.argv[4:])))
