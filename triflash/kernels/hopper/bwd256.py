"""Hopper (sm90) dK/dV kernel for head dim 256 in Gluon, the head-dim axis split over the two
consumer warpgroups; dispatched on sm90 at head dim 256 (``hopper/bwd.py::bwd``), and at 192
on dense batches as 256 (loads zero-filled past the head dim, WG1's stores masked there:
``HEAD_DIM``). dQ comes from the Gluon dQ kernel (``hopper/bwd_dq.py``), as at 64/128.

Why a different structure than ``hopper/bwd.py``: there each warpgroup owns 64 keys and
holds dK and dV for them, 2 x 64 x D fp32; at D = 256 that is 256 registers per thread,
more than a thread has. Here one CTA owns 64 keys of one (batch, KV head), and warpgroup
c in {0, 1} owns columns [128 c, 128 c + 128) of dK and dV (2 x 64 x 128 fp32 = 128
registers). Per query block (64 rows; every query head of the GQA group, as in bwd.py):

* WG0: S^T = K Q^T (64 keys x 64 queries, two wgmmas over the two 128-column halves of K and
  Q), P^T = exp2(S^T * scale_log2 - lse_log2) (masked on edge blocks), P^T -> ``pt_buf``
  (16-bit) for WG1; dV[:, :128] += P^T dO[:, :128] with P^T from registers;
  dK[:, :128] += dS^T Q[:, :128] with dS^T from ``ds_buf``.
* WG1: dP'^T = V dO^T - Delta (two wgmmas, Delta as the initial accumulator);
  dS^T = P^T dP'^T with P^T read back from ``pt_buf`` -> ``ds_buf`` (16-bit) for WG0;
  dV[:, 128:] += P^T dO[:, 128:] (P^T from ``pt_buf``); dK[:, 128:] += dS^T Q[:, 128:]
  (dS^T from registers).
* ``DS_WG1`` off (with softcap, whose dS needs WG0's tanh): WG1 hands dP'^T to WG0
  in fp32 (``dp_buf``, XOR-swizzled: unswizzled, the accumulator's row pairs hit the same
  banks 8 ways and the backward was 8% slower), WG0 computes dS^T.
* loader (1 warp): ``bwd_loader._bwd_loader`` with ``SPLIT_D``: K and V halves once; Q / dO halves
  + lse_log2 / Delta per query block into ``STAGES``-deep rings (``q_ready``, ``do_ready``,
  ``free`` barriers as in bwd.py). Every 256-wide tile is held as two 128-column halves, so
  no shared tile is ever sliced.

Epilogue: with ``TMA_EPILOGUE`` (dense batches) each warpgroup stages its dK / dV halves in
its own K / V half tiles and TMA-stores them (``_store_half_tma``); on varlen batches masked
register stores (``_store_half``).

Exchange barriers (one completion per query block; a writer waits for the reader's
previous completion): ``pt_ready`` / ``pt_free``, ``dp_ready`` / ``dp_free``,
``ds_ready`` / ``ds_free``. The P^T writer never waits for dS^T before writing P^T, and
the dP'^T side only needs P^T, so no two waits form a cycle.

``REG_A`` (dispatched: 1, not with softcap): the first column half of K (WG0) and of V (WG1)
held in registers as the A operand of S^T / dP'^T, so that those wgmmas read only Q / dO
from shared memory (the kernel is bound by shared-memory traffic: docs/hopper.md;
``benchmarks/NOTES.md`` at fb45c0d, section b8688a0).

Shared memory (bf16, 2 stages): K, V 64 KB; Q, dO rings 128 KB; pt 8 KB, ds 8 KB, dp 16 KB
(softcap only); lse / Delta rings 1 KB: 214480 B (230912 B with softcap) of 232448.
"""
from typing import NamedTuple

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

from ..common import ceil_div, tanh
from .bwd_loader import _bwd_loader, _loader_barriers
from .common import (CONSUMER_REGS, LOADER_REGS, _acc_layout, _key_tile, _tma_view, a_operand, descriptor,
                     kernel_head_dim, opaque_zero, planned_launch, stat_descriptor, tma_store, to_16bit)

BLOCK_N = 64   # keys per CTA (wgmma M of S^T / dP^T / dK / dV)
BLOCK_M = 64   # query rows per streamed tile
HALF = 128     # head-dim columns per warpgroup


