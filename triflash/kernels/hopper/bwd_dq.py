"""Hopper (sm90) dQ kernel in Gluon: the backward's dQ pass with the forward's structure,
dispatched at every Hopper head dim (``hopper/bwd.py::bwd``), dense or varlen.

One CTA owns ``NUM_CONSUMERS * 64`` query rows of one (batch, head):

* **loader** (1 warp): TMA-loads each consumer's Q and dO tiles once (one barrier), then
  streams the K and V tiles (``BLOCK_N`` keys) of every key block ``common.n_block_range``
  says the query block visits into ``STAGES``-deep rings; one ``kv_ready`` barrier per slot
  (TMA completes it with the byte count of K + V) and one ``kv_free`` barrier that each
  consumer arrives on once its last wgmma reading the slot (dQ += dS K) has retired. With
  ``V_STAGES`` = 1 (``HopperBwdConfig.dq_split_v``) V has a single slot of its own,
  landing on K's ``kv_ready`` and freed by ``v_free`` once dP' (its only reader) has retired,
  so that 64-key tiles fit at head dim 256 (2 K slots + 1 V slot + Q + dO: 229680 B).
* **consumers** (one warpgroup each, 64 query rows): per key block
  dP' = dO V^T - Delta (Delta as the initial accumulator: issued first, see
  ``hopper/bwd.py``), S = Q K^T, P = exp2(S * scale_log2 - lse_log2) (masked on edge
  blocks), dS = P dP' (times 1 - tanh^2 with softcap), dQ += dS K with dS in registers as
  the wgmma A operand and the K tile (keys x D, row-major) as B.
* epilogue: dQ * softmax_scale into the consumer's own Q tile, TMA store (clips rows past
  the sequence).

Statistics come from the padded ``bwd_stats_kernel`` buffers of ``hopper/bwd.py``
(lse in log2 units with +inf for rows past len_q and rows that saw no key, Delta), read with
plain loads: 64 floats per consumer per CTA. Math and masking are those of the portable
``bwd_dq_kernel``.
"""
from typing import NamedTuple

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier, warpgroup_mma, warpgroup_mma_wait)

from ..common import ceil_div, tanh, visible
from .common import (CONSUMER_REGS, LOADER_REGS, _acc_layout, _seq_query_tile, _store_query_tile, _tma_view,
                     descriptor, kernel_head_dim, opaque_zero, planned_launch, stat_row0, tma_load, to_16bit)

ROWS_PER_CONSUMER = 64
NUM_CONSUMERS = 2  # consumer warpgroups
# K / V ring slots (at 128 a 3-deep ring measured slower: docs/performance.md)
STAGES = 2


class DqMeta(NamedTuple):
    """The compile-time choices of ``hopper_dq_kernel``, its constexpr ``META``: every field
    specializes the kernel as a constexpr parameter of its own did (one parameter instead of
    twelve; a function reads the fields it needs into constexprs of the same names)."""
    STAGES: int            # K / V ring depth
    V_STAGES: int          # 0: V in K's slots; 1: V in one slot of its own
    NUM_CONSUMERS: int     # consumer warpgroups (2)
    HAS_LEFT: bool         # sliding window: left edge
    HAS_RIGHT: bool        # causal / window right edge
    SOFTCAP: bool
    IS_VARLEN: bool
    HAS_SEQUSED_Q: bool
    HAS_SEQUSED_K: bool
    LOADER_REGS: int
    CONSUMER_REGS: int
    HEAD_DIM: int          # the tensors' head dim (96 / 192: computed as 128 / 256)


@gluon.jit
def _query_tile(seq, window_left, window_right, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                META: gl.constexpr):
    """``common._seq_query_tile`` of this CTA; ``seq``: (num_m_blocks, section_heads, nheads,
    nheads_kv, seqlen_q, seqlen_k, total_q, total_k, CU_Q, CU_K, USED_Q, USED_K)."""
    (num_m_blocks, section_heads, nheads, nheads_kv, seqlen_q, seqlen_k, total_q, total_k,
     CU_Q, CU_K, USED_Q, USED_K) = seq
    return _seq_query_tile(
        gl.program_id(0), num_m_blocks, section_heads, nheads, nheads_kv, seqlen_q, seqlen_k, total_q, total_k,
        CU_Q, CU_K, USED_Q, USED_K, window_left, window_right, BLOCK_M, BLOCK_N,
        META.HAS_LEFT, META.HAS_RIGHT, META.IS_VARLEN, META.HAS_SEQUSED_Q, META.HAS_SEQUSED_K)


