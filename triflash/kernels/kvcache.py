"""Append new keys and values to a KV cache in place (``flash_attn_with_kvcache``), one
launch for both: row i of sequence b's new tokens goes to the sequence's logical cache row
``starts[b] + i``, which lives in cache batch ``batch_idx[b]`` (or b), or, paged, in block
``page_table[b, row // page_size]`` at row ``row % page_size``. Rows that would land past
the sequence's cache are not written and indices are clamped to the cache (masked stores,
no device-side fault); the caller checks the values where it can without a device sync.
Packed new tokens (``cu_seqlens_new``, FA3's ``cu_seqlens_k_new``): sequence b's are rows
cu_seqlens_new[b] .. cu_seqlens_new[b + 1] - 1 of (total_new, heads, dim) tensors. The same
launch writes each sequence's key count after the append, ``starts[b]`` + its new tokens,
which the attention reads as ``seqused_k`` (no elementwise launch of its own)."""
import torch
import triton
import triton.language as tl

from .common import FP_FUSION, cache_batch, launch_order, paged_rows


@triton.jit
def _append_rows(NEW, CACHE, batch, head, rows, cache_rows, ok_rows, stride_new, stride_ch,
                 DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Copy rows ``rows`` of sequence ``batch``'s new tokens to the cache offsets
    ``cache_rows`` (int64, head excluded). ``stride_new``: NEW's (batch, token, head) strides."""
    stride_nb, stride_nn, stride_nh = stride_new
    cols = tl.arange(0, BLOCK_D)
    ok = ok_rows[:, None] & (cols < DIM)[None, :]
    x = tl.load(NEW + batch.to(tl.int64) * stride_nb + head.to(tl.int64) * stride_nh
                + rows.to(tl.int64)[:, None] * stride_nn + cols[None, :], mask=ok)
    tl.store(CACHE + head.to(tl.int64) * stride_ch + cache_rows[:, None] + cols[None, :], x, mask=ok)


@triton.jit
def append_kv_kernel(K_NEW, V_NEW, K_CACHE, V_CACHE, STARTS, USED, KV_BATCH, PAGE_TABLE, CU_NEW, stride_ptb,
                     sizes, strides,
                     D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
                     HAS_KV_BATCH: tl.constexpr, PAGED: tl.constexpr, VARLEN_NEW: tl.constexpr):
    # sizes: (seqlen_new, capacity, page_size, num_blocks, nheads_kv); strides: the (batch,
    # token, head) strides of K_NEW, V_NEW, K_CACHE and V_CACHE. USED[b]: STARTS[b] + sequence
    # b's new tokens, written by its (head 0, first block) program
    seqlen_new, capacity, page_size, num_blocks, nheads_kv = sizes
    stride_kn, stride_vn, stride_kc, stride_vc = strides
    stride_kcb, stride_kcn, stride_kch = stride_kc
    stride_vcb, stride_vcn, stride_vch = stride_vc
    bh, n_block = launch_order(tl.program_id(0), tl.cdiv(seqlen_new, BLOCK_N), 1)
    batch = bh // nheads_kv
    head = bh % nheads_kv
    rows = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    len_new = seqlen_new
    src_batch = batch
    first = 0
    if VARLEN_NEW:  # rows first .. first + len_new - 1 of the packed tensors (batch stride 0)
        first = tl.minimum(tl.maximum(tl.load(CU_NEW + batch), 0), seqlen_new)
        len_new = tl.maximum(tl.minimum(tl.load(CU_NEW + batch + 1), seqlen_new) - first, 0)
    start = tl.load(STARTS + batch)
    if (n_block == 0) & (head == 0):
        tl.store(USED + batch, start + len_new)
    if n_block * BLOCK_N >= len_new:
        return
    src_rows = first + rows
    pos = start + rows  # the sequence's logical cache row
    ok_rows = (rows < len_new) & (pos >= 0) & (pos < capacity)
    if PAGED:
        block, row = paged_rows(PAGE_TABLE + batch.to(tl.int64) * stride_ptb, pos, ok_rows,
                                page_size, num_blocks)
    else:
        block = cache_batch(KV_BATCH, batch, num_blocks, HAS_KV_BATCH).to(tl.int64)
        row = pos.to(tl.int64)
    _append_rows(K_NEW, K_CACHE, src_batch, head, src_rows, block * stride_kcb + row * stride_kcn, ok_rows,
                 stride_kn, stride_kch, D, BLOCK_D)
    _append_rows(V_NEW, V_CACHE, src_batch, head, src_rows, block * stride_vcb + row * stride_vcn, ok_rows,
                 stride_vn, stride_vch, DV, BLOCK_DV)


def append_kv(k_new, v_new, k_cache, v_cache, starts, batch_idx=None, page_table=None, cu_seqlens_new=None):
    """Write ``k_new`` / ``v_new`` (batch, seqlen_new, heads, dim), or with ``cu_seqlens_new``
    (batch + 1,) packed (total_new, heads, dim), into ``k_cache`` / ``v_cache`` at each
    sequence's logical rows ``starts[b]`` (int32 (batch,)) onwards: caches (cache_batch,
    seqlen_cache, heads, dim) indexed by ``batch_idx`` (int32 (batch,), None: b), or paged
    (num_blocks, page_size, heads, dim) through ``page_table`` (batch, pages). Returns each
    sequence's key count after the append, ``starts`` + its new tokens (int32 (batch,))."""
    varlen = cu_seqlens_new is not None
    if varlen:  # a packed tensor seen as one batch row; each sequence's rows from cu_seqlens_new
        batch = cu_seqlens_new.shape[0] - 1
        k_new, v_new = k_new.unsqueeze(0), v_new.unsqueeze(0)
    else:
        batch = k_new.shape[0]
    _, seqlen_new, nheads_kv, d = k_new.shape
    dv = v_new.shape[-1]
    if k_new.numel() == 0 or batch == 0:  # (no new token)
        return starts.clone()
    used = torch.empty_like(starts)
    paged = page_table is not None
    capacity = page_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
    dummy = starts
    block_n = 16
    # (packed: every sequence's programs cover the whole packed length; those past its own
    # new tokens return at once)
    grid = (triton.cdiv(seqlen_new, block_n) * batch * nheads_kv,)
    knb, knn, knh = k_new.stride()[:3]
    vnb, vnn, vnh = v_new.stride()[:3]
    if varlen:
        knb = vnb = 0
    append_kv_kernel[grid](
        k_new, v_new, k_cache, v_cache, starts, used, batch_idx if batch_idx is not None else dummy,
        page_table if paged else dummy, cu_seqlens_new if varlen else dummy, page_table.stride(0) if paged else 0,
        (seqlen_new, capacity, k_cache.shape[1] if paged else 1, k_cache.shape[0], nheads_kv),
        ((knb, knn, knh), (vnb, vnn, vnh), tuple(k_cache.stride()[:3]), tuple(v_cache.stride()[:3])),
        D=d, DV=dv, BLOCK_D=max(16, triton.next_power_of_2(d)),
        BLOCK_DV=max(16, triton.next_power_of_2(dv)), BLOCK_N=block_n,
        HAS_KV_BATCH=batch_idx is not None, PAGED=paged, VARLEN_NEW=varlen, num_warps=4,
        enable_fp_fusion=FP_FUSION)
    return used
