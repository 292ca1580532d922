"""Input validation: every bad input becomes an exception that names the argument, the value
and what is allowed. Nothing here synchronizes with the GPU unless ``check_inputs`` is on
(``triflash.set_check_inputs(True)`` or TRIFLASH_CHECK_INPUTS=1), which adds the data-
dependent varlen checks (cu_seqlens monotone, in range; max_seqlen large enough)."""
import math
import os

import torch

from . import dispatch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEADDIM = 256
_check_inputs = os.environ.get("TRIFLASH_CHECK_INPUTS", "0") == "1"


def set_check_inputs(enabled: bool) -> None:
    """Turn on/off the varlen checks that read cu_seqlens (a device-to-host sync on GPU)."""
    global _check_inputs
    _check_inputs = bool(enabled)


def _fail(name, value, allowed, exc=ValueError):
    raise exc(f"{name}={value} is not supported: {allowed}")


def _check_tensor(name, x, ndim):
    if not isinstance(x, torch.Tensor):
        _fail(name, type(x).__name__, "expected a torch.Tensor", TypeError)
    if x.dim() != ndim:
        _fail(f"{name}.dim()", x.dim(), f"expected {ndim} dims ({'total, heads, dim' if ndim == 3 else 'batch, seqlen, heads, dim'}), got shape {tuple(x.shape)}")
    if x.dtype not in SUPPORTED_DTYPES:
        _fail(f"{name}.dtype", x.dtype, "expected torch.float16 or torch.bfloat16", TypeError)


def _check_headdim(name, d):
    if d % 8 != 0 or d < 8 or d > MAX_HEADDIM:
        _fail(f"{name} head dim", d, f"expected a multiple of 8 between 8 and {MAX_HEADDIM}")


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


def normalize_window(window_size, causal):
    """(left, right) with -1 for unbounded; causal sets right = 0 (bottom-right aligned)."""
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        _fail("window_size", window_size, "expected a pair (left, right) of ints >= -1")
    left, right = window_size
    for side, w in (("window_size[0]", left), ("window_size[1]", right)):
        if isinstance(w, bool) or not isinstance(w, int) or w < -1:
            _fail(side, w, "expected an int >= -1 (-1 means unbounded)")
    if causal:
        right = 0
    return int(left), int(right)


def check_scalars(softmax_scale, softcap, headdim):
    if softmax_scale is None:
        softmax_scale = headdim ** -0.5
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)) \
            or not math.isfinite(softmax_scale):
        _fail("softmax_scale", softmax_scale, "expected a finite float (or None for headdim**-0.5)")
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not softcap >= 0.0 \
            or not math.isfinite(softcap):
        _fail("softcap", softcap, "expected a finite float >= 0 (0 disables soft-capping)")
    return float(softmax_scale), float(softcap)


def reject_unsupported(**features):
    """FA3 arguments triflash accepts for compatibility but does not implement yet."""
    for name, (value, default) in features.items():
        if value is not default and value != default:
            _fail(name, value if not isinstance(value, torch.Tensor) else "a tensor",
                  f"triflash does not implement {name} yet; pass {default!r}",
                  NotImplementedError)


def check_qkv(q, k, v, varlen: bool, names=("q", "k", "v")):
    ndim = 3 if varlen else 4
    qn, kn, vn = names
    _check_tensor(qn, q, ndim)
    _check_tensor(kn, k, ndim)
    _check_tensor(vn, v, ndim)
    if not (q.dtype == k.dtype == v.dtype):
        _fail("dtypes", (q.dtype, k.dtype, v.dtype), f"{qn}, {kn} and {vn} must share one dtype", TypeError)
    check_device(q, k, v)
    if not varlen:
        if not (q.shape[0] == k.shape[0] == v.shape[0]):
            _fail("batch sizes", (q.shape[0], k.shape[0], v.shape[0]), f"{qn}, {kn} and {vn} must share the batch size")
        if k.shape[1] != v.shape[1]:
            _fail("seqlen_k", (k.shape[1], v.shape[1]), f"{kn} and {vn} must share seqlen_k")
    elif k.shape[0] != v.shape[0]:
        _fail("total_k", (k.shape[0], v.shape[0]), "k and v must share the token count")
    _check_headdim(qn, q.shape[-1])
    _check_headdim(vn, v.shape[-1])
    if k.shape[-1] != q.shape[-1]:
        _fail(f"{kn} head dim", k.shape[-1], f"must equal {qn}'s head dim {q.shape[-1]}")
    nheads, nheads_kv = q.shape[-2], k.shape[-2]
    if v.shape[-2] != nheads_kv:
        _fail(f"{vn} nheads", v.shape[-2], f"must equal {kn}'s nheads {nheads_kv}")
    if nheads_kv == 0 or nheads % nheads_kv != 0:
        _fail("nheads_kv", nheads_kv, f"must divide nheads={nheads} (GQA/MQA)")


