"""Host side of the portable Triton tier: compute launch grids and flags, launch.

Every function takes already-validated tensors (see ``triflash.validation``) and the
problem's host view (``problem``: AttnParams, CacheAddressing, the outputs, the (batch,
token, head) strides of dense and varlen layouts).
"""
from typing import Optional

import torch
import triton

from .bwd import BwdMeta, bwd_dkdv_kernel, bwd_dq_kernel, bwd_preprocess_kernel
from .common import FP_FUSION, ceil_div, launch_sections
from .configs import BwdConfig, FwdConfig
from .fwd import FwdMeta, flash_fwd_kernel
from .problem import AttnParams, CacheAddressing, alloc_fwd_outputs, alloc_output, bshd_strides, lse_strides


def _seq_args(q, k, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, p: AttnParams):
    varlen = cu_seqlens_q is not None
    dummy = q  # never dereferenced when the matching constexpr flag is off
    batch = cu_seqlens_q.shape[0] - 1 if varlen else q.shape[0]
    total_q = q.shape[0] if varlen else q.shape[1]
    # keys packed like the queries, or (cu_seqlens_k None: a KV cache under packed queries) dense
    total_k = k.shape[0] if cu_seqlens_k is not None else k.shape[1]
    return dict(
        varlen=varlen, batch=batch,
        ptrs=(cu_seqlens_q if varlen else dummy, cu_seqlens_k if cu_seqlens_k is not None else dummy,
              seqused_q if seqused_q is not None else dummy,
              seqused_k if seqused_k is not None else dummy),
        sizes=(p.max_seqlen_q, p.max_seqlen_k, total_q, total_k),
        flags=dict(IS_VARLEN=varlen, HAS_SEQUSED_Q=seqused_q is not None,
                   HAS_SEQUSED_K=seqused_k is not None),
    )


def _sections(q, k, v, s, p: AttnParams):
    return launch_sections(s["batch"], q.shape[-2], k, v, p.max_seqlen_k, p.window_left, p.window_right)


def _common_flags(q, v, p: AttnParams, upcast: bool):
    d, dv = q.shape[-1], v.shape[-1]
    return dict(
        HEADDIM=d, HEADDIM_V=dv,
        BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_DV=max(16, triton.next_power_of_2(dv)),
        HAS_LEFT=p.window_left >= 0, HAS_RIGHT=p.window_right >= 0, SOFTCAP=p.softcap > 0.0,
        UPCAST=upcast,
    )


def wide_rows(max_seqlen_q: int, block_m: int, q, out, varlen: bool) -> bool:
    """``FwdMeta.WIDE_ROWS``: whether a Q or O row offset inside a sequence (row x row stride,
    rows up to the longest sequence rounded up to a block) can pass 2^31 elements; else it is
    computed in 32 bits and only the sequence's first row in 64."""
    row_stride = max(abs(bshd_strides(q, varlen)[1]), abs(bshd_strides(out, varlen)[1]))
    return (max_seqlen_q + block_m) * row_stride >= 2 ** 31


def fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, p: AttnParams,
        cfg: FwdConfig, upcast: bool, cache: Optional[CacheAddressing] = None,
        out: Optional[torch.Tensor] = None, qv: Optional[torch.Tensor] = None, descale=None):
    """Returns (out, lse) with FlashAttention-3's shapes. ``cache``: a KV cache's addressing
    (then ``p.max_seqlen_k`` is one sequence's cache capacity, and packed queries come with
    ``cu_seqlens_q`` and no ``cu_seqlens_k``). ``out``: written instead of a new tensor
    (``alloc_fwd_outputs``). ``qv`` (q's layout, headdim_v wide) and ``p.chunk``: FA3's
    forward-only extras (``fwd.flash_fwd_kernel``'s ``extras``); so is ``descale``, the
    (q, k, v) descales of fp8 inputs (``validation.check_descales``), None otherwise."""
    s = _seq_args(q, k, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, p)
    cache_args, cache_flags = (cache or _NO_CACHE).kernel_args(k, q)
    # (KV_BATCH, K_START, PAGE_TABLE) and the kernel's paging (stride_ptb, page_size, num_kv_blocks)
    cache_ptrs, cache_paging = cache_args[:3], tuple(cache_args[3:])
    varlen = s["varlen"]
    k_varlen = cu_seqlens_k is not None  # else dense keys, also under packed queries (DENSE_K)
    nheads, nheads_kv = q.shape[-2], k.shape[-2]
    out, lse = alloc_fwd_outputs(q, v, varlen, out)
    if s["batch"] == 0 or p.max_seqlen_q == 0 or nheads == 0:
        return out, lse
    qk_scale, softcap_log2 = p.score_constants()
    grid = (ceil_div(p.max_seqlen_q, cfg.block_m) * s["batch"] * nheads,)  # (common.launch_order)
    extras = ()
    if p.chunk > 0 or qv is not None or descale is not None:
        extras = (p.chunk, qv if qv is not None else q, bshd_strides(qv if qv is not None else q, varlen))
    if descale is not None:
        extras += (*descale, tuple(st for t in descale for st in t.stride()))
    flash_fwd_kernel[grid](
        q, k, v, out, lse,
        (bshd_strides(q, varlen), bshd_strides(k, k_varlen), bshd_strides(v, k_varlen),
         bshd_strides(out, varlen), lse_strides(lse, varlen)),
        *s["ptrs"], (nheads, nheads_kv, *s["sizes"]),
        (qk_scale, softcap_log2, p.window_left, p.window_right, _sections(q, k, v, s, p)),
        *cache_ptrs, cache_paging, extras,
        FwdMeta(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, **s["flags"], **_common_flags(q, v, p, upcast),
                **cache_flags, DENSE_K=varlen and not k_varlen, HAS_CHUNK=p.chunk > 0, HAS_QV=qv is not None,
                FP8=descale is not None, WIDE_ROWS=wide_rows(p.max_seqlen_q, cfg.block_m, q, out, varlen)),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=FP_FUSION,
    )
    return out, lse


