"""Measuring one case: inputs, the fp32 reference, timing and the correctness check.

Timing follows /work/shared/ANCHORS.md: ``triton.testing.do_bench(fn, warmup, rep,
return_mode="median")`` on CUDA; the forward is timed with autograd enabled (a training
forward; ``--inference-fwd`` times it under no_grad); the backward is ``torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)``
on one forward output made outside the timed region; fwd_bwd times both together. On the
CPU (Triton interpreter) a wall-clock median of a few calls stands in; it means nothing.
``host_ms`` (CUDA only) is the CPU time to issue one call; close to ``ms`` it means the
measurement is launch-bound (Python/launch overhead, not the kernel).

Correctness: out (and dq, dk, dv) against ``attention_ref(..., upcast=True)`` (fp32) with
FlashAttention-3's rule ``max_err <= fa_tolerance(ref, attention_ref(..., upcast=False))``.
The reference is computed once per case and reused by every impl. For large cases it is
computed on a leading subset of the batch and heads (whole GQA groups, so the subset's
dk/dv are exact) and the impl's outputs are compared on the same subset (see ``note``).
"""
import gc
import statistics
import time
from dataclasses import dataclass, field
from typing import Dict, Optional

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
GRAD_NAMES = ("dq", "dk", "dv")


@dataclass
class Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor


@dataclass
class Reference:
    b: int                      # leading batch entries compared
    h: int                      # leading query heads compared
    hk: int                     # leading KV heads compared
    ref: Dict[str, torch.Tensor] = field(default_factory=dict)   # out, dq, dk, dv (fp32 ref)
    tol: Dict[str, float] = field(default_factory=dict)          # FA3 tolerance per tensor
    note: str = ""


def make_inputs(case, device, seed=0) -> Inputs:
    """Fresh q, k, v (leaf tensors with requires_grad) and dout, from a fixed seed."""
    gen = torch.Generator(device=device).manual_seed(seed)
    dt = DTYPES[case.dtype]

    def rnd(*shape, grad=True):
        return torch.randn(*shape, generator=gen, device=device, dtype=dt).requires_grad_(grad)
    q = rnd(case.batch, case.seqlen_q, case.nheads, case.headdim)
    k = rnd(case.batch, case.seqlen_k, case.nheads_kv, case.headdim)
    v = rnd(case.batch, case.seqlen_k, case.nheads_kv, case.headdim_v)
    dout = rnd(case.batch, case.seqlen_q, case.nheads, case.headdim_v, grad=False)
    return Inputs(q, k, v, dout)


