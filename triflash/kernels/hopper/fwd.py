"""Hopper (sm90) forward in Gluon: TMA producer warp + wgmma consumer warpgroups.

One CTA computes one query block of ``NUM_CONSUMERS * 64`` rows of one (batch, head):

* **loader** (1 warp, few registers; ``hopper/fwd_loader.py``): TMA-loads each consumer's
  64-row Q tile once, then streams K and V tiles of the visited key blocks into
  ``STAGES``-deep rings. Each slot has a ``ready`` barrier (TMA completes it with the byte
  count) and a ``free`` barrier (every consumer arrives when its wgmma has read the slot).
* **consumers** (one warpgroup each, 64 query rows each): per key block
  ``S = Q K^T`` (wgmma, shared x shared), online softmax in registers (exp2, scale folded
  into log2 e), ``O += P V`` with P kept in registers as the wgmma A operand. The QK^T of
  block j is issued before the PV of block j-1, so the softmax of block j overlaps the PV
  wgmma of block j-1 (FA3's intra-warpgroup overlap).
* key blocks are visited from the last to the first, so the masked blocks (causal diagonal,
  sequence tail) come first, then the unmasked middle, then the left sliding-window edge;
  ``common.n_block_range`` decides which is which, as in the portable kernels. With
  ``OWN_BLOCKS`` (``HopperFwdConfig.own_blocks``) each consumer takes that range for its
  own 64 rows: it computes only the blocks they see, masks only where they need it, and
  merely waits for and releases the ring slots (and turns) of the tile's others
  (``_own_blocks``, ``_skip_step``).
* epilogue: O / l into the consumer's own Q tile (no longer needed), TMA store (rows past
  the sequence are clipped by the descriptor), LSE with plain stores.
* persistent (``walk``): one CTA per SM walks tiles, on a dense batch without causal /
  window mask tile, tile + grid, ... (``persistent_unmasked``: every tile the same length),
  under a mask (also over a KV cache: dense queries, ``seqused_k``) the host's longest-first
  schedule
  (``common.persistent_schedule``: each tile to the CTA that would
  free up first, as the hardware does for one CTA per tile); the K/V ring runs on across
  tiles, and with ``Q_SLOTS`` = 2 the Q tiles (each its tile's O staging) alternate, so the
  next tile's Q loads while this one runs.
* split tail (``split_keys``, ``PIECES``): without a mask, where the last round of tiles
  would leave SMs idle, the host's table (``common.split_table``) gives each CTA whole
  tiles, then pieces (key blocks [lo, hi) of a tile): a piece leaves O / l in fp32 and its
  lse in a workspace slot (``_store_piece``), and ``split_combine_kernel`` merges a
  tile's pieces after the launch.

Descriptors are rank 4 over (batch, seqlen, heads, dim) with blocks (1, rows, 1, dim), so
any strides with a contiguous last dim work without copies and TMA zero-fills and clips at
each sequence's end. Varlen batches (``VARLEN``): the (total, heads, dim) tensors are seen as
(1, total, heads, dim), boxes start at each sequence's first row, key blocks past a
sequence's end are masked like a dense tail, and O leaves by masked stores (a box would run
into the next sequence). Head dims 96 and 192 run as 128 and 256 (``kernel_head_dim``; a
varlen batch's masked O stores stop at ``HEAD_DIM``). Not covered (dispatch falls back to
the portable kernels): other head dims, headdim_v != headdim.
"""
from typing import NamedTuple

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from ..common import ceil_div, n_block_range, scores, visible
from .common import (LOADER_REGS, SCHEDULE_MAX_TILES, Problem, _acc_layout, _store_query_tile,
                     _tile_walk, a_operand, descriptor, kernel_head_dim, launch, num_sms, persistent_walk,
                     planned_launch, schedule_table, split_plan, to_16bit)
from .fwd_loader import Tiles, _clip_blocks, _fwd_loader, _piece_at, _q_slot
from .split_combine import combine_args, split_combine_kernel

ROWS_PER_CONSUMER = 64  # one warpgroup's wgmma M
# A row's running max is kept until a key block raises it by more than this (log2 units; FA4's
# Blackwell rule): most blocks then leave every alpha at 1 and skip O's rescale (``_rescale``).
# Measured (five interleaved rounds, probes/probe-rounds-0919854.json at fb45c0d): off -> 8.0,
# both with the per-warp skip, 64 521.4 -> 534.2, 128 637.0 -> 654.1 / 600.8 -> 623.7.
RESCALE_THRESHOLD = 8.0
_THRESHOLD = gl.constexpr(RESCALE_THRESHOLD)
# The host's schedules (common.persistent_schedule, common.split_table) count a tile's fixed
# cost (Q load, O store, pipeline fill) as this many key blocks: tiles of a few blocks each
# (1k tokens) weigh it many times per CTA. 3 or 6 measured within noise of 1 (docs/performance.md).
SCHEDULE_OVERHEAD = 1


@gluon.jit
def _store_piece(out, lse, WS, WSL, piece, row_off, BMT: gl.constexpr, o_layout: gl.constexpr,
                 row_layout: gl.constexpr):
    """A piece's partial output (fp32, normalized by its own row sums) and log-sum-exp, rows
    ``row_off + i`` of its tile, into slot ``piece`` of the workspaces (``WS``: slots x BMT x
    DV, ``WSL``: slots x BMT), for ``split_combine_kernel``."""
    BM: gl.constexpr = out.shape[0]
    DV: gl.constexpr = out.shape[1]
    base = piece.to(gl.int64) * BMT + row_off
    o_rows = base + gl.arange(0, BM, layout=gl.SliceLayout(1, o_layout))
    cols = gl.arange(0, DV, layout=gl.SliceLayout(0, o_layout))
    gl.store(WS + gl.expand_dims(o_rows * DV, 1) + gl.expand_dims(cols, 0), out)
    gl.store(WSL + base + gl.arange(0, BM, layout=row_layout), lse)


