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
"""
import triton
import triton.language as tl

from .common import (cache_batch, launch_order, n_block_range, paged_rows, scores, seqlen_info,
                     softmax_step, to_output, visible)


@triton.jit
def _fwd_inner(acc, m_i, l_i, q, k_base, v_base, stride_kn, stride_vn,
               n_lo, n_hi, offs_m, offs_d, offs_dv, len_q, len_k,
               window_left, window_right, qk_scale, softcap_log2,
               page_row, start_k, page_size, num_blocks, stride_kb, stride_vb,
               HEADDIM: tl.constexpr, HEADDIM_V: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
               MASK: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
               SOFTCAP: tl.constexpr, UPCAST: tl.constexpr, PAGED: tl.constexpr):
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
        qk = tl.dot(q, tl.trans(k))
        if MASK:
            s = scores(qk, qk_scale, softcap_log2, SOFTCAP)
            s = tl.where(visible(offs_m[:, None], offs_n[None, :], len_q, len_k,
                                 window_left, window_right, HAS_LEFT, HAS_RIGHT), s, float("-inf"))
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
    Q, K, V, O, LSE,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_ob, stride_om, stride_oh,
    stride_lseb, stride_lseh, stride_lsem,
    cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
    nheads, nheads_kv, seqlen_q, seqlen_k, total_q, total_k,
    qk_scale, softcap_log2, window_left, window_right, section_heads,
    KV_BATCH, K_START, PAGE_TABLE, stride_ptb, page_size, num_kv_blocks,
    HEADDIM: tl.constexpr, HEADDIM_V: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_SEQUSED_Q: tl.constexpr, HAS_SEQUSED_K: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
    UPCAST: tl.constexpr, HAS_KV_BATCH: tl.constexpr = False, HAS_K_START: tl.constexpr = False,
    PAGED: tl.constexpr = False, DENSE_K: tl.constexpr = False,
):
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
        seqused_q, seqused_k, IS_VARLEN, HAS_SEQUSED_Q, HAS_SEQUSED_K, DENSE_K)
    kv_batch = cache_batch(KV_BATCH, batch, num_kv_blocks, HAS_KV_BATCH)
    if HAS_K_START:  # keys start_k .. start_k + len_k - 1 of the cache (left padding skipped)
        skip = tl.minimum(tl.maximum(tl.load(K_START + batch), 0), len_k)
        start_k += skip
        len_k -= skip
    if m_block * BLOCK_M >= len_q:
        return

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < len_q
    q_base = (Q + batch.to(tl.int64) * stride_qb + head.to(tl.int64) * stride_qh
              + start_q.to(tl.int64) * stride_qm)
    if PAGED:  # rows found per key block (_paged_rows)
        k_base = K + head_kv.to(tl.int64) * stride_kh
        v_base = V + head_kv.to(tl.int64) * stride_vh
    else:
        k_base = (K + kv_batch.to(tl.int64) * stride_kb + head_kv.to(tl.int64) * stride_kh
                  + start_k.to(tl.int64) * stride_kn)
        v_base = (V + kv_batch.to(tl.int64) * stride_vb + head_kv.to(tl.int64) * stride_vh
                  + start_k.to(tl.int64) * stride_vn)
    page_row = PAGE_TABLE + batch.to(tl.int64) * stride_ptb
    q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_d[None, :],
                mask=row_ok[:, None] & (offs_d[None, :] < HEADDIM), other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    n_min, n_full_min, n_full_max, n_max = n_block_range(
        m_block, len_q, len_k, window_left, window_right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    # masked left edge (sliding window), unmasked middle, masked right edge (causal/tail)
    acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, k_base, v_base, stride_kn, stride_vn,
                               n_min, n_full_min, offs_m, offs_d, offs_dv, len_q, len_k,
                               window_left, window_right, qk_scale, softcap_log2,
                               page_row, start_k, page_size, num_kv_blocks, stride_kb, stride_vb,
                               HEADDIM, HEADDIM_V, BLOCK_N, BLOCK_D, BLOCK_DV,
                               True, HAS_LEFT, HAS_RIGHT, SOFTCAP, UPCAST, PAGED)
    acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, k_base, v_base, stride_kn, stride_vn,
                               n_full_min, n_full_max, offs_m, offs_d, offs_dv, len_q, len_k,
                               window_left, window_right, qk_scale, softcap_log2,
                               page_row, start_k, page_size, num_kv_blocks, stride_kb, stride_vb,
                               HEADDIM, HEADDIM_V, BLOCK_N, BLOCK_D, BLOCK_DV,
                               False, HAS_LEFT, HAS_RIGHT, SOFTCAP, UPCAST, PAGED)
    acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, k_base, v_base, stride_kn, stride_vn,
                               n_full_max, n_max, offs_m, offs_d, offs_dv, len_q, len_k,
                               window_left, window_right, qk_scale, softcap_log2,
                               page_row, start_k, page_size, num_kv_blocks, stride_kb, stride_vb,
                               HEADDIM, HEADDIM_V, BLOCK_N, BLOCK_D, BLOCK_DV,
                               True, HAS_LEFT, HAS_RIGHT, SOFTCAP, UPCAST, PAGED)

    # A row that saw no key: output 0, lse = -inf (never NaN).
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(seen, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))

    o_base = (O + batch.to(tl.int64) * stride_ob + head.to(tl.int64) * stride_oh
              + start_q.to(tl.int64) * stride_om)
    tl.store(o_base + offs_m[:, None] * stride_om + offs_dv[None, :], to_output(out, O.dtype.element_ty, UPCAST),
             mask=row_ok[:, None] & (offs_dv[None, :] < HEADDIM_V))
    lse_base = LSE + batch.to(tl.int64) * stride_lseb + head.to(tl.int64) * stride_lseh
    tl.store(lse_base + (start_q + offs_m).to(tl.int64) * stride_lsem, lse, mask=row_ok)