def reference(case, x: Inputs, with_grad: bool, budget_elems: int) -> Reference:
    """fp32 reference (and the low-precision one for the tolerance) on a subset whose
    score matrices hold at most ~budget_elems entries in all."""
    from triflash.testing import attention_ref, fa_tolerance

    per_head = case.seqlen_q * case.seqlen_k
    group = case.nheads // case.nheads_kv
    if case.batch * case.nheads * per_head <= budget_elems:
        b, h = case.batch, case.nheads
    elif case.nheads * per_head <= budget_elems:
        b, h = budget_elems // (case.nheads * per_head), case.nheads
    else:
        b, h = 1, max(group, budget_elems // per_head // group * group)
    hk = h // group
    sub = Reference(b, h, hk)
    if (b, h) != (case.batch, case.nheads):
        sub.note = f"checked on batch[:{b}], heads[:{h}] of {case.batch}x{case.nheads}"
    chunk = max(1, (1 << 28) // max(1, b * per_head))  # <= 1 GiB of fp32 scores per chunk
    q, k, v = (t.detach()[:b, :, :n] for t, n in ((x.q, h), (x.k, hk), (x.v, hk)))
    dout = x.dout[:b, :, :h]
    kw = dict(causal=case.causal, window_size=tuple(case.window_size), head_chunk=chunk)
    results = {}
    for upcast in (True, False):
        qs, ks, vs = (t.clone().requires_grad_(with_grad) for t in (q, k, v))
        with torch.set_grad_enabled(with_grad):
            out, _ = attention_ref(qs, ks, vs, upcast=upcast, **kw)
            res = {"out": out.detach()}
            if with_grad:
                res.update(zip(GRAD_NAMES, torch.autograd.grad(out, (qs, ks, vs), dout)))
        results[upcast] = res
        del qs, ks, vs, out
    sub.ref = results[True]
    sub.tol = {name: fa_tolerance(results[True][name], results[False][name]) for name in results[True]}
    return sub


def _subset(t, ref: Reference, heads):
    return t[:ref.b, :, :heads]


def compare(ref: Reference, got: Dict[str, torch.Tensor]):
    """{name: max abs error} and whether every tensor is within its tolerance."""
    from triflash.testing import max_err
    errs, ok = {}, True
    heads = {"out": ref.h, "dq": ref.h, "dk": ref.hk, "dv": ref.hk}
    for name, tensor in got.items():
        err = max_err(_subset(tensor.detach(), ref, heads[name]), ref.ref[name])
        errs[name] = err
        ok = ok and err <= ref.tol[name]  # NaN fails
    return errs, ok


def bench(fn, device, warmup, rep, cpu_reps):
    """(median milliseconds of fn(), host milliseconds per call or None).

    The host time is the CPU time to issue one call (median of 5 back-to-back calls, no
    sync). When it comes close to the GPU time, do_bench measures launch overhead, not the
    kernel."""
    if device == "cuda":
        import triton
        ms = float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
        torch.cuda.synchronize()
        host = []
        for _ in range(5):  # median of single calls: robust to one slow (GC, allocator) call
            t0 = time.perf_counter()
            fn()
            host.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
        return ms, statistics.median(host)
    times = []
    for _ in range(cpu_reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), None


def run_impl(impl, case, x: Inputs, ref: Optional[Reference], modes, device, timing,
             inference_fwd=False, timers=None):
    """Measure one impl on one case in every mode. Returns {mode: partial row}; ``timers``
    (a dict), when given, receives {mode: the timed callable} for later rounds
    (``retime``). Exceptions propagate (the caller decides between 'skipped' and 'FAIL')."""
    q, k, v, dout = x.q, x.k, x.v, x.dout
    fn = impl.make(case, device)
    need_grad = any(m != "fwd" for m in modes)
    with impl.context():
        out = fn(q, k, v)
        got = {"out": out}
        if need_grad:
            got.update(zip(GRAD_NAMES, torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)))
    if device == "cuda":
        torch.cuda.synchronize()
    errs, ok = compare(ref, got) if ref is not None else ({}, None)
    del got

    def t_fwd():
        with impl.context(), torch.set_grad_enabled(not inference_fwd):
            fn(q, k, v)

    def t_bwd():
        with impl.context():
            torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

    def t_fwd_bwd():
        with impl.context():
            torch.autograd.grad(fn(q, k, v), (q, k, v), dout)

    timed = {"fwd": t_fwd, "bwd": t_bwd, "fwd_bwd": t_fwd_bwd}
    if timers is not None:
        timers.update((m, timed[m]) for m in modes)
    rows = {}
    for mode in modes:
        ms, host_ms = bench(timed[mode], device, **timing)
        keys = ("out",) if mode == "fwd" else ("out",) + GRAD_NAMES
        mode_errs = {n: errs.get(n) if n in keys else None for n in ("out",) + GRAD_NAMES}
        mode_ok = None if ok is None else all(
            mode_errs[n] is not None and mode_errs[n] <= ref.tol[n] for n in keys)
        rows[mode] = {"ms": ms, "host_ms": host_ms, "max_err": mode_errs, "passed": mode_ok,
                      "tolerance": {n: ref.tol[n] for n in keys} if ref is not None else None}
    return rows


def retime(rows_by_impl, timers_by_impl, device, timing, rounds):
    """Rounds 2..``rounds`` of a case: every impl that ran is timed again, one after the
    other, round after round; each row's ``ms`` becomes the median of its rounds and
    ``ms_rounds`` lists them. A GPU's clock drifts over a run (power and heat: the same
    kernel measured a few percent apart seconds later), so interleaving keeps the impls of a
    case comparable, whichever goes first."""
    for _ in range(rounds - 1):
        for name, timers in timers_by_impl.items():
            for mode, fn in timers.items():
                row = rows_by_impl[name][mode]
                remote = getattr(fn, "remote_ms", None)  # an isolated peer's (bench/isolate.py)
                row.setdefault("ms_rounds", [row["ms"]]).append(
                    remote(timing) if remote else
                    bench(fn, device, timing["warmup"], timing["rep"], timing["cpu_reps"])[0])
    for rows in rows_by_impl.values():
        for row in rows.values():
            if "ms_rounds" in row:
                row["ms"] = statistics.median(row["ms_rounds"])


def free_memory(device):
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


__all__ = ["make_inputs", "reference", "run_impl", "retime", "bench", "free_memory", "DTYPES"]
