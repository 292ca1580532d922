"""The backward's row statistics (plain Triton, on the host's path before the dK/dV and dQ
kernels of ``hopper/bwd.py``, ``bwd256.py`` and ``bwd_dq.py``): Delta = rowsum(dO * O) and
lse in log2 units, in fp32 buffers padded per sequence to whole query tiles, so that a TMA
tile of them never leaves a sequence's rows (``common.stat_row0``)."""
import torch
import triton
import triton.language as tl

from ..common import ceil_div, launch_order, seqlen_info
from .common import planned_launch, stat_row0, stat_rows

BLOCK_M = 64  # query rows per tile: the dK/dV and dQ kernels' streamed Q / dO tiles


@triton.jit
def bwd_stats_kernel(O, DO, LSE, STAT, DELTA, stride_o, stride_do, stride_lse, stride_s, sizes, CU_Q, USED_Q,
                     HEADDIM_V: tl.constexpr, BLOCK_M: tl.constexpr,
                     IS_VARLEN: tl.constexpr, HAS_SEQUSED_Q: tl.constexpr, BLOCK_D: tl.constexpr):
    """Per query row, into buffers padded to whole query tiles per sequence (TMA tiles never
    leave a sequence's rows, see ``common.stat_row0``): Delta = rowsum(dO * O) (0 past
    len_q) and lse in log2 units, +inf past len_q and for rows that saw no key (lse = -inf),
    so that P = exp2(S - lse) is 0 there. ``BLOCK_D``: HEADDIM_V rounded up to a power of two
    (columns past HEADDIM_V masked). ``stride_o`` / ``stride_do``: (batch, row, head) strides
    of O / dO; ``stride_lse``: LSE's (batch, head, row); ``stride_s``: STAT's and DELTA's
    (batch, head); ``sizes``: (nheads, seqlen_q, total_q)."""
    stride_ob, stride_om, stride_oh = stride_o
    stride_dob, stride_dom, stride_doh = stride_do
    stride_lseb, stride_lseh, stride_lsem = stride_lse
    stride_sb, stride_sh = stride_s
    nheads, seqlen_q, total_q = sizes
    bh, m_block = launch_order(tl.program_id(0), tl.cdiv(seqlen_q, BLOCK_M), 1)  # seqlen_q: the longest
    batch = bh // nheads
    head = bh % nheads
    start_q, len_q, _, _ = seqlen_info(batch, seqlen_q, 0, total_q, 0, CU_Q, CU_Q, USED_Q, USED_Q,
                                       IS_VARLEN, HAS_SEQUSED_Q, False)
    if IS_VARLEN and m_block * BLOCK_M >= len_q:  # no dK/dV or dQ tile reads these rows
        return
    if IS_VARLEN:  # (1, total, heads, dim) tensors
        tma_batch = batch * 0
    else:
        tma_batch = batch
    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < len_q
    if BLOCK_D == HEADDIM_V:
        ok = row_ok[:, None]
    else:
        ok = row_ok[:, None] & (offs_d[None, :] < HEADDIM_V)
    rows = (start_q + offs_m[:, None]).to(tl.int64)
    o = tl.load(O + tma_batch.to(tl.int64) * stride_ob + head.to(tl.int64) * stride_oh
                + rows * stride_om + offs_d[None, :], mask=ok, other=0.0).to(tl.float32)
    do = tl.load(DO + tma_batch.to(tl.int64) * stride_dob + head.to(tl.int64) * stride_doh
                 + rows * stride_dom + offs_d[None, :], mask=ok, other=0.0).to(tl.float32)
    delta = tl.sum(o * do, 1)
    lse = tl.load(LSE + tma_batch.to(tl.int64) * stride_lseb + head.to(tl.int64) * stride_lseh
                  + (start_q + offs_m).to(tl.int64) * stride_lsem, mask=row_ok, other=float("-inf"))
    stat = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    out_off = (tma_batch.to(tl.int64) * stride_sb + head.to(tl.int64) * stride_sh
               + stat_row0(batch, start_q, IS_VARLEN, BLOCK_M) + offs_m)
    tl.store(STAT + out_off, stat)
    tl.store(DELTA + out_off, delta)


def stats(pb, out, dout, lse):
    """(stat, delta): lse_log2 and Delta = rowsum(dO * O) of every query row, in fp32 buffers
    padded per sequence to whole BLOCK_M-row tiles (``common.stat_row0``): dense (batch,
    heads, seqlen_pad), varlen (1, heads, ``common.stat_rows``)."""
    if pb.varlen:
        shape = (1, pb.nheads, stat_rows(pb.total_q, pb.batch, BLOCK_M))
    else:
        shape = (pb.batch, pb.nheads, ceil_div(pb.seqlen_q, BLOCK_M) * BLOCK_M)
    stat = torch.empty(shape, dtype=torch.float32, device=out.device)
    delta = torch.empty(shape, dtype=torch.float32, device=out.device)
    o4, do4 = pb.view(out), pb.view(dout)

    def build():
        return (ceil_div(pb.seqlen_q, BLOCK_M) * pb.batch * pb.nheads,), [
            o4, do4, lse, stat, delta, o4.stride()[:3], do4.stride()[:3], pb.lse_strides(lse),
            (stat.stride(0), stat.stride(1)), (pb.nheads, pb.seqlen_q, pb.total_q), pb.cu_q, pb.used_q,
            out.shape[-1], BLOCK_M, pb.varlen, pb.has_used_q,  # HEADDIM_V, BLOCK_M, IS_VARLEN, HAS_SEQUSED_Q
            triton.next_power_of_2(out.shape[-1])]  # BLOCK_D
    # dense: a plan per signature (pb.cu_q: the tensor a dense batch passes for its absent
    # sequence pointers)
    key = None if pb.varlen or pb.has_used_q else (
        "stats", out.shape, out.stride(), dout.stride(), lse.shape, lse.stride(), out.dtype, out.get_device())
    planned_launch(bwd_stats_kernel, key, (out, dout, lse, stat, delta, pb.cu_q), build)
    return stat, delta
