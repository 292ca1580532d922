"""Hopper (sm90) backward in Gluon: TMA loader warp + two wgmma consumer warpgroups computing
dK and dV, and dQ either in the same kernel, added in L2 by TMA reduce-add
(deterministic=False on a dense batch, where the tile has ``atomic_dq``: 5 matmuls), or in
the Gluon dQ kernel (``hopper/bwd_dq.py``; 7 matmuls, no atomics, bitwise reproducible).
Dispatched on sm90 for dense and varlen batches at head dim 64 and 128 (= headdim_v; 256:
``hopper/bwd256.py``'s dK/dV kernel), and at 96 / 192 computed as 128 / 256
(``common.kernel_head_dim``: boxes of the tile's width over the tensor's head dim, loads
zero-filled past it, TMA stores clipped, masked stores stopped at ``HEAD_DIM``); tiles in
``configs.SM90_HOPPER_BWD``; this module also holds the backward's host side (``bwd``).
Compile check: ``python -m tools.compile_check --bwd`` (from the repository root).

FA3-style "swapAB" dK/dV kernel: keys sit on the wgmma M axis, so P^T and dS^T come out of
their wgmmas already in the accumulator orientation of dV += P^T dO and dK += dS^T Q and feed
those wgmmas from registers. One CTA owns one key block of ``NUM_CONSUMERS * 64`` keys of one
(batch, KV head):

* **loader** (1 warp, few registers): TMA-loads each consumer's 64-row K_w and V_w tiles once
  (one barrier), then streams the Q and dO tiles (64 query rows each) of every query block
  that ``common.m_block_range`` says visits the key block, for every query head of the GQA
  group, into ``STAGES``-deep rings, together with the 64 matching lse_log2 / Delta values
  (rank-3 TMA boxes of padded fp32 buffers). Each slot has ``q_ready`` (Q + lse) and
  ``do_ready`` (dO + Delta) barriers that TMA completes with the byte count, and one ``free``
  barrier that each consumer arrives on once (count ``NUM_CONSUMERS``) when its wgmmas
  reading the slot have retired.
* **consumers** (one warpgroup each, 64 keys each), per query block m of query head h:
  dP'^T = V_w dO_m^T - Delta (Delta as the initial accumulator) and S^T = K_w Q_m^T (async
  wgmmas, shared x shared; with softcap dP is issued after P instead, see ``_bwd_step``);
  P^T = exp2(S^T * scale_log2 - lse_log2[q]) (masked on edge blocks);
  dV_w += P^T dO_m (P^T from registers); dS^T = P^T dP'^T (times 1 - tanh^2 with softcap);
  dK_w += dS^T Q_m (dS^T from registers). With ``ATOMIC_DQ``, dS^T also goes to this
  warpgroup's shared tile (two slots, alternating per query block; barriers ``ds_bars`` 0 / 1
  count both warpgroups' arrivals, 2 guards the K tiles before the epilogue) and warpgroup c computes columns [c D/2, (c+1) D/2) of
  dQ_m = dS K over the CTA's 128 keys (two wgmmas, A = the transposed views of both dS^T
  tiles, B = column slices of both K tiles), stages that fp32 slice in shared memory and
  adds it into ``dq_accum`` with one TMA reduce-add (``cp.reduce.async.bulk.tensor``): the
  L2 does the adds, a bulk operation per 64 x D/2 slice instead of per-thread atomics.
* epilogue: dK_w * softmax_scale and dV_w go out through the consumer's own K_w / V_w tiles
  (no longer read) with TMA stores, which clip rows past the sequence.
* last partial wave (``SPLIT`` > 1, ``tail_pieces``: dense, no mask, ATOMIC_DQ): the key
  tiles that would run alone at the end each run as SPLIT CTAs over parts of their query
  blocks; those store fp32 dK / dV per piece and ``_split_fixup_kernel`` sums and writes them.

The host function runs ``bwd_stats.bwd_stats_kernel`` (Delta = rowsum(dO * O) and lse in log2 units with
+inf for rows past len_q / rows that saw no key, both padded to whole 64-row tiles), then
this kernel with ATOMIC_DQ (dq = dq_accum * softmax_scale after it) or without it followed
by the Gluon dQ kernel. Why the TMA reduce-add: per-thread ``red.global.add`` of each
warpgroup's 64 x D partial made the backward slower than the portable one (298.4 TFLOPS at
head dim 128); in one process the separate dQ kernel reached 483.8 / 459.7 (non-causal /
causal) and the TMA reduce-add of shared dS 532.6 / 526.6 (``benchmarks/results/probes/``
``hopper-bwd-speed-5387ddb.json`` and ``bwd-probe-speed-*-9878a6e.json`` at fb45c0d;
docs/performance.md).

Math and masking are those of ``triflash/kernels/bwd.py`` (the portable backward).
Covered: dense (batch, seqlen, heads, dim) inputs, head dim 64 / 128 (= headdim_v),
fp16/bf16, causal, sliding window, softcap, GQA/MQA (the CTA loops over the group's query
heads, so dK/dV are summed in registers: no reduction step, deterministic). Varlen
(``VARLEN``): (total, heads, dim) tensors seen as (1, total, heads, dim); each CTA's
sequence start and length come from ``cu_seqlens`` / ``seqused`` (``common._key_tile``),
the lse_log2 / Delta buffers give each sequence its own padded rows (``common.stat_row0``),
and dK / dV leave by masked stores (``common._store_rows``) where a TMA box would run into
the next sequence.
"""
import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

from .. import configs, problem
from . import bwd256, bwd_dq
from ..common import ceil_div, tanh
from .bwd_loader import _bwd_loader, _loader_barriers
from .bwd_stats import BLOCK_M, stats  # (BLOCK_M: query rows per streamed Q / dO tile)
from .common import (CONSUMER_REGS, LOADER_REGS, Problem, _acc_layout, _key_tile_at, _store_rows, _tma_view,
                     a_operand, descriptor, kernel_head_dim, launch, num_sms, planned_launch,
                     opaque_zero, stat_descriptor, tma_compatible, tma_reduce_add, tma_store,
                     to_16bit)

