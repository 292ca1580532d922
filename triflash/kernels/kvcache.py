"""Append new keys and values to a KV cache in place (``flash_attn_with_kvcache``), one
launch for both: row i of sequence b's new tokens goes to cache row ``starts[b] + i``.
Rows that would land past the cache's end are not written (masked stores, no device-side
fault); the caller checks the bounds where it can without a device sync."""
import triton
import triton.language as tl

from .common import launch_order


@triton.jit
def _append_rows(NEW, CACHE, batch, head, rows, pos, ok_rows, stride_nb, stride_nn, stride_nh,
                 stride_cb, stride_cn, stride_ch, DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    cols = tl.arange(0, BLOCK_D)
    ok = ok_rows[:, None] & (cols < DIM)[None, :]
    x = tl.load(NEW + batch.to(tl.int64) * stride_nb + head.to(tl.int64) * stride_nh
                + rows.to(tl.int64)[:, None] * stride_nn + cols[None, :], mask=ok)
    tl.store(CACHE + batch.to(tl.int64) * stride_cb + head.to(tl.int64) * stride_ch
             + pos.to(tl.int64)[:, None] * stride_cn + cols[None, :], x, mask=ok)


@triton.jit
def append_kv_kernel(K_NEW, V_NEW, K_CACHE, V_CACHE, STARTS, seqlen_new, seqlen_cache, nheads_kv,
                     stride_knb, stride_knn, stride_knh, stride_vnb, stride_vnn, stride_vnh,
                     stride_kcb, stride_kcn, stride_kch, stride_vcb, stride_vcn, stride_vch,
                     D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr):
    bh, n_block = launch_order(tl.program_id(0), tl.cdiv(seqlen_new, BLOCK_N), 1)
    batch = bh // nheads_kv
    head = bh % nheads_kv
    rows = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    pos = tl.load(STARTS + batch) + rows
    ok_rows = (rows < seqlen_new) & (pos >= 0) & (pos < seqlen_cache)
    _append_rows(K_NEW, K_CACHE, batch, head, rows, pos, ok_rows, stride_knb, stride_knn, stride_knh,
                 stride_kcb, stride_kcn, stride_kch, D, BLOCK_D)
    _append_rows(V_NEW, V_CACHE, batch, head, rows, pos, ok_rows, stride_vnb, stride_vnn, stride_vnh,
                 stride_vcb, stride_vcn, stride_vch, DV, BLOCK_DV)


def append_kv(k_new, v_new, k_cache, v_cache, starts):
    """Write ``k_new`` / ``v_new`` (batch, seqlen_new, heads, dim) into ``k_cache`` /
    ``v_cache`` (batch, seqlen_cache, heads, dim) at rows ``starts[b]`` (int32 (batch,))."""
    batch, seqlen_new, nheads_kv, d = k_new.shape
    dv = v_new.shape[-1]
    if k_new.numel() == 0:
        return
    block_n = 16
    grid = (triton.cdiv(seqlen_new, block_n) * batch * nheads_kv,)
    append_kv_kernel[grid](
        k_new, v_new, k_cache, v_cache, starts, seqlen_new, k_cache.shape[1], nheads_kv,
        *k_new.stride()[:3], *v_new.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3],
        D=d, DV=dv, BLOCK_D=max(16, triton.next_power_of_2(d)),
        BLOCK_DV=max(16, triton.next_power_of_2(dv)), BLOCK_N=block_n, num_warps=4)
