"""Portable Triton backward (FlashAttention-2 algorithm).

Three kernels:

* ``bwd_preprocess_kernel``: delta = rowsum(dO * O) in fp32, one program per query block.
* ``bwd_dkdv_kernel``: one program per key block (BLOCK_N keys) of one KV head. K and V stay
  on chip, dK and dV accumulate in fp32 registers over every query head of the GQA
  group and every query block that ``m_block_range`` says visits the key block; Q, dO, LSE
  and delta stream. Per query block: S = K Q^T, P = exp(S - lse), dV += P dO,
  dP = V dO^T, dS = P (dP - delta), dK += dS Q (4 matmuls). With ``ATOMIC_DQ`` it also does
  the 5th matmul, dQ += dS^T K, and adds it to an fp32 ``dq_accum`` with float atomics
  (fast, not bitwise reproducible). ``DO_DK`` / ``DO_DV`` split it into two launches, one
  accumulating dV only (S, dV: 2 matmuls) and one dK only (S, dP, dK [, dQ]): S is
  computed twice, but each program holds one BLOCK_N x D fp32 accumulator instead of two,
  which at head dim 256 is what lets a key block be large without spilling.
* ``bwd_dq_kernel``: one program per query block, dQ accumulated in registers over the
  visited key blocks, recomputing P and dS (3 matmuls); no atomics, so the deterministic
  backward is this kernel plus ``bwd_dkdv_kernel`` without ``ATOMIC_DQ``.

GQA: the dK/dV program of a KV head loops over its query heads itself, so dK/dV are summed
in registers in a fixed order: no extra buffer, no reduction kernel, deterministic.
"""
from typing import NamedTuple

import triton
import triton.language as tl

from .common import launch_order, m_block_range, n_block_range, seqlen_info, tanh, to_output, visible


class BwdMeta(NamedTuple):
    """The compile-time constants (``META``) of ``bwd_dkdv_kernel`` and ``bwd_dq_kernel``: head
    dims and their power-of-two tiles, the (BLOCK_M, BLOCK_N) tile, the feature flags, and the
    dK/dV kernel's modes (ATOMIC_DQ, DO_DK, DO_DV; the dQ kernel leaves them as they are)."""
    HEADDIM: int
    HEADDIM_V: int
    BLOCK_M: int
    BLOCK_N: int
    BLOCK_D: int
    BLOCK_DV: int
    IS_VARLEN: bool
    HAS_SEQUSED_Q: bool
    HAS_SEQUSED_K: bool
    HAS_LEFT: bool
    HAS_RIGHT: bool
    SOFTCAP: bool
    UPCAST: bool
    ATOMIC_DQ: bool = False
    DO_DK: bool = True
    DO_DV: bool = True


@triton.jit
def bwd_preprocess_kernel(
    O, DO, DELTA, strides, cu_seqlens_q, seqused_q, nheads, seqlen_q, total_q,
    HEADDIM_V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_SEQUSED_Q: tl.constexpr,
):
    # strides: the (batch, token, head) strides of O, DO and DELTA
    stride_o, stride_do, stride_delta = strides
    stride_ob, stride_om, stride_oh = stride_o
    stride_dob, stride_dom, stride_doh = stride_do
    stride_deltab, stride_deltah, stride_deltam = stride_delta
    bh, m_block = launch_order(tl.program_id(0), tl.cdiv(seqlen_q, BLOCK_M), 1)
    batch = bh // nheads
    head = bh % nheads
    start_q, len_q, _, _ = seqlen_info(batch, seqlen_q, 0, total_q, 0, cu_seqlens_q, cu_seqlens_q,
                                       seqused_q, seqused_q, IS_VARLEN, HAS_SEQUSED_Q, False)
    if m_block * BLOCK_M >= len_q:
        return
    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask = (offs_m[:, None] < len_q) & (offs_dv[None, :] < HEADDIM_V)
    o = tl.load(O + batch.to(tl.int64) * stride_ob + head.to(tl.int64) * stride_oh
                + (start_q + offs_m[:, None]).to(tl.int64) * stride_om + offs_dv[None, :],
                mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DO + batch.to(tl.int64) * stride_dob + head.to(tl.int64) * stride_doh
                 + (start_q + offs_m[:, None]).to(tl.int64) * stride_dom + offs_dv[None, :],
                 mask=mask, other=0.0).to(tl.float32)
    delta = tl.sum(o * do, 1)
    tl.store(DELTA + batch.to(tl.int64) * stride_deltab + head.to(tl.int64) * stride_deltah
             + (start_q + offs_m).to(tl.int64) * stride_deltam, delta, mask=offs_m < len_q)