ROWS_PER_CONSUMER = 64   # keys per consumer warpgroup (wgmma M)
NUM_CONSUMERS = 2        # consumer warpgroups
BLOCK_N = ROWS_PER_CONSUMER * NUM_CONSUMERS  # keys per CTA
HEAD_DIMS = (64, 96, 128, 192, 256)  # dispatched (= headdim_v); 96 / 192 computed as 128 / 256
VARLEN = True               # cu_seqlens / seqused: per-sequence tiles, masked dK/dV/dQ stores
SPLIT_D_HEAD_DIMS = (256,)  # dK/dV by hopper/bwd256.py (head-dim axis split over the warpgroups)


class BwdMeta(NamedTuple):
    """The compile-time choices of ``hopper_bwd_kernel``, its constexpr ``META``: every field
    specializes the kernel as a constexpr parameter of its own did (one parameter instead of
    fifteen; a function reads the fields it needs into constexprs of the same names)."""
    STAGES: int            # Q / dO ring depth
    NUM_CONSUMERS: int     # consumer warpgroups (2)
    HAS_LEFT: bool         # sliding window: left edge
    HAS_RIGHT: bool        # causal / window right edge
    SOFTCAP: bool
    ATOMIC_DQ: bool        # dQ by TMA reduce-adds in this kernel
    IS_VARLEN: bool
    HAS_SEQUSED_Q: bool
    HAS_SEQUSED_K: bool
    LOADER_REGS: int
    CONSUMER_REGS: int
    HEAD_DIM: int          # the tensors' head dim (96: computed as 128)
    REG_A: int             # configs.HopperBwdConfig.reg_a
    SPLIT: int             # > 1: the last wave's key tiles in SPLIT pieces (tail_pieces)
    FRESH_TILES: bool = False  # the K / V tiles' wgmma descriptors built anew every step (``fresh_tiles``)


@gluon.jit
def _bwd_step(it, m, head, k_buf, v_buf, k_bufs, v_bufs, ring, dq_io, dk, dv, keys, qcols0, tma_batch, len_q, len_k,
              scalars, bounds, META: gl.constexpr, MASK: gl.constexpr, C: gl.constexpr):
    """One query block ``m`` of query head ``head`` (ring slot ``it``) for the 64 keys of
    consumer warpgroup ``C``; returns (dk, dv). With ``ATOMIC_DQ`` also its columns of the
    dQ of the block before (the previous query block of this head, or the last, ``m_max`` -
    1, of the head before): one block later, so that a warpgroup waits for the other's dS^T
    of the block before, not of this one, and the two are not held in step at every block. ``k_buf`` / ``v_buf``: the
    S^T / dP^T wgmmas' A operands, shared tiles or registers (``REG_A``). ``ring``: the
    loader's rings and barriers (``bwd_loader._bwd_loader``); ``dq_io``: (ds_bufs, ds_bars,
    this warpgroup's dq_buf, dq_desc); ``scalars``: the kernel's; ``bounds``: the key
    block's query block range (m_min, m_full_min, m_full_max, m_max). ``FRESH_TILES``: the
    shared K / V tiles indexed anew from ``k_bufs`` / ``v_bufs`` through a zero the compiler
    cannot prove (``common.opaque_zero``), so that their wgmma descriptors are built in the step
    instead of hoisted out of the loop and held in registers
    (``configs.HopperBwdConfig.fresh_tiles``)."""
    q_ring, do_ring, lse_ring, delta_ring, q_ready, do_ready, free = ring
    ds_bufs, ds_bars, dq_buf, dq_desc = dq_io
    qk_scale, softmax_scale, softcap_log2, window_left, window_right = scalars
    m_min, m_full_min, m_full_max, m_max = bounds
    STAGES: gl.constexpr = META.STAGES
    HAS_LEFT: gl.constexpr = META.HAS_LEFT
    HAS_RIGHT: gl.constexpr = META.HAS_RIGHT
    SOFTCAP: gl.constexpr = META.SOFTCAP
    ATOMIC_DQ: gl.constexpr = META.ATOMIC_DQ
    KR: gl.constexpr = k_buf.shape[0]
    D: gl.constexpr = k_buf.shape[1]
    BM: gl.constexpr = q_ring.shape[1]
    dtype: gl.constexpr = k_buf.dtype
    KW: gl.constexpr = 32 // dtype.primitive_bitwidth
    s_layout: gl.constexpr = _acc_layout(BM, dtype)
    o_layout: gl.constexpr = _acc_layout(D, dtype)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=KW)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)

    stage = it % STAGES
    phase = (it // STAGES) & 1
    fresh = 0
    if META.FRESH_TILES:
        fresh = opaque_zero(it)
        if META.REG_A == 0:
            k_buf = k_bufs.index(C + fresh)
        if META.REG_A < 2:
            v_buf = v_bufs.index(C + fresh)
    q_buf = q_ring.index(stage)
    do_buf = do_ring.index(stage)

    # Per-query statistics come with the tiles (queries are the N axis of S^T): lse_log2 is
    # +inf for rows past len_q and rows that saw no key, so their P is exactly 0; Delta is
    # folded into dP's initial accumulator (dP' = V dO^T - Delta). ptxas serializes a wgmma
    # whose initial accumulator is written while another wgmma is in flight (C7517), so the
    # one with an initial value goes first: dP, then S (zero-initialized), one wait for both.
    # With softcap (tanh keeps one more 64x64 tile alive) dP is issued after P instead, so
    # its accumulator is not reserved while P is formed.
    if not SOFTCAP:
        mbarrier.wait(do_ready.index(stage), phase)
        dp_tok = warpgroup_mma(v_buf, do_buf.permute((1, 0)), gl.zeros([KR, BM], gl.float32, s_layout)
                               - gl.expand_dims(delta_ring.index(stage).load(col_layout), 0),
                               is_async=True)
    mbarrier.wait(q_ready.index(stage), phase)
    s_tok = warpgroup_mma(k_buf, q_buf.permute((1, 0)), gl.zeros([KR, BM], gl.float32, s_layout),
                          use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=(s_tok,))
    lse = gl.expand_dims(lse_ring.index(stage).load(col_layout), 0)
    if SOFTCAP:
        t = tanh(s * qk_scale)
        p = gl.exp2(t * softcap_log2 - lse)
    else:
        p = gl.exp2(s * qk_scale - lse)
    if MASK:
        # common.visible on (key - query) differences, compared with scalars: the per-element
        # thresholds (query + shift + right ...) would otherwise be hoisted out of the loop.
        diff = gl.expand_dims(keys - (m + opaque_zero(m)) * BM, 1) - gl.expand_dims(qcols0, 0)
        ok = gl.expand_dims(keys < len_k, 1)
        if HAS_RIGHT:
            ok = ok & (diff <= len_k - len_q + window_right)
        if HAS_LEFT:
            ok = ok & (diff >= len_k - len_q - window_left)
        p = gl.where(ok, p, 0.0)
    p_op = gl.convert_layout(to_16bit(p, dtype), op_layout)
    if SOFTCAP:
        p = p * (1.0 - t * t)  # the softcap derivative, folded in before t dies
        mbarrier.wait(do_ready.index(stage), phase)
        dp_tok = warpgroup_mma(v_buf, do_buf.permute((1, 0)), gl.zeros([KR, BM], gl.float32, s_layout)
                               - gl.expand_dims(delta_ring.index(stage).load(col_layout), 0),
                               is_async=True)
    # dV += P^T dO, P^T from registers
    dv_tok = warpgroup_mma(p_op, do_buf, dv, is_async=True)
    dp = warpgroup_mma_wait(1, deps=(dp_tok,))
    ds = to_16bit(p * dp, dtype)  # dS^T = P^T (dP^T - Delta)
    if ATOMIC_DQ:
        # dS^T to this warpgroup's tile of shared slot (it + 1) % 4 (slot 0 holds the zeros
        # of a block before the first, ``_dq_lag_start``), for both warpgroups' dQ wgmmas
        # (``ds_bars`` 0-3: the slot written by both). Once both warpgroups wrote block it - 1,
        # each has finished block it - 2 and with it the dQ wgmmas of block it - 3, the last
        # reads of the slot written here (three slots would do; four index by bits).
        mbarrier.wait(ds_bars.index(it & 3), (it >> 2) & 1)
        slot = (it + 1) & 3
        ds_bufs.index(2 * slot + C).store(ds)
        fence_async_shared()
        mbarrier.arrive(ds_bars.index(slot))
        # The block before's dQ wgmmas before this block's dK (FA4's order): they retire
        # first, and the warpgroup stages and reduces dQ while dK's wgmma runs (dQ after dK:
        # docs/performance.md, "Tried and not kept").
        dq_tok = _dq_wgmmas(ds_bufs, k_bufs, it & 3, fresh, BM, C)
        dk_tok = warpgroup_mma(gl.convert_layout(ds, op_layout), q_buf, dk, is_async=True)
        dv, dq = warpgroup_mma_wait(1, deps=(dv_tok, dq_tok))  # (dK goes on)
        if it > 0:  # the block before's dQ slice (the first step's is the zero block's)
            first = (m == m_min).to(gl.int32)
            _dq_reduce(dq, dq_buf, dq_desc, tma_batch, m - 1 + first * (m_max - m_min), head - first, C)
        dk = warpgroup_mma_wait(0, deps=(dk_tok,))
        mbarrier.arrive(free.index(stage))
        return dk, dv
    dk_tok = warpgroup_mma(gl.convert_layout(ds, op_layout), q_buf, dk, is_async=True)
    dv, dk = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok))
    # Every wgmma reading Q, dO, LSE and Delta of this slot has retired (the statistics are
    # in registers by now): one arrival per warpgroup.
    mbarrier.arrive(free.index(stage))
    return dk, dv


