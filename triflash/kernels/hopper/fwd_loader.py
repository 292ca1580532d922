"""The loader warp of the Hopper forward (``hopper/fwd.py``'s ``hopper_fwd_kernel``) and the walk
of tiles it shares with the consumer warpgroups.

* ``_fwd_loader``: one warp of few registers, the TMA producer. For each tile of the CTA's
  walk (``common._tile_walk``: one tile, tile + grid, ... of a persistent CTA, or the
  host's schedule) it waits until the tile's Q slot is free (``q_free``: the consumers'
  stores of the O the slot last staged are done), loads each consumer's 64-row Q tile onto
  ``q_ready``, then streams the K and V tiles of the tile's key blocks, from the last to the
  first, into ``STAGES``-deep rings: per slot ``k_ready`` / ``v_ready`` (TMA completes them
  with the byte count) after ``k_free`` / ``v_free`` (every consumer arrives once its wgmma
  has read the slot; a fresh barrier counts as having completed the phase before 0). The
  rings run on across the CTA's tiles.
* ``_piece_at``, ``_clip_blocks``: with ``PIECES`` (the split tail, ``hopper.fwd.split_keys``)
  an entry of the host's table is a whole tile or a piece, key blocks [lo, hi) of one.
* ``_q_slot``: which of the ``Q_SLOTS`` Q tiles a tile uses (two: the next tile's Q loads
  while this one is computed).
* ``Tiles``: the kernel's arguments that place a tile (the launch's tile count and order,
  heads, sequence lengths and their cu_seqlens / seqused pointers), one value for the
  loader and the consumers instead of thirteen arguments each.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier
from triton.language.core import _aggregate as aggregate

from .common import _seq_query_tile, _tile_at, _tile_walk, _tma_view, tma_load


@gluon.constexpr_function
def _field(x):
    """A kernel argument as an aggregate field: a value, or a constant where Triton
    specialized the argument (an integer argument equal to 1, e.g. one KV head)."""
    return x if isinstance(x, gl.tensor) else gl.constexpr(x)


# (Triton's aggregates: ``triton.language.core._aggregate`` in 3.6 and 3.8; the kernel's PTX
# is the same as with the arguments spelled out.)
@aggregate
class Tiles:
    """What places tile ``tile`` of the launch (``common._seq_query_tile``)."""
    num_tiles: (gl.tensor, gl.constexpr)
    num_m_blocks: (gl.tensor, gl.constexpr)
    section_heads: (gl.tensor, gl.constexpr)
    nheads: (gl.tensor, gl.constexpr)
    nheads_kv: (gl.tensor, gl.constexpr)
    seqlen_q: (gl.tensor, gl.constexpr)
    seqlen_k: (gl.tensor, gl.constexpr)
    total_q: (gl.tensor, gl.constexpr)
    total_k: (gl.tensor, gl.constexpr)
    CU_Q: (gl.tensor, gl.constexpr)
    CU_K: (gl.tensor, gl.constexpr)
    USED_Q: (gl.tensor, gl.constexpr)
    USED_K: (gl.tensor, gl.constexpr)

    @gluon.constexpr_function
    def __init__(self, nheads, nheads_kv, seqlen_q, seqlen_k, num_tiles, num_m_blocks, section_heads, total_q,
                 total_k, CU_Q, CU_K, USED_Q, USED_K):  # (the kernel's ``sizes``, then its pointers)
        self.num_tiles = _field(num_tiles)
        self.num_m_blocks = _field(num_m_blocks)
        self.section_heads = _field(section_heads)
        self.nheads = _field(nheads)
        self.nheads_kv = _field(nheads_kv)
        self.seqlen_q = _field(seqlen_q)
        self.seqlen_k = _field(seqlen_k)
        self.total_q = _field(total_q)
        self.total_k = _field(total_k)
        self.CU_Q = _field(CU_Q)
        self.CU_K = _field(CU_K)
        self.USED_Q = _field(USED_Q)
        self.USED_K = _field(USED_K)

    @gluon.jit
    def query_tile(self, tile, window_left, window_right, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                   HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, IS_VARLEN: gl.constexpr,
                   HAS_SEQUSED_Q: gl.constexpr, HAS_SEQUSED_K: gl.constexpr):
        """``common._seq_query_tile`` of ``tile``."""
        return _seq_query_tile(tile, self.num_m_blocks, self.section_heads, self.nheads, self.nheads_kv,
                               self.seqlen_q, self.seqlen_k, self.total_q, self.total_k, self.CU_Q, self.CU_K,
                               self.USED_Q, self.USED_K, window_left, window_right, BLOCK_M, BLOCK_N,
                               HAS_LEFT, HAS_RIGHT, IS_VARLEN, HAS_SEQUSED_Q, HAS_SEQUSED_K)


@gluon.jit
def _fwd_loader(q_desc, k_desc, v_desc, smem, tiles, SCHED, window, META: gl.constexpr):
    """The loader warp (see above). ``smem``: the Q tiles, K / V rings and their barriers
    (``hopper_fwd_kernel``); ``window`` (window_left, window_right), ``META`` (a
    ``FwdMeta``): the kernel's."""
    q_bufs, q_ready, q_free, k_ring, v_ring, k_ready, v_ready, k_free, v_free = smem
    NUM_CONSUMERS: gl.constexpr = META.NUM_CONSUMERS
    BLOCK_N: gl.constexpr = META.BLOCK_N
    STAGES: gl.constexpr = META.STAGES
    HAS_LEFT: gl.constexpr = META.HAS_LEFT
    HAS_RIGHT: gl.constexpr = META.HAS_RIGHT
    IS_VARLEN: gl.constexpr = META.IS_VARLEN
    HAS_SEQUSED_Q: gl.constexpr = META.HAS_SEQUSED_Q
    HAS_SEQUSED_K: gl.constexpr = META.HAS_SEQUSED_K
    Q_SLOTS: gl.constexpr = META.Q_SLOTS
    SCHEDULED: gl.constexpr = META.SCHEDULED
    PIECES: gl.constexpr = META.PIECES
    BM: gl.constexpr = q_desc.block_type.shape[1]
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
        # The Q tiles double as the O staging of the tile that last used the slot: wait for
        # its stores (with two slots the next tile's Q loads while this one is computed).
        # A fresh barrier counts as having completed the phase before 0.
        slot, use = _q_slot(local, Q_SLOTS)
        mbarrier.wait(q_free.index(slot), (use & 1) ^ 1)
        mbarrier.expect(q_ready.index(slot), NUM_CONSUMERS * q_desc.block_type.nbytes)
        for c in gl.static_range(NUM_CONSUMERS):
            tma_load(q_desc, [tma_batch, start_q + row0 + c * BM, head, 0],
                                            q_ready.index(slot),
                                            _tma_view(q_bufs.index(slot * NUM_CONSUMERS + c), q_desc))
        count = n_max - n_min
        for it in range(count):
            n = n_max - 1 - it
            g = kv_base + it
            stage = g % STAGES
            phase = (g // STAGES) & 1
            mbarrier.wait(k_free.index(stage), phase ^ 1)
            mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
            tma_load(k_desc, [tma_batch, start_k + n * BLOCK_N, head_kv, 0],
                                            k_ready.index(stage), _tma_view(k_ring.index(stage), k_desc))
            mbarrier.wait(v_free.index(stage), phase ^ 1)
            mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
            tma_load(v_desc, [tma_batch, start_k + n * BLOCK_N, head_kv, 0],
                                            v_ready.index(stage), _tma_view(v_ring.index(stage), v_desc))
        kv_base += count
        local += 1


@gluon.jit
def _piece_at(walk, SCHED, SCHEDULED: gl.constexpr, PIECES: gl.constexpr):
    """(tile, lo, hi, piece) at position ``walk`` of ``_tile_walk``: with ``PIECES`` an
    entry of the host's ``common.split_table`` (key blocks [lo, hi) of the tile, ``piece``
    its partial output's slot, -1 for the whole tile), else the whole tile."""
    if PIECES:
        at = SCHED + gl.num_programs(0) + 1 + 4 * walk
        tile = gl.load(at)
        lo = gl.load(at + 1)
        hi = gl.load(at + 2)
        piece = gl.load(at + 3)
    else:
        tile = _tile_at(walk, SCHED, SCHEDULED)
        lo = 0
        hi = 0
        piece = -1
    return tile, lo, hi, piece


@gluon.jit
def _clip_blocks(lo, hi, n_min, n_full_min, n_full_max, n_max):
    """A tile's key block range (``n_block_range``'s four) cut to the piece [lo, hi)."""
    n_min = gl.maximum(n_min, lo)
    n_max = gl.maximum(gl.minimum(n_max, hi), n_min)
    n_full_min = gl.minimum(gl.maximum(n_full_min, n_min), n_max)
    n_full_max = gl.maximum(gl.minimum(n_full_max, n_max), n_full_min)
    return n_min, n_full_min, n_full_max, n_max


@gluon.jit
def _q_slot(local, Q_SLOTS: gl.constexpr):
    """(Q slot, how many times it was used before) of the CTA's ``local``-th tile."""
    if Q_SLOTS == 1:
        return 0, local
    else:
        return local % Q_SLOTS, local // Q_SLOTS
