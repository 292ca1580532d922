"""``--preset decode``: attention over a KV cache (one query token per sequence, a few, or a
prefill chunk over a cache), in K+V bytes read per second against a device copy measured in
the same run. Cases and byte accounting: ``decode_cases.py``; the CLI: ``__main__.py``.

Implementations (``--impls``; each is a ``DecodeImpl``):

    triflash        triflash.flash_attn_with_kvcache(q, k_cache, v_cache, [k, v,]
                    cache_seqlens=..., page_table=..., causal=True): the case as given,
                    paged caches as two views of one (num_blocks, page_size, 2, nheads_kv,
                    headdim) tensor (vLLM's layout), pages in a random permutation
    triflash-dense  triflash.flash_attn_func on the same tokens (prefill-cache rows only: q
                    (batch, seqlen_new, ...), k/v the cache and the new keys, contiguous)
    sdpa-cudnn, sdpa-flash (sdpa-math on the CPU)
                    F.scaled_dot_product_attention pinned to one backend, q (b, hq, sq, d),
                    k/v (b, hkv, len, d) contiguous, enable_gqa=True; one query token only
                    (SDPA's is_causal is top-left aligned)
    fa4             flash_attn.cute's flash_attn_func(q, k, v, causal=True) over the dense cache
    fa4-kvcache     flash_attn.cute's flash_attn_varlen_func(q, k_cache, v_cache,
                    seqused_k=cache_seqlens, page_table=..., causal=True, num_splits=0): FA4
                    over the cache as given (paged, ragged; its split heuristic), the call
                    a serving engine makes of FA4 on SM90 (no append: decoding rows only)
    fa3             flash_attn_interface.flash_attn_with_kvcache: the case as given (paged,
                    ragged), when importable
    flashinfer      BatchDecodeWithPagedKVCacheWrapper (NHD; a dense cache as one page per
                    sequence), one query token, when importable

Peers that take no page table read the dense cache holding the same tokens (row
``kv_layout`` "dense"); those that take no per-sequence lengths read every sequence's whole
cache on ragged cases (``kv_full`` true; their bytes and correctness reference are those of
the full cache). Every output is checked against an fp32 reference of what that impl
attends to (FlashAttention-3's tolerance rule, as in ``runner.py``).

Timing is ``runner.bench``: ``triton.testing.do_bench`` (median), which zeroes a 256 MB
buffer before every timed call, so each call starts with a cold L2 (50 MB on an H200) and no
rotation among cache copies is needed. On a GPU the timed call is the replay of a CUDA graph
holding one call (``_graphed``; row ``timing`` "cuda-graph", else "eager" with the reason in
``note``), as serving engines run decoding steps; ``host_ms`` is the host time to issue the timed call.
"""
import contextlib
import importlib
import re
import warnings
from dataclasses import dataclass, field, fields
from typing import Dict, Optional

import torch

from .decode_cases import CPU_IMPLS, FP8_IMPLS, GPU_IMPLS, ISOLATED_BY_DEFAULT, SUBJECTS, DecodeCase  # noqa: F401
from .runner import DTYPES as _DTYPES
from .runner import Reference, bench, compare

# fp8: FA3's float8_e4m3fn q and caches (bf16 output); the inputs are drawn in bf16 and rounded
DTYPES = {**_DTYPES, "fp8": torch.float8_e4m3fn}


def dtype_unsupported(name, case):
    """Why implementation ``name`` cannot run ``case``'s dtype, or None."""
    if case.dtype == "fp8" and name not in FP8_IMPLS:
        return "no fp8 (e4m3) inputs"
    return None

COPY_BYTES = {"cuda": 1 << 30, "cpu": 8 << 20}  # the copy's source buffer