@gluon.jit
def _dq_lag_start(ds_bufs, ds_bars, KR: gl.constexpr, BM: gl.constexpr, layout: gl.constexpr,
                  C: gl.constexpr):
    """A block before the first whose dS^T is zero, in slot 0 (its dQ, computed
    in the first step, is not added anywhere)."""
    ds_bufs.index(C).store(gl.zeros([KR, BM], ds_bufs.dtype, layout))
    fence_async_shared()
    mbarrier.arrive(ds_bars.index(0))


@gluon.jit
def _dq_lag_end(ds_bufs, k_bufs, ds_bars, dq_buf, dq_desc, tma_batch, steps, prev_m, prev_head,
                BM: gl.constexpr, C: gl.constexpr):
    """The dQ of the CTA's last block (``steps`` blocks in all; in slot steps % 4)."""
    mbarrier.wait(ds_bars.index(steps & 3), (steps >> 2) & 1)
    dq = warpgroup_mma_wait(0, deps=(_dq_wgmmas(ds_bufs, k_bufs, steps & 3, 0, BM, C),))
    if steps > 0:
        _dq_reduce(dq, dq_buf, dq_desc, tma_batch, prev_m, prev_head, C)


@gluon.jit
def _dq_wgmmas(ds_bufs, k_bufs, dslot, fresh, BM: gl.constexpr, C: gl.constexpr):
    """The async wgmmas of dQ_m[:, C-th column half] = dS K[:, half] over the CTA's 128 keys,
    one per warpgroup's 64 keys (A = the transposed view of its dS^T tile of ``dslot``, both
    written); K's tiles indexed through ``fresh`` (0; see ``_bwd_step``)."""
    D: gl.constexpr = k_bufs.shape[2]
    DQN: gl.constexpr = D // 2
    tok = warpgroup_mma(ds_bufs.index(2 * dslot).permute((1, 0)), k_bufs.index(fresh).slice(C * DQN, DQN, dim=1),
                        gl.zeros([BM, DQN], gl.float32, _acc_layout(DQN, k_bufs.dtype)), use_acc=False,
                        is_async=True)
    return warpgroup_mma(ds_bufs.index(2 * dslot + 1).permute((1, 0)),
                         k_bufs.index(1 + fresh).slice(C * DQN, DQN, dim=1), tok, is_async=True)