class Bwd256Meta(NamedTuple):
    """The compile-time choices of ``hopper_bwd256_kernel``, its constexpr ``META``: every
    field specializes the kernel as a constexpr parameter of its own did (a function reads
    the fields it needs into constexprs of the same names)."""
    STAGES: int            # Q / dO ring depth
    HAS_LEFT: bool         # sliding window: left edge
    HAS_RIGHT: bool        # causal / window right edge
    SOFTCAP: bool
    IS_VARLEN: bool
    HAS_SEQUSED_Q: bool
    HAS_SEQUSED_K: bool
    LOADER_REGS: int
    CONSUMER_REGS: int
    HEAD_DIM: int          # the tensors' head dim (192: computed as 256)
    REG_A: int             # configs.HopperBwdConfig.reg_a


@gluon.jit
def _wg_scores(kv, ring, xchg, dkv_out, seq, bounds, scalars, META: gl.constexpr):
    """WG0: S^T, P^T (and dS^T unless ``DS_WG1``); dK and dV columns [0, 128). ``REG_A``
    (``configs.HopperBwdConfig.reg_a``): the first ``REG_A`` K halves in registers.
    ``kv`` / ``ring``: as the loader's (``bwd_loader._bwd_loader``); ``xchg``: the exchange
    tiles and barriers (pt_buf, dp_buf, ds_buf, pt_ready, pt_free, dp_ready, dp_free,
    ds_ready, ds_free); ``dkv_out``: (DK, DV, their (batch, row, head) strides, dk_desc,
    dv_desc); ``seq``: the key block's (tma_batch, head_kv, group, start_k, key0, len_q,
    len_k); ``bounds``: its query block range (m_min, m_full_min, m_full_max, m_max);
    ``scalars``: the kernel's."""
    k_bufs, v_bufs, kv_bar = kv
    q_ring, do_ring, lse_ring, delta_ring, q_ready, do_ready, free = ring
    pt_buf, dp_buf, ds_buf, pt_ready, pt_free, dp_ready, dp_free, ds_ready, ds_free = xchg
    DK, DV, stride_dk, stride_dv, dk_desc, dv_desc = dkv_out
    stride_dkb, stride_dkn, stride_dkh = stride_dk
    stride_dvb, stride_dvn, stride_dvh = stride_dv
    tma_batch, head_kv, group, start_k, key0, len_q, len_k = seq
    m_min, m_full_min, m_full_max, m_max = bounds
    qk_scale, softmax_scale, softcap_log2, window_left, window_right = scalars
    STAGES: gl.constexpr = META.STAGES
    HAS_LEFT: gl.constexpr = META.HAS_LEFT
    HAS_RIGHT: gl.constexpr = META.HAS_RIGHT
    SOFTCAP: gl.constexpr = META.SOFTCAP
    IS_VARLEN: gl.constexpr = META.IS_VARLEN
    REG_A: gl.constexpr = META.REG_A
    # dS^T by WG1 from P^T in 16 bits, but with softcap (its dS needs WG0's tanh)
    DS_WG1: gl.constexpr = not SOFTCAP
    # dK / dV out by TMA stores, but on a varlen batch (they would cross into the next sequence)
    TMA_EPILOGUE: gl.constexpr = not IS_VARLEN
    dtype: gl.constexpr = k_bufs.dtype
    KN: gl.constexpr = k_bufs.shape[1]
    H: gl.constexpr = k_bufs.shape[2]
    BM: gl.constexpr = q_ring.shape[1]
    KW: gl.constexpr = 32 // dtype.primitive_bitwidth
    s_layout: gl.constexpr = _acc_layout(BM, dtype)
    o_layout: gl.constexpr = _acc_layout(H, dtype)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=KW)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    keys = key0 + gl.arange(0, KN, layout=gl.SliceLayout(1, s_layout))
    qcols0 = gl.arange(0, BM, layout=col_layout)
    dk = gl.zeros([KN, H], gl.float32, o_layout)
    dv = gl.zeros([KN, H], gl.float32, o_layout)
    mbarrier.wait(kv_bar, 0)
    k0 = a_operand(k_bufs.index(0), REG_A > 0, s_layout)  # the first REG_A halves in registers
    k1 = a_operand(k_bufs.index(1), REG_A > 1, s_layout)
    count = m_max - m_min
    bounds = (m_min, m_full_min, m_full_max, m_max)
    for g in range(group):
        base = g * count - m_min
        for seg in gl.static_range(3):
            for m in range(bounds[seg], bounds[seg + 1]):
                it = base + m
                stage = it % STAGES
                phase = (it // STAGES) & 1
                x = it & 1  # exchange-barrier phase of this query block
                mbarrier.wait(q_ready.index(stage), phase)
                q_lo = q_ring.index(2 * stage)
                s_tok = warpgroup_mma(k0, q_lo.permute((1, 0)),
                                      gl.zeros([KN, BM], gl.float32, s_layout), use_acc=False, is_async=True)
                s_tok = warpgroup_mma(k1, q_ring.index(2 * stage + 1).permute((1, 0)), s_tok, is_async=True)
                s = warpgroup_mma_wait(0, deps=(s_tok,))
                lse = gl.expand_dims(lse_ring.index(stage).load(col_layout), 0)
                if SOFTCAP:
                    t = tanh(s * qk_scale)
                    p = gl.exp2(t * softcap_log2 - lse)
                else:
                    p = gl.exp2(s * qk_scale - lse)
                if seg != 1:
                    # as in bwd.py: (key - query) differences against scalar thresholds
                    diff = gl.expand_dims(keys - (m + opaque_zero(m)) * BM, 1) - gl.expand_dims(qcols0, 0)
                    ok = gl.expand_dims(keys < len_k, 1)
                    if HAS_RIGHT:
                        ok = ok & (diff <= len_k - len_q + window_right)
                    if HAS_LEFT:
                        ok = ok & (diff >= len_k - len_q - window_left)
                    p = gl.where(ok, p, 0.0)
                p16 = to_16bit(p, dtype)
                # P^T for WG1's half of dV (and its dS^T with DS_WG1)
                mbarrier.wait(pt_free, x ^ 1)
                pt_buf.store(p16)
                fence_async_shared()
                mbarrier.arrive(pt_ready)
                mbarrier.wait(do_ready.index(stage), phase)
                dv_tok = warpgroup_mma(gl.convert_layout(p16, op_layout), do_ring.index(2 * stage), dv,
                                       is_async=True)
                if DS_WG1:
                    # dS^T from WG1, read by both warpgroups' wgmmas
                    mbarrier.wait(ds_ready, x)
                    dk_tok = warpgroup_mma(ds_buf, q_lo, dk, is_async=True)
                    dv, dk = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok))
                    mbarrier.arrive(ds_free)
                else:
                    if SOFTCAP:
                        p = p * (1.0 - t * t)
                    # dS^T = P^T (dP^T - Delta), dP'^T from WG1
                    mbarrier.wait(dp_ready, x)
                    dp = dp_buf.load(s_layout)
                    mbarrier.arrive(dp_free)
                    ds16 = to_16bit(p * dp, dtype)
                    mbarrier.wait(ds_free, x ^ 1)
                    ds_buf.store(ds16)
                    fence_async_shared()
                    mbarrier.arrive(ds_ready)
                    dk_tok = warpgroup_mma(gl.convert_layout(ds16, op_layout), q_lo, dk, is_async=True)
                    dv, dk = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok))
                mbarrier.arrive(free.index(stage))
    if TMA_EPILOGUE:
        # K half 0 is read by WG0 only; V half 0 by WG1's dP'^T, whose last one retired
        # before WG1's last dS^T / dP'^T hand-off that WG0 waited for above
        _store_half_tma(dk * softmax_scale, dv, k_bufs.index(0), v_bufs.index(0), dk_desc, dv_desc,
                        tma_batch, key0, head_kv, 0)
    else:
        _store_half(dk * softmax_scale, DK, stride_dkb, stride_dkn, stride_dkh, tma_batch, head_kv,
                    start_k, key0, len_k, 0, o_layout, 2 * H)
        _store_half(dv, DV, stride_dvb, stride_dvn, stride_dvh, tma_batch, head_kv, start_k, key0, len_k, 0,
                    o_layout, 2 * H)