@gluon.jit
def _halve(x, ADD: gl.constexpr):
    """[M, N] -> [M, N / 2]: the two column halves added (``ADD``) or maxed elementwise. In
    the wgmma accumulator layout each thread holds both halves of its columns: no data
    moves."""
    M: gl.constexpr = x.shape[0]
    N: gl.constexpr = x.shape[1]
    a, b = x.reshape([M, 2, N // 2]).permute(0, 2, 1).split()
    if ADD:
        return a + b
    else:
        return gl.maximum(a, b)


@gluon.jit
def _fold8(x, ADD: gl.constexpr):
    """[M, N] -> [M, 8] by halving (``_halve``): each row's sum or max over the thread's own
    columns, by a tree (independent operations at each level), without the quad's shuffles."""
    if x.shape[1] > 8:
        x = _halve(x, ADD)
    if x.shape[1] > 8:
        x = _halve(x, ADD)
    if x.shape[1] > 8:
        x = _halve(x, ADD)
    if x.shape[1] > 8:
        x = _halve(x, ADD)
    return x


@gluon.jit
def _partial_sums(p):
    """[M, N] -> [M, 8] per-thread partial row sums over the thread's own columns (a tree,
    no shuffles; ``_row_sum`` adds the 8 across the quad at the end of the tile, FA4's Hopper
    softmax: two shuffles and two adds fewer per row and key block. Each block's sum across
    the quad instead: docs/performance.md, "Tried and not kept")."""
    return _fold8(p, True)


@gluon.jit
def _l_init(BM: gl.constexpr, BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
    """The running row sums l at 0: [BM, 8] per-thread partial sums (the layout
    ``_partial_sums`` leaves)."""
    return _partial_sums(gl.zeros([BM, BLOCK_N], gl.float32, s_layout))


@gluon.jit
def _row_sum(l, row_layout: gl.constexpr):
    """The rows' l from the running sums (``_l_init``): the quad's shuffles once per tile."""
    return gl.convert_layout(gl.sum(l, 1), row_layout)


@gluon.jit
def _row_max(s, TREE: gl.constexpr):
    """Each row's max of a wgmma accumulator tile. ``TREE`` (``HopperFwdConfig.tree_max``): the
    thread's own columns halved pairwise down to 8 columns first (a few independent
    FMNMX per level), then the quad's shuffles, instead of one FMNMX chain through all of a
    thread's columns of the row (32 deep at 128 keys). Max is exact: the same result."""
    if TREE:
        row_layout: gl.constexpr = gl.SliceLayout(1, s.type.layout)
        # (the same rows on the same threads: a conversion that moves nothing)
        return gl.convert_layout(gl.max(_fold8(s, False), 1), row_layout)
    else:
        return gl.max(s, 1)


@gluon.jit
def _softmax_update(s, m_i, l_i, rows, cols, len_q, len_k, qk_scale, softcap_log2,
                    window_left, window_right, MASK: gl.constexpr, HAS_LEFT: gl.constexpr,
                    HAS_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr, TREE_MAX: gl.constexpr = False):
    """One online-softmax step on raw scores ``s`` = Q K^T: (p, alpha, m_new, l_new), with
    m and l in the log2 domain. Without softcap the scale is folded into the exponent, so
    each score costs one FFMA + one exp2 (FA3's trick): p = exp2(s * scale - max * scale).
    A row keeps its running max unless the block raises it by more than ``RESCALE_THRESHOLD``
    (log2 units; its p are then at most 2^8, as exact in fp32 and 16 bits as below 1), so its
    alpha is exactly 1 and ``_rescale`` can skip O; a row that has seen nothing (O and l are
    0) gets alpha 1 too."""
    if SOFTCAP:
        s = scores(s, qk_scale, softcap_log2, SOFTCAP)  # already log2-scaled
    if MASK:
        s = gl.where(visible(gl.expand_dims(rows, 1), gl.expand_dims(cols, 0), len_q, len_k,
                             window_left, window_right, HAS_LEFT, HAS_RIGHT), s, float("-inf"))
    if SOFTCAP:
        m_new = gl.maximum(m_i, _row_max(s, TREE_MAX))
    else:
        m_new = gl.maximum(m_i, _row_max(s, TREE_MAX) * qk_scale)
    m_new = gl.where(m_new - m_i > _THRESHOLD, m_new, m_i)  # (-inf - -inf is NaN: kept)
    if MASK:
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row that saw nothing yet
    else:
        m_use = m_new
    if SOFTCAP:
        p = gl.exp2(s - gl.expand_dims(m_use, 1))
    else:
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_use, 1))
    alpha = gl.exp2(m_i - m_use)
    if MASK:
        alpha = gl.where(m_i == float("-inf"), 1.0, alpha)
    part = _partial_sums(p)  # l_i: [BM, 8] per-thread partial sums (``_l_init``)
    l_new = l_i * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, part.type.layout)), 1) + part
    return p, alpha, m_new, l_new


def _warp_skip_ptx(n):
    """(asm, constraints) of ``_rescale``'s per-warp multiply over a thread's ``n`` values of
    O ($0..$n-1, tied to inputs $n..$2n-1) by their rows' alpha ($2n..$3n-1). In the wgmma
    accumulator layout a thread's registers 0 and 2 are its two rows (r and r + 8; register
    bit 1 is row + 8, the others columns), so two compares, one ``vote.any`` over the warp's
    16 rows and a uniform branch skip the multiplies where every alpha of the warp is 1."""
    mul = "\n".join(f"mul.f32 ${i}, ${n + i}, ${2 * n + i};" for i in range(n))
    asm = ("{\n.reg .pred skp_a, skp_w;\n"
           f"setp.neu.f32 skp_a, ${2 * n}, 0f3F800000;\n"
           f"setp.neu.or.f32 skp_a, ${2 * n + 2}, 0f3F800000, skp_a;\n"
           "vote.sync.any.pred skp_w, skp_a, 0xffffffff;\n"
           "@!skp_w bra.uni SKIP_O;\n" + mul + "\nSKIP_O:\n}")
    constraints = ",".join(["=f"] * n + [str(i) for i in range(n)] + ["f"] * n)
    return asm, constraints