@triton.jit
def _dkdv_inner(dk, dv, k, v, q_base, do_base, dq_base, lse_base, delta_base, row_strides,
                m_lo, m_hi, offs_n, offs_d, offs_dv, len_q, len_k, scalars,
                MASK: tl.constexpr, META: tl.constexpr):
    """Query blocks m_lo .. m_hi - 1 into (dk, dv). ``row_strides``: the token strides
    (stride_qm, stride_dom, stride_dqm, stride_lsem); ``scalars``: the kernel's."""
    stride_qm, stride_dom, stride_dqm, stride_lsem = row_strides
    qk_scale, softmax_scale, softcap_log2, window_left, window_right = scalars
    HEADDIM: tl.constexpr = META.HEADDIM
    HEADDIM_V: tl.constexpr = META.HEADDIM_V
    BLOCK_M: tl.constexpr = META.BLOCK_M
    HAS_LEFT: tl.constexpr = META.HAS_LEFT
    HAS_RIGHT: tl.constexpr = META.HAS_RIGHT
    SOFTCAP: tl.constexpr = META.SOFTCAP
    ATOMIC_DQ: tl.constexpr = META.ATOMIC_DQ
    DO_DK: tl.constexpr = META.DO_DK
    DO_DV: tl.constexpr = META.DO_DV
    UPCAST: tl.constexpr = META.UPCAST
    offs_m0 = tl.arange(0, BLOCK_M)
    d_ok = offs_d < HEADDIM
    dv_ok = offs_dv < HEADDIM_V
    for m_block in range(m_lo, m_hi):
        start_m = m_block * BLOCK_M
        offs_m = start_m + offs_m0
        row_ok = offs_m < len_q
        q = tl.load(q_base + start_m.to(tl.int64) * stride_qm + offs_m0[:, None] * stride_qm + offs_d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        do = tl.load(do_base + start_m.to(tl.int64) * stride_dom + offs_m0[:, None] * stride_dom + offs_dv[None, :],
                     mask=row_ok[:, None] & dv_ok[None, :], other=0.0)
        # lse in log2 units; rows past the sequence (and rows that saw no key) get +inf so P = 0
        lse = tl.load(lse_base + offs_m.to(tl.int64) * stride_lsem, mask=row_ok, other=float("inf"))
        lse = tl.where(lse == float("-inf"), float("inf"), lse) * 1.4426950408889634
        if UPCAST:
            q = q.to(tl.float32)
            do = do.to(tl.float32)
        qkT = tl.dot(k, tl.trans(q))  # (BLOCK_N, BLOCK_M)
        if SOFTCAP:
            t = tanh(qkT * qk_scale)
            sT = t * softcap_log2
        else:
            sT = qkT * qk_scale
        pT = tl.exp2(sT - lse[None, :])
        if MASK:
            pT = tl.where(visible(offs_m[None, :], offs_n[:, None], len_q, len_k,
                                  window_left, window_right, HAS_LEFT, HAS_RIGHT), pT, 0.0)
        if DO_DV:
            dv += tl.dot(pT.to(do.dtype), do)
        if DO_DK:
            delta = tl.load(delta_base + offs_m.to(tl.int64) * stride_lsem, mask=row_ok, other=0.0)
            dpT = tl.dot(v, tl.trans(do))
            dsT = pT * (dpT - delta[None, :])
            if SOFTCAP:
                dsT = dsT * (1.0 - t * t)
            dsT = dsT.to(q.dtype)
            dk += tl.dot(dsT, q)
            if ATOMIC_DQ:
                dq = tl.dot(tl.trans(dsT), k) * softmax_scale
                tl.atomic_add(dq_base + offs_m[:, None].to(tl.int64) * stride_dqm + offs_d[None, :], dq,
                              mask=row_ok[:, None] & d_ok[None, :], sem="relaxed")
    return dk, dv


@triton.jit
def bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DQ_ACCUM, DK, DV, strides,
    cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, sizes, scalars,
    META: tl.constexpr,
):
    # strides: the (batch, token, head) strides of Q, K, V, DO, LSE (DELTA's too), DQ_ACCUM,
    # DK and DV; sizes: (nheads, nheads_kv, seqlen_q, seqlen_k, total_q, total_k);
    # scalars: (qk_scale, softmax_scale, softcap_log2, window_left, window_right);
    # META: a BwdMeta.
    stride_q, stride_k, stride_v, stride_do, stride_lse, stride_dq, stride_dk, stride_dv = strides
    stride_qb, stride_qm, stride_qh = stride_q
    stride_kb, stride_kn, stride_kh = stride_k
    stride_vb, stride_vn, stride_vh = stride_v
    stride_dob, stride_dom, stride_doh = stride_do
    stride_lseb, stride_lseh, stride_lsem = stride_lse
    stride_dqb, stride_dqm, stride_dqh = stride_dq
    stride_dkb, stride_dkn, stride_dkh = stride_dk
    stride_dvb, stride_dvn, stride_dvh = stride_dv
    nheads, nheads_kv, seqlen_q, seqlen_k, total_q, total_k = sizes
    qk_scale, softmax_scale, softcap_log2, window_left, window_right = scalars
    HEADDIM: tl.constexpr = META.HEADDIM
    HEADDIM_V: tl.constexpr = META.HEADDIM_V
    BLOCK_M: tl.constexpr = META.BLOCK_M
    BLOCK_N: tl.constexpr = META.BLOCK_N
    BLOCK_D: tl.constexpr = META.BLOCK_D
    BLOCK_DV: tl.constexpr = META.BLOCK_DV
    HAS_LEFT: tl.constexpr = META.HAS_LEFT
    HAS_RIGHT: tl.constexpr = META.HAS_RIGHT
    DO_DK: tl.constexpr = META.DO_DK
    DO_DV: tl.constexpr = META.DO_DV
    UPCAST: tl.constexpr = META.UPCAST
    bh, n_block = launch_order(tl.program_id(0), tl.cdiv(seqlen_k, BLOCK_N), 1)  # seqlen_k: the longest
    batch = bh // nheads_kv
    head_kv = bh % nheads_kv
    group = nheads // nheads_kv
    start_q, len_q, start_k, len_k = seqlen_info(
        batch, seqlen_q, seqlen_k, total_q, total_k, cu_seqlens_q, cu_seqlens_k,
        seqused_q, seqused_k, META.IS_VARLEN, META.HAS_SEQUSED_Q, META.HAS_SEQUSED_K)
    if n_block * BLOCK_N >= len_k:
        return

    offs_n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    col_ok = offs_n < len_k
    k_ptrs = (K + batch.to(tl.int64) * stride_kb + head_kv.to(tl.int64) * stride_kh
              + (start_k + offs_n[:, None]).to(tl.int64) * stride_kn + offs_d[None, :])
    v_ptrs = (V + batch.to(tl.int64) * stride_vb + head_kv.to(tl.int64) * stride_vh
              + (start_k + offs_n[:, None]).to(tl.int64) * stride_vn + offs_dv[None, :])
    k = tl.load(k_ptrs, mask=col_ok[:, None] & (offs_d[None, :] < HEADDIM), other=0.0)
    if DO_DK:
        v = tl.load(v_ptrs, mask=col_ok[:, None] & (offs_dv[None, :] < HEADDIM_V), other=0.0)
    else:
        v = k  # unused: the dV-only pass never forms dP
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    # a pass that skips dK (or dV) carries a 1x1 placeholder instead of a BLOCK_N x D tile
    if DO_DK:
        dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    else:
        dk = tl.zeros([1, 1], dtype=tl.float32)
    if DO_DV:
        dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    else:
        dv = tl.zeros([1, 1], dtype=tl.float32)
    m_min, m_full_min, m_full_max, m_max = m_block_range(
        n_block, len_q, len_k, window_left, window_right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)

    row_strides = (stride_qm, stride_dom, stride_dqm, stride_lsem)
    for g in range(0, group):
        head = head_kv * group + g
        q_base = (Q + batch.to(tl.int64) * stride_qb + head.to(tl.int64) * stride_qh
                  + start_q.to(tl.int64) * stride_qm)
        do_base = (DO + batch.to(tl.int64) * stride_dob + head.to(tl.int64) * stride_doh
                   + start_q.to(tl.int64) * stride_dom)
        dq_base = (DQ_ACCUM + batch.to(tl.int64) * stride_dqb + head.to(tl.int64) * stride_dqh
                   + start_q.to(tl.int64) * stride_dqm)
        lse_base = (LSE + batch.to(tl.int64) * stride_lseb + head.to(tl.int64) * stride_lseh
                    + start_q.to(tl.int64) * stride_lsem)
        delta_base = (DELTA + batch.to(tl.int64) * stride_lseb + head.to(tl.int64) * stride_lseh
                      + start_q.to(tl.int64) * stride_lsem)
        dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, dq_base, lse_base, delta_base, row_strides,
                             m_min, m_full_min, offs_n, offs_d, offs_dv, len_q, len_k, scalars, True, META)
        dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, dq_base, lse_base, delta_base, row_strides,
                             m_full_min, m_full_max, offs_n, offs_d, offs_dv, len_q, len_k, scalars, False, META)
        dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, dq_base, lse_base, delta_base, row_strides,
                             m_full_max, m_max, offs_n, offs_d, offs_dv, len_q, len_k, scalars, True, META)

    dk = dk * softmax_scale
    dk_ptrs = (DK + batch.to(tl.int64) * stride_dkb + head_kv.to(tl.int64) * stride_dkh
               + (start_k + offs_n[:, None]).to(tl.int64) * stride_dkn + offs_d[None, :])
    dv_ptrs = (DV + batch.to(tl.int64) * stride_dvb + head_kv.to(tl.int64) * stride_dvh
               + (start_k + offs_n[:, None]).to(tl.int64) * stride_dvn + offs_dv[None, :])
    if DO_DK:
        tl.store(dk_ptrs, to_output(dk, DK.dtype.element_ty, UPCAST), mask=col_ok[:, None] & (offs_d[None, :] < HEADDIM))
    if DO_DV:
        tl.store(dv_ptrs, to_output(dv, DV.dtype.element_ty, UPCAST), mask=col_ok[:, None] & (offs_dv[None, :] < HEADDIM_V))