def check_varlen(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k):
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor):
            _fail(name, type(cu).__name__, "expected an int32 tensor of shape (batch + 1,)", TypeError)
        if cu.dtype != torch.int32 or cu.dim() != 1 or cu.shape[0] < 1:
            _fail(name, f"tensor{tuple(cu.shape)} {cu.dtype}", "expected an int32 tensor of shape (batch + 1,)")
        if not cu.is_contiguous():
            _fail(name, "non-contiguous", "expected a contiguous tensor")
    if cu_seqlens_q.shape[0] != cu_seqlens_k.shape[0]:
        _fail("cu_seqlens_k.shape[0]", cu_seqlens_k.shape[0], f"must equal cu_seqlens_q.shape[0]={cu_seqlens_q.shape[0]}")
    batch = cu_seqlens_q.shape[0] - 1
    for name, used in (("seqused_q", seqused_q), ("seqused_k", seqused_k)):
        if used is None:
            continue
        if not isinstance(used, torch.Tensor) or used.dtype != torch.int32 or used.shape != (batch,) \
                or not used.is_contiguous():
            _fail(name, used if not isinstance(used, torch.Tensor) else f"tensor{tuple(used.shape)} {used.dtype}",
                  f"expected a contiguous int32 tensor of shape ({batch},)")
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            _fail(name, m, "expected an int >= 0 (the longest sequence in the batch)")
    check_device(q, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
    if (_check_inputs or q.device.type == "cpu") and not torch.compiler.is_compiling():
        for name, cu, total, mx in (("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q),
                                    ("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k)):
            c = cu.cpu()
            lens = c[1:] - c[:-1]
            if c[0].item() != 0 or (lens < 0).any() or c[-1].item() > total:
                _fail(name, c.tolist(), f"expected 0 = c[0] <= c[1] <= ... <= c[-1] <= {total} (tokens in the tensor)")
            if batch > 0 and lens.max().item() > mx:
                _fail(f"max_seqlen_{name[-1]}", mx, f"must be >= the longest sequence, {lens.max().item()}")


def check_kvcache(q, k_cache, v_cache, k, v, cache_seqlens):
    """``flash_attn_with_kvcache``'s tensors. Returns (starts, used): int32 (batch,) tensors,
    where each sequence's new keys go and how many keys it attends to, or (None, None) for
    the whole cache."""
    check_qkv(q, k_cache, v_cache, varlen=False, names=("q", "k_cache", "v_cache"))
    batch, seqlen_cache = k_cache.shape[0], k_cache.shape[1]
    seqlen_new = 0
    if (k is None) != (v is None):
        _fail("k, v", ("a tensor" if k is not None else None, "a tensor" if v is not None else None),
              "pass both new k and v, or neither")
    if k is not None:
        _check_tensor("k", k, 4)
        _check_tensor("v", v, 4)
        seqlen_new = k.shape[1]
        for name, new, cache in (("k", k, k_cache), ("v", v, v_cache)):
            want = (batch, seqlen_new) + tuple(cache.shape[2:])
            if tuple(new.shape) != want or new.dtype != cache.dtype:
                _fail(f"{name}.shape", f"{tuple(new.shape)} {new.dtype}",
                      f"expected {want} {cache.dtype} (batch, new tokens, {name}_cache's heads and dim)")
            if cache.stride(-1) != 1:
                _fail(f"{name}_cache.stride(-1)", cache.stride(-1),
                      "the cache is updated in place: its last dim must be contiguous")
        check_device(q, k, v)
        if cache_seqlens is None:
            _fail("cache_seqlens", None, "required with new k/v: where each sequence's new tokens go")
    if cache_seqlens is None:
        return None, None
    if isinstance(cache_seqlens, bool) or not isinstance(cache_seqlens, (int, torch.Tensor)):
        _fail("cache_seqlens", type(cache_seqlens).__name__, "expected an int or an int32 tensor (batch,)", TypeError)
    if isinstance(cache_seqlens, int):
        if not 0 <= cache_seqlens <= seqlen_cache - seqlen_new:
            _fail("cache_seqlens", cache_seqlens,
                  f"expected 0 <= cache_seqlens <= {seqlen_cache - seqlen_new} (cache rows {seqlen_cache} "
                  f"minus {seqlen_new} new tokens)")
        starts = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=q.device)
        return starts, starts + seqlen_new
    if cache_seqlens.dtype != torch.int32 or tuple(cache_seqlens.shape) != (batch,) \
            or not cache_seqlens.is_contiguous():
        _fail("cache_seqlens", f"tensor{tuple(cache_seqlens.shape)} {cache_seqlens.dtype}",
              f"expected a contiguous int32 tensor of shape ({batch},)")
    check_device(q, cache_seqlens)
    if (_check_inputs or q.device.type == "cpu") and not torch.compiler.is_compiling():
        c = cache_seqlens.cpu()
        if (c < 0).any() or (c > seqlen_cache - seqlen_new).any():
            _fail("cache_seqlens", c.tolist(),
                  f"expected values in [0, {seqlen_cache - seqlen_new}] (cache rows {seqlen_cache} "
                  f"minus {seqlen_new} new tokens)")
    return cache_seqlens, cache_seqlens + seqlen_new