# [DV // 128]: the PTX and its constraints for a thread's DV / 2 values of O (DV = 64, 128, 256)
_WARP_SKIP_ASM, _WARP_SKIP_CONSTRAINTS = (gl.constexpr(t) for t in zip(*(_warp_skip_ptx(dv // 2)
                                                                       for dv in (64, 128, 256))))


@gluon.jit
def _rescale(o_acc, alpha, o_layout: gl.constexpr):
    """O scaled by the rows' alpha, decided per warp: each warp skips its own 16 rows where
    their alpha are all 1 (inline PTX, ``_warp_skip_ptx``; no cross-warp reduction).
    Skipping multiplies by exactly 1: the same bits either way. (Every block multiplying,
    or the decision per warpgroup: docs/performance.md, "Tried and not kept".)"""
    DV: gl.constexpr = o_acc.shape[1]
    gl.static_assert(o_acc.shape[0] == 64 and (DV == 64 or DV == 128 or DV == 256),
                     "one warpgroup's 64 rows of O, 64 / 128 / 256 columns")
    a = gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
    return gl.inline_asm_elementwise(_WARP_SKIP_ASM[DV // 128], _WARP_SKIP_CONSTRAINTS[DV // 128],
                                     [o_acc, a], dtype=gl.float32, is_pure=False, pack=DV // 2)


# The consumers' turns at issuing wgmmas (FA3 / FA4's warp scheduler barriers) are named
# barriers: TURN_BARRIER + consumer id. Triton's warp specialization uses ids 0-3 here (the partitions' own syncs, the
# CTA-wide one); 16 exist. _TURN_ASM[ARRIVE * 3 + id]: the PTX that waits on (``bar.sync``)
# or arrives at (``bar.arrive``) one, for the 256 threads of two consumer warpgroups.
TURN_BARRIER = 12
_TURN_ASM = gl.constexpr(tuple(f"bar.{op} {TURN_BARRIER + i}, 256;\n mov.u32 $0, 0;"
                               for op in ("sync", "arrive") for i in range(3)))


@gluon.jit
def _named_barrier(ID: gl.constexpr, ARRIVE: gl.constexpr):
    """Wait on (or with ``ARRIVE`` arrive at, not waiting) named barrier TURN_BARRIER + ``ID``,
    by every thread of this warpgroup."""
    gl.inline_asm_elementwise(_TURN_ASM[ARRIVE * 3 + ID], "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _take_turn(CID: gl.constexpr):
    """Wait until the consumer before has issued its wgmmas (FA3's warp scheduler barrier;
    with three consumers a round robin, as FA4's at head dim 64), so one warpgroup's softmax
    runs under the others' matrix multiplies. On named barriers, as FA3 / FA4: no polling,
    and none of the warpgroup syncs that Triton's barrier pass puts around a one-thread
    ``mbarrier.arrive`` (turns without them, or on mbarriers: docs/performance.md, "Tried
    and not kept")."""
    _named_barrier(CID, False)


@gluon.jit
def _pass_turn(CID: gl.constexpr, NUM_CONSUMERS: gl.constexpr):
    """... to the next consumer (round robin over two or three)."""
    _named_barrier((CID + 1) % NUM_CONSUMERS, True)


@gluon.jit
def _first_turn(CID: gl.constexpr):
    """Consumer 0 arrives on its own barrier once, so it issues first."""
    if CID == 0:
        _named_barrier(0, True)


@gluon.jit
def _own_blocks(row_start, len_q, len_k, window_left, window_right, n_min, n_full_min, n_full_max, n_max,
                BM: gl.constexpr, BLOCK_N: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr):
    """A consumer's part of its tile's key blocks [n_min, n_max), counted in visiting order
    (it = 0 is block n_max - 1): (lead, end, full_min, full_max): it computes blocks
    it in [lead, end) and needs no mask for blocks in [full_min, full_max) (the range of
    ``common.n_block_range`` for its own 64 rows, a subset of the tile's). Rows all past
    len_q compute nothing."""
    count = n_max - n_min
    lead = count * 0
    end = count
    c_full_min = n_full_min
    c_full_max = n_full_max
    if HAS_LEFT or HAS_RIGHT:
        c_min, c_full_min, c_full_max, c_max = n_block_range(
            row_start // BM, len_q, len_k, window_left, window_right, BM, BLOCK_N, HAS_LEFT, HAS_RIGHT)
        lead = gl.minimum(gl.maximum(n_max - c_max, 0), count)
        if HAS_LEFT:  # (causal alone: c_min = n_min = 0)
            end = gl.maximum(gl.minimum(n_max - c_min, count), lead)
    if row_start >= len_q:
        lead = count
    if end == lead:  # nothing to compute: every slot is skipped in the leading loop
        lead = count
        end = count
    return lead, end, c_full_min, c_full_max


@gluon.jit
def _skip_step(g, k_ready, v_ready, k_free, v_free, STAGES: gl.constexpr, CID: gl.constexpr,
               NUM_CONSUMERS: gl.constexpr):
    """A key block none of this consumer's rows sees: its turn is taken and passed, its ring
    slot waited for (an arrival must not count toward the slot's previous phase) and
    released."""
    stage = g % STAGES
    phase = (g // STAGES) & 1
    _take_turn(CID)
    _pass_turn(CID, NUM_CONSUMERS)
    mbarrier.wait(k_ready.index(stage), phase)
    mbarrier.arrive(k_free.index(stage))
    mbarrier.wait(v_ready.index(stage), phase)
    mbarrier.arrive(v_free.index(stage))


@gluon.jit
def _fwd_step(g, it, n_max, q_buf, ring, state, rows, cols0, len_q, len_k, scalars, window,
              MASK: gl.constexpr, CID: gl.constexpr, META: gl.constexpr):
    """Key block number ``it`` of the tile (counted from the last; ``g`` counts the ring
    slots over the whole CTA): S_it = Q K_it^T overlapped with O += P_{it-1} V_{it-1};
    ``state`` (o_acc, m_i, l_i, p_prev, alpha_prev) in, the state with P_it pending out.
    ``q_buf``: Q as the A operand, its shared tile or registers (``Q_REGS``). ``ring``: the
    K / V rings and their barriers (``hopper_fwd_kernel``); ``scalars``, ``window``: the
    kernel's (splatted into ``_softmax_update``); ``META``: its ``FwdMeta``.
    ``RESCALE_EARLY``: O is rescaled by the previous block's ``alpha_prev`` while S_it's
    wgmma runs, just before P_{it-1} V_{it-1} is issued (FA3's order at head dims above
    128), instead of after that wgmma retires. The block's alpha is returned too (the next
    step's ``alpha_prev`` under ``RESCALE_EARLY``)."""
    k_ring, v_ring, k_ready, v_ready, k_free, v_free = ring
    o_acc, m_i, l_i, p_prev, alpha_prev = state
    BLOCK_N: gl.constexpr = META.BLOCK_N
    STAGES: gl.constexpr = META.STAGES
    NUM_CONSUMERS: gl.constexpr = META.NUM_CONSUMERS
    HAS_LEFT: gl.constexpr = META.HAS_LEFT
    HAS_RIGHT: gl.constexpr = META.HAS_RIGHT
    SOFTCAP: gl.constexpr = META.SOFTCAP
    RESCALE_EARLY: gl.constexpr = META.RESCALE_EARLY
    TREE_MAX: gl.constexpr = META.TREE_MAX
    BM: gl.constexpr = q_buf.shape[0]
    DV: gl.constexpr = v_ring.shape[2]
    s_layout: gl.constexpr = _acc_layout(BLOCK_N, q_buf.dtype)
    o_layout: gl.constexpr = _acc_layout(DV, q_buf.dtype)
    stage = g % STAGES
    prev = (g - 1) % STAGES
    _take_turn(CID)
    mbarrier.wait(k_ready.index(stage), (g // STAGES) & 1)
    s_tok = warpgroup_mma(q_buf, k_ring.index(stage).permute((1, 0)),
                          gl.zeros([BM, BLOCK_N], gl.float32, s_layout),
                          use_acc=False, is_async=True)
    if RESCALE_EARLY:
        o_acc = _rescale(o_acc, alpha_prev, o_layout)
    mbarrier.wait(v_ready.index(prev), ((g - 1) // STAGES) & 1)
    o_tok = warpgroup_mma(p_prev, v_ring.index(prev), o_acc, is_async=True)
    _pass_turn(CID, NUM_CONSUMERS)
    s = warpgroup_mma_wait(1, deps=(s_tok,))
    mbarrier.arrive(k_free.index(stage))
    cols = (n_max - 1 - it) * BLOCK_N + cols0
    p, alpha, m_i, l_i = _softmax_update(s, m_i, l_i, rows, cols, len_q, len_k, *scalars, *window,
                                         MASK, HAS_LEFT, HAS_RIGHT, SOFTCAP, TREE_MAX)
    o_acc = warpgroup_mma_wait(0, deps=(o_tok,))
    mbarrier.arrive(v_free.index(prev))
    if not RESCALE_EARLY:
        o_acc = _rescale(o_acc, alpha, o_layout)
    p_prev = gl.convert_layout(to_16bit(p, q_buf.dtype), p_prev.type.layout)
    return o_acc, m_i, l_i, p_prev, alpha


@gluon.jit
def _fwd_consumer(CID: gl.constexpr, smem, o_desc, O, stride_o, LSE, stride_lse, tiles, SCHED, WS, WSL,
                  scalars, window, META: gl.constexpr):
    """Consumer warpgroup ``CID``: its 64 rows of each tile of the CTA's walk. ``smem``: the
    Q tiles, K / V rings and their barriers (``hopper_fwd_kernel`` builds it); the others:
    the kernel's arguments (``tiles``: its ``Tiles``). The tuples of host scalars are
    splatted into the calls that name their elements, never unpacked into variables: an
    assignment would turn an element Triton specialized to a constant (a stride or size
    equal to 1) into a value."""
    q_bufs, q_ready, q_free, k_ring, v_ring, k_ready, v_ready, k_free, v_free = smem
    ring = (k_ring, v_ring, k_ready, v_ready, k_free, v_free)
    BLOCK_N: gl.constexpr = META.BLOCK_N
    STAGES: gl.constexpr = META.STAGES
    NUM_CONSUMERS: gl.constexpr = META.NUM_CONSUMERS
    HAS_LEFT: gl.constexpr = META.HAS_LEFT
    HAS_RIGHT: gl.constexpr = META.HAS_RIGHT
    SOFTCAP: gl.constexpr = META.SOFTCAP
    IS_VARLEN: gl.constexpr = META.IS_VARLEN
    HAS_SEQUSED_Q: gl.constexpr = META.HAS_SEQUSED_Q
    HAS_SEQUSED_K: gl.constexpr = META.HAS_SEQUSED_K
    Q_SLOTS: gl.constexpr = META.Q_SLOTS
    SCHEDULED: gl.constexpr = META.SCHEDULED
    HEAD_DIM: gl.constexpr = META.HEAD_DIM
    Q_REGS: gl.constexpr = META.Q_REGS
    OWN_BLOCKS: gl.constexpr = META.OWN_BLOCKS
    RESCALE_EARLY: gl.constexpr = META.RESCALE_EARLY
    TREE_MAX: gl.constexpr = META.TREE_MAX
    PIECES: gl.constexpr = META.PIECES
    BM: gl.constexpr = q_bufs.shape[1]
    DV: gl.constexpr = v_ring.shape[2]
    KW: gl.constexpr = 32 // q_bufs.dtype.primitive_bitwidth
    s_layout: gl.constexpr = _acc_layout(BLOCK_N, q_bufs.dtype)
    o_layout: gl.constexpr = _acc_layout(DV, q_bufs.dtype)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=KW)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    cols0 = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))

    _first_turn(CID)
    kv_base = 0
    local = 0
    first, end, step = _tile_walk(tiles.num_tiles, SCHED, SCHEDULED)
    for walk in range(first, end, step):
        tile, lo, hi, piece = _piece_at(walk, SCHED, SCHEDULED, PIECES)
        (tma_batch, batch, head, head_kv, start_q, len_q, start_k, len_k, row0,
         n_min, n_full_min, n_full_max, n_max) = tiles.query_tile(
            tile, *window, BM * NUM_CONSUMERS, BLOCK_N, HAS_LEFT, HAS_RIGHT, IS_VARLEN,
            HAS_SEQUSED_Q, HAS_SEQUSED_K)
        if PIECES:  # (a piece of a tile: key blocks [lo, hi), split_schedule)
            n_min, n_full_min, n_full_max, n_max = _clip_blocks(lo, hi, n_min, n_full_min, n_full_max, n_max)
        row_start = row0 + CID * BM
        rows = row_start + gl.arange(0, BM, layout=row_layout)
        m_i = gl.full([BM], float("-inf"), gl.float32, layout=row_layout)
        l_i = _l_init(BM, BLOCK_N, s_layout)
        o_acc = gl.zeros([BM, DV], gl.float32, layout=o_layout)
        slot, use = _q_slot(local, Q_SLOTS)
        q_buf = q_bufs.index(slot * NUM_CONSUMERS + CID)
        mbarrier.wait(q_ready.index(slot), use & 1)
        q_a = a_operand(q_buf, Q_REGS, s_layout)  # (Q_REGS: every S wgmma reads Q from registers)
        count = n_max - n_min
        # This warpgroup's own key blocks (``_own_blocks``): of the tile's ``count`` (visited
        # from the last), the first ``lead`` and those after ``end`` hold no key any of its
        # 64 rows sees; it only waits for and releases their ring slots.
        if OWN_BLOCKS:
            lead, end, c_full_min, c_full_max = _own_blocks(
                row_start, len_q, len_k, *window, n_min, n_full_min, n_full_max, n_max,
                BM, BLOCK_N, HAS_LEFT, HAS_RIGHT)
            for it in range(0, lead):
                _skip_step(kv_base + it, k_ready, v_ready, k_free, v_free, STAGES, CID, NUM_CONSUMERS)
        else:  # the tile's range for every consumer
            lead: gl.constexpr = 0
            end = count
            c_full_min = n_full_min
            c_full_max = n_full_max
        if end > lead:
            # Prologue: its first key block, always through the mask (it may be the
            # diagonal or the sequence tail; masking an unmasked block is merely a little
            # slower).
            g0 = kv_base + lead
            stage = g0 % STAGES
            _take_turn(CID)
            mbarrier.wait(k_ready.index(stage), (g0 // STAGES) & 1)
            s_tok = warpgroup_mma(q_a, k_ring.index(stage).permute((1, 0)),
                                  gl.zeros([BM, BLOCK_N], gl.float32, s_layout),
                                  use_acc=False, is_async=True)
            _pass_turn(CID, NUM_CONSUMERS)
            s = warpgroup_mma_wait(0, deps=(s_tok,))
            mbarrier.arrive(k_free.index(stage))
            p, alpha, m_i, l_i = _softmax_update(s, m_i, l_i, rows, (n_max - 1 - lead) * BLOCK_N + cols0,
                                                 len_q, len_k, *scalars, *window,
                                                 True, HAS_LEFT, HAS_RIGHT, SOFTCAP, TREE_MAX)
            p_prev = gl.convert_layout(to_16bit(p, q_buf.dtype), p_layout)
            # Steps after it: masked right edge, unmasked middle, masked left edge (of its
            # own rows; unrolled: MASK is a compile-time constant per segment).
            r1 = gl.maximum(n_max - c_full_max, lead + 1)
            r2 = gl.maximum(n_max - c_full_min, r1)
            if OWN_BLOCKS:
                r1 = gl.minimum(r1, end)
                r2 = gl.minimum(r2, end)
            bounds = (lead + 1, r1, r2, end)
            for seg in gl.static_range(3):
                for it in range(bounds[seg], bounds[seg + 1]):
                    o_acc, m_i, l_i, p_prev, alpha = _fwd_step(
                        kv_base + it, it, n_max, q_a, ring, (o_acc, m_i, l_i, p_prev, alpha), rows, cols0,
                        len_q, len_k, scalars, window, seg != 1, CID, META)
            # Epilogue: the PV of its last key block.
            if RESCALE_EARLY:
                o_acc = _rescale(o_acc, alpha, o_layout)
            g_last = kv_base + end - 1
            last = g_last % STAGES
            _take_turn(CID)
            mbarrier.wait(v_ready.index(last), (g_last // STAGES) & 1)
            o_tok = warpgroup_mma(p_prev, v_ring.index(last), o_acc, is_async=True)
            _pass_turn(CID, NUM_CONSUMERS)
            o_acc = warpgroup_mma_wait(0, deps=(o_tok,))
            mbarrier.arrive(v_free.index(last))
            if OWN_BLOCKS and HAS_LEFT:  # blocks left of its rows' window
                for it in range(end, count):
                    _skip_step(kv_base + it, k_ready, v_ready, k_free, v_free, STAGES, CID, NUM_CONSUMERS)
        if OWN_BLOCKS:
            if count > 0:
                if end == lead:  # (every block skipped: one more turn, so each takes count + 1)
                    _take_turn(CID)
                    _pass_turn(CID, NUM_CONSUMERS)
        kv_base += count

        # A row that saw no key: output 0, lse = -inf (never NaN).
        l_row = _row_sum(l_i, row_layout)
        seen = l_row > 0.0
        l_safe = gl.where(seen, l_row, 1.0)
        lse = gl.where(seen, (m_i + gl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
        out = o_acc / gl.expand_dims(gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout)), 1)
        if PIECES:
            if piece >= 0:  # a piece: its partial, for split_combine_kernel
                _store_piece(out, lse, WS, WSL, piece, CID * BM, BM * NUM_CONSUMERS, o_layout, row_layout)
            else:
                _store_out(out, lse, q_buf, o_desc, O, stride_o, LSE, *stride_lse, tma_batch, batch, head,
                           start_q, row_start, rows, len_q, IS_VARLEN, HEAD_DIM)
        else:  # (PIECES is a constexpr: a kernel without pieces never traces _store_piece)
            _store_out(out, lse, q_buf, o_desc, O, stride_o, LSE, *stride_lse, tma_batch, batch, head,
                       start_q, row_start, rows, len_q, IS_VARLEN, HEAD_DIM)
        mbarrier.arrive(q_free.index(slot))
        local += 1


@gluon.jit
def _store_out(out, lse, q_buf, o_desc, O, stride_o, LSE, stride_lseb, stride_lseh, stride_lsem,
               tma_batch, batch, head, start_q, row_start, rows, len_q, IS_VARLEN: gl.constexpr,
               HEAD_DIM: gl.constexpr):
    """A consumer's 64 rows of O and their log-sum-exps to the outputs (``stride_o``: O's
    (row, head) strides)."""
    gl.store(LSE + batch.to(gl.int64) * stride_lseb + head.to(gl.int64) * stride_lseh
             + (start_q + rows).to(gl.int64) * stride_lsem, lse, mask=rows < len_q)
    # O goes out through this consumer's Q tile: every wgmma reading it has retired.
    q_buf.store(out.to(q_buf.dtype))
    _store_query_tile(q_buf, o_desc, O, *stride_o, tma_batch, head, start_q, row_start,
                      len_q, IS_VARLEN, HEAD_DIM)


@gluon.jit
def hopper_fwd_kernel(q_desc, k_desc, v_desc, o_desc, O, stride_o, LSE, stride_lse, sizes,
                      CU_Q, CU_K, USED_Q, USED_K, SCHED, WS, WSL, scalars, window, META: gl.constexpr):
    """The forward (see the module's docstring). Tensors and descriptors are arguments of
    their own (launch plans swap them per call: ``common.LaunchPlan``); host scalars travel
    as tuples: ``stride_o`` O's (row, head) strides, ``stride_lse`` LSE's (batch, head, row);
    ``sizes`` (nheads, nheads_kv, seqlen_q, seqlen_k, num_tiles, num_m_blocks,
    section_heads, total_q, total_k); ``scalars`` (qk_scale, softcap_log2); ``window``
    (window_left, window_right). ``META``: the compile-time constants, a ``FwdMeta``.
    (The tuples go to the partitions whole and are splatted into the calls that name their
    elements: unpacked into variables, an element Triton specialized to a constant, a size
    or stride equal to 1, would become a value, and the partitions would capture it.)"""
    BLOCK_N: gl.constexpr = META.BLOCK_N
    STAGES: gl.constexpr = META.STAGES
    NUM_CONSUMERS: gl.constexpr = META.NUM_CONSUMERS
    Q_SLOTS: gl.constexpr = META.Q_SLOTS
    HEAD_DIM: gl.constexpr = META.HEAD_DIM
    LOADER_REGS: gl.constexpr = META.LOADER_REGS
    CONSUMER_REGS: gl.constexpr = META.CONSUMER_REGS
    BM: gl.constexpr = q_desc.block_type.shape[1]
    D: gl.constexpr = q_desc.block_type.shape[3]
    DV: gl.constexpr = v_desc.block_type.shape[3]
    dtype: gl.constexpr = q_desc.dtype
    gl.static_assert(BM == 64, "one warpgroup owns 64 query rows")
    gl.static_assert(HEAD_DIM <= D, "the tensors' head dim (columns past it are padding)")
    gl.static_assert(NUM_CONSUMERS == 2 or NUM_CONSUMERS == 3, "two or three consumer warpgroups")

    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, D], dtype)
    k_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], dtype)
    v_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, DV], dtype)
    q_bufs = gl.allocate_shared_memory(dtype, [Q_SLOTS * NUM_CONSUMERS, BM, D], q_layout)
    k_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], k_layout)
    v_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, DV], v_layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [Q_SLOTS, 1], mbarrier.MBarrierLayout())
    q_free = gl.allocate_shared_memory(gl.int64, [Q_SLOTS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    # One mbarrier per consumer, initialised and never waited on: the turns' barriers before
    # they moved to named barriers (``_take_turn``). Kept, with consumer 0's arrival below:
    # without them the shared-memory offsets, and so the instructions, of the kernel measured
    # on the H200 change.
    TURNS: gl.constexpr = NUM_CONSUMERS
    turns = gl.allocate_shared_memory(gl.int64, [TURNS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(Q_SLOTS):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_free.index(i), count=NUM_CONSUMERS)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_free.index(i), count=NUM_CONSUMERS)
        mbarrier.init(v_free.index(i), count=NUM_CONSUMERS)
    for i in gl.static_range(TURNS):
        mbarrier.init(turns.index(i), count=1)
    mbarrier.arrive(turns.index(0))

    tiles = Tiles(*sizes, CU_Q, CU_K, USED_Q, USED_K)
    # The shared memory the partitions share: Q tiles, K / V rings, their barriers (values,
    # no constants: a tuple variable is safe).
    smem = (q_bufs, q_ready, q_free, k_ring, v_ring, k_ready, v_ready, k_free, v_free)
    # (Gluon takes each partition's constexpr arguments spelled out: a tuple assigned to a
    # variable would turn them into values; ``META`` is one constexpr.) Three consumers: 192
    # query rows per tile (HopperFwdConfig).
    if NUM_CONSUMERS == 3:
        gl.warp_specialize(
            [(_fwd_consumer, (0, smem, o_desc, O, stride_o, LSE, stride_lse, tiles, SCHED, WS, WSL, scalars,
                              window, META)),
             (_fwd_consumer, (1, smem, o_desc, O, stride_o, LSE, stride_lse, tiles, SCHED, WS, WSL, scalars,
                              window, META)),
             (_fwd_consumer, (2, smem, o_desc, O, stride_o, LSE, stride_lse, tiles, SCHED, WS, WSL, scalars,
                              window, META)),
             (_fwd_loader, (q_desc, k_desc, v_desc, smem, tiles, SCHED, window, META))],
            [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, LOADER_REGS])
    else:
        gl.warp_specialize(
            [(_fwd_consumer, (0, smem, o_desc, O, stride_o, LSE, stride_lse, tiles, SCHED, WS, WSL, scalars,
                              window, META)),
             (_fwd_consumer, (1, smem, o_desc, O, stride_o, LSE, stride_lse, tiles, SCHED, WS, WSL, scalars,
                              window, META)),
             (_fwd_loader, (q_desc, k_desc, v_desc, smem, tiles, SCHED, window, META))],
            [4, 1], [CONSUMER_REGS, LOADER_REGS])


# ---- host side --------------------------------------------------------------------------

class FwdMeta(NamedTuple):
    """``hopper_fwd_kernel``'s compile-time constants (its ``META``, built by ``kernel_args``):
    the tile (``BLOCK_N`` keys, ``STAGES`` ring slots, ``NUM_CONSUMERS`` warpgroups), the
    mask and softcap, the varlen / seqused addressing, the partitions' registers
    (``LOADER_REGS``, ``CONSUMER_REGS``), the walk (``Q_SLOTS``, ``SCHEDULED``: the host's
    table, ``PIECES``: the split tail), the tensors' ``HEAD_DIM`` and the tile's options
    (``HopperFwdConfig``)."""
    BLOCK_N: int
    STAGES: int
    NUM_CONSUMERS: int
    HAS_LEFT: bool
    HAS_RIGHT: bool
    SOFTCAP: bool
    IS_VARLEN: bool
    HAS_SEQUSED_Q: bool
    HAS_SEQUSED_K: bool
    LOADER_REGS: int
    CONSUMER_REGS: int
    Q_SLOTS: int
    SCHEDULED: bool
    HEAD_DIM: int
    Q_REGS: bool
    OWN_BLOCKS: bool
    RESCALE_EARLY: bool
    TREE_MAX: bool
    PIECES: bool


# Dispatched head dims (dispatch.hopper_fwd_supports). 96 / 192 (common.PADDED_HEAD_DIMS)
# are computed at the next tile width, 128 / 256 (configs.SM90_HOPPER_FWD has that width's
# tile), through descriptors with boxes that wide over the tensor's own head dim.
HEAD_DIMS = (64, 96, 128, 192, 256)
# Varlen (cu_seqlens / seqused) through this kernel: 24 of 24 GPU cases passed at 4cf91bc
# (``benchmarks/results/probes/hopper-fwd-varlen-tests-4cf91bc.txt`` at fb45c0d).
VARLEN = True


def kernel_args(q, k, v, out, lse, params, cfg, cu_seqlens_q=None, cu_seqlens_k=None,
                seqused_q=None, seqused_k=None, num_sms=132, split=None, ws=None, wsl=None):
    """(grid, args) of ``hopper_fwd_kernel``: dense (batch, seqlen, heads, dim) tensors with
    lse (batch, heads, seqlen_q), or varlen (total, heads, dim) with ``cu_seqlens_q/k`` and
    lse (heads, total_q), ``params.max_seqlen_q`` bounding a sequence's query blocks.
    ``split``: ``split_keys``'s plan, its pieces' partials into ``ws`` / ``wsl``."""
    pb = Problem(q, k, params, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
    q4, k4, v4, o4 = (pb.view(x) for x in (q, k, v, out))
    d = kernel_head_dim(q.shape[-1])
    bm = ROWS_PER_CONSUMER
    num_m_blocks = ceil_div(pb.seqlen_q, bm * cfg.num_consumers)
    num_tiles = num_m_blocks * pb.nheads * pb.batch
    sections = pb.section_heads(k, v, params)
    how = walk(cfg, params, pb, num_tiles)
    sched = None
    if how == "scheduled":
        sched = schedule_table(q.device, (pb.batch * pb.nheads, num_m_blocks, sections, pb.seqlen_q, pb.seqlen_k,
                                          params.window_left, params.window_right, bm * cfg.num_consumers,
                                          cfg.block_n, min(num_tiles, num_sms), SCHEDULE_OVERHEAD))
        how = "grid" if sched is None else how  # (a CUDA graph capturing a new shape)
    q_slots = 1 if how == "grid" else cfg.q_slots
    if split is not None:  # the walks of split_schedule, persistent or not
        sched = split[0]
        q_slots = cfg.q_slots if how == "strided" else 1
        how = "pieces"
    # "grid": one CTA per tile; else one CTA per SM walking tiles (_tile_walk)
    grid = (num_tiles if how == "grid" else split[1] if how == "pieces" else min(num_tiles, num_sms),)
    qk_scale, softcap_log2 = params.score_constants()
    if cfg.block_n & (cfg.block_n - 1):
        raise ValueError(f"HopperFwdConfig.block_n={cfg.block_n}: a power of two (Gluon's tiles and TMA boxes)")
    is_varlen, has_used_q, has_used_k = pb.seq_flags
    meta = FwdMeta(BLOCK_N=cfg.block_n, STAGES=cfg.stages, NUM_CONSUMERS=cfg.num_consumers,
                   HAS_LEFT=params.window_left >= 0, HAS_RIGHT=params.window_right >= 0,
                   SOFTCAP=params.softcap > 0.0, IS_VARLEN=is_varlen, HAS_SEQUSED_Q=has_used_q,
                   HAS_SEQUSED_K=has_used_k, LOADER_REGS=LOADER_REGS, CONSUMER_REGS=cfg.consumer_regs,
                   Q_SLOTS=q_slots, SCHEDULED=how in ("scheduled", "pieces"), HEAD_DIM=q.shape[-1],
                   Q_REGS=cfg.q_regs, OWN_BLOCKS=cfg.own_blocks, RESCALE_EARLY=rescale_early(cfg, params),
                   TREE_MAX=cfg.tree_max, PIECES=how == "pieces")
    # (pb.seq_args: (total_q, total_k) end ``sizes``, the four pointers follow)
    total_q, total_k, cu_q, cu_k, used_q, used_k = pb.seq_args
    # (only host scalars in the tuples: every tensor and descriptor is an argument of its own,
    # where a launch plan finds and replaces it)
    args = [descriptor(q4, bm, d), descriptor(k4, cfg.block_n, d), descriptor(v4, cfg.block_n, d),
            descriptor(o4, bm, d), out, (o4.stride(1), o4.stride(2)), lse, tuple(pb.lse_strides(lse)),
            (pb.nheads, pb.nheads_kv, pb.seqlen_q, pb.seqlen_k, num_tiles, num_m_blocks, sections,
             total_q, total_k),
            cu_q, cu_k, used_q, used_k, sched, q if ws is None else ws, q if wsl is None else wsl,
            (qk_scale, softcap_log2), (params.window_left, params.window_right), meta]
    return grid, args


def rescale_early(cfg, params) -> bool:
    """O rescaled before P V is issued (``RESCALE_EARLY``): where the tile says
    ``rescale_early``, or ``rescale_early_unmasked`` and the launch has no causal / window
    mask and no softcap."""
    plain = params.window_left < 0 and params.window_right < 0 and params.softcap == 0.0
    return cfg.rescale_early or (cfg.rescale_early_unmasked and plain)


def walk(cfg, params, pb, num_tiles) -> str:
    """How the forward's CTAs take their tiles (``common.persistent_walk``): "strided"
    without a mask where the tile says ``persistent_unmasked``; "scheduled" under a causal /
    window mask, dense or with ``seqused_k`` alone (docs/hopper.md, "Persistent
    schedules")."""
    return persistent_walk(cfg.persistent_unmasked, pb, params, num_tiles)


def split_keys(q, k, params, cfg):
    """``HopperFwdConfig.split_keys`` on a dense batch without causal / window mask: None, or
    the plan of ``common.split_table`` (its table on the device, CTAs, partial slots, tiles
    cut) when the last round of tiles would leave CTAs idle (``split_keys`` = 2: whenever it
    is part empty)."""
    if not cfg.split_keys or params.masked:
        return None
    bmt = ROWS_PER_CONSUMER * cfg.num_consumers
    num_tiles = ceil_div(q.shape[1], bmt) * q.shape[2] * q.shape[0]
    if num_tiles == 0 or k.shape[1] == 0 or num_tiles > SCHEDULE_MAX_TILES:
        return None
    return split_plan(q.device, (num_tiles, ceil_div(k.shape[1], cfg.block_n), num_sms(q.device),
                                 cfg.persistent_unmasked, SCHEDULE_OVERHEAD, cfg.split_keys == 2))


def fwd(q, k, v, out, lse, params, cfg, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None,
        seqused_k=None):
    """Forward into ``out`` and ``lse`` (layouts: ``kernel_args``). Dense batches launch
    through a plan per signature (``common.planned_launch``); where ``split_keys`` cuts the
    last round's tiles into pieces, ``split_combine_kernel`` merges their partials after."""
    dense = cu_seqlens_q is None and seqused_q is None and seqused_k is None
    split = split_keys(q, k, params, cfg) if dense else None
    tensors = (q, k, v, out, lse)
    ws = wsl = None
    if split is not None:
        bmt = ROWS_PER_CONSUMER * cfg.num_consumers
        ws = torch.empty(split[2] * bmt * kernel_head_dim(v.shape[-1]), dtype=torch.float32, device=q.device)
        wsl = torch.empty(split[2] * bmt, dtype=torch.float32, device=q.device)
        tensors += (ws, wsl)

    def build():
        return kernel_args(q, k, v, out, lse, params, cfg, cu_seqlens_q, cu_seqlens_k,
                           seqused_q, seqused_k, num_sms(q.device), split, ws, wsl)
    key = None  # (varlen / seqused: their tensors are not in the key)
    if dense:
        key = ("fwd", q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), out.stride(),
               lse.stride(), q.dtype, q.get_device(), params, cfg)
    planned_launch(hopper_fwd_kernel, key, tensors, build)
    if split is not None and split[3]:  # (tiles of one key block each are never cut)
        # (its arguments built on every call, ~0.05 ms of host time; no launch plan as
        # above for it)
        table, ncut = split[0], split[3]
        launch(split_combine_kernel, *combine_args(out, lse, ws, wsl, table[table.numel() - 3 * ncut:], q, k, v,
                                                   params, ROWS_PER_CONSUMER * cfg.num_consumers))
    return out, lse