@triton.jit
def _dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_k, stride_v,
              n_lo, n_hi, offs_m, offs_d, offs_dv, len_q, len_k, scalars,
              MASK: tl.constexpr, META: tl.constexpr):
    """Key blocks n_lo .. n_hi - 1 into dq. ``stride_k`` / ``stride_v``, ``scalars``: the
    kernel's."""
    _, stride_kn, _ = stride_k
    _, stride_vn, _ = stride_v
    qk_scale, _, softcap_log2, window_left, window_right, _ = scalars
    HEADDIM: tl.constexpr = META.HEADDIM
    HEADDIM_V: tl.constexpr = META.HEADDIM_V
    BLOCK_N: tl.constexpr = META.BLOCK_N
    HAS_LEFT: tl.constexpr = META.HAS_LEFT
    HAS_RIGHT: tl.constexpr = META.HAS_RIGHT
    SOFTCAP: tl.constexpr = META.SOFTCAP
    UPCAST: tl.constexpr = META.UPCAST
    offs_n0 = tl.arange(0, BLOCK_N)
    d_ok = offs_d < HEADDIM
    dv_ok = offs_dv < HEADDIM_V
    for n_block in range(n_lo, n_hi):
        start_n = n_block * BLOCK_N
        offs_n = start_n + offs_n0
        col_ok = offs_n < len_k
        k = tl.load(k_base + start_n.to(tl.int64) * stride_kn + offs_n0[:, None] * stride_kn + offs_d[None, :],
                    mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        v = tl.load(v_base + start_n.to(tl.int64) * stride_vn + offs_n0[:, None] * stride_vn + offs_dv[None, :],
                    mask=col_ok[:, None] & dv_ok[None, :], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        qk = tl.dot(q, tl.trans(k))
        if SOFTCAP:
            t = tanh(qk * qk_scale)
            s = t * softcap_log2
        else:
            s = qk * qk_scale
        p = tl.exp2(s - lse[:, None])
        if MASK:
            p = tl.where(visible(offs_m[:, None], offs_n[None, :], len_q, len_k,
                                 window_left, window_right, HAS_LEFT, HAS_RIGHT), p, 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - t * t)
        dq += tl.dot(ds.to(k.dtype), k)
    return dq


# Sequence lengths (and the lse strides derived from seqlen_q) are not specialized: with
# head dim 96 (BLOCK_D 128) and seqlen_q a multiple of 16, the variant Triton 3.6 builds for
# sm90 faulted with "misaligned address" on the H200 (scripts/fault_repro.py;
# ``benchmarks/results/gpu-tests-5387ddb.txt.gz`` at fb45c0d); the unspecialized variant is
# the one that ran correctly for seqlen_q 113, 239, 799.
@triton.jit(do_not_specialize=["stride_lseb", "stride_lseh", "seqlen_q", "seqlen_k", "total_q", "total_k"])
def bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, strides,
    stride_lseb, stride_lseh, stride_lsem, stride_dq,
    cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
    heads, seqlen_q, seqlen_k, total_q, total_k, scalars,
    META: tl.constexpr,
):
    # strides: the (batch, token, head) strides of Q, K, V and DO; then LSE's (DELTA's too;
    # flat, for do_not_specialize) and DQ's; heads: (nheads, nheads_kv); scalars: (qk_scale,
    # softmax_scale, softcap_log2, window_left, window_right, section_heads); META: a BwdMeta.
    stride_q, stride_k, stride_v, stride_do = strides
    stride_qb, stride_qm, stride_qh = stride_q
    stride_kb, stride_kn, stride_kh = stride_k
    stride_vb, stride_vn, stride_vh = stride_v
    stride_dob, stride_dom, stride_doh = stride_do
    stride_dqb, stride_dqm, stride_dqh = stride_dq
    nheads, nheads_kv = heads
    qk_scale, softmax_scale, softcap_log2, window_left, window_right, section_heads = scalars
    HEADDIM: tl.constexpr = META.HEADDIM
    HEADDIM_V: tl.constexpr = META.HEADDIM_V
    BLOCK_M: tl.constexpr = META.BLOCK_M
    BLOCK_N: tl.constexpr = META.BLOCK_N
    BLOCK_D: tl.constexpr = META.BLOCK_D
    BLOCK_DV: tl.constexpr = META.BLOCK_DV
    HAS_LEFT: tl.constexpr = META.HAS_LEFT
    HAS_RIGHT: tl.constexpr = META.HAS_RIGHT
    UPCAST: tl.constexpr = META.UPCAST
    num_m = tl.cdiv(seqlen_q, BLOCK_M)  # seqlen_q: the longest sequence's length
    bh, rank = launch_order(tl.program_id(0), num_m, section_heads)
    m_block = num_m - 1 - rank
    batch = bh // nheads
    head = bh % nheads
    head_kv = head // (nheads // nheads_kv)
    start_q, len_q, start_k, len_k = seqlen_info(
        batch, seqlen_q, seqlen_k, total_q, total_k, cu_seqlens_q, cu_seqlens_k,
        seqused_q, seqused_k, META.IS_VARLEN, META.HAS_SEQUSED_Q, META.HAS_SEQUSED_K)
    if m_block * BLOCK_M >= len_q:
        return
    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < len_q
    row_off = (start_q + offs_m[:, None]).to(tl.int64)
    q = tl.load(Q + batch.to(tl.int64) * stride_qb + head.to(tl.int64) * stride_qh
                + row_off * stride_qm + offs_d[None, :],
                mask=row_ok[:, None] & (offs_d[None, :] < HEADDIM), other=0.0)
    do = tl.load(DO + batch.to(tl.int64) * stride_dob + head.to(tl.int64) * stride_doh
                 + row_off * stride_dom + offs_dv[None, :],
                 mask=row_ok[:, None] & (offs_dv[None, :] < HEADDIM_V), other=0.0)
    lse_off = (batch.to(tl.int64) * stride_lseb + head.to(tl.int64) * stride_lseh
               + (start_q + offs_m).to(tl.int64) * stride_lsem)
    lse = tl.load(LSE + lse_off, mask=row_ok, other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse) * 1.4426950408889634
    delta = tl.load(DELTA + lse_off, mask=row_ok, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    k_base = (K + batch.to(tl.int64) * stride_kb + head_kv.to(tl.int64) * stride_kh
              + start_k.to(tl.int64) * stride_kn)
    v_base = (V + batch.to(tl.int64) * stride_vb + head_kv.to(tl.int64) * stride_vh
              + start_k.to(tl.int64) * stride_vn)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    n_min, n_full_min, n_full_max, n_max = n_block_range(
        m_block, len_q, len_k, window_left, window_right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    dq = _dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_k, stride_v,
                   n_min, n_full_min, offs_m, offs_d, offs_dv, len_q, len_k, scalars, True, META)
    dq = _dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_k, stride_v,
                   n_full_min, n_full_max, offs_m, offs_d, offs_dv, len_q, len_k, scalars, False, META)
    dq = _dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_k, stride_v,
                   n_full_max, n_max, offs_m, offs_d, offs_dv, len_q, len_k, scalars, True, META)
    dq = dq * softmax_scale
    tl.store(DQ + batch.to(tl.int64) * stride_dqb + head.to(tl.int64) * stride_dqh
             + row_off * stride_dqm + offs_d[None, :], to_output(dq, DQ.dtype.element_ty, UPCAST),
             mask=row_ok[:, None] & (offs_d[None, :] < HEADDIM))