@gluon.jit
def _dq_reduce(dq, dq_buf, dq_desc, tma_batch, dq_m, dq_head, C: gl.constexpr):
    """This warpgroup's fp32 dQ slice (over the CTA's keys) added into dq_accum in L2 by a
    TMA reduce-add through its staging tile (scaled on the host)."""
    BM: gl.constexpr = dq.shape[0]
    DQN: gl.constexpr = dq.shape[1]
    tma.store_wait(0)  # the previous reduce has read dq_buf
    dq_buf.store(dq)
    fence_async_shared()
    tma_reduce_add(dq_desc, [tma_batch, dq_m * BM, dq_head, C * DQN], _tma_view(dq_buf, dq_desc))


@gluon.jit
def _split_tile(n_full, nb, nheads_kv, SPLIT: gl.constexpr):
    """With the last wave split (grid: ``n_full`` whole key tiles, then ``SPLIT`` CTAs for each
    tile after them; tiles numbered key block fastest, then KV head, then batch): this CTA's
    (key block, KV head, batch, piece, pieces, slot), ``slot`` = split tile * SPLIT + piece its
    place in the pieces' buffer, -1 for a whole tile (piece 0 of 1)."""
    pid = gl.program_id(0)
    split = (pid >= n_full).to(gl.int32)
    j = (pid - n_full) * split
    part = j // SPLIT
    tile = pid + split * (n_full + part - pid)
    return (tile % nb, (tile // nb) % nheads_kv, tile // (nb * nheads_kv), j - part * SPLIT,
            1 + split * (SPLIT - 1), j - (1 - split))


@gluon.jit
def _piece(m_min, m_full_min, m_full_max, m_max, piece, pieces):
    """The query blocks of piece ``piece`` of ``pieces`` of a key tile's range (its masked
    edges kept where they fall inside the piece)."""
    count = m_max - m_min
    lo = m_min + count * piece // pieces
    hi = m_min + count * (piece + 1) // pieces
    return (lo, gl.minimum(gl.maximum(m_full_min, lo), hi), gl.minimum(gl.maximum(m_full_max, lo), hi), hi)


@gluon.jit
def _store_piece(DKV_PART, slot, dk, dv, C: gl.constexpr):
    """A split tile's piece: this warpgroup's fp32 dK (scaled) / dV rows to the piece's slot of
    ``DKV_PART`` ([split tiles * pieces, 2, keys, D]; ``_split_fixup_kernel`` sums a tile's
    pieces in order and writes them out: no atomics, the same bits every run)."""
    KR: gl.constexpr = dk.shape[0]
    D: gl.constexpr = dk.shape[1]
    layout: gl.constexpr = dk.type.layout
    rows = gl.arange(0, KR, layout=gl.SliceLayout(1, layout)) + C * KR
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    offs = gl.expand_dims(rows * D, 1) + gl.expand_dims(cols, 0)
    base = DKV_PART + slot.to(gl.int64) * (2 * 2 * KR * D)
    gl.store(base + offs, dk)
    gl.store(base + 2 * KR * D + offs, dv)


@gluon.jit
def _bwd_consumer(kv, ring, dq_io, out, seq, bounds, scalars, split_out, META: gl.constexpr, C: gl.constexpr):
    """Consumer warpgroup ``C``: dK and dV of keys ``key_start + [0, 64)`` (its K / V tiles
    ``k_bufs.index(C)``, ``v_bufs.index(C)``), and with ``ATOMIC_DQ`` a column slice of
    every query block's dQ over the CTA's keys. ``REG_A`` (``configs.HopperBwdConfig.reg_a``)
    1: K, 2: K and V held in registers as the S^T / dP^T wgmmas' A operand. ``SPLIT`` > 1: a
    CTA with ``slot`` >= 0 ran a piece of a split tile and stores its dK / dV in ``DKV_PART``.
    ``kv`` / ``ring``: as the loader's (``bwd_loader._bwd_loader``); ``dq_io``: (ds_bufs,
    ds_bars, dq_bufs, dq_desc); ``out``: dK / dV's way out (``_store_dkdv``); ``seq``: the
    key block's (tma_batch, head_kv, group, start_k, key_start, len_q, len_k); ``bounds``: its
    query block range (m_min, m_full_min, m_full_max, m_max); ``scalars``: the kernel's;
    ``split_out``: (slot, DKV_PART)."""
    k_bufs, v_bufs, kv_bar = kv
    q_ring, do_ring, lse_ring, delta_ring, q_ready, do_ready, free = ring
    ds_bufs, ds_bars, dq_bufs, dq_desc = dq_io
    tma_batch, head_kv, group, start_k, key_start, len_q, len_k = seq
    m_min, m_full_min, m_full_max, m_max = bounds
    qk_scale, softmax_scale, softcap_log2, window_left, window_right = scalars
    slot, DKV_PART = split_out
    ATOMIC_DQ: gl.constexpr = META.ATOMIC_DQ
    IS_VARLEN: gl.constexpr = META.IS_VARLEN
    HEAD_DIM: gl.constexpr = META.HEAD_DIM
    REG_A: gl.constexpr = META.REG_A
    SPLIT: gl.constexpr = META.SPLIT
    k_buf = k_bufs.index(C)
    v_buf = v_bufs.index(C)
    KR: gl.constexpr = k_buf.shape[0]
    D: gl.constexpr = k_buf.shape[1]
    DV: gl.constexpr = v_buf.shape[1]
    BM: gl.constexpr = q_ring.shape[1]
    dtype: gl.constexpr = k_buf.dtype
    s_layout: gl.constexpr = _acc_layout(BM, dtype)
    o_layout: gl.constexpr = _acc_layout(D, dtype)
    ov_layout: gl.constexpr = _acc_layout(DV, dtype)

    keys = key_start + gl.arange(0, KR, layout=gl.SliceLayout(1, s_layout))
    qcols0 = gl.arange(0, BM, layout=gl.SliceLayout(0, s_layout))
    dk = gl.zeros([KR, D], gl.float32, o_layout)
    dv = gl.zeros([KR, DV], gl.float32, ov_layout)

    mbarrier.wait(kv_bar, 0)
    k_a = a_operand(k_buf, REG_A > 0, s_layout)
    v_a = a_operand(v_buf, REG_A > 1, s_layout)
    count = m_max - m_min
    if ATOMIC_DQ:  # each step adds the dQ of the block before (_bwd_step): slot 0 starts as zeros
        _dq_lag_start(ds_bufs, ds_bars, KR, BM, s_layout, C)
    for g in range(group):
        head = head_kv * group + g
        base = g * count - m_min  # ring slot counter of query block m is base + m
        # masked bottom edge (causal diagonal / window right edge), unmasked middle, masked
        # top edge (window left edge) of ``bounds``; a key block reaching past len_k is masked
        # throughout.
        for seg in gl.static_range(3):  # unrolled: MASK is a compile-time constant per segment
            for m in range(bounds[seg], bounds[seg + 1]):
                dk, dv = _bwd_step(base + m, m, head, k_a, v_a, k_bufs, v_bufs, ring,
                                   (ds_bufs, ds_bars, dq_bufs.index(C), dq_desc), dk, dv, keys, qcols0,
                                   tma_batch, len_q, len_k, scalars, bounds, META, seg != 1, C)
    if ATOMIC_DQ:
        _dq_lag_end(ds_bufs, k_bufs, ds_bars, dq_bufs.index(C), dq_desc, tma_batch, group * count,
                    m_max - 1, head_kv * group + group - 1, BM, C)
        # The other warpgroup's last dQ wgmmas read this warpgroup's K tile, which the
        # epilogue overwrites: both arrive (count 2) once theirs have retired (the last of
        # ds_bars, after the slots' own).
        END: gl.constexpr = ds_bars.shape[0] - 1
        mbarrier.arrive(ds_bars.index(END))
        mbarrier.wait(ds_bars.index(END), 0)
        tma.store_wait(0)

    # Epilogue: dK, dV out through this warpgroup's K_w / V_w tiles (every wgmma reading them
    # has retired; the other warpgroup never touches them); the TMA store clips rows past
    # the (dense) sequence, a varlen sequence's end needs masked stores.
    # (two calls of _store_dkdv: SPLIT decides at compile time whether the branch on slot exists)
    if SPLIT > 1:
        if slot >= 0:
            _store_piece(DKV_PART, slot, dk * softmax_scale, dv, C)
        else:
            _store_dkdv(k_buf, v_buf, dk, dv, out, tma_batch, head_kv, start_k, key_start, len_k, softmax_scale,
                        IS_VARLEN, HEAD_DIM)
    else:
        _store_dkdv(k_buf, v_buf, dk, dv, out, tma_batch, head_kv, start_k, key_start, len_k, softmax_scale,
                    IS_VARLEN, HEAD_DIM)


@gluon.jit
def _store_dkdv(k_buf, v_buf, dk, dv, out, tma_batch, head_kv, start_k, key_start, len_k, softmax_scale,
                IS_VARLEN: gl.constexpr, HEAD_DIM: gl.constexpr):
    """dK * softmax_scale and dV of a warpgroup's keys out through its K / V tiles; ``out``:
    (dk_desc, dv_desc, DK_OUT, (stride_dkn, stride_dkh), DV_OUT, (stride_dvn, stride_dvh))."""
    dk_desc, dv_desc, DK_OUT, stride_dk, DV_OUT, stride_dv = out
    stride_dkn, stride_dkh = stride_dk
    stride_dvn, stride_dvh = stride_dv
    dtype: gl.constexpr = k_buf.dtype
    k_buf.store((dk * softmax_scale).to(dtype))
    v_buf.store(dv.to(dtype))
    if IS_VARLEN:
        row0 = start_k + key_start
        _store_rows(k_buf, DK_OUT + head_kv.to(gl.int64) * stride_dkh + row0.to(gl.int64) * stride_dkn,
                    stride_dkn, len_k - key_start, HEAD_DIM)
        _store_rows(v_buf, DV_OUT + head_kv.to(gl.int64) * stride_dvh + row0.to(gl.int64) * stride_dvn,
                    stride_dvn, len_k - key_start, HEAD_DIM)
    else:
        fence_async_shared()
        tma_store(dk_desc, [tma_batch, key_start, head_kv, 0], _tma_view(k_buf, dk_desc))
        tma_store(dv_desc, [tma_batch, key_start, head_kv, 0], _tma_view(v_buf, dv_desc))
        tma.store_wait(0)


@gluon.jit
def hopper_bwd_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse_desc, delta_desc,
                      DK_OUT, stride_dk, DV_OUT, stride_dv, dq_desc,
                      sizes, CU_Q, CU_K, USED_Q, USED_K, scalars, split_tiles, DKV_PART, META: gl.constexpr):
    """``stride_dk`` / ``stride_dv``: (row, head) strides of DK_OUT / DV_OUT (varlen stores);
    ``sizes``: (nheads, nheads_kv, seqlen_q, seqlen_k, total_q, total_k); ``scalars``:
    (qk_scale, softmax_scale, softcap_log2, window_left, window_right); ``split_tiles``:
    (n_full, nb) of a split last wave (``_split_tile``); ``META``: a ``BwdMeta``. Tuples of
    host scalars only: the launch plans swap tensors in top-level argument slots."""
    nheads, nheads_kv, seqlen_q, seqlen_k, total_q, total_k = sizes
    qk_scale, softmax_scale, softcap_log2, window_left, window_right = scalars
    n_full, nb = split_tiles
    STAGES: gl.constexpr = META.STAGES
    NUM_CONSUMERS: gl.constexpr = META.NUM_CONSUMERS
    HAS_LEFT: gl.constexpr = META.HAS_LEFT
    HAS_RIGHT: gl.constexpr = META.HAS_RIGHT
    ATOMIC_DQ: gl.constexpr = META.ATOMIC_DQ
    IS_VARLEN: gl.constexpr = META.IS_VARLEN
    HAS_SEQUSED_Q: gl.constexpr = META.HAS_SEQUSED_Q
    HAS_SEQUSED_K: gl.constexpr = META.HAS_SEQUSED_K
    LOADER_REGS: gl.constexpr = META.LOADER_REGS
    CONSUMER_REGS: gl.constexpr = META.CONSUMER_REGS
    SPLIT: gl.constexpr = META.SPLIT
    BM: gl.constexpr = q_desc.block_type.shape[1]
    KR: gl.constexpr = k_desc.block_type.shape[1]
    D: gl.constexpr = q_desc.block_type.shape[3]
    DV: gl.constexpr = v_desc.block_type.shape[3]
    dtype: gl.constexpr = q_desc.dtype
    gl.static_assert(KR == 64, "one warpgroup owns 64 keys")
    gl.static_assert(BM == 64, "query tiles of 64 rows")
    gl.static_assert(lse_desc.block_type.shape[2] == BM, "LSE tiles match the query tiles")
    gl.static_assert(NUM_CONSUMERS == 2, "two consumer warpgroups")
    gl.static_assert(D == DV, "headdim == headdim_v")
    gl.static_assert(not (IS_VARLEN and ATOMIC_DQ), "varlen: dQ by the dQ kernel")
    BLOCK_N: gl.constexpr = KR * NUM_CONSUMERS
    if SPLIT > 1:  # 1D grid, the last wave's tiles in SPLIT pieces (host: ``tail_pieces``)
        n_block, head_kv, batch, piece, pieces, slot = _split_tile(n_full, nb, nheads_kv, SPLIT)
    else:  # grid (key blocks, KV heads, batch)
        n_block, head_kv, batch = gl.program_id(0), gl.program_id(1), gl.program_id(2)
        slot = n_block * 0 - 1
    (tma_batch, head_kv, group, start_q, len_q, start_k, len_k, stat0, key0,
     m_min, m_full_min, m_full_max, m_max) = _key_tile_at(
        n_block, head_kv, batch, nheads, nheads_kv, seqlen_q, seqlen_k, total_q, total_k, CU_Q, CU_K, USED_Q, USED_K,
        window_left, window_right, BM, BLOCK_N, HAS_LEFT, HAS_RIGHT, IS_VARLEN,
        HAS_SEQUSED_Q, HAS_SEQUSED_K)
    if SPLIT > 1:
        m_min, m_full_min, m_full_max, m_max = _piece(m_min, m_full_min, m_full_max, m_max, piece, pieces)

    k_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([KR, D], dtype)
    v_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([KR, DV], dtype)
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, D], dtype)
    do_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, DV], dtype)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([KR, BM], dtype)
    stat_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)
    k_bufs = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS, KR, D], k_layout)
    v_bufs = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS, KR, DV], v_layout)
    q_ring = gl.allocate_shared_memory(dtype, [STAGES, BM, D], q_layout)
    do_ring = gl.allocate_shared_memory(dtype, [STAGES, BM, DV], do_layout)
    lse_ring = gl.allocate_shared_memory(gl.float32, [STAGES, BM], stat_layout)
    delta_ring = gl.allocate_shared_memory(gl.float32, [STAGES, BM], stat_layout)
    DS_SLOTS: gl.constexpr = 4  # (_bwd_step indexes them by it & 3)
    if ATOMIC_DQ:
        # dS^T in four slots per warpgroup ([slot, warpgroup], _bwd_step), dQ staging per
        # warpgroup (a column half of the row block)
        DQN: gl.constexpr = D // 2
        ds_bufs = gl.allocate_shared_memory(dtype, [DS_SLOTS * NUM_CONSUMERS, KR, BM], ds_layout)
        dq_bufs = gl.allocate_shared_memory(gl.float32, [NUM_CONSUMERS, BM, DQN],
                                            gl.NVMMASharedLayout.get_default_for([BM, DQN], gl.float32))
    else:
        ds_bufs = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS, KR, BM], ds_layout)  # unused
        dq_bufs = ds_bufs
    # ds_bars (both warpgroups arrive): 0-3 dS^T of a slot written, then the loop's end
    ds_bars = gl.allocate_shared_memory(gl.int64, [DS_SLOTS + 1, 1], mbarrier.MBarrierLayout())
    if ATOMIC_DQ:
        for i in gl.static_range(DS_SLOTS + 1):
            mbarrier.init(ds_bars.index(i), count=NUM_CONSUMERS)
    kv_bar, q_ready, do_ready, free = _loader_barriers(STAGES, NUM_CONSUMERS)

    # (the partitions' arguments grouped in tuples: the same PTX as spelled out one by one)
    kv = (k_bufs, v_bufs, kv_bar)
    ring = (q_ring, do_ring, lse_ring, delta_ring, q_ready, do_ready, free)
    dq_io = (ds_bufs, ds_bars, dq_bufs, dq_desc)
    out = (dk_desc, dv_desc, DK_OUT, stride_dk, DV_OUT, stride_dv)
    bounds = (m_min, m_full_min, m_full_max, m_max)
    split_out = (slot, DKV_PART)
    gl.warp_specialize(
        [(_bwd_consumer, (kv, ring, dq_io, out, (tma_batch, head_kv, group, start_k, key0, len_q, len_k),
                          bounds, scalars, split_out, META, 0)),
         (_bwd_consumer, (kv, ring, dq_io, out, (tma_batch, head_kv, group, start_k, key0 + KR, len_q, len_k),
                          bounds, scalars, split_out, META, 1)),
         (_bwd_loader, ((q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc), kv, ring,
                        (tma_batch, head_kv, group, start_q, start_k, stat0, key0, m_min, m_max),
                        NUM_CONSUMERS, STAGES))],
        [4, 1], [CONSUMER_REGS, LOADER_REGS])


