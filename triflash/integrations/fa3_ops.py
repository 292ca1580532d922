"""FlashAttention-3's torch operators, ``torch.ops.flash_attn_3.{fwd, bwd, fwd_combine,
get_scheduler_metadata}``, with FA3's schemas (the ones its ``test_flash3_bw_compatibility``
pins), served by triflash: for code and exported programs (``torch.export``) that call FA3's
operators rather than its Python functions.

``import triflash`` registers them when FlashAttention-3 itself is not installed (no
``flash_attn_3`` package: its extension defines the namespace, and a second definition would
make its import fail); ``register()`` says whether they are triflash's. What each returns is
what FA3's returns: ``fwd`` (out, softmax_lse, out_accum, softmax_lse_accum), the split
accumulators empty; ``bwd`` (dq, dk, dv, softmax_d, softmax_lse_log2, dq_accum, dk_accum,
dv_accum), the accumulators empty; ``fwd_combine`` (out, lse); ``get_scheduler_metadata``
the plan as ``triflash.get_scheduler_metadata`` returns it. Forward-only, as FA3's operators
are (its autograd lives in its Python functions).
"""
import importlib.util
import math

import torch

from ..kernels.problem import out_dtype

NAMESPACE = "flash_attn_3"

SCHEMAS = {
    "fwd": (
        "fwd(Tensor q, Tensor k, Tensor v, Tensor(k_new!)? k_new=None, "
        "Tensor(v_new!)? v_new=None, Tensor? q_v=None, Tensor(out!)? out=None, "
        "Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, "
        "Tensor? cu_seqlens_k_new=None, Tensor? seqused_q=None, Tensor? seqused_k=None, "
        "int? max_seqlen_q=None, int? max_seqlen_k=None, Tensor? page_table=None, "
        "Tensor? kv_batch_idx=None, Tensor? leftpad_k=None, Tensor? rotary_cos=None, Tensor? rotary_sin=None, "
        "Tensor? seqlens_rotary=None, Tensor? q_descale=None, Tensor? k_descale=None, Tensor? v_descale=None, "
        "float? softmax_scale=None, bool is_causal=False, int window_size_left=-1, int window_size_right=-1, "
        "int attention_chunk=0, float softcap=0., bool is_rotary_interleaved=False, "
        "Tensor? scheduler_metadata=None, int num_splits=0, bool? pack_gqa=None, int sm_margin=0) "
        "-> (Tensor(out!), Tensor, Tensor, Tensor)"),
    "bwd": (
        "bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor softmax_lse, "
        "Tensor(dq!)? dq=None, Tensor(dk!)? dk=None, Tensor(dv!)? dv=None, Tensor? cu_seqlens_q=None, "
        "Tensor? cu_seqlens_k=None, Tensor? seqused_q=None, Tensor? seqused_k=None, int? max_seqlen_q=None, "
        "int? max_seqlen_k=None, float? softmax_scale=None, bool is_causal=False, int window_size_left=-1, "
        "int window_size_right=-1, float softcap=0., bool deterministic=False, int sm_margin=0) "
        "-> (Tensor(dq!), Tensor(dk!), Tensor(dv!), Tensor, Tensor, Tensor, Tensor, Tensor)"),
    "fwd_combine": (
        "fwd_combine(Tensor out_partial, Tensor lse_partial, Tensor(out!)? out=None, "
        "ScalarType? out_dtype=None) -> (Tensor(out!), Tensor)"),
    "get_scheduler_metadata": (
        "get_scheduler_metadata(int batch_size, int max_seqlen_q, int max_seqlen_k, "
        "int num_heads, int num_heads_k, int headdim, int headdim_v, ScalarType qkv_dtype, Tensor seqused_k, "
        "Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, Tensor? cu_seqlens_k_new=None, "
        "Tensor? seqused_q=None, Tensor? leftpad_k=None, int? page_size=None, int max_seqlen_k_new=0, "
        "bool is_causal=False, int window_size_left=-1, int window_size_right=-1, "
        "int attention_chunk=0, bool has_softcap=False, int num_splits=0, bool? pack_gqa=None, "
        "int sm_margin=0) -> Tensor"),
}

_library = None


def _fwd(q, k, v, k_new=None, v_new=None, q_v=None, out=None, cu_seqlens_q=None, cu_seqlens_k=None,
         cu_seqlens_k_new=None, seqused_q=None, seqused_k=None, max_seqlen_q=None, max_seqlen_k=None,
         page_table=None, kv_batch_idx=None, leftpad_k=None, rotary_cos=None, rotary_sin=None,
         seqlens_rotary=None, q_descale=None, k_descale=None, v_descale=None, softmax_scale=None,
         is_causal=False, window_size_left=-1, window_size_right=-1, attention_chunk=0, softcap=0.0,
         is_rotary_interleaved=False, scheduler_metadata=None, num_splits=0, pack_gqa=None, sm_margin=0):
    from .. import interface
    with torch.no_grad():
        out, lse, *_ = interface._flash_attn_forward(
            q, k, v, k_new, v_new, q_v, out, cu_seqlens_q, cu_seqlens_k, cu_seqlens_k_new, seqused_q,
            seqused_k, max_seqlen_q, max_seqlen_k, page_table, kv_batch_idx, leftpad_k, rotary_cos,
            rotary_sin, seqlens_rotary, q_descale, k_descale, v_descale, softmax_scale, is_causal,
            window_size_left, window_size_right, attention_chunk, softcap, is_rotary_interleaved,
            scheduler_metadata, num_splits, pack_gqa, sm_margin)
    return out, lse, q.new_empty(0, dtype=torch.float32), q.new_empty(0, dtype=torch.float32)


