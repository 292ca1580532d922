"""Portable Triton forward (FlashAttention-2 algorithm), every GPU Triton targets and the CPU
interpreter.

One program computes one query block (BLOCK_M rows) of one (batch, head):

* registers: the Q tile (BLOCK_M x D), the fp32 output accumulator (BLOCK_M x DV), the
  running max ``m_i`` and sum ``l_i`` (online softmax, base 2);
* streamed: K and V tiles (BLOCK_N x D / DV) of the key blocks that ``n_block_range`` says
  the query block visits; Triton software-pipelines them through shared memory;
* HBM writes: O (BLOCK_M x DV in the input dtype) and the natural-log LSE (fp32).

Cost per program: 2 * BLOCK_M * visited_keys * (D + DV) FLOPs; reads Q once and each
visited K/V tile once. Key blocks are split into masked edges and an unmasked middle so the
common case pays no masking arithmetic.

FlashAttention-3's two forward-only extras travel in the launch's ``extras`` tuple, empty
without them: ``attention_chunk`` (``HAS_CHUNK``: each row sees only its position's chunk of
keys, ``common.in_chunk``) and ``qv`` (``HAS_QV``: scores q k^T + qv v^T, MLA's absorbed
form; the qv tile (BLOCK_M x DV) stays in registers beside Q and meets each V tile already
loaded for P V).

FlashAttention-3's fp8 inputs (``FP8``, float8_e4m3fn q / k / v, forward only): every tile is
converted to fp16 as it is loaded (exact: e4m3's values are fp16 values), so the products
run in fp16 with fp32 accumulation and P V takes P in fp16; the per-(sequence, KV head)
descales (``extras[3:7]``) fold into the score scale (q_descale x k_descale) and the output
(v_descale); the output is bf16.
"""
from typing import NamedTuple

import triton
import triton.language as tl

from .common import (cache_bases, cache_batch, chunk_block_range, fp8_descales, in_chunk, launch_order, n_block_range,
                     paged_rows, scores, seqlen_info, softmax_step, to_output, visible)


class FwdMeta(NamedTuple):
    """``flash_fwd_kernel``'s compile-time constants (its ``META``): head dims and their
    power-of-two tiles, the (BLOCK_M, BLOCK_N) tile, and the feature flags."""
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
    HAS_KV_BATCH: bool = False
    HAS_K_START: bool = False
    PAGED: bool = False
    DENSE_K: bool = False
    HAS_CHUNK: bool = False
    HAS_QV: bool = False
    WIDE_ROWS: bool = False  # a Q / O row offset inside a sequence may pass 2^31 elements (``wide_rows``)
    FP8: bool = False  # float8_e4m3fn inputs, converted to fp16 as loaded; descales in ``extras``