# ---- host side --------------------------------------------------------------------------

def _kernel_args(pb, q, k, v, dout, dk, dv, stat, delta, dq_accum, params, cfg, atomic_dq, split=None):
    """Arguments of ``hopper_bwd_kernel``: ``pb`` a ``common.Problem``, the tensors its 4D views
    (head dims 96: boxes 128 wide, ``common.kernel_head_dim``); ``split``: None, or (pieces,
    whole tiles, the fp32 dK / dV buffer of the split ones) (``tail_pieces``)."""
    pieces, n_full, dkv_part = split or (1, 0, dq_accum)
    qk_scale, softcap_log2 = params.score_constants()
    kr = ROWS_PER_CONSUMER
    d = kernel_head_dim(q.shape[-1])
    total_q, total_k, cu_q, cu_k, used_q, used_k = pb.seq_args
    meta = BwdMeta(STAGES=cfg.atomic_stages if atomic_dq else cfg.stages, NUM_CONSUMERS=NUM_CONSUMERS,
                   HAS_LEFT=params.window_left >= 0, HAS_RIGHT=params.window_right >= 0,
                   SOFTCAP=params.softcap > 0.0, ATOMIC_DQ=atomic_dq, IS_VARLEN=pb.seq_flags[0],
                   HAS_SEQUSED_Q=pb.seq_flags[1], HAS_SEQUSED_K=pb.seq_flags[2], LOADER_REGS=LOADER_REGS,
                   CONSUMER_REGS=CONSUMER_REGS, HEAD_DIM=q.shape[-1], REG_A=cfg.reg_a_for(params.softcap),
                   SPLIT=pieces, FRESH_TILES=cfg.fresh_tiles)
    return [descriptor(q, BLOCK_M, d), descriptor(k, kr, d), descriptor(v, kr, d), descriptor(dout, BLOCK_M, d),
            descriptor(dk, kr, d), descriptor(dv, kr, d), stat_descriptor(stat), stat_descriptor(delta),
            dk, (dk.stride(1), dk.stride(2)), dv, (dv.stride(1), dv.stride(2)),
            descriptor(dq_accum, BLOCK_M, d // 2),
            (pb.nheads, pb.nheads_kv, pb.seqlen_q, pb.seqlen_k, total_q, total_k), cu_q, cu_k, used_q, used_k,
            (qk_scale, params.softmax_scale, softcap_log2, params.window_left, params.window_right),
            (n_full, ceil_div(pb.seqlen_k, BLOCK_N)), dkv_part, meta]


def bwd(dout, q, k, v, out, lse, params, deterministic=False, cfg=None, dq=None, dk=None, dv=None,
        cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None):
    """(dq, dk, dv) for dense (batch, seqlen, heads, dim) q/k/v/out/dout and lse (batch,
    heads, seqlen_q) fp32 natural log, as the forward returns it, or varlen (total, heads,
    dim) tensors with lse (heads, total_q) and ``cu_seqlens_q/k`` (``seqused_q/k``). Given
    dq/dk/dv (any strides, e.g. views of one packed dqkv) are written; dk/dv that TMA cannot
    store to directly are computed into contiguous buffers and copied. The case must be one
    ``dispatch.hopper_bwd_supports`` accepts (the dispatch checks it once, before calling).

    dK/dV: ``hopper_bwd_kernel``, or ``bwd256`` at head dim 256. dQ: the Gluon dQ kernel
    (``hopper/bwd_dq.py``), or, with ``cfg.atomic_dq`` and not ``deterministic`` (dense
    only), TMA reduce-adds inside the dK/dV kernel (dq = dq_accum * scale)."""
    pb = Problem(q, k, params, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
    d = kernel_head_dim(q.shape[-1])  # 96 / 192: computed as 128 / 256
    cfg = cfg or configs.SM90_HOPPER_BWD[d]
    if not tma_compatible(dout):
        dout = dout.contiguous()
    dq = problem.alloc_output(q.shape, q.dtype, q.device) if dq is None else dq
    dk_out = problem.alloc_output(k.shape, k.dtype, k.device) if dk is None else dk
    dv_out = problem.alloc_output(v.shape, v.dtype, v.device) if dv is None else dv
    if pb.empty():
        return dq.zero_(), dk_out.zero_(), dv_out.zero_()
    # TMA stores need 16-byte aligned strides; anything else goes through a contiguous buffer
    dk = dk_out if tma_compatible(dk_out) else torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = dv_out if tma_compatible(dv_out) else torch.empty(v.shape, dtype=v.dtype, device=v.device)
    dq_out = dq if tma_compatible(dq) else torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if pb.varlen:  # rows no sequence covers (cu_seqlens gaps, past seqused) get zeros
        dq_out.zero_(), dk.zero_(), dv.zero_()
    stat, delta = stats(pb, out, dout, lse)

    q4, k4, v4, do4, dk4, dv4 = (pb.view(x) for x in (q, k, v, dout, dk, dv))
    # (head dim 256: dQ always by the separate kernel)
    atomic_dq = cfg.atomic_dq and not deterministic and not pb.varlen and d not in SPLIT_D_HEAD_DIMS
    grid = (ceil_div(pb.seqlen_k, BLOCK_N), pb.nheads_kv, pb.batch)
    n_tiles = grid[0] * grid[1] * grid[2]
    pieces, n_split = 1, 0  # the last wave's n_split tiles in pieces (tail_pieces)
    if atomic_dq and params.window_left < 0 and params.window_right < 0:
        sms = num_sms(q.device)
        pieces = tail_pieces(n_tiles, sms)
        n_split = n_tiles % sms or n_tiles
    if d in SPLIT_D_HEAD_DIMS:  # D split over the warpgroups; dQ by a separate kernel
        bwd256.launch(pb, q4, k4, v4, do4, dk4, dv4, stat, delta, params, cfg)
    else:
        split = None
        if pieces > 1:
            dkv_part = torch.empty(n_split * pieces * 2 * BLOCK_N * d, dtype=torch.float32, device=q.device)
            split = (pieces, n_tiles - n_split, dkv_part)
            grid = (n_tiles - n_split + pieces * n_split, 1, 1)
        if atomic_dq:
            dq_accum = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        else:
            dq_accum = _unused_dq_accum(q.device, d)
        tensors = (q, k, v, dout, dk, dv, stat, delta, dq_accum) + ((split[2],) if split else ())

        def build():
            return grid, _kernel_args(pb, q4, k4, v4, do4, dk4, dv4, stat, delta, dq_accum, params, cfg,
                                      atomic_dq, split)
        key = None if pb.varlen else (  # dense: a plan per signature (common.planned_launch)
            "bwd", q.shape, q.stride(), k.shape, k.stride(), v.stride(), dout.stride(), dk.stride(),
            dv.stride(), q.dtype, q.get_device(), params, cfg, atomic_dq, pb.seq_flags, pieces)
        planned_launch(hopper_bwd_kernel, key, tensors, build)
        if split:
            _split_fixup(pb, dk4, dv4, split, BLOCK_N, d)
        if atomic_dq:
            _scale_into(dq, dq_accum, params.softmax_scale)
    if not atomic_dq:  # the Gluon dQ kernel, after the dK/dV kernel on the caller's stream
        block_n, v_stages = bwd_dq.tile(cfg, pb.varlen)
        bwd_dq.launch(pb, q4, k4, v4, do4, pb.view(dq_out), stat, delta, params, block_n, v_stages=v_stages)
        if dq_out is not dq:
            dq.copy_(dq_out)
    return _finish(dq, dk, dk_out, dv, dv_out)


def tail_pieces(n_tiles: int, n_sm: int) -> int:
    """Into how many pieces (query-block ranges, 1 = none) to split each key tile of the last
    partial wave when ``n_tiles`` equal CTAs (no mask) run one per SM on ``n_sm`` SMs: with r
    tiles left over, the last wave holds r SMs for a whole tile's time while the others
    idle. Split in 4 where r <= n_sm / 4 (they then run side by side in one round of a
    quarter tile): 2x8192x32x64 (4096 tiles, r = 4 on 132 SMs) 428.4 -> 434.5 TFLOPS and
    424.9 -> 451.3 in two sets of interleaved rounds. Not above: 2x8192x16x128 (2048 tiles,
    r = 68) in 3 pieces lost, 543.6 -> 535.3 and 541.9 -> 535.1 (the CTAs' start times are
    already spread over the last wave; ``benchmarks/results/probes/``
    ``bwd-probe-rounds-d{64,128}-split-*.json`` at fb45c0d)."""
    r = n_tiles % n_sm
    if r == 0 or n_tiles < n_sm or 4 * r > n_sm:
        return 1
    return 4


@triton.jit
def _split_fixup_kernel(PART, DK, DV, n_full, nb, nheads_kv, seqlen_k,
                        stride_dkb, stride_dkn, stride_dkh, stride_dvb, stride_dvn, stride_dvh,
                        BLOCK_N: tl.constexpr, D: tl.constexpr, HEAD_DIM: tl.constexpr, PIECES: tl.constexpr):
    """dK / dV of split tile ``program_id``, the sums of its ``PIECES`` pieces in ``PART`` (in
    order; dK already scaled), to the outputs in their dtype; rows past seqlen_k and columns
    past HEAD_DIM (a padded head dim) are not written."""
    part = tl.program_id(0)
    tile = n_full + part
    n_block = tile % nb
    head = (tile // nb) % nheads_kv
    batch = tile // (nb * nheads_kv)
    rows = tl.arange(0, BLOCK_N)
    cols = tl.arange(0, D)
    src = PART + part.to(tl.int64) * (PIECES * 2 * BLOCK_N * D) + rows[:, None] * D + cols[None, :]
    keys = (n_block * BLOCK_N + rows).to(tl.int64)
    ok = (keys < seqlen_k)[:, None] & (cols < HEAD_DIM)[None, :]
    dk = tl.load(src)
    dv = tl.load(src + BLOCK_N * D)
    for i in tl.static_range(1, PIECES):
        dk += tl.load(src + i * (2 * BLOCK_N * D))
        dv += tl.load(src + i * (2 * BLOCK_N * D) + BLOCK_N * D)
    tl.store(DK + batch.to(tl.int64) * stride_dkb + head.to(tl.int64) * stride_dkh + keys[:, None] * stride_dkn
             + cols[None, :], dk.to(DK.dtype.element_ty), mask=ok)
    tl.store(DV + batch.to(tl.int64) * stride_dvb + head.to(tl.int64) * stride_dvh + keys[:, None] * stride_dvn
             + cols[None, :], dv.to(DV.dtype.element_ty), mask=ok)


def _split_fixup(pb, dk4, dv4, split, block_n, d):
    pieces, n_full, part = split
    n_split = part.numel() // (pieces * 2 * block_n * d)
    launch(_split_fixup_kernel, (n_split,),
           [part, dk4, dv4, n_full, ceil_div(pb.seqlen_k, block_n), pb.nheads_kv, pb.seqlen_k,
            dk4.stride(0), dk4.stride(1), dk4.stride(2), dv4.stride(0), dv4.stride(1), dv4.stride(2),
            block_n, d, dk4.shape[-1], pieces], num_warps=8)


@triton.jit
def _scale_cast_kernel(X, Y, n, scale, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    tl.store(Y + offs, (tl.load(X + offs, mask=ok) * scale).to(Y.dtype.element_ty), mask=ok)


def _scale_into(dq, dq_accum, scale):
    """dq = dq_accum * scale in dq's dtype: one pass where dq is contiguous."""
    if dq.is_contiguous():
        n = dq.numel()
        launch(_scale_cast_kernel, (triton.cdiv(n, 4096),), [dq_accum, dq, n, scale, 4096], num_warps=8)
    else:
        dq.copy_(dq_accum.mul_(scale))


@functools.lru_cache(maxsize=None)
def _unused_dq_accum(device, d):
    """The dq_accum a launch without ATOMIC_DQ passes (its TMA descriptor is built, never read)."""
    return torch.empty((1, BLOCK_M, 1, d), dtype=torch.float32, device=device)


def _finish(dq, dk, dk_out, dv, dv_out):
    """Copy dK / dV computed into contiguous buffers to the requested outputs."""
    if dk is not dk_out:
        dk_out.copy_(dk)
    if dv is not dv_out:
        dv_out.copy_(dv)
    return dq, dk_out, dv_out