@dataclass
class DecodeInputs:
    """One case's tensors (every impl reads these; nothing is regenerated per impl).

    k_cache, v_cache: the dense caches (batch, capacity, nheads_kv, headdim[_v]); paged
    cases also hold the same tokens in ``kv_paged`` (num_blocks, page_size, 2, nheads_kv,
    headdim) under ``page_table`` (batch, pages per sequence) int32. k_full, v_full
    (batch, seqlen_k, ...): the keys and values attended, the cache's first seqlen_k rows
    when decoding, a contiguous copy of the cached tokens followed by k_new / v_new for a
    prefill over a cache (whose call appends k_new / v_new to k_cache / v_cache)."""
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    cache_seqlens: torch.Tensor
    k_full: torch.Tensor
    v_full: torch.Tensor
    kv_paged: Optional[torch.Tensor] = None
    page_table: Optional[torch.Tensor] = None
    k_new: Optional[torch.Tensor] = None
    v_new: Optional[torch.Tensor] = None
    derived: Dict[str, object] = field(default_factory=dict)  # per-case layouts impls share

    def tensors(self):
        """The tensors, by name (for a worker process: shared, not copied)."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name != "derived" and getattr(self, f.name) is not None}

    def cache_as_given(self):
        """(k_cache, v_cache, page_table) as a case gives them to an impl that takes pages:
        the paged views and their table, or the dense caches and None."""
        if self.kv_paged is not None:
            return self.kv_paged[:, :, 0], self.kv_paged[:, :, 1], self.page_table
        return self.k_cache, self.v_cache, None

    def get(self, key, build):
        if key not in self.derived:
            self.derived[key] = build()
        return self.derived[key]


def _bits(x):
    """x's raw bits (an integer view of its element size): indexing and concatenation work on
    every dtype's bits, fp8's included."""
    return x.view({1: torch.uint8, 2: torch.int16}[x.element_size()])


def _cat(xs, dim):
    return torch.cat([_bits(x) for x in xs], dim=dim).view(xs[0].dtype)


def make_inputs(case: DecodeCase, device, seed=0) -> DecodeInputs:
    gen = torch.Generator(device=device).manual_seed(seed)
    dt = DTYPES[case.dtype]
    b, cap, hk = case.batch, case.capacity, case.nheads_kv

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.bfloat16 if dt == DTYPES["fp8"] else dt
                           ).to(dt)
    q = rnd(b, case.seqlen_q, case.nheads, case.headdim)
    k_cache, v_cache = rnd(b, cap, hk, case.headdim), rnd(b, cap, hk, case.headdim_v)
    lens = torch.tensor(case.seqlens(), dtype=torch.int32, device=device)
    x = dict(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=lens)
    if case.seqlen_new:
        k_new, v_new = rnd(b, case.seqlen_new, hk, case.headdim), rnd(b, case.seqlen_new, hk, case.headdim_v)
        n = case.cache_len
        x.update(k_new=k_new, v_new=v_new, k_full=_cat([k_cache[:, :n], k_new], dim=1),
                 v_full=_cat([v_cache[:, :n], v_new], dim=1))
    else:
        x.update(k_full=k_cache[:, :case.seqlen_k], v_full=v_cache[:, :case.seqlen_k])
    if case.page_size:
        pps, ps = case.pages_per_seq, case.page_size
        perm = torch.randperm(b * pps, generator=gen, device=device)
        # block perm[j] holds the j-th page of the dense caches (sequence j // pps)
        kv = torch.empty(b * pps, ps, 2, hk, case.headdim, device=device, dtype=dt)
        bits = _bits(kv)  # (moved as raw bits: fp8 tensors take no indexed writes)
        bits[perm] = torch.stack([_bits(k_cache), _bits(v_cache)], dim=2).view(b * pps, ps, 2, hk, case.headdim)
        x.update(kv_paged=kv, page_table=perm.view(b, pps).to(torch.int32))
    return DecodeInputs(**x)


def reference(case: DecodeCase, x: DecodeInputs, full: bool, budget_elems: int) -> Reference:
    """fp32 reference (and the low-precision one for the tolerance) of the queries over
    the keys each sequence attends to (``full``: every sequence's whole cache), on a
    leading subset of the batch whose score matrices hold at most ~budget_elems entries."""
    from triflash.testing import attention_ref, fa_tolerance
    keys = case.keys(full)
    per_seq = case.nheads * case.seqlen_q * case.seqlen_k
    b = max(1, min(case.batch, budget_elems // max(1, per_seq)))
    sub = Reference(b, case.nheads, case.nheads_kv)
    if b < case.batch:
        sub.note = f"checked on batch[:{b}] of {case.batch}"
    # heads per attention_ref call: <= 1 GiB of fp32 scores, and of fp32 keys gathered per head
    chunk = max(1, min((1 << 28) // (b * case.seqlen_q * case.seqlen_k),
                       (1 << 28) // (b * case.seqlen_k * case.headdim)))
    groups = {}  # sequences of one length: one batched call
    for i, n in enumerate(keys[:b]):
        groups.setdefault(n, []).append(i)
    results = {}
    # fp8: the low-precision computation in bf16 on the (exact) fp8 values, output bf16
    lowp = (lambda t: t.bfloat16()) if x.q.dtype == DTYPES["fp8"] else (lambda t: t)
    for upcast in (True, False):
        out = torch.empty(b, case.seqlen_q, case.nheads, case.headdim_v, device=x.q.device,
                          dtype=lowp(x.q[:0]).dtype)
        for n, idx in groups.items():
            sel = slice(idx[0], idx[-1] + 1) if idx == list(range(idx[0], idx[-1] + 1)) else idx
            o, _ = attention_ref(lowp(x.q[sel]), lowp(x.k_full[sel, :n]), lowp(x.v_full[sel, :n]), causal=case.causal,
                                 upcast=upcast, head_chunk=chunk)
            out[sel] = o
        results[upcast] = out
    sub.ref = {"out": results[True]}  # computed in fp32, in q's dtype (as runner.reference)
    sub.tol = {"out": fa_tolerance(results[True], results[False])}
    return sub


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


class DecodeImpl:
    """``load()``, ``unsupported(case)`` (None or why not), ``make(case, x, device)`` -> a
    callable fn() -> out (batch, seqlen_q, nheads, headdim_v), ``context()``, ``version()``;
    ``paged`` / ``ragged``: whether it reads a paged cache / per-sequence lengths as given."""
    name = "?"
    devices = ("cuda",)
    paged = False
    ragged = False

    def load(self):
        pass

    def unsupported(self, case):
        return None

    def make(self, case, x, device):
        raise NotImplementedError

    def context(self):
        return contextlib.nullcontext()

    def version(self):
        return None

    def layout(self, case):
        """(kv_layout, kv_full): the cache form it reads, and whether it reads every
        sequence's whole cache (a ragged case without per-sequence lengths)."""
        return ("paged" if case.page_size and self.paged else "dense",
                bool(case.ragged and not self.ragged))


class Triflash(DecodeImpl):
    devices = ("cuda", "cpu")
    paged = ragged = True

    def load(self):
        self.tf = importlib.import_module("triflash")

    def version(self):
        return getattr(self.tf, "__version__", None)

    def make(self, case, x, device):
        f, causal = self.tf.flash_attn_with_kvcache, case.causal
        q, lens, kn, vn = x.q, x.cache_seqlens, x.k_new, x.v_new
        kc, vc, pt = x.cache_as_given()
        return lambda: f(q, kc, vc, k=kn, v=vn, cache_seqlens=lens, page_table=pt, causal=causal)


class TriflashDense(Triflash):
    """flash_attn_func on a prefill-over-a-cache case's tokens, contiguous."""
    paged = ragged = False

    def unsupported(self, case):
        if not case.seqlen_new:
            return "the dense comparison of the prefill-cache rows only"
        return None

    def make(self, case, x, device):
        f, causal, q, k, v = self.tf.flash_attn_func, case.causal, x.q, x.k_full, x.v_full
        return lambda: f(q, k, v, causal=causal)


class Sdpa(DecodeImpl):
    """SDPA pinned to one backend on (b, h, len, d) contiguous tensors of the dense cache."""

    def __init__(self, name, backend, devices=("cuda",)):
        self.name, self.backend_name, self.devices = name, backend, devices

    def load(self):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        self.backend = getattr(SDPBackend, self.backend_name)
        self.sdpa_kernel = sdpa_kernel
        self.F = torch.nn.functional

    def unsupported(self, case):
        if case.causal and case.seqlen_q > 1:
            return "SDPA's is_causal is top-left aligned; a cache's queries are bottom-right"
        return None

    def make(self, case, x, device):
        q = x.get("sdpa_q", lambda: x.q.transpose(1, 2).contiguous())
        k, v = x.get("sdpa_kv", lambda: (x.k_full.transpose(1, 2).contiguous(),
                                          x.v_full.transpose(1, 2).contiguous()))
        sdpa = self.F.scaled_dot_product_attention
        kw = {"enable_gqa": True} if case.nheads_kv != case.nheads else {}
        # one query token: causal (bottom-right) sees every key, is_causal=False says the same
        return lambda: sdpa(q, k, v, is_causal=False, **kw).transpose(1, 2)

    def context(self):
        return self.sdpa_kernel(self.backend)


class FlashAttnDense(DecodeImpl):
    """FA4's (or another FA package's) flash_attn_func over the dense cache."""

    def __init__(self, name, modules, window_none=False):
        from .peers import FlashAttn
        self.name, self._fa = name, FlashAttn(name, modules, window_none)

    def load(self):
        self._fa.load()

    def version(self):
        return self._fa.version()

    def make(self, case, x, device):
        f, causal, q, k, v = self._fa.func, case.causal, x.q, x.k_full, x.v_full
        return lambda: _first(f(q, k, v, causal=causal))


class FlashAttnKVCache(DecodeImpl):
    """FA4's flash_attn_varlen_func over the cache as given: per-sequence lengths
    (``seqused_k``), the page table, and its own split heuristic (``num_splits=0``)."""
    paged = ragged = True

    def __init__(self, name, modules):
        from .peers import FlashAttn
        self.name, self._fa = name, FlashAttn(name, modules, window_none=True)

    def load(self):
        self._fa.load()
        self.func = getattr(importlib.import_module(self._fa.module), "flash_attn_varlen_func")

    def version(self):
        return self._fa.version()

    def unsupported(self, case):
        if case.seqlen_new:
            return "no append of new keys (k / v) in flash_attn_varlen_func"
        return None

    def make(self, case, x, device):
        f, causal, q, lens = self.func, case.causal, x.q, x.cache_seqlens
        kc, vc, pt = x.cache_as_given()
        return lambda: _first(f(q, kc, vc, seqused_k=lens, page_table=pt, causal=causal, num_splits=0))


class Fa3KVCache(DecodeImpl):
    """flash_attn_interface.flash_attn_with_kvcache (FlashAttention-3): triflash's own API."""
    paged = ragged = True

    def load(self):
        self.mod = importlib.import_module("flash_attn_interface")
        self.func = self.mod.flash_attn_with_kvcache

    def version(self):
        from .peers import FlashAttn
        fa = FlashAttn("fa3", ["flash_attn_interface"])
        fa.module = "flash_attn_interface"
        return fa.version()

    def make(self, case, x, device):
        f, causal = self.func, case.causal
        q, lens, kn, vn = x.q, x.cache_seqlens, x.k_new, x.v_new
        kc, vc, pt = x.cache_as_given()
        return lambda: _first(f(q, kc, vc, k=kn, v=vn, cache_seqlens=lens, page_table=pt, causal=causal))


class FlashInfer(DecodeImpl):
    """flashinfer.BatchDecodeWithPagedKVCacheWrapper, NHD; a dense cache is one page per
    sequence. plan() (host metadata, once per batch in a server) is made outside the timing."""
    paged = ragged = True

    def load(self):
        self.fi = importlib.import_module("flashinfer")

    def version(self):
        return f"flashinfer {getattr(self.fi, '__version__', '')}".strip()

    def unsupported(self, case):
        if case.seqlen_q != 1 or case.seqlen_new:
            return "the decode wrapper takes one query token per sequence"
        return None

    def make(self, case, x, device):
        lens = case.seqlens()
        if case.page_size:
            ps, kc, vc, table = case.page_size, x.kv_paged[:, :, 0], x.kv_paged[:, :, 1], x.page_table.cpu()
        else:
            ps, kc, vc = case.capacity, x.k_cache, x.v_cache
            table = torch.arange(case.batch, dtype=torch.int32).view(-1, 1)
        used = [-(-n // ps) for n in lens]
        indptr = torch.tensor([0] + used, dtype=torch.int32).cumsum(0).to(torch.int32)
        indices = torch.cat([table[i, :u] for i, u in enumerate(used)]).to(torch.int32)
        last = torch.tensor([n - (u - 1) * ps for n, u in zip(lens, used)], dtype=torch.int32)
        workspace = torch.empty(128 << 20, dtype=torch.uint8, device=device)
        w = self.fi.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
        w.plan(indptr.to(device), indices.to(device), last.to(device), case.nheads, case.nheads_kv,
               case.headdim, ps, pos_encoding_mode="NONE", q_data_type=x.q.dtype, kv_data_type=kc.dtype)
        q = x.q[:, 0]
        return lambda: w.run(q, (kc, vc)).unsqueeze(1)


def make_impl(name) -> DecodeImpl:
    table = {
        "triflash": Triflash,
        "triflash-dense": TriflashDense,
        "sdpa-cudnn": lambda: Sdpa("sdpa-cudnn", "CUDNN_ATTENTION"),
        "sdpa-flash": lambda: Sdpa("sdpa-flash", "FLASH_ATTENTION"),
        "sdpa-math": lambda: Sdpa("sdpa-math", "MATH", devices=("cpu",)),
        "fa4": lambda: FlashAttnDense("fa4", ["flash_attn.cute", "flash_attn.cute.interface"], window_none=True),
        "fa4-kvcache": lambda: FlashAttnKVCache("fa4-kvcache", ["flash_attn.cute", "flash_attn.cute.interface"]),
        "fa3": Fa3KVCache,
        "flashinfer": FlashInfer,
    }
    impl = table[name]()
    impl.name = name
    return impl


def _error_text(e, caught):
    """The exception's first line, with the warnings the call raised (SDPA says why each
    backend refused only in warnings: 'No available kernel' is all its exception says)."""
    msg = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    reasons = list(dict.fromkeys(str(w.message).splitlines()[0] for w in caught))
    return "; ".join([msg] + reasons)[:500]


class ImplError(RuntimeError):
    """An impl's call failed; the message names the original exception and the warnings."""


def error_text(e):
    """One line for a row's note: the exception's first line, without the wrappers that a
    worker process and ``run_impl`` put around it."""
    text = str(e).splitlines()[0] if str(e) else ""
    m = re.match(r"(?:(?:RuntimeError|ImplError): )+(?=\w+(?:Error|Exception): )", text)
    if m:
        text = text[m.end():]
    if not isinstance(e, ImplError) and not re.match(r"\w+(?:Error|Exception): ", text):
        text = f"{type(e).__name__}: {text}"
    return text[:500]


def run_impl(impl, case, x: DecodeInputs, ref: Optional[Reference], device, timing, timers=None):
    """Check and time one impl on one case: {mode: partial row}; ``timers`` (a dict)
    receives {mode: the timed callable} for later rounds (``runner.retime``). Exceptions
    propagate, with the warnings of the first call in their message."""
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            fn = impl.make(case, x, device)
            with impl.context():
                out = fn()
            if device == "cuda":
                torch.cuda.synchronize()
        except Exception as e:
            raise ImplError(_error_text(e, caught)) from e
    errs, ok = compare(ref, {"out": out}) if ref is not None else ({}, None)
    del out

    def timed():
        with torch.no_grad(), impl.context():
            fn()

    how, note = "eager", None
    if device == "cuda":
        try:
            timed, how = _graphed(timed), "cuda-graph"
        except Exception as e:  # noqa: BLE001 (an impl that cannot be captured is timed eagerly)
            note = f"CUDA graph capture failed, timed eagerly: {error_text(e)}"
            torch.cuda.synchronize()
    if timers is not None:
        timers[case.mode] = timed
    ms, host_ms = bench(timed, device, **timing)
    row = {"ms": ms, "host_ms": host_ms, "timing": how, "max_err": {"out": errs.get("out")},
           "tolerance": {"out": ref.tol["out"]} if ref is not None else None, "passed": ok}
    if note:
        row["note"] = note
    return {case.mode: row}


def _graphed(timed):
    """One call of ``timed`` captured in a CUDA graph; returns its replay. Serving engines
    replay decoding steps from graphs, so every impl is timed that way: the kernels' time,
    not Python's per-call work (which ``host_ms`` still reports for the eager call)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        timed()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        timed()
    torch.cuda.synchronize()

    def replay():
        graph.replay()
    replay.graph = graph
    return replay


def derive(row, case: DecodeCase):
    """tb_s and TFLOPS of a row from its ms and what it read (``kv_full``)."""
    if row.get("ms"):
        s = row["ms"] * 1e-3
        row["tb_s"] = case.kv_bytes(row["kv_full"]) / s / 1e12
        row["tflops"] = case.flops(row["kv_full"]) / s / 1e12


def measure_copy(device, timing, nbytes=None):
    """A device-to-device copy of ``nbytes`` (default ``COPY_BYTES``), timed like every row:
    {"bytes": source bytes, "ms": median, "tb_s": (bytes read + written) / time / 1e12}."""
    nbytes = nbytes or COPY_BYTES[device]
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    ms, _ = bench(lambda: dst.copy_(src), device, **timing)
    return {"bytes": nbytes, "ms": ms, "tb_s": 2 * nbytes / (ms * 1e-3) / 1e12}


__all__ = ["GPU_IMPLS", "CPU_IMPLS", "ISOLATED_BY_DEFAULT", "SUBJECTS", "DecodeInputs", "make_inputs",
           "reference", "make_impl", "run_impl", "derive", "measure_copy"]