@triton.jit
def _fwd_inner(acc, m_i, l_i, q, qv, k_base, v_base, stride_k, stride_v,
               n_lo, n_hi, offs_m, offs_d, offs_dv, len_q, len_k, scalars, pages, extras,
               MASK: tl.constexpr, META: tl.constexpr):
    """Key blocks n_lo .. n_hi - 1 into (acc, m_i, l_i). ``stride_k`` / ``stride_v``,
    ``scalars``, ``extras``: the kernel's; ``pages``: (page_row, start_k, page_size,
    num_kv_blocks), where paged K/V rows live (read only under PAGED); ``qv``: the qv tile
    (read only under HAS_QV)."""
    stride_kb, stride_kn, _ = stride_k
    stride_vb, stride_vn, _ = stride_v
    qk_scale, softcap_log2, window_left, window_right, _ = scalars
    page_row, start_k, page_size, num_blocks = pages
    HEADDIM: tl.constexpr = META.HEADDIM
    HEADDIM_V: tl.constexpr = META.HEADDIM_V
    BLOCK_N: tl.constexpr = META.BLOCK_N
    HAS_LEFT: tl.constexpr = META.HAS_LEFT
    HAS_RIGHT: tl.constexpr = META.HAS_RIGHT
    SOFTCAP: tl.constexpr = META.SOFTCAP
    UPCAST: tl.constexpr = META.UPCAST
    PAGED: tl.constexpr = META.PAGED
    offs_n0 = tl.arange(0, BLOCK_N)
    d_ok = offs_d < HEADDIM
    dv_ok = offs_dv < HEADDIM_V
    for n_block in range(n_lo, n_hi):
        start_n = n_block * BLOCK_N
        offs_n = start_n + offs_n0
        if PAGED:  # one page-table load per key block serves K and V
            blk, row = paged_rows(page_row, start_k + offs_n, offs_n < len_k, page_size, num_blocks)
            k_ptrs = k_base + (blk * stride_kb + row * stride_kn)[:, None] + offs_d[None, :]
            v_ptrs = v_base + (blk * stride_vb + row * stride_vn)[:, None] + offs_dv[None, :]
        else:
            k_ptrs = k_base + start_n.to(tl.int64) * stride_kn + offs_n0[:, None] * stride_kn + offs_d[None, :]
            v_ptrs = v_base + start_n.to(tl.int64) * stride_vn + offs_n0[:, None] * stride_vn + offs_dv[None, :]
        if MASK:
            k = tl.load(k_ptrs, mask=(offs_n[:, None] < len_k) & d_ok[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=(offs_n[:, None] < len_k) & dv_ok[None, :], other=0.0)
        else:
            k = tl.load(k_ptrs, mask=d_ok[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=dv_ok[None, :], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        elif META.FP8:
            k = k.to(tl.float16)
            v = v.to(tl.float16)
        qk = tl.dot(q, tl.trans(k))
        if META.HAS_QV:
            qk = tl.dot(qv, tl.trans(v), qk)
        if MASK:
            s = scores(qk, qk_scale, softcap_log2, SOFTCAP)
            seen = visible(offs_m[:, None], offs_n[None, :], len_q, len_k,
                           window_left, window_right, HAS_LEFT, HAS_RIGHT)
            if META.HAS_CHUNK:
                seen = seen & in_chunk(offs_m[:, None], offs_n[None, :], len_q, len_k, extras[0])
            s = tl.where(seen, s, float("-inf"))
            acc, m_i, l_i = softmax_step(acc, m_i, l_i, s, v)
        else:
            # Every row sees every key here, so each row's max is finite. Without softcap the
            # scale is applied inside exp2's argument (one FMA per score: max(qk) * scale is
            # the max of the scaled scores, scale > 0).
            if SOFTCAP:
                s = scores(qk, qk_scale, softcap_log2, SOFTCAP)
                m_new = tl.maximum(m_i, tl.max(s, 1))
            else:
                m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            # (Rescaling only when a row's max grew by more than 2^8, FlashAttention-4's
            # conditional rescale, measured slower here at every head dim: the branch breaks
            # Triton's software pipeline; benchmarks/results/sweep-h200-25aaea1.json.gz.)
            alpha = tl.exp2(m_i - m_new)
            acc = acc * alpha[:, None]
            l_i = l_i * alpha
            m_i = m_new
            if SOFTCAP:
                p = tl.exp2(s - m_i[:, None])
            else:
                p = tl.exp2(qk * qk_scale - m_i[:, None])
            l_i = l_i + tl.sum(p, 1)
            acc = acc + tl.dot(p.to(v.dtype), v)
    return acc, m_i, l_i


@triton.jit
def flash_fwd_kernel(
    Q, K, V, O, LSE, strides,
    cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, sizes, scalars,
    KV_BATCH, K_START, PAGE_TABLE, paging, extras,
    META: tl.constexpr,
):
    # strides: the (batch, token, head) strides of Q, K, V, O and LSE (problem.bshd_strides,
    # lse_strides); sizes: (nheads, nheads_kv, seqlen_q, seqlen_k, total_q, total_k);
    # scalars: (qk_scale, softcap_log2, window_left, window_right, section_heads);
    # paging: (stride_ptb, page_size, num_kv_blocks); extras: () or, under HAS_CHUNK, HAS_QV
    # or FP8, (attention_chunk, QV, (batch, token, head) strides of QV), under FP8 followed by
    # the descales (Q_DESCALE, K_DESCALE, V_DESCALE, their (batch, head) strides as one
    # 6-tuple); META: an FwdMeta.
    stride_q, stride_k, stride_v, stride_o, stride_lse = strides
    stride_qb, stride_qm, stride_qh = stride_q
    stride_ob, stride_om, stride_oh = stride_o
    stride_lseb, stride_lseh, stride_lsem = stride_lse
    nheads, nheads_kv, seqlen_q, seqlen_k, total_q, total_k = sizes
    qk_scale, softcap_log2, window_left, window_right, section_heads = scalars
    stride_ptb, page_size, num_kv_blocks = paging
    HEADDIM: tl.constexpr = META.HEADDIM
    HEADDIM_V: tl.constexpr = META.HEADDIM_V
    BLOCK_M: tl.constexpr = META.BLOCK_M
    BLOCK_N: tl.constexpr = META.BLOCK_N
    BLOCK_D: tl.constexpr = META.BLOCK_D
    BLOCK_DV: tl.constexpr = META.BLOCK_DV
    HAS_LEFT: tl.constexpr = META.HAS_LEFT
    HAS_RIGHT: tl.constexpr = META.HAS_RIGHT
    UPCAST: tl.constexpr = META.UPCAST
    PAGED: tl.constexpr = META.PAGED
    # KV-cache addressing (flash_attn_with_kvcache): KV_BATCH[b] the cache batch of sequence
    # b (cache_batch_idx), K_START[b] its first key (cache_leftpad), PAGED: K and V are
    # (num_kv_blocks, page_size, heads, dim) blocks found through PAGE_TABLE (batch, pages);
    # DENSE_K: packed (varlen) queries over such a dense cache. Off, the pointers are never read.
    # Longest (under causal, last) query blocks first, a few heads at a time (launch_order).
    num_m = tl.cdiv(seqlen_q, BLOCK_M)  # seqlen_q: the longest sequence's length
    bh, rank = launch_order(tl.program_id(0), num_m, section_heads)
    m_block = num_m - 1 - rank
    batch = bh // nheads
    head = bh % nheads
    head_kv = head // (nheads // nheads_kv)
    start_q, len_q, start_k, len_k = seqlen_info(
        batch, seqlen_q, seqlen_k, total_q, total_k, cu_seqlens_q, cu_seqlens_k,
        seqused_q, seqused_k, META.IS_VARLEN, META.HAS_SEQUSED_Q, META.HAS_SEQUSED_K, META.DENSE_K)
    kv_batch = cache_batch(KV_BATCH, batch, num_kv_blocks, META.HAS_KV_BATCH)
    if META.HAS_K_START:  # keys start_k .. start_k + len_k - 1 of the cache (left padding skipped)
        skip = tl.minimum(tl.maximum(tl.load(K_START + batch), 0), len_k)
        start_k += skip
        len_k -= skip
    if m_block * BLOCK_M >= len_q:
        return

    rows = tl.arange(0, BLOCK_M)
    offs_m = m_block * BLOCK_M + rows
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < len_q
    # Q / O rows: the sequence's first in 64 bits, the block's inside it in 32; under
    # WIDE_ROWS (a row offset inside the sequence can pass 2^31 elements) the block's first
    # row in 64 bits, the rows inside the block in 32
    if META.WIDE_ROWS:
        first_row = start_q + m_block * BLOCK_M
        block_rows = rows
    else:
        first_row = start_q
        block_rows = offs_m
    q_base = (Q + batch.to(tl.int64) * stride_qb + head.to(tl.int64) * stride_qh
              + first_row.to(tl.int64) * stride_qm)
    k_base, v_base = cache_bases(K, V, kv_batch, head_kv, start_k, stride_k, stride_v, PAGED)
    page_row = PAGE_TABLE + batch.to(tl.int64) * stride_ptb
    q = tl.load(q_base + block_rows[:, None] * stride_qm + offs_d[None, :],
                mask=row_ok[:, None] & (offs_d[None, :] < HEADDIM), other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    elif META.FP8:
        q = q.to(tl.float16)
    v_descale = 1.0
    if META.FP8:  # (sequence, KV head) descales: q's and k's scale the scores, v's the output
        qk_descale, v_descale = fp8_descales(extras[3:], batch, head_kv)
        scalars = (qk_scale * qk_descale, softcap_log2, window_left, window_right, section_heads)
    qv = q  # (read only under HAS_QV)
    if META.HAS_QV:
        stride_qvb, stride_qvm, stride_qvh = extras[2]
        qv_base = (extras[1] + batch.to(tl.int64) * stride_qvb + head.to(tl.int64) * stride_qvh
                   + (start_q + m_block * BLOCK_M).to(tl.int64) * stride_qvm)
        qv = tl.load(qv_base + rows[:, None] * stride_qvm + offs_dv[None, :],
                     mask=row_ok[:, None] & (offs_dv[None, :] < HEADDIM_V), other=0.0)
        if UPCAST:
            qv = qv.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    n_min, n_full_min, n_full_max, n_max = n_block_range(
        m_block, len_q, len_k, window_left, window_right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    if META.HAS_CHUNK:
        pos = m_block * BLOCK_M + len_k - len_q
        n_min, n_full_min, n_full_max, n_max = chunk_block_range(
            pos, pos + BLOCK_M - 1, extras[0], n_min, n_full_min, n_full_max, n_max, BLOCK_N)
    # masked left edge (sliding window), unmasked middle, masked right edge (causal/tail)
    pages = (page_row, start_k, page_size, num_kv_blocks)
    acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, qv, k_base, v_base, stride_k, stride_v,
                               n_min, n_full_min, offs_m, offs_d, offs_dv, len_q, len_k,
                               scalars, pages, extras, True, META)
    acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, qv, k_base, v_base, stride_k, stride_v,
                               n_full_min, n_full_max, offs_m, offs_d, offs_dv, len_q, len_k,
                               scalars, pages, extras, False, META)
    acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, qv, k_base, v_base, stride_k, stride_v,
                               n_full_max, n_max, offs_m, offs_d, offs_dv, len_q, len_k,
                               scalars, pages, extras, True, META)

    # A row that saw no key: output 0, lse = -inf (never NaN).
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc / l_safe[:, None]
    if META.FP8:
        out = out * v_descale
    lse = tl.where(seen, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))

    o_base = (O + batch.to(tl.int64) * stride_ob + head.to(tl.int64) * stride_oh
              + first_row.to(tl.int64) * stride_om)
    tl.store(o_base + block_rows[:, None] * stride_om + offs_dv[None, :], to_output(out, O.dtype.element_ty, UPCAST),
             mask=row_ok[:, None] & (offs_dv[None, :] < HEADDIM_V))
    lse_base = LSE + batch.to(tl.int64) * stride_lseb + head.to(tl.int64) * stride_lseh
    tl.store(lse_base + (start_q + offs_m).to(tl.int64) * stride_lsem, lse, mask=row_ok)
