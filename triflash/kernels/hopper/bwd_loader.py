"""The loader warp of the Hopper dK/dV kernels (``hopper/bwd.py``'s ``hopper_bwd_kernel`` and
``hopper/bwd256.py``'s ``hopper_bwd256_kernel``): one warp of few registers, the TMA producer
of a CTA that owns one key block of one (batch, KV head).

* ``_loader_barriers`` allocates and initialises the mbarriers it works with: ``kv_bar``
  (count 1, K and V, completed once), and per ring slot ``q_ready`` and ``do_ready`` (count
  1, completed by TMA with the slot's byte count) and ``free`` (count ``NUM_CONSUMERS``:
  every consumer warpgroup arrives once its wgmmas reading the slot have retired).
* ``_bwd_loader`` first TMA-loads K and V on ``kv_bar`` (``mbarrier.expect`` with the bytes
  of all of them): ``NUM_CONSUMERS`` tiles, one per consumer's 64 keys, or with ``SPLIT_D``
  (bwd256.py) the two 128-column halves of the one key block. Then it streams, in the order
  the consumers walk them (the query heads of the GQA group outer, the query blocks
  ``m_min`` .. ``m_max`` of the key block ascending), each query block's tiles into
  ``STAGES``-deep rings: slot ``it % STAGES`` is awaited ``free`` (phase flipping each pass
  through the ring; a fresh barrier lets the first pass through), then Q (its halves with
  ``SPLIT_D``) with its rows' lse_log2 complete ``q_ready``, and dO with its rows' Delta
  complete ``do_ready`` (lse / Delta: rank-3 TMA boxes of the padded fp32 statistics).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from .common import _tma_view, tma_load


@gluon.jit
def _loader_barriers(STAGES: gl.constexpr, NUM_CONSUMERS: gl.constexpr):
    """The barriers ``_bwd_loader`` works with, initialised: ``kv_bar`` (K and V, once), and
    per ring slot ``q_ready`` (Q + lse), ``do_ready`` (dO + Delta) and ``free`` (every
    consumer warpgroup arrives when done with the slot)."""
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(do_ready.index(i), count=1)
        mbarrier.init(free.index(i), count=NUM_CONSUMERS)
    return kv_bar, q_ready, do_ready, free


@gluon.jit
def _bwd_loader(descs, kv, ring, tile, NUM_CONSUMERS: gl.constexpr, STAGES: gl.constexpr,
                SPLIT_D: gl.constexpr = False):
    """The TMA producer of the dK/dV kernels. ``descs``: the TMA descriptors (q, do, k, v,
    lse, delta); ``kv``: (k_bufs, v_bufs, kv_bar); ``ring``: the Q / dO / lse / Delta rings
    and their barriers (q_ring, do_ring, lse_ring, delta_ring, q_ready, do_ready, free);
    ``tile``: the CTA's key block (tma_batch, head_kv, group, q_row0, k_row0, stat0, key0,
    m_min, m_max). K and V: ``NUM_CONSUMERS`` tiles, one per
    consumer's keys, or with ``SPLIT_D`` (hopper/bwd256.py) the two column halves of one key
    block's tile (the descriptors' boxes are then half the head dim wide, and every Q / dO
    ring slot is two consecutive halves too). Keys and query blocks are relative to the
    sequence, whose rows start at ``k_row0`` / ``q_row0`` / ``stat0`` (``common._key_tile``)."""
    q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc = descs
    k_bufs, v_bufs, kv_bar = kv
    q_ring, do_ring, lse_ring, delta_ring, q_ready, do_ready, free = ring
    tma_batch, head_kv, group, q_row0, k_row0, stat0, key0, m_min, m_max = tile
    KR: gl.constexpr = k_desc.block_type.shape[1]
    BM: gl.constexpr = q_desc.block_type.shape[1]
    W: gl.constexpr = q_desc.block_type.shape[3]
    PIECES: gl.constexpr = 2 if SPLIT_D else 1  # smem tiles per Q / dO ring slot
    KEY_STEP: gl.constexpr = 0 if SPLIT_D else KR
    COL_STEP: gl.constexpr = W if SPLIT_D else 0
    mbarrier.expect(kv_bar, NUM_CONSUMERS * (k_desc.block_type.nbytes + v_desc.block_type.nbytes))
    for c in gl.static_range(NUM_CONSUMERS):
        tma_load(k_desc, [tma_batch, k_row0 + key0 + c * KEY_STEP, head_kv, c * COL_STEP],
                                        kv_bar, _tma_view(k_bufs.index(c), k_desc))
        tma_load(v_desc, [tma_batch, k_row0 + key0 + c * KEY_STEP, head_kv, c * COL_STEP],
                                        kv_bar,
                                        _tma_view(v_bufs.index(c), v_desc))
    count = m_max - m_min
    # Same order as the consumers: query heads of the group outer, query blocks ascending.
    for it in range(group * count):
        g = it // count
        m = m_min + (it - g * count)
        head = head_kv * group + g
        stage = it % STAGES
        phase = (it // STAGES) & 1
        # A fresh barrier counts as having completed the phase before 0: the first pass
        # through the ring does not wait.
        mbarrier.wait(free.index(stage), phase ^ 1)
        # Q with its rows' LSE, dO with its rows' Delta: one barrier each.
        mbarrier.expect(q_ready.index(stage), PIECES * q_desc.block_type.nbytes + lse_desc.block_type.nbytes)
        for j in gl.static_range(PIECES):
            tma_load(q_desc, [tma_batch, q_row0 + m * BM, head, j * W], q_ready.index(stage),
                                            _tma_view(q_ring.index(PIECES * stage + j), q_desc))
        tma_load(lse_desc, [tma_batch, head, stat0 + m * BM], q_ready.index(stage),
                                        _tma_view(lse_ring.index(stage), lse_desc))
        mbarrier.expect(do_ready.index(stage), PIECES * do_desc.block_type.nbytes + delta_desc.block_type.nbytes)
        for j in gl.static_range(PIECES):
            tma_load(do_desc, [tma_batch, q_row0 + m * BM, head, j * W], do_ready.index(stage),
                                            _tma_view(do_ring.index(PIECES * stage + j), do_desc))
        tma_load(delta_desc, [tma_batch, head, stat0 + m * BM], do_ready.index(stage),
                                        _tma_view(delta_ring.index(stage), delta_desc))