@gluon.jit
def _dq_loader(descs, smem, seq, window, META: gl.constexpr):
    """The TMA producer. ``descs``: (q_desc, do_desc, k_desc, v_desc); ``smem``: the shared
    tiles and barriers (q_bufs, do_bufs, q_ready, k_ring, v_ring, kv_ready, kv_free, v_free);
    ``seq``: as ``_query_tile``'s; ``window``: (window_left, window_right)."""
    q_desc, do_desc, k_desc, v_desc = descs
    q_bufs, do_bufs, q_ready, k_ring, v_ring, kv_ready, kv_free, v_free = smem
    window_left, window_right = window
    NUM_CONSUMERS: gl.constexpr = META.NUM_CONSUMERS
    STAGES: gl.constexpr = META.STAGES
    V_STAGES: gl.constexpr = META.V_STAGES
    BM: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[1]
    (tma_batch, batch, head, head_kv, start_q, len_q, start_k, len_k, row0,
     n_min, n_full_min, n_full_max, n_max) = _query_tile(seq, window_left, window_right, BM * NUM_CONSUMERS,
                                                          BLOCK_N, META)
    mbarrier.expect(q_ready, NUM_CONSUMERS * (q_desc.block_type.nbytes + do_desc.block_type.nbytes))
    for c in gl.static_range(NUM_CONSUMERS):
        tma_load(q_desc, [tma_batch, start_q + row0 + c * BM, head, 0], q_ready,
                                        _tma_view(q_bufs.index(c), q_desc))
        tma_load(do_desc, [tma_batch, start_q + row0 + c * BM, head, 0], q_ready,
                                        _tma_view(do_bufs.index(c), do_desc))
    for it in range(n_max - n_min):
        n = n_min + it
        stage = it % STAGES
        # a fresh barrier counts as having completed the phase before 0
        mbarrier.wait(kv_free.index(stage), ((it // STAGES) & 1) ^ 1)
        if V_STAGES != 0:  # V in a ring of its own (read by dP' only, so freed before K)
            mbarrier.wait(v_free.index(it % V_STAGES), ((it // V_STAGES) & 1) ^ 1)
        mbarrier.expect(kv_ready.index(stage), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma_load(k_desc, [tma_batch, start_k + n * BLOCK_N, head_kv, 0],
                                        kv_ready.index(stage), _tma_view(k_ring.index(stage), k_desc))
        v_slot = stage if V_STAGES == 0 else it % V_STAGES
        tma_load(v_desc, [tma_batch, start_k + n * BLOCK_N, head_kv, 0],
                                        kv_ready.index(stage), _tma_view(v_ring.index(v_slot), v_desc))


@gluon.jit
def _dq_step(it, n, smem, dq, lse, delta, rows, cols0, len_q, len_k, scalars, seqlen_q,
             META: gl.constexpr, MASK: gl.constexpr, CID: gl.constexpr):
    """Key block ``n`` (ring slot ``it``) for consumer warpgroup ``CID``; returns dq. Each
    wgmma is waited for inside the step (an async token cannot be carried through a loop);
    the two consumer warpgroups overlap each other's element-wise work and wgmmas. ``smem``:
    as the loader's (``_dq_loader``); ``scalars``: the kernel's."""
    q_bufs, do_bufs, q_ready, k_ring, v_ring, kv_ready, kv_free, v_free = smem
    qk_scale, softmax_scale, softcap_log2, window_left, window_right = scalars
    STAGES: gl.constexpr = META.STAGES
    V_STAGES: gl.constexpr = META.V_STAGES
    HAS_LEFT: gl.constexpr = META.HAS_LEFT
    HAS_RIGHT: gl.constexpr = META.HAS_RIGHT
    SOFTCAP: gl.constexpr = META.SOFTCAP
    if V_STAGES == 0:
        slot = CID
    else:
        # A tile index that is CID but not a compile-time constant (``seqlen_q`` >= 0 is a
        # kernel argument; a varlen sequence's len_q, clamped at 0 by common.seqlen_info,
        # would let the compiler fold it), so that ptxas rebuilds the wgmma descriptors of Q,
        # dO and the one V slot each step instead of hoisting them out of the loop in
        # registers (64-key tiles at head dim 256: 1.4 KB of spills, 60 spill loads / stores
        # per step, -> none).
        slot = CID + (it & opaque_zero(seqlen_q))
    q_buf = q_bufs.index(slot)
    do_buf = do_bufs.index(slot)
    BM: gl.constexpr = q_buf.shape[0]
    D: gl.constexpr = q_buf.shape[1]
    BLOCK_N: gl.constexpr = k_ring.shape[1]
    dtype: gl.constexpr = q_buf.dtype
    KW: gl.constexpr = 32 // dtype.primitive_bitwidth
    s_layout: gl.constexpr = _acc_layout(BLOCK_N, dtype)
    o_layout: gl.constexpr = _acc_layout(D, dtype)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=KW)
    stage = it % STAGES
    mbarrier.wait(kv_ready.index(stage), (it // STAGES) & 1)
    k_buf = k_ring.index(stage)
    v_buf = v_ring.index(stage if V_STAGES == 0 else slot - CID)  # (V_STAGES = 1)
    dp_tok = warpgroup_mma(do_buf, v_buf.permute((1, 0)),
                           gl.zeros([BM, BLOCK_N], gl.float32, s_layout) - gl.expand_dims(delta, 1),
                           is_async=True)
    s_tok = warpgroup_mma(q_buf, k_buf.permute((1, 0)), gl.zeros([BM, BLOCK_N], gl.float32, s_layout),
                          use_acc=False, is_async=True)
    dp, s = warpgroup_mma_wait(0, deps=(dp_tok, s_tok))
    if SOFTCAP:
        t = tanh(s * qk_scale)
        p = gl.exp2(t * softcap_log2 - gl.expand_dims(lse, 1))
    else:
        p = gl.exp2(s * qk_scale - gl.expand_dims(lse, 1))
    if MASK:
        cols = n * BLOCK_N + cols0
        p = gl.where(visible(gl.expand_dims(rows, 1), gl.expand_dims(cols, 0), len_q, len_k,
                             window_left, window_right, HAS_LEFT, HAS_RIGHT), p, 0.0)
    ds = p * dp
    if SOFTCAP:
        ds = ds * (1.0 - t * t)
    ds_op = gl.convert_layout(to_16bit(ds, dtype), op_layout)
    dq_tok = warpgroup_mma(ds_op, k_buf, dq, is_async=True)
    if V_STAGES != 0:  # (here, not right after dP' retired: fewer registers live)
        mbarrier.arrive(v_free.index(it % V_STAGES))  # V of this step is no longer read
    dq = warpgroup_mma_wait(0, deps=(dq_tok,))
    mbarrier.arrive(kv_free.index(stage))  # K (and V with a shared slot) no longer read
    return dq


@gluon.jit
def _dq_consumer(smem, dq_out, stats, seq, scalars, META: gl.constexpr, CID: gl.constexpr):
    """Consumer warpgroup ``CID``: dQ of query rows ``row0 + CID * 64 + [0, 64)``.
    ``smem``: as the loader's (``_dq_loader``); ``dq_out``: (dq_desc, DQ, (stride_dqm,
    stride_dqh)); ``stats``: (STAT, DELTA, (stride_sb, stride_sh)); ``seq``: as
    ``_query_tile``'s; ``scalars``: the kernel's."""
    q_bufs, do_bufs, q_ready, k_ring, v_ring, kv_ready, kv_free, v_free = smem
    dq_desc, DQ, stride_dq = dq_out
    stride_dqm, stride_dqh = stride_dq
    STAT, DELTA, stride_s = stats
    stride_sb, stride_sh = stride_s
    (num_m_blocks, section_heads, nheads, nheads_kv, seqlen_q, seqlen_k, total_q, total_k,
     CU_Q, CU_K, USED_Q, USED_K) = seq
    qk_scale, softmax_scale, softcap_log2, window_left, window_right = scalars
    NUM_CONSUMERS: gl.constexpr = META.NUM_CONSUMERS
    IS_VARLEN: gl.constexpr = META.IS_VARLEN
    HEAD_DIM: gl.constexpr = META.HEAD_DIM
    q_buf = q_bufs.index(CID)
    BM: gl.constexpr = q_buf.shape[0]
    D: gl.constexpr = q_buf.shape[1]
    BLOCK_N: gl.constexpr = k_ring.shape[1]
    dtype: gl.constexpr = q_buf.dtype
    s_layout: gl.constexpr = _acc_layout(BLOCK_N, dtype)
    o_layout: gl.constexpr = _acc_layout(D, dtype)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    (tma_batch, batch, head, head_kv, start_q, len_q, start_k, len_k, row0,
     n_min, n_full_min, n_full_max, n_max) = _query_tile(seq, window_left, window_right, BM * NUM_CONSUMERS,
                                                          BLOCK_N, META)
    row_start = row0 + CID * BM
    rows = row_start + gl.arange(0, BM, layout=row_layout)
    cols0 = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    # rows past len_q: lse_log2 = +inf, so P = 0 there (the stats rows of hopper/bwd.py: BM each)
    stat_off = (tma_batch.to(gl.int64) * stride_sb + head.to(gl.int64) * stride_sh
                + stat_row0(batch, start_q, IS_VARLEN, BM) + rows)
    lse = gl.load(STAT + stat_off, mask=rows < len_q, other=float("inf"))
    delta = gl.load(DELTA + stat_off, mask=rows < len_q, other=0.0)
    dq = gl.zeros([BM, D], gl.float32, o_layout)
    mbarrier.wait(q_ready, 0)
    bounds = (n_min, n_full_min, n_full_max, n_max)
    for seg in gl.static_range(3):  # masked left edge, unmasked middle, masked right edge
        for n in range(bounds[seg], bounds[seg + 1]):
            dq = _dq_step(n - n_min, n, smem, dq, lse, delta, rows, cols0, len_q, len_k, scalars, seqlen_q,
                          META, seg != 1, CID)
    # dQ leaves through this consumer's Q tile (every wgmma reading it has retired)
    q_buf.store((dq * softmax_scale).to(dtype))
    _store_query_tile(q_buf, dq_desc, DQ, stride_dqm, stride_dqh, tma_batch, head, start_q, row_start,
                      len_q, IS_VARLEN, HEAD_DIM)


@gluon.jit
def hopper_dq_kernel(q_desc, k_desc, v_desc, do_desc, dq_desc, DQ, stride_dq, STAT, DELTA, stride_s,
                     sizes, CU_Q, CU_K, USED_Q, USED_K, scalars, META: gl.constexpr):
    """``stride_dq``: (row, head) strides of DQ (varlen stores); ``stride_s``: (batch, head)
    strides of STAT / DELTA; ``sizes``: (nheads, nheads_kv, seqlen_q, seqlen_k, num_m_blocks,
    section_heads, total_q, total_k); ``scalars``: (qk_scale, softmax_scale, softcap_log2,
    window_left, window_right); ``META``: a ``DqMeta``. Tuples of host scalars only: the
    launch plans swap tensors in top-level argument slots."""
    nheads, nheads_kv, seqlen_q, seqlen_k, num_m_blocks, section_heads, total_q, total_k = sizes
    qk_scale, softmax_scale, softcap_log2, window_left, window_right = scalars
    STAGES: gl.constexpr = META.STAGES
    V_STAGES: gl.constexpr = META.V_STAGES
    NUM_CONSUMERS: gl.constexpr = META.NUM_CONSUMERS
    LOADER_REGS: gl.constexpr = META.LOADER_REGS
    CONSUMER_REGS: gl.constexpr = META.CONSUMER_REGS
    BM: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[1]
    D: gl.constexpr = q_desc.block_type.shape[3]
    DV: gl.constexpr = v_desc.block_type.shape[3]
    dtype: gl.constexpr = q_desc.dtype
    gl.static_assert(BM == 64, "one warpgroup owns 64 query rows")
    gl.static_assert(NUM_CONSUMERS == 2, "two consumer warpgroups")
    gl.static_assert(D == DV, "headdim == headdim_v")
    gl.static_assert(V_STAGES <= 1, "V shares K's slots (0) or has one of its own (1)")

    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, D], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], dtype)
    q_bufs = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS, BM, D], q_layout)
    do_bufs = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS, BM, D], q_layout)
    k_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], kv_layout)
    # V in K's slots, freed with K (V_STAGES = 0), or in one of its own
    v_ring = gl.allocate_shared_memory(dtype, [STAGES if V_STAGES == 0 else V_STAGES, BLOCK_N, D], kv_layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    kv_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_ready, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(kv_ready.index(i), count=1)
        mbarrier.init(kv_free.index(i), count=NUM_CONSUMERS)
    if V_STAGES == 0:
        v_free = kv_free  # (unused)
    else:  # V's own slot lands on K's kv_ready and is freed once dP' has read it
        v_free = gl.allocate_shared_memory(gl.int64, [V_STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(V_STAGES):
            mbarrier.init(v_free.index(i), count=NUM_CONSUMERS)

    # (the partitions' arguments in the order they were spelled out one by one: the values
    # each partition captures, in that order)
    smem = (q_bufs, do_bufs, q_ready, k_ring, v_ring, kv_ready, kv_free, v_free)
    seq = (num_m_blocks, section_heads, nheads, nheads_kv, seqlen_q, seqlen_k, total_q, total_k,
           CU_Q, CU_K, USED_Q, USED_K)
    dq_out = (dq_desc, DQ, stride_dq)
    stats = (STAT, DELTA, stride_s)
    gl.warp_specialize(
        [(_dq_consumer, (smem, dq_out, stats, seq, scalars, META, 0)),
         (_dq_consumer, (smem, dq_out, stats, seq, scalars, META, 1)),
         (_dq_loader, ((q_desc, do_desc, k_desc, v_desc), smem, seq, (window_left, window_right), META))],
        [4, 1], [CONSUMER_REGS, LOADER_REGS])


def tile(cfg, varlen):
    """(keys per K / V tile, V_STAGES) of the dQ kernel for ``cfg`` (a ``HopperBwdConfig``):
    ``dq_split_v`` keys with V in one slot of its own on a dense batch, else ``dq_block_n``
    keys with V in K's slots. (A varlen batch's 64-key tiles at 256: docs/performance.md,
    "Tried and not kept".)"""
    if cfg.dq_split_v and not varlen:
        return cfg.dq_split_v, 1
    return cfg.dq_block_n, 0


def kernel_args(pb, q, k, v, dout, dq, stat, delta, params, block_n, v_stages=0):
    """Launch arguments of ``hopper_dq_kernel``: ``pb`` a ``common.Problem``, the tensors its 4D
    views, ``stat`` / ``delta`` the buffers of ``hopper.bwd_stats.stats``; returns (grid, args)."""
    bm = ROWS_PER_CONSUMER
    num_m_blocks = ceil_div(pb.seqlen_q, bm * NUM_CONSUMERS)
    qk_scale, softcap_log2 = params.score_constants()
    d = kernel_head_dim(q.shape[-1])  # 96 / 192: boxes 128 / 256 wide
    total_q, total_k, cu_q, cu_k, used_q, used_k = pb.seq_args
    is_varlen, has_used_q, has_used_k = pb.seq_flags
    meta = DqMeta(STAGES=STAGES, V_STAGES=v_stages, NUM_CONSUMERS=NUM_CONSUMERS,
                  HAS_LEFT=params.window_left >= 0, HAS_RIGHT=params.window_right >= 0,
                  SOFTCAP=params.softcap > 0.0, IS_VARLEN=is_varlen, HAS_SEQUSED_Q=has_used_q,
                  HAS_SEQUSED_K=has_used_k, LOADER_REGS=LOADER_REGS, CONSUMER_REGS=CONSUMER_REGS,
                  HEAD_DIM=q.shape[-1])
    args = [descriptor(q, bm, d), descriptor(k, block_n, d), descriptor(v, block_n, d), descriptor(dout, bm, d),
            descriptor(dq, bm, d), dq, (dq.stride(1), dq.stride(2)), stat, delta, (stat.stride(0), stat.stride(1)),
            (pb.nheads, pb.nheads_kv, pb.seqlen_q, pb.seqlen_k, num_m_blocks, pb.section_heads(k, v, params),
             total_q, total_k), cu_q, cu_k, used_q, used_k,
            (qk_scale, params.softmax_scale, softcap_log2, params.window_left, params.window_right), meta]
    return (num_m_blocks * pb.nheads * pb.batch,), args


def launch(pb, q, k, v, dout, dq, stat, delta, params, block_n=64, v_stages=0):
    """A dense batch launches through the plan of its signature (``common.planned_launch``),
    a varlen one builds its arguments every call."""
    def build():
        return kernel_args(pb, q, k, v, dout, dq, stat, delta, params, block_n, v_stages=v_stages)
    key = None if pb.varlen else (
        "dq", q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), dout.stride(), dq.stride(),
        q.dtype, q.get_device(), params, block_n, v_stages, pb.seq_flags)
    planned_launch(hopper_dq_kernel, key, (q, k, v, dout, dq, stat, delta), build)
