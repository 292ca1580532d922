"""Input validation: every bad input becomes an exception that names the argument, the value
and what is allowed. Nothing here synchronizes with the GPU unless ``check_inputs`` is on
(``triflash.set_check_inputs(True)`` or TRIFLASH_CHECK_INPUTS=1), which adds the data-
dependent varlen checks (cu_seqlens monotone, in range; max_seqlen large enough)."""
import math
import numbers
import os

import torch

from . import dispatch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
# FlashAttention-3's fp8 inputs (forward only, output bf16): FA3's own call forms take them
FP8 = torch.float8_e4m3fn
MAX_HEADDIM = 256
# v's head dim may reach 512 (FlashAttention-3's MLA shape, headdim 64 / headdim_v 512) in the
# forward; the backward stops at MAX_HEADDIM (dispatch.run_bwd)
MAX_HEADDIM_V = 512
_INT_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)
_check_inputs = os.environ.get("TRIFLASH_CHECK_INPUTS", "0") == "1"


def set_check_inputs(enabled: bool) -> None:
    """Turn on/off the varlen checks that read cu_seqlens (a device-to-host sync on GPU)."""
    global _check_inputs
    _check_inputs = bool(enabled)


def _fail(name, value, allowed, exc=ValueError):
    raise exc(f"{name}={value} is not supported: {allowed}")


def describe(x):
    """How an error message shows a value: a tensor by its shape and dtype, a number, string or
    None as itself, anything else by its type's name."""
    if isinstance(x, torch.Tensor):
        return f"tensor{tuple(x.shape)} {x.dtype}"
    if x is None or isinstance(x, (bool, int, float, str)):
        return repr(x)
    return type(x).__name__


def _check_tensor(name, x, ndim, fp8=False):
    """``fp8``: FA3's call forms, which also take torch.float8_e4m3fn (forward only)."""
    if not isinstance(x, torch.Tensor):
        _fail(name, type(x).__name__, "expected a torch.Tensor", TypeError)
    if x.dim() != ndim:
        _fail(f"{name}.dim()", x.dim(), f"expected {ndim} dims ({'total, heads, dim' if ndim == 3 else 'batch, seqlen, heads, dim'}), got shape {tuple(x.shape)}")
    if x.dtype not in SUPPORTED_DTYPES and not (fp8 and x.dtype == FP8):
        _fail(f"{name}.dtype", x.dtype, "expected torch.float16 or torch.bfloat16"
              + (" (or torch.float8_e4m3fn, forward only)" if fp8 else ""), TypeError)


def _check_headdim(name, d, most=MAX_HEADDIM):
    if d < 1 or d > most:
        _fail(f"{name} head dim", d, f"expected 1 to {most}")


def check_device(*tensors):
    devices = {t.device for t in tensors if t is not None}
    if len(devices) > 1:
        _fail("device", sorted(str(d) for d in devices),
              "q, k, v (and cu_seqlens/seqused) must be on one device")
    device = next(iter(devices))
    if device.type == "cpu":
        if not dispatch.interpreting():
            _fail("q.device", device, "CPU tensors run only under Triton's interpreter: set "
                  "TRITON_INTERPRET=1 before importing triflash, or move the tensors to CUDA")
    elif device.type != "cuda":
        _fail("q.device", device, "expected a CUDA device (or CPU under TRITON_INTERPRET=1)")


def last_dim_contiguous(x):
    return x if x is None or x.stride(-1) == 1 else x.contiguous()