@gluon.jit
def _dprobs_t(v0, v1, do_ring, delta_ring, do_ready, it, STAGES: gl.constexpr,
              s_layout: gl.constexpr, col_layout: gl.constexpr):
    """dP'^T = V dO^T - Delta of ring slot ``it`` (``v0`` / ``v1``: V's halves, shared or
    registers), waited for."""
    KN: gl.constexpr = v0.shape[0]
    BM: gl.constexpr = do_ring.shape[1]
    stage = it % STAGES
    mbarrier.wait(do_ready.index(stage), (it // STAGES) & 1)
    acc = gl.zeros([KN, BM], gl.float32, s_layout) - gl.expand_dims(delta_ring.index(stage).load(col_layout), 0)
    dp_tok = warpgroup_mma(v0, do_ring.index(2 * stage).permute((1, 0)), acc, is_async=True)
    dp_tok = warpgroup_mma(v1, do_ring.index(2 * stage + 1).permute((1, 0)), dp_tok, is_async=True)
    return warpgroup_mma_wait(0, deps=(dp_tok,))


@gluon.jit
def _wg_dprobs(kv, ring, xchg, dkv_out, seq, bounds, scalars, META: gl.constexpr):
    """WG1: dP'^T (and dS^T = P^T dP'^T with ``DS_WG1``, P^T from WG0 in 16 bits: no fp32
    exchange); dK and dV columns [128, HEAD_DIM). Arguments as ``_wg_scores``'."""
    k_bufs, v_bufs, kv_bar = kv
    q_ring, do_ring, lse_ring, delta_ring, q_ready, do_ready, free = ring
    pt_buf, dp_buf, ds_buf, pt_ready, pt_free, dp_ready, dp_free, ds_ready, ds_free = xchg
    DK, DV, stride_dk, stride_dv, dk_desc, dv_desc = dkv_out
    stride_dkb, stride_dkn, stride_dkh = stride_dk
    stride_dvb, stride_dvn, stride_dvh = stride_dv
    tma_batch, head_kv, group, start_k, key0, len_q, len_k = seq
    m_min, m_full_min, m_full_max, m_max = bounds
    qk_scale, softmax_scale, softcap_log2, window_left, window_right = scalars
    STAGES: gl.constexpr = META.STAGES
    SOFTCAP: gl.constexpr = META.SOFTCAP
    IS_VARLEN: gl.constexpr = META.IS_VARLEN
    HEAD_DIM: gl.constexpr = META.HEAD_DIM
    REG_A: gl.constexpr = META.REG_A
    DS_WG1: gl.constexpr = not SOFTCAP  # (as _wg_scores')
    TMA_EPILOGUE: gl.constexpr = not IS_VARLEN
    dtype: gl.constexpr = k_bufs.dtype
    KN: gl.constexpr = k_bufs.shape[1]
    H: gl.constexpr = k_bufs.shape[2]
    BM: gl.constexpr = q_ring.shape[1]
    KW: gl.constexpr = 32 // dtype.primitive_bitwidth
    s_layout: gl.constexpr = _acc_layout(BM, dtype)
    o_layout: gl.constexpr = _acc_layout(H, dtype)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=KW)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    dk = gl.zeros([KN, H], gl.float32, o_layout)
    dv = gl.zeros([KN, H], gl.float32, o_layout)
    mbarrier.wait(kv_bar, 0)
    v0 = a_operand(v_bufs.index(0), REG_A > 0, s_layout)
    v1 = a_operand(v_bufs.index(1), REG_A > 1, s_layout)
    for it in range(group * (m_max - m_min)):
        stage = it % STAGES
        phase = (it // STAGES) & 1
        x = it & 1
        do_hi = do_ring.index(2 * stage + 1)
        dp = _dprobs_t(v0, v1, do_ring, delta_ring, do_ready, it, STAGES, s_layout, col_layout)
        if DS_WG1:
            mbarrier.wait(pt_ready, x)
            dv_tok = warpgroup_mma(pt_buf, do_hi, dv, is_async=True)
            ds16 = to_16bit(pt_buf.load(s_layout).to(gl.float32) * dp, dtype)
            mbarrier.wait(ds_free, x ^ 1)
            ds_buf.store(ds16)
            fence_async_shared()
            mbarrier.arrive(ds_ready)
            mbarrier.wait(q_ready.index(stage), phase)
            dk_tok = warpgroup_mma(gl.convert_layout(ds16, op_layout), q_ring.index(2 * stage + 1), dk,
                                   is_async=True)
            dv, dk = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok))
            mbarrier.arrive(pt_free)  # (ds_free: WG0, the only reader of ds_buf)
        else:
            mbarrier.wait(dp_free, x ^ 1)
            dp_buf.store(dp)
            fence_async_shared()
            mbarrier.arrive(dp_ready)
            mbarrier.wait(pt_ready, x)
            dv_tok = warpgroup_mma(pt_buf, do_hi, dv, is_async=True)
            mbarrier.wait(q_ready.index(stage), phase)
            mbarrier.wait(ds_ready, x)
            dk_tok = warpgroup_mma(ds_buf, q_ring.index(2 * stage + 1), dk, is_async=True)
            dv, dk = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok))
            mbarrier.arrive(pt_free)
            mbarrier.arrive(ds_free)
        mbarrier.arrive(free.index(stage))
    if TMA_EPILOGUE:
        # V half 1 is read by WG1 only; K half 1 by WG0's S^T, whose last one retired before
        # WG0's last P^T hand-off that WG1 waited for above. The TMA store clips the
        # columns past HEAD_DIM (192).
        _store_half_tma(dk * softmax_scale, dv, k_bufs.index(1), v_bufs.index(1), dk_desc, dv_desc,
                        tma_batch, key0, head_kv, H)
    else:
        _store_half(dk * softmax_scale, DK, stride_dkb, stride_dkn, stride_dkh, tma_batch, head_kv,
                    start_k, key0, len_k, H, o_layout, HEAD_DIM)
        _store_half(dv, DV, stride_dvb, stride_dvn, stride_dvh, tma_batch, head_kv, start_k, key0, len_k, H,
                    o_layout, HEAD_DIM)


