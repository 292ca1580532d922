"""Pieces every Hopper (Gluon) kernel shares, written once: accumulator layouts, the view of a
2D shared tile as a rank-4 TMA box, and the host-side TMA descriptors."""
import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ..common import m_block_range, n_block_range, seqlen_info


@gluon.constexpr_function
def _acc_layout(n, dtype):
    """wgmma accumulator of one warpgroup: instr m16 x n x k(16 for 16-bit inputs)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                     instr_shape=[16, n, 256 // dtype.primitive_bitwidth])


@gluon.jit
def _tma_view(buf, desc):
    """A 2D [rows, dim] smem tile seen as the rank-4 (1, rows, 1, dim) box of ``desc``."""
    return buf._reinterpret(desc.dtype, desc.block_type.shape, desc.layout)


@gluon.jit
def _seq_query_tile(tile, num_m_blocks, nheads, nheads_kv, seqlen_q, seqlen_k, total_q, total_k,
                    CU_Q, CU_K, USED_Q, USED_K, window_left, window_right,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                    HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, IS_VARLEN: gl.constexpr,
                    HAS_SEQUSED_Q: gl.constexpr, HAS_SEQUSED_K: gl.constexpr):
    """Work tile of a kernel that walks key blocks for a query block (forward, dQ), dense or
    varlen -> (tma_batch, batch, head, head_kv, start_q, len_q, start_k, len_k, first row,
    key block range). Rows are relative to the sequence; a TMA box starts at row
    ``start_q + row`` of batch ``tma_batch`` (varlen tensors are seen as (1, total, h, d), so
    0). Tiles of one head are adjacent (its K/V stay in L2) and go longest first (the last
    query block under causal). A varlen query block past its sequence's end visits nothing."""
    bh = tile // num_m_blocks
    m_block = num_m_blocks - 1 - (tile - bh * num_m_blocks)
    batch = bh // nheads
    head = bh - batch * nheads
    head_kv = head // (nheads // nheads_kv)
    start_q, len_q, start_k, len_k = seqlen_info(
        batch, seqlen_q, seqlen_k, total_q, total_k, CU_Q, CU_K, USED_Q, USED_K,
        IS_VARLEN, HAS_SEQUSED_Q, HAS_SEQUSED_K)
    n_min, n_full_min, n_full_max, n_max = n_block_range(
        m_block, len_q, len_k, window_left, window_right,
        BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    if IS_VARLEN:
        tma_batch = 0
        if m_block * BLOCK_M >= len_q:
            n_full_min = n_min
            n_full_max = n_min
            n_max = n_min
    else:
        tma_batch = batch
    return (tma_batch, batch, head, head_kv, start_q, len_q, start_k, len_k, m_block * BLOCK_M,
            n_min, n_full_min, n_full_max, n_max)


@gluon.jit
def _query_tile(tile, num_m_blocks, nheads, nheads_kv, seqlen_q, seqlen_k,
                window_left, window_right, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr):
    """``_seq_query_tile`` of a dense batch -> (batch, head, head_kv, first row, key block
    range)."""
    _, batch, head, head_kv, _, _, _, _, row0, n_min, n_full_min, n_full_max, n_max = _seq_query_tile(
        tile, num_m_blocks, nheads, nheads_kv, seqlen_q, seqlen_k, seqlen_q, seqlen_k,
        0, 0, 0, 0, window_left, window_right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT,
        False, False, False)
    return batch, head, head_kv, row0, n_min, n_full_min, n_full_max, n_max


@gluon.jit
def _key_tile(nheads, nheads_kv, seqlen_q, seqlen_k, window_left, window_right,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr):
    """This CTA's key block of a dK/dV kernel (grid: key blocks, KV heads, batch) ->
    (batch, head_kv, GQA group size, first key, query block range)."""
    n_block = gl.program_id(0)
    head_kv = gl.program_id(1)
    batch = gl.program_id(2)
    group = nheads // nheads_kv
    m_min, m_full_min, m_full_max, m_max = m_block_range(
        n_block, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    return batch, head_kv, group, n_block * BLOCK_N, m_min, m_full_min, m_full_max, m_max


def _gl_dtype(dtype):
    return {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[dtype]


@functools.lru_cache(maxsize=None)
def _box_layout(rows, dim, dtype):
    # get_default_for costs ~9 us of Python per call: computed once per (box, dtype)
    return gl.NVMMASharedLayout.get_default_for([1, rows, 1, dim], _gl_dtype(dtype))


def _make_descriptor(x, block, layout):
    """``TensorDescriptor(x, x.shape, x.stride(), block, layout)`` without its per-call
    validation (~5 us each, 11 per backward): every caller has checked ``tma_compatible``
    and the blocks are fixed powers of two. Same class, same fields, as the launcher reads."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    d = object.__new__(TensorDescriptor)
    d.base, d.shape, d.strides, d.block_shape, d.layout, d.padding = (
        x, x.shape, x.stride(), block, layout, "zero")
    return d


def descriptor(x, rows, cols=None):
    """Rank-4 TMA descriptor over x (batch, seqlen, heads, dim), box (1, rows, 1, cols);
    cols defaults to the whole head dim."""
    cols = x.shape[-1] if cols is None else cols
    return _make_descriptor(x, [1, rows, 1, cols], _box_layout(rows, cols, x.dtype))


@functools.lru_cache(maxsize=None)
def _stat_layout(rows):
    return gl.NVMMASharedLayout.get_default_for([1, 1, rows], gl.float32)


def stat_descriptor(x, rows=64):
    """Rank-3 TMA descriptor over a padded (batch, heads, seqlen_pad) fp32 buffer of per-row
    statistics (lse_log2, Delta), box (1, 1, rows)."""
    return _make_descriptor(x, [1, 1, rows], _stat_layout(rows))


def tma_compatible(*tensors) -> bool:
    """TMA needs 16-byte aligned base pointers and 16-byte multiples for the outer strides."""
    for x in tensors:
        if x.data_ptr() % 16 or x.stride(-1) != 1:
            return False
        if any((s * x.element_size()) % 16 for s in x.stride()[:-1]):
            return False
    return True