_NO_CACHE = CacheAddressing()


def launch_dq(q, k, v, dout, lse, delta, dq, s, p: AttnParams, cfg: BwdConfig, flags):
    """The separate dQ kernel (no atomics): one program per query block. ``s`` and ``flags``
    as ``_seq_args`` / ``_common_flags`` build them; ``delta`` has ``lse``'s shape and strides."""
    varlen = s["varlen"]
    nheads, nheads_kv = q.shape[-2], k.shape[-2]
    qk_scale, softcap_log2 = p.score_constants()
    bwd_dq_kernel[(ceil_div(p.max_seqlen_q, cfg.dq_block_m) * s["batch"] * nheads,)](
        q, k, v, dout, lse, delta, dq,
        (bshd_strides(q, varlen), bshd_strides(k, varlen), bshd_strides(v, varlen),
         bshd_strides(dout, varlen)),
        *lse_strides(lse, varlen), bshd_strides(dq, varlen),
        *s["ptrs"], (nheads, nheads_kv), *s["sizes"],
        (qk_scale, p.softmax_scale, softcap_log2, p.window_left, p.window_right,
         _sections(q, k, v, s, p)),
        BwdMeta(BLOCK_M=cfg.dq_block_m, BLOCK_N=cfg.dq_block_n, **s["flags"], **flags),
        num_warps=cfg.dq_warps, num_stages=cfg.dq_stages, enable_fp_fusion=FP_FUSION,
    )


def bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
        p: AttnParams, cfg: BwdConfig, deterministic: bool, upcast: bool,
        dq: Optional[torch.Tensor] = None, dk: Optional[torch.Tensor] = None,
        dv: Optional[torch.Tensor] = None):
    """Returns (dq, dk, dv). ``deterministic`` selects the separate dQ kernel (no atomics);
    otherwise dQ is accumulated with fp32 atomics inside the dK/dV kernel."""
    s = _seq_args(q, k, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, p)
    varlen = s["varlen"]
    nheads, nheads_kv = q.shape[-2], k.shape[-2]
    dq = alloc_output(q.shape, q.dtype, q.device) if dq is None else dq
    dk = alloc_output(k.shape, k.dtype, k.device) if dk is None else dk
    dv = alloc_output(v.shape, v.dtype, v.device) if dv is None else dv
    if s["batch"] == 0 or nheads == 0 or p.max_seqlen_q == 0 or p.max_seqlen_k == 0:
        # no query sees any key: every gradient is zero
        dq.zero_(), dk.zero_(), dv.zero_()
        return dq, dk, dv
    # rows a varlen batch leaves uncovered, keys no sequence owns and rows past seqused (a
    # dense batch's too) still get zeros
    if varlen or seqused_q is not None or seqused_k is not None:
        dq.zero_(), dk.zero_(), dv.zero_()
    qk_scale, softcap_log2 = p.score_constants()
    flags = _common_flags(q, v, p, upcast)
    lse_view = lse_strides(lse, varlen)

    delta = alloc_output(lse.shape, torch.float32, lse.device)
    pre_block = 64
    bwd_preprocess_kernel[(ceil_div(p.max_seqlen_q, pre_block) * s["batch"] * nheads,)](
        out, dout, delta, (bshd_strides(out, varlen), bshd_strides(dout, varlen), lse_view),
        s["ptrs"][0], s["ptrs"][2], nheads, p.max_seqlen_q, s["sizes"][2],
        HEADDIM_V=flags["HEADDIM_V"], BLOCK_M=pre_block, BLOCK_DV=flags["BLOCK_DV"],
        IS_VARLEN=varlen, HAS_SEQUSED_Q=s["flags"]["HAS_SEQUSED_Q"], enable_fp_fusion=FP_FUSION,
    )

    atomic_dq = not deterministic
    dq_accum = torch.zeros(q.shape, dtype=torch.float32, device=q.device) if atomic_dq else dq
    # one launch computing dK and dV, or (split_dkdv) a dV pass and a dK(+dQ) pass
    passes = [(True, False), (False, True)] if cfg.split_dkdv else [(True, True)]
    for do_dk, do_dv in passes:
        bwd_dkdv_kernel[(ceil_div(p.max_seqlen_k, cfg.dkdv_block_n) * s["batch"] * nheads_kv,)](
            q, k, v, dout, lse, delta, dq_accum, dk, dv,
            (bshd_strides(q, varlen), bshd_strides(k, varlen), bshd_strides(v, varlen),
             bshd_strides(dout, varlen), lse_view, bshd_strides(dq_accum, varlen),
             bshd_strides(dk, varlen), bshd_strides(dv, varlen)),
            *s["ptrs"], (nheads, nheads_kv, *s["sizes"]),
            (qk_scale, p.softmax_scale, softcap_log2, p.window_left, p.window_right),
            BwdMeta(BLOCK_M=cfg.dkdv_block_m, BLOCK_N=cfg.dkdv_block_n, **s["flags"], **flags,
                    ATOMIC_DQ=atomic_dq and do_dk, DO_DK=do_dk, DO_DV=do_dv),
            num_warps=cfg.dkdv_warps, num_stages=cfg.dkdv_stages, enable_fp_fusion=FP_FUSION,
        )
    if atomic_dq:
        dq.copy_(dq_accum)
    else:
        launch_dq(q, k, v, dout, lse, delta, dq, s, p, cfg, flags)
    return dq, dk, dv