@gluon.jit
def _store_half_tma(dk, dv, k_buf, v_buf, dk_desc, dv_desc, tma_batch, key0, head_kv, COL0: gl.constexpr):
    """Dense batches: the [64 keys, 128] dK / dV halves through this warpgroup's own (no longer
    read) K / V half tiles, out by TMA stores (rows past the sequence clipped)."""
    k_buf.store(dk.to(k_buf.dtype))
    v_buf.store(dv.to(v_buf.dtype))
    fence_async_shared()
    tma_store(dk_desc, [tma_batch, key0, head_kv, COL0], _tma_view(k_buf, dk_desc))
    tma_store(dv_desc, [tma_batch, key0, head_kv, COL0], _tma_view(v_buf, dv_desc))
    tma.store_wait(0)


@gluon.jit
def _store_half(acc, PTR, stride_b, stride_n, stride_h, tma_batch, head_kv, start_k, key0, len_k,
                COL0: gl.constexpr, layout: gl.constexpr, HEAD_DIM: gl.constexpr):
    """A [64 keys, 128] fp32 accumulator -> columns [COL0, min(COL0 + 128, HEAD_DIM)) of dK or
    dV, rows ``start_k + key0 + i`` for the sequence's keys ``key0 + i < len_k``."""
    KN: gl.constexpr = acc.shape[0]
    H: gl.constexpr = acc.shape[1]
    keys = key0 + gl.arange(0, KN, layout=gl.SliceLayout(1, layout))
    cols = COL0 + gl.arange(0, H, layout=gl.SliceLayout(0, layout))
    ptrs = (PTR + tma_batch.to(gl.int64) * stride_b + head_kv.to(gl.int64) * stride_h
            + gl.expand_dims((start_k + keys).to(gl.int64) * stride_n, 1) + gl.expand_dims(cols, 0))
    if COL0 + H > HEAD_DIM:  # head dim 192: the upper half's last 64 columns are padding
        ok = gl.expand_dims(keys < len_k, 1) & gl.expand_dims(cols < HEAD_DIM, 0)
    else:
        ok = gl.expand_dims(keys < len_k, 1)
    gl.store(ptrs, acc.to(PTR.dtype.element_ty), mask=ok)


