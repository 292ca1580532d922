"""Append new keys/values to a KV cache in place (``flash_attn_with_kvcache``): row i of
sequence b's new tokens goes to cache row ``start[b] + i``. Rows that would land past the
cache's end are not written (masked stores, no device-side fault); the caller checks the
bounds where it can without a device sync."""
import triton
import triton.language as tl

from .common import head_major_tile


@triton.jit
def append_kv_kernel(NEW, CACHE, STARTS, start_all, seqlen_new, seqlen_cache, nheads_kv,
                     stride_nb, stride_nn, stride_nh, stride_cb, stride_cn, stride_ch,
                     DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                     HAS_STARTS: tl.constexpr):
    bh, n_block = head_major_tile(tl.cdiv(seqlen_new, BLOCK_N))
    batch = bh // nheads_kv
    head = bh % nheads_kv
    if HAS_STARTS:
        start = tl.load(STARTS + batch)
    else:
        start = start_all
    rows = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    pos = start + rows
    cols = tl.arange(0, BLOCK_D)
    ok = ((rows < seqlen_new) & (pos >= 0) & (pos < seqlen_cache))[:, None] & (cols < DIM)[None, :]
    x = tl.load(NEW + batch.to(tl.int64) * stride_nb + head.to(tl.int64) * stride_nh
                + rows.to(tl.int64)[:, None] * stride_nn + cols[None, :], mask=ok)
    tl.store(CACHE + batch.to(tl.int64) * stride_cb + head.to(tl.int64) * stride_ch
             + pos.to(tl.int64)[:, None] * stride_cn + cols[None, :], x, mask=ok)


def append_kv(new, cache, starts, start_all):
    """Write ``new`` (batch, seqlen_new, heads, dim) into ``cache`` (batch, seqlen_cache,
    heads, dim) at rows ``starts[b]`` (an int32 tensor) or ``start_all`` (an int)."""
    batch, seqlen_new, nheads_kv, dim = new.shape
    if new.numel() == 0:
        return
    block_n = 16
    grid = (triton.cdiv(seqlen_new, block_n) * batch * nheads_kv,)
    append_kv_kernel[grid](
        new, cache, starts if starts is not None else cache, start_all, seqlen_new, cache.shape[1],
        nheads_kv, new.stride(0), new.stride(1), new.stride(2),
        cache.stride(0), cache.stride(1), cache.stride(2),
        DIM=dim, BLOCK_D=max(16, triton.next_power_of_2(dim)), BLOCK_N=block_n,
        HAS_STARTS=starts is not None, num_warps=4)