def _bwd(dout, q, k, v, out, softmax_lse, dq=None, dk=None, dv=None, cu_seqlens_q=None, cu_seqlens_k=None,
         seqused_q=None, seqused_k=None, max_seqlen_q=None, max_seqlen_k=None, softmax_scale=None,
         is_causal=False, window_size_left=-1, window_size_right=-1, softcap=0.0, deterministic=False,
         sm_margin=0):
    from .. import interface
    dq = torch.empty_like(q) if dq is None else dq
    dk = torch.empty_like(k) if dk is None else dk
    dv = torch.empty_like(v) if dv is None else dv
    softmax_d = interface._flash_attn_backward(
        dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
        max_seqlen_k, dq, dk, dv, softmax_scale, is_causal, window_size_left, window_size_right, softcap,
        deterministic, sm_margin)
    empty = q.new_empty(0, dtype=torch.float32)
    return dq, dk, dv, softmax_d, softmax_lse * math.log2(math.e), empty, empty.clone(), empty.clone()


def _fwd_combine(out_partial, lse_partial, out=None, out_dtype=None):
    from .. import interface
    return interface.flash_attn_combine(out_partial, lse_partial, out=out, out_dtype=out_dtype)


def _get_scheduler_metadata(batch_size, max_seqlen_q, max_seqlen_k, num_heads, num_heads_k, headdim,
                            headdim_v, qkv_dtype, seqused_k, cu_seqlens_q=None, cu_seqlens_k=None,
                            cu_seqlens_k_new=None, seqused_q=None, leftpad_k=None, page_size=None,
                            max_seqlen_k_new=0, is_causal=False, window_size_left=-1, window_size_right=-1,
                            attention_chunk=0, has_softcap=False, num_splits=0, pack_gqa=None, sm_margin=0):
    from .. import interface
    return interface.get_scheduler_metadata(
        batch_size, max_seqlen_q, max_seqlen_k, num_heads, num_heads_k, headdim, seqused_k, qkv_dtype,
        headdim_v=headdim_v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k_new=cu_seqlens_k_new,
        cache_leftpad=leftpad_k, page_size=page_size, max_seqlen_k_new=max_seqlen_k_new, causal=is_causal,
        window_size=(window_size_left, window_size_right), attention_chunk=attention_chunk,
        has_softcap=has_softcap, num_splits=num_splits, pack_gqa=pack_gqa, sm_margin=sm_margin)


def _fwd_fake(q, k, v, k_new=None, v_new=None, q_v=None, out=None, cu_seqlens_q=None, *args, **kwargs):
    out = q.new_empty(q.shape[:-1] + (v.shape[-1],), dtype=out_dtype(q.dtype)) if out is None else out
    if cu_seqlens_q is not None:
        lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    else:
        lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
    empty = q.new_empty(0, dtype=torch.float32)
    return out, lse, empty, empty.clone()


def _bwd_fake(dout, q, k, v, out, softmax_lse, dq=None, dk=None, dv=None, cu_seqlens_q=None, *args, **kwargs):
    dq = torch.empty_like(q) if dq is None else dq
    dk = torch.empty_like(k) if dk is None else dk
    dv = torch.empty_like(v) if dv is None else dv
    if cu_seqlens_q is not None:
        d = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    else:
        d = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
    empty = q.new_empty(0, dtype=torch.float32)
    return dq, dk, dv, d, torch.empty_like(softmax_lse), empty, empty.clone(), empty.clone()


def _fwd_combine_fake(out_partial, lse_partial, out=None, out_dtype=None):
    dtype = out_dtype if out_dtype is not None else (out.dtype if out is not None else out_partial.dtype)
    out = out_partial.new_empty(out_partial.shape[1:], dtype=dtype) if out is None else out
    return out, lse_partial.new_empty(lse_partial.shape[1:])


def _get_scheduler_metadata_fake(batch_size, max_seqlen_q, max_seqlen_k, num_heads, num_heads_k, headdim,
                                 headdim_v, qkv_dtype, seqused_k, *args, **kwargs):
    return seqused_k.new_empty((1,), dtype=torch.int32)


def fa3_installed() -> bool:
    """Whether FlashAttention-3 (the ``flash_attn_3`` package, whose extension defines the
    operators) is installed."""
    try:
        return importlib.util.find_spec("flash_attn_3") is not None
    except (ImportError, ValueError):
        return False


def register() -> bool:
    """Define the operators, served by triflash, unless FlashAttention-3 is installed or they
    exist already. Returns whether triflash's serve them."""
    global _library
    if _library is not None:
        return True
    if fa3_installed() or hasattr(getattr(torch.ops, NAMESPACE), "fwd"):
        return False
    lib = torch.library.Library(NAMESPACE, "FRAGMENT")
    impls = {"fwd": (_fwd, _fwd_fake), "bwd": (_bwd, _bwd_fake), "fwd_combine": (_fwd_combine, _fwd_combine_fake),
             "get_scheduler_metadata": (_get_scheduler_metadata, _get_scheduler_metadata_fake)}
    for name, schema in SCHEMAS.items():
        impl, fake = impls[name]
        lib.define(schema)
        lib.impl(name, impl, "CompositeExplicitAutograd")
        torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=lib)
    _library = lib
    return True