def as_int(name, value, allowed):
    """One of FA3's int arguments: a Python or NumPy integer, or a one-element integer tensor
    (FA3's C++ binding converts those, e.g. a window drawn with torch.randint; reading a
    CUDA tensor's value is a sync). Bools and floats are refused: in an int slot they are a
    misplaced argument."""
    if value.__class__ is int:
        return value
    if isinstance(value, torch.SymInt):  # torch.compile with dynamic shapes
        return value
    if not isinstance(value, bool) and isinstance(value, numbers.Integral):  # numpy ints
        return int(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.dtype in _INT_DTYPES:
        return int(value.item())
    _fail(name, value, allowed)


def _is_numpy_bool(value):
    """numpy.bool_ (numpy.bool in numpy 2), without importing numpy (not a dependency)."""
    return type(value).__module__ == "numpy" and type(value).__name__ in ("bool_", "bool")


def as_flag(name, value):
    """One of FA3's bool arguments (causal, deterministic, rotary_interleaved): a bool, or
    what FA3's C++ binding converts to one (None: False; a Python or NumPy integer or bool;
    a one-element bool or integer tensor), by truth value."""
    if value.__class__ is bool:
        return value
    if value is None:
        return False
    if isinstance(value, numbers.Integral) or _is_numpy_bool(value):
        return bool(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1 and (value.dtype == torch.bool or value.dtype in _INT_DTYPES):
        return bool(value.item())
    _fail(name, value, "expected a bool (or an integer / one-element tensor FA3 reads as one)", TypeError)


def _as_float(name, value, allowed):
    """One of FA3's float arguments: a Python or NumPy number, or a one-element tensor (not
    a bool: in a float slot it is a misplaced argument)."""
    if value.__class__ is float or value.__class__ is int:
        return float(value)
    if isinstance(value, (torch.SymFloat, torch.SymInt)):  # torch.compile(dynamic=True)
        return torch.sym_float(value)
    if not isinstance(value, bool) and isinstance(value, numbers.Real):  # (numpy's bool is not Real)
        return float(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.dtype != torch.bool \
            and not value.is_complex():
        return float(value.item())
    _fail(name, value, allowed)


_WINDOW = "expected a pair (left, right) of ints, a negative one unbounded (FA3's -1)"
_WINDOW_SIDE = "expected an int, negative for unbounded (FA3's -1; None is FA4's form)"


_WINDOW_CAP = 1 << 30


def normalize_window(window_size, causal):
    """(left, right) with -1 for unbounded; causal sets right = 0 (bottom-right aligned).
    window_size: FA3's forms, a tuple or list of two ints (or one-element integer tensors),
    or a 2-element integer tensor; any negative side is unbounded, as in FA3."""
    if isinstance(window_size, torch.Tensor):
        if window_size.shape != (2,) or window_size.dtype not in _INT_DTYPES:
            _fail("window_size", describe(window_size),
                  "expected a 2-element integer tensor, or a pair (left, right) of ints")
        window_size = window_size.tolist()
    elif not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        _fail("window_size", window_size, _WINDOW)
    left, right = (as_int(f"window_size[{i}]", w, _WINDOW_SIDE) for i, w in enumerate(window_size))
    # a side past any sequence is unbounded in effect; capped, the kernels' 32-bit mask sums
    # (row + shift + window) cannot wrap
    left, right = min(max(left, -1), _WINDOW_CAP), min(max(right, -1), _WINDOW_CAP)
    if causal:
        right = 0
    return left, right


def check_scalars(softmax_scale, softcap, headdim):
    """(softmax_scale, softcap) as floats. None scale: headdim**-0.5; softcap <= 0 disables
    soft-capping (FA3: "anything > 0 activates")."""
    allowed = "expected a finite float (or None for headdim**-0.5)"
    softmax_scale = headdim ** -0.5 if softmax_scale is None else _as_float("softmax_scale", softmax_scale, allowed)
    # (while torch.compile traces, dynamic=True makes both symbolic: their values are not known)
    tracing = torch.compiler.is_compiling()
    if not tracing and not math.isfinite(softmax_scale):
        _fail("softmax_scale", softmax_scale, allowed)
    allowed = "expected a finite float (> 0 soft-caps; 0 or below disables it)"
    softcap = _as_float("softcap", softcap, allowed)
    if not tracing and not math.isfinite(softcap):
        _fail("softcap", softcap, allowed)
    return softmax_scale, max(softcap, 0.0)


def check_extras(qv, attention_chunk, q, v):
    """FA3's forward-only extras: ``attention_chunk`` as an int (0 off, else keys per chunk,
    capped like a window) and ``qv`` (q's shape with v's head dim, q's dtype and device, its
    last dim made contiguous). Returns (qv, chunk)."""
    chunk = as_int("attention_chunk", attention_chunk, "expected an int >= 0 (0: no chunking)")
    if chunk < 0:
        _fail("attention_chunk", chunk, "expected an int >= 0 (0: no chunking)")
    if qv is not None:
        if not isinstance(qv, torch.Tensor):
            _fail("qv", type(qv).__name__, "expected a torch.Tensor or None", TypeError)
        expected = tuple(q.shape[:-1]) + (v.shape[-1],)
        if tuple(qv.shape) != expected:
            _fail("qv.shape", tuple(qv.shape), f"expected q's shape with v's head dim, {expected}")
        if qv.dtype != q.dtype:
            _fail("qv.dtype", qv.dtype, f"expected q's dtype {q.dtype}", TypeError)
        check_device(q, qv)
        qv = last_dim_contiguous(qv)
    return qv, min(chunk, _WINDOW_CAP)


SINK_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_sink(learnable_sink, nheads, q):
    """A learnable attention sink (FA4's ``learnable_sink``, transformers' ``s_aux``): None, or
    a (nheads,) float16 / bfloat16 / float32 tensor of logits, one per query head, on q's
    device (``merge.fold_sink``)."""
    if learnable_sink is None:
        return None
    if not isinstance(learnable_sink, torch.Tensor):
        _fail("learnable_sink", type(learnable_sink).__name__, "expected a torch.Tensor or None", TypeError)
    if tuple(learnable_sink.shape) != (nheads,):
        _fail("learnable_sink.shape", tuple(learnable_sink.shape), f"expected (nheads,) = ({nheads},): one logit "
              "per query head")
    if learnable_sink.dtype not in SINK_DTYPES:
        _fail("learnable_sink.dtype", learnable_sink.dtype, "expected torch.float16, torch.bfloat16 or "
              "torch.float32", TypeError)
    check_device(q, learnable_sink)
    return learnable_sink


def check_descales(q, v, qv, descales, batch, nheads_kv):
    """FA3's fp8 forward: with float8_e4m3fn inputs, ``descales`` (q_descale, k_descale,
    v_descale) are float32 (batch, nheads_kv) tensors (any strides, e.g. expanded views) or
    None (1). Scores are q k^T x q_descale x k_descale x softmax_scale and the output P v x
    v_descale, each per sequence and KV head. Returns the three tensors (a None as ones), or
    None for fp16 / bf16 inputs, whose descales are ignored, as FA3 ignores them."""
    if q.dtype != FP8:
        return None
    if qv is not None:
        _fail("qv", "a tensor", "qv takes fp16 / bf16 inputs (FA3 has no fp8 qv)", NotImplementedError)
    if v.shape[-1] > MAX_HEADDIM:
        _fail("v head dim", v.shape[-1], f"fp8 inputs take headdim_v up to {MAX_HEADDIM} (as FA3)")
    out, ones = [], None
    for name, t in zip(("q_descale", "k_descale", "v_descale"), descales):
        if t is None:  # (one scalar of ones serves every descale left out)
            if ones is None:
                ones = torch.ones((), dtype=torch.float32, device=q.device).expand(batch, nheads_kv)
            t = ones
        elif not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or tuple(t.shape) != (batch, nheads_kv):
            _fail(name, describe(t),
                  f"expected None or a float32 tensor of shape (batch, nheads_kv) = ({batch}, {nheads_kv})")
        else:
            check_device(q, t)
        out.append(t)
    return tuple(out)


def check_qkv(q, k, v, varlen: bool, names=("q", "k", "v"), fp8=False):
    ndim = 3 if varlen else 4
    qn, kn, vn = names
    _check_tensor(qn, q, ndim, fp8)
    _check_tensor(kn, k, ndim, fp8)
    _check_tensor(vn, v, ndim, fp8)
    _check_dtypes_heads(q, k, v, names)
    if not varlen:
        if not (q.shape[0] == k.shape[0] == v.shape[0]):
            _fail("batch sizes", (q.shape[0], k.shape[0], v.shape[0]), f"{qn}, {kn} and {vn} must share the batch size")
        if k.shape[1] != v.shape[1]:
            _fail("seqlen_k", (k.shape[1], v.shape[1]), f"{kn} and {vn} must share seqlen_k")
    elif k.shape[0] != v.shape[0]:
        _fail("total_k", (k.shape[0], v.shape[0]), "k and v must share the token count")


def _check_dtypes_heads(q, k, v, names):
    """One dtype and device; head dims (1 to 256, k's = q's; v's to 512); GQA head counts."""
    qn, kn, vn = names
    if not (q.dtype == k.dtype == v.dtype):
        _fail("dtypes", (q.dtype, k.dtype, v.dtype), f"{qn}, {kn} and {vn} must share one dtype", TypeError)
    check_device(q, k, v)
    _check_headdim(qn, q.shape[-1])
    _check_headdim(vn, v.shape[-1], MAX_HEADDIM_V)
    if k.shape[-1] != q.shape[-1]:
        _fail(f"{kn} head dim", k.shape[-1], f"must equal {qn}'s head dim {q.shape[-1]}")
    nheads, nheads_kv = q.shape[-2], k.shape[-2]
    if v.shape[-2] != nheads_kv:
        _fail(f"{vn} nheads", v.shape[-2], f"must equal {kn}'s nheads {nheads_kv}")
    if nheads_kv == 0 or nheads % nheads_kv != 0:
        _fail("nheads_kv", nheads_kv, f"must divide nheads={nheads} (GQA/MQA)")


def check_varlen(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k):
    _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q)
    _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k)
    if cu_seqlens_q.shape[0] != cu_seqlens_k.shape[0]:
        _fail("cu_seqlens_k.shape[0]", cu_seqlens_k.shape[0], f"must equal cu_seqlens_q.shape[0]={cu_seqlens_q.shape[0]}")
    batch = cu_seqlens_q.shape[0] - 1
    for name, used in (("seqused_q", seqused_q), ("seqused_k", seqused_k)):
        if used is None:
            continue
        if not isinstance(used, torch.Tensor) or used.dtype != torch.int32 or used.shape != (batch,) \
                or not used.is_contiguous():
            _fail(name, describe(used),
                  f"expected a contiguous int32 tensor of shape ({batch},)")
    max_seqlen_q = as_max_seqlen("max_seqlen_q", max_seqlen_q)
    max_seqlen_k = as_max_seqlen("max_seqlen_k", max_seqlen_k)
    check_device(q, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
    if _host_checks(q):
        _check_cu_seqlens_values("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q)
        _check_cu_seqlens_values("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k)
        for name, used, cu in (("seqused_q", seqused_q, cu_seqlens_q), ("seqused_k", seqused_k, cu_seqlens_k)):
            if used is not None:
                u, c = used.cpu(), cu.cpu()
                if (u < 0).any() or (u > c[1:] - c[:-1]).any():
                    _fail(name, u.tolist(), f"expected 0 <= {name}[b] <= the sequence's tokens in "
                          f"cu_seqlens_{name[-1]}, {(c[1:] - c[:-1]).tolist()}")


def _check_cu_seqlens(name, cu):
    if not isinstance(cu, torch.Tensor):
        _fail(name, type(cu).__name__, "expected an int32 tensor of shape (batch + 1,)", TypeError)
    if cu.dtype != torch.int32 or cu.dim() != 1 or cu.shape[0] < 1:
        _fail(name, describe(cu), "expected an int32 tensor of shape (batch + 1,)")
    if not cu.is_contiguous():
        _fail(name, "non-contiguous", "expected a contiguous tensor")


def as_max_seqlen(name, m):
    """max_seqlen_q / max_seqlen_k as an int >= 0 (FA3 takes a Python or NumPy integer or a
    one-element integer tensor: ``as_int``)."""
    allowed = "expected an int >= 0 (the longest sequence in the batch)"
    m = as_int(name, m, allowed)
    if m < 0:
        _fail(name, m, allowed)
    return m


def _host_checks(q) -> bool:
    """Whether the data-dependent checks run: always on the CPU, on a GPU under
    ``set_check_inputs(True)`` (they copy index tensors to the host: a sync)."""
    return (_check_inputs or q.device.type == "cpu") and not torch.compiler.is_compiling()


def _check_cu_seqlens_values(name, cu, total, max_seqlen):
    """Data-dependent: 0 = c[0] <= ... <= c[-1] <= total, no sequence longer than max_seqlen."""
    c = cu.cpu()
    lens = c[1:] - c[:-1]
    if c[0].item() != 0 or (lens < 0).any() or c[-1].item() > total:
        _fail(name, c.tolist(), f"expected 0 = c[0] <= c[1] <= ... <= c[-1] <= {total} (tokens in the tensor)")
    if lens.numel() > 0 and lens.max().item() > max_seqlen:
        _fail(f"max_seqlen_{name[-1]}", max_seqlen, f"must be >= the longest sequence, {lens.max().item()}")


def _check_index_vector(name, x, batch, device_of):
    """An int32 (batch,) contiguous tensor on ``device_of``'s device."""
    if not isinstance(x, torch.Tensor):
        _fail(name, type(x).__name__, f"expected a contiguous int32 tensor of shape ({batch},)", TypeError)
    if x.dtype != torch.int32 or tuple(x.shape) != (batch,) or not x.is_contiguous():
        _fail(name, describe(x), f"expected a contiguous int32 tensor of shape ({batch},)")
    check_device(device_of, x)


def check_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx=None,
                  cache_leftpad=None, page_table=None, cu_seqlens_q=None, max_seqlen_q=None,
                  cu_seqlens_k_new=None):
    """``flash_attn_with_kvcache``'s tensors. Returns (starts, used, capacity): int32 (batch,)
    tensors, where each sequence's new keys go and how many cache rows it attends up to (None,
    None: the whole cache; used None with new keys, whose append returns it), and the rows one
    sequence's cache holds (page_table: pages x page size). Values of index tensors are read
    (a device sync) on the CPU, or on a GPU with ``set_check_inputs(True)``; the kernels clamp
    them so that nothing faults."""
    varlen_q = cu_seqlens_q is not None
    _check_tensor("q", q, 3 if varlen_q else 4, fp8=True)
    _check_tensor("k_cache", k_cache, 4, fp8=True)
    _check_tensor("v_cache", v_cache, 4, fp8=True)
    names = ("q", "k_cache", "v_cache")
    _check_dtypes_heads(q, k_cache, v_cache, names)
    if tuple(k_cache.shape[:2]) != tuple(v_cache.shape[:2]):
        _fail("v_cache.shape", tuple(v_cache.shape), f"must share k_cache's first two dims {tuple(k_cache.shape[:2])}")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.stride(-1) != 1:
            _fail(f"{name}.stride(-1)", cache.stride(-1), "the cache is updated in place: its last dim must be contiguous")
    host = _host_checks(q)
    if varlen_q:
        _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q)
        check_device(q, cu_seqlens_q)
        max_seqlen_q = as_max_seqlen("max_seqlen_q", max_seqlen_q)
        batch = cu_seqlens_q.shape[0] - 1
        if host:
            _check_cu_seqlens_values("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q)
    else:
        batch = q.shape[0]
    if page_table is not None:
        # FA3: one row per sequence, or with cache_batch_idx any number of rows, sequence b
        # reading row cache_batch_idx[b]
        rows = "rows" if cache_batch_idx is not None else f"batch={batch}"
        if not isinstance(page_table, torch.Tensor) or page_table.dtype != torch.int32 or page_table.dim() != 2 \
                or (page_table.shape[0] != batch and cache_batch_idx is None) or page_table.stride(-1) != 1 \
                or (page_table.shape[0] == 0 and batch > 0):
            _fail("page_table", describe(page_table),
                  f"expected an int32 tensor ({rows}, pages per sequence) with a contiguous last dim")
        check_device(q, page_table)
        capacity = page_table.shape[1] * k_cache.shape[1]
        if host and page_table.numel():
            pt = page_table.cpu()
            if pt.min().item() < 0 or pt.max().item() >= k_cache.shape[0]:
                _fail("page_table", f"values in [{pt.min().item()}, {pt.max().item()}]",
                      f"expected block indices in [0, {k_cache.shape[0]}) (k_cache.shape[0])")
    else:
        capacity = k_cache.shape[1]
        if cache_batch_idx is None and k_cache.shape[0] != batch:
            _fail("k_cache.shape[0]", k_cache.shape[0], f"must equal the batch size {batch} (or pass cache_batch_idx)")
    if cache_batch_idx is not None:
        _check_index_vector("cache_batch_idx", cache_batch_idx, batch, q)
        if host and batch:
            c = cache_batch_idx.cpu()
            n, of = (page_table.shape[0], "page_table rows") if page_table is not None else (k_cache.shape[0], "k_cache.shape[0]")
            if c.min().item() < 0 or c.max().item() >= n:
                _fail("cache_batch_idx", c.tolist(), f"expected values in [0, {n}) ({of})")
    seqlen_new = 0
    if (k is None) != (v is None):
        _fail("k, v", ("a tensor" if k is not None else None, "a tensor" if v is not None else None),
              "pass both new k and v, or neither")
    new_lens = None
    if k is not None and cu_seqlens_k_new is not None:
        _check_tensor("k", k, 3, fp8=True)
        _check_tensor("v", v, 3, fp8=True)
        _check_cu_seqlens("cu_seqlens_k_new", cu_seqlens_k_new)
        check_device(q, cu_seqlens_k_new)
        if cu_seqlens_k_new.shape[0] != batch + 1:
            _fail("cu_seqlens_k_new.shape", tuple(cu_seqlens_k_new.shape), f"expected ({batch + 1},) (batch + 1)")
        for name, new, cache in (("k", k, k_cache), ("v", v, v_cache)):
            want = (k.shape[0],) + tuple(cache.shape[2:])
            if tuple(new.shape) != want or new.dtype != cache.dtype:
                _fail(f"{name}.shape", f"{tuple(new.shape)} {new.dtype}",
                      f"expected {want} {cache.dtype} (new tokens of every sequence, {name}_cache's heads and dim)")
        check_device(q, k, v)
        if cache_seqlens is None:
            _fail("cache_seqlens", None, "required with new k/v: where each sequence's new tokens go")
        if host:
            _check_cu_seqlens_values("cu_seqlens_k_new", cu_seqlens_k_new, k.shape[0], k.shape[0])
        if host and batch:
            new_lens = cu_seqlens_k_new[1:] - cu_seqlens_k_new[:-1]
            seqlen_new = int(new_lens.max().item())  # (the bound the cache_seqlens check uses)
    elif k is not None:
        _check_tensor("k", k, 4, fp8=True)
        _check_tensor("v", v, 4, fp8=True)
        seqlen_new = k.shape[1]
        for name, new, cache in (("k", k, k_cache), ("v", v, v_cache)):
            want = (batch, seqlen_new) + tuple(cache.shape[2:])
            if tuple(new.shape) != want or new.dtype != cache.dtype:
                _fail(f"{name}.shape", f"{tuple(new.shape)} {new.dtype}",
                      f"expected {want} {cache.dtype} (batch, new tokens, {name}_cache's heads and dim)")
        check_device(q, k, v)
        if cache_seqlens is None:
            _fail("cache_seqlens", None, "required with new k/v: where each sequence's new tokens go")
    if cache_seqlens is None:
        if cache_leftpad is not None:
            _fail("cache_leftpad", "a tensor", "needs cache_seqlens (the keys are cache_leftpad .. cache_seqlens - 1)")
        if page_table is not None:
            used = torch.full((batch,), capacity, dtype=torch.int32, device=q.device)
            return None, used, capacity
        return None, None, capacity
    if not isinstance(cache_seqlens, torch.Tensor):
        cache_seqlens = as_int("cache_seqlens", cache_seqlens, "expected an int or an int32 tensor (batch,)")
    if not isinstance(cache_seqlens, torch.Tensor):
        if not 0 <= cache_seqlens <= capacity - seqlen_new:
            _fail("cache_seqlens", cache_seqlens,
                  f"expected 0 <= cache_seqlens <= {capacity - seqlen_new} (cache rows {capacity} "
                  f"minus {seqlen_new} new tokens)")
        starts = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=q.device)
    else:
        _check_index_vector("cache_seqlens", cache_seqlens, batch, q)
        starts = cache_seqlens
        if host:
            c = cache_seqlens.cpu()
            room = capacity - (new_lens.cpu() if new_lens is not None else seqlen_new)
            if (c < 0).any() or (c > room).any():
                _fail("cache_seqlens", c.tolist(),
                      f"expected values in [0, {capacity - seqlen_new}] (cache rows {capacity} "
                      f"minus {seqlen_new} new tokens)")
    if cache_leftpad is not None:
        _check_index_vector("cache_leftpad", cache_leftpad, batch, q)
        if host:
            lp, c = cache_leftpad.cpu(), starts.cpu()
            if (lp < 0).any() or (lp > c).any():
                _fail("cache_leftpad", lp.tolist(), f"expected 0 <= cache_leftpad <= cache_seqlens {c.tolist()}")
    # with new keys the append writes each sequence's key count (kvcache.append_kv)
    return starts, None if k is not None else starts, capacity


def check_rotary(rotary_cos, rotary_sin, rotary_seqlens, q, k, batch):
    """``flash_attn_with_kvcache``'s rotary tables: both or neither, (seqlen_ro, rotary_dim /
    2) each, rotary_dim <= the head dim, new keys given (they are what gets rotated into the
    cache). Returns True when rotary embedding applies. Without tables ``rotary_seqlens`` is
    ignored, as FA3 ignores it."""
    if rotary_cos is None and rotary_sin is None:
        return False  # rotary_seqlens is then ignored, as in FA3 (its tests pass it regardless)
    if rotary_cos is None or rotary_sin is None:
        _fail("rotary_cos, rotary_sin", ("a tensor" if rotary_cos is not None else None,
                                         "a tensor" if rotary_sin is not None else None), "pass both or neither")
    for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or not t.is_floating_point():
            _fail(name, getattr(t, "shape", type(t).__name__), "expected a float tensor (seqlen_ro, rotary_dim / 2)")
    if rotary_cos.shape != rotary_sin.shape:
        _fail("rotary_sin.shape", tuple(rotary_sin.shape), f"must equal rotary_cos.shape {tuple(rotary_cos.shape)}")
    if 2 * rotary_cos.shape[1] > q.shape[-1]:
        _fail("rotary_cos.shape[1]", rotary_cos.shape[1], f"rotary_dim = 2 x that must be <= the head dim {q.shape[-1]}")
    check_device(q, rotary_cos, rotary_sin)
    if k is None:
        _fail("rotary_cos", "a tensor", "rotary embedding needs new k and v (they are rotated into the cache)")
    if rotary_seqlens is not None:
        _check_index_vector("rotary_seqlens", rotary_seqlens, batch, q)
    return True


def check_rotary_positions(rotary_cos, offsets, q, k, cu_seqlens_q, cu_seqlens_k_new, q_per_token):
    """Data-dependent: the tables hold every position rotated, ``offsets`` (batch,) + i for
    each sequence's new keys, and for its queries when they are rotated token by token (FA3
    reads past a short table)."""
    if offsets is None or not _host_checks(q):
        return
    lens = lambda cu, dense: (cu[1:] - cu[:-1]).cpu() if cu is not None else torch.full((offsets.shape[0],), dense)  # noqa: E731
    n = lens(cu_seqlens_k_new, k.shape[1])
    if q_per_token:
        n = torch.maximum(n, lens(cu_seqlens_q, q.shape[-3]))
    need = int((offsets.cpu().long() + n).max()) if n.numel() else 0
    if need > rotary_cos.shape[0]:
        _fail("rotary_cos.shape[0]", rotary_cos.shape[0], f"the tables must hold the {need} positions rotated "
              "(rotary_seqlens or cache_seqlens + each sequence's new tokens)")