@gluon.jit
def hopper_bwd256_kernel(q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, dk_desc, dv_desc,
                         DK, DV, stride_dk, stride_dv, sizes, CU_Q, CU_K, USED_Q, USED_K, scalars,
                         META: gl.constexpr):
    """``stride_dk`` / ``stride_dv``: (batch, row, head) strides of DK / DV (varlen stores);
    ``sizes``: (nheads, nheads_kv, seqlen_q, seqlen_k, total_q, total_k); ``scalars``:
    (qk_scale, softmax_scale, softcap_log2, window_left, window_right); ``META``: a
    ``Bwd256Meta``. Tuples of host scalars only: the launch plans swap tensors in top-level
    argument slots."""
    nheads, nheads_kv, seqlen_q, seqlen_k, total_q, total_k = sizes
    qk_scale, softmax_scale, softcap_log2, window_left, window_right = scalars
    STAGES: gl.constexpr = META.STAGES
    HAS_LEFT: gl.constexpr = META.HAS_LEFT
    HAS_RIGHT: gl.constexpr = META.HAS_RIGHT
    IS_VARLEN: gl.constexpr = META.IS_VARLEN
    HAS_SEQUSED_Q: gl.constexpr = META.HAS_SEQUSED_Q
    HAS_SEQUSED_K: gl.constexpr = META.HAS_SEQUSED_K
    LOADER_REGS: gl.constexpr = META.LOADER_REGS
    CONSUMER_REGS: gl.constexpr = META.CONSUMER_REGS
    HEAD_DIM: gl.constexpr = META.HEAD_DIM
    BM: gl.constexpr = q_desc.block_type.shape[1]
    KN: gl.constexpr = k_desc.block_type.shape[1]
    H: gl.constexpr = q_desc.block_type.shape[3]
    dtype: gl.constexpr = q_desc.dtype
    gl.static_assert(KN == 64, "64 keys per CTA")
    gl.static_assert(BM == 64, "query tiles of 64 rows")
    gl.static_assert(H == 128, "each warpgroup owns 128 head-dim columns")
    gl.static_assert(HEAD_DIM > H and HEAD_DIM <= 2 * H, "head dims 192 / 256 (columns past it are padding)")
    (tma_batch, head_kv, group, start_q, len_q, start_k, len_k, stat0, key0,
     m_min, m_full_min, m_full_max, m_max) = _key_tile(
        nheads, nheads_kv, seqlen_q, seqlen_k, total_q, total_k, CU_Q, CU_K, USED_Q, USED_K,
        window_left, window_right, BM, KN, HAS_LEFT, HAS_RIGHT, IS_VARLEN, HAS_SEQUSED_Q, HAS_SEQUSED_K)

    half_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([KN, H], dtype)
    x_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([KN, BM], dtype)
    # XOR-swizzled so that rows r and r + 4 of a wgmma accumulator store hit different 32-byte
    # bank groups (unswizzled: 8-way conflicts, 8% slower backward on the H200)
    dp_layout: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 4, order=[1, 0])
    stat_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)
    k_bufs = gl.allocate_shared_memory(dtype, [2, KN, H], half_layout)
    v_bufs = gl.allocate_shared_memory(dtype, [2, KN, H], half_layout)
    q_ring = gl.allocate_shared_memory(dtype, [2 * STAGES, BM, H], half_layout)
    do_ring = gl.allocate_shared_memory(dtype, [2 * STAGES, BM, H], half_layout)
    lse_ring = gl.allocate_shared_memory(gl.float32, [STAGES, BM], stat_layout)
    delta_ring = gl.allocate_shared_memory(gl.float32, [STAGES, BM], stat_layout)
    pt_buf = gl.allocate_shared_memory(dtype, [KN, BM], x_layout)
    ds_buf = gl.allocate_shared_memory(dtype, [KN, BM], x_layout)
    dp_buf = gl.allocate_shared_memory(gl.float32, [KN, BM], dp_layout)
    kv_bar, q_ready, do_ready, free = _loader_barriers(STAGES, 2)
    xbar = gl.allocate_shared_memory(gl.int64, [6, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(6):
        mbarrier.init(xbar.index(i), count=1)
    pt_ready = xbar.index(0)
    pt_free = xbar.index(1)
    dp_ready = xbar.index(2)
    dp_free = xbar.index(3)
    ds_ready = xbar.index(4)
    ds_free = xbar.index(5)

    kv = (k_bufs, v_bufs, kv_bar)
    ring = (q_ring, do_ring, lse_ring, delta_ring, q_ready, do_ready, free)
    xchg = (pt_buf, dp_buf, ds_buf, pt_ready, pt_free, dp_ready, dp_free, ds_ready, ds_free)
    dkv_out = (DK, DV, stride_dk, stride_dv, dk_desc, dv_desc)
    seq = (tma_batch, head_kv, group, start_k, key0, len_q, len_k)
    bounds = (m_min, m_full_min, m_full_max, m_max)
    gl.warp_specialize(
        [(_wg_scores, (kv, ring, xchg, dkv_out, seq, bounds, scalars, META)),
         (_wg_dprobs, (kv, ring, xchg, dkv_out, seq, bounds, scalars, META)),
         (_bwd_loader, ((q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc), kv, ring,
                        (tma_batch, head_kv, group, start_q, start_k, stat0, key0, m_min, m_max),
                        2, STAGES, True))],
        [4, 1], [CONSUMER_REGS, LOADER_REGS])


def kernel_args(pb, q, k, v, dout, dk, dv, stat, delta, params, cfg):
    """(grid, args) of ``hopper_bwd256_kernel``: ``pb`` a ``common.Problem``, the tensors its 4D
    views, ``stat`` / ``delta`` the buffers of ``hopper.bwd_stats.stats``, ``cfg`` the
    ``configs.HopperBwdConfig`` tile."""
    d = q.shape[-1]
    assert kernel_head_dim(d) == 2 * HALF and v.shape[-1] == d, "head dims 192 / 256 only"
    qk_scale, softcap_log2 = params.score_constants()
    tma_epilogue = not pb.varlen  # (the kernel's TMA_EPILOGUE)
    total_q, total_k, cu_q, cu_k, used_q, used_k = pb.seq_args
    grid = (ceil_div(pb.seqlen_k, BLOCK_N), pb.nheads_kv, pb.batch)
    k_desc = descriptor(k, BLOCK_N, HALF)
    v_desc = descriptor(v, BLOCK_N, HALF)
    args = [descriptor(q, BLOCK_M, HALF), k_desc, v_desc,
            descriptor(dout, BLOCK_M, HALF), stat_descriptor(stat), stat_descriptor(delta),
            # unused without the TMA epilogue: K's / V's descriptors stand in
            descriptor(dk, BLOCK_N, HALF) if tma_epilogue else k_desc,
            descriptor(dv, BLOCK_N, HALF) if tma_epilogue else v_desc,
            dk, dv, dk.stride()[:3], dv.stride()[:3],
            (pb.nheads, pb.nheads_kv, pb.seqlen_q, pb.seqlen_k, total_q, total_k), cu_q, cu_k, used_q, used_k,
            (qk_scale, params.softmax_scale, softcap_log2, params.window_left, params.window_right),
            Bwd256Meta(STAGES=cfg.stages, HAS_LEFT=params.window_left >= 0, HAS_RIGHT=params.window_right >= 0,
                       SOFTCAP=params.softcap > 0.0, IS_VARLEN=pb.seq_flags[0], HAS_SEQUSED_Q=pb.seq_flags[1],
                       HAS_SEQUSED_K=pb.seq_flags[2], LOADER_REGS=LOADER_REGS, CONSUMER_REGS=CONSUMER_REGS,
                       HEAD_DIM=d, REG_A=cfg.reg_a_for(params.softcap))]
    return grid, args


def launch(pb, q, k, v, dout, dk, dv, stat, delta, params, cfg):
    """``cfg``: the ``configs.HopperBwdConfig`` tile. A dense batch launches through the plan
    of its signature (``common.planned_launch``); varlen batches build their arguments every
    call."""
    def build():
        return kernel_args(pb, q, k, v, dout, dk, dv, stat, delta, params, cfg)
    key = None if pb.varlen else (
        "bwd256", q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), dout.stride(), dk.stride(),
        dv.stride(), q.dtype, q.get_device(), params, cfg, pb.seq_flags)
    planned_launch(hopper_bwd256_kernel, key, (q, k, v, dout, dk, dv, stat, delta), build)
