"""Concepts every attention kernel shares, written once.

* ``seqlen_info``: where a (batch, sequence) starts in the token dimension and how long it is.
  Dense tensors are the varlen case with a batch stride and start 0; varlen tensors are
  (total, heads, dim) with a batch stride of 0 and starts from ``cu_seqlens``.
* ``n_block_range`` / ``m_block_range``: which key blocks a query block visits (forward, dQ)
  and which query blocks a key block is visited by (dK/dV), split into the blocks that need
  a mask and the blocks that do not.
* ``visible``: the element-wise mask (sequence tail, causal, sliding window); ``in_chunk`` and
  ``chunk_block_range`` add FlashAttention-3's ``attention_chunk`` (the forwards only).
* ``scores``: scale + optional softcap, in the log2 domain the kernels use for exp2.
* ``launch_order`` (with the host's ``launch_sections``): which (batch, head) and which block
  a program computes: query-block launches (forward, dQ) longest first, a few heads at a
  time; the others (sections of one head) one head's blocks after another. Every launch
  is one-dimensional: CUDA's grid axes y and z stop at 65535, and batch * heads does not.
* ``persistent_schedule``: the same tiles handed out to a fixed number of persistent CTAs
  as the hardware hands them to CTAs of a one-tile-per-CTA launch (the next tile in launch
  order to the CTA that frees up first), costed by ``visited_key_blocks``.
* ``split_schedule``: a launch without masks whose tiles leave the last round of CTAs part
  empty, with that round's key blocks cut into equal shares (pieces of tiles, combined
  afterwards from their partial outputs and log-sum-exps).

Masking convention (FlashAttention's, bottom-right aligned): with ``shift = len_k - len_q``,
query row i sees key column j iff ``i + shift - left <= j <= i + shift + right``, where a
negative ``left``/``right`` means unbounded and causal is ``right = 0``. With an
``attention_chunk`` of C keys (chunked local attention) the row also sees only the columns of
its position's chunk: with p = i + shift, ``floor(p / C) * C <= j < floor(p / C) * C + C``.
"""
import functools
import heapq

import triton
import triton.language as tl

# Every launch states FP fusion (a * b + c as one fma), as the kernels were validated and tuned:
# Triton 3.9 warns when a launch leaves it unset, and 3.10 turns it off by default.
FP_FUSION = True

LOG2E = 1.4426950408889634


def ceil_div(a: int, b: int) -> int:
    """Host-side ``triton.cdiv`` (a constexpr function in Triton 3.6: ~4 us per host call)."""
    return -(-a // b)


# FlashAttention-3's L2 budget for the K and V that one section of heads streams (the H200
# has 50 MB of L2; the rest holds Q/O tiles and whatever else is in flight).
# (Read at each launch: scripts/order_probe.py sets it, 0 meaning one head after another.)
L2_SECTION_BYTES = 32 * 1024 * 1024


def section_heads(num_bh: int, nheads: int, nheads_kv: int, seqlen_k: int, kv_row_bytes: int,
                  masked: bool) -> int:
    """Heads per section of ``launch_order``: 1 (one head after another) without a causal or
    local mask, where every block costs the same. With one, as many heads as keep their K/V
    (``kv_row_bytes`` per key: (d + dv) * element size) within ``L2_SECTION_BYTES``, times the
    query heads sharing a KV head, and a divisor of ``num_bh`` (batch * heads), so every
    section holds the same number of heads."""
    if not masked or num_bh <= 1:
        return 1
    per_kv_head = max(1, seqlen_k * kv_row_bytes)
    cap = max(1, L2_SECTION_BYTES // per_kv_head) * max(1, nheads // max(1, nheads_kv))
    return _largest_divisor_at_most(num_bh, cap)


@functools.lru_cache(maxsize=256)
def _largest_divisor_at_most(n: int, cap: int) -> int:
    if cap >= n:
        return n
    best, i = 1, 1
    while i * i <= n:
        if n % i == 0:
            for c in (i, n // i):
                if best < c <= cap:
                    best = c
        i += 1
    return best


def launch_sections(batch, nheads, k, v, seqlen_k, window_left, window_right) -> int:
    """``section_heads`` of a query-block launch over ``batch`` x ``nheads`` query heads
    reading ``k``, ``v`` (any layout: their head count, head dims and element size count)."""
    return section_heads(batch * nheads, nheads, k.shape[-2], seqlen_k,
                         (k.shape[-1] + v.shape[-1]) * k.element_size(),
                         window_left >= 0 or window_right >= 0)


@triton.jit
def launch_order(tile, num_blocks, section_heads):
    """Program ``tile`` of a launch over (batch * heads) x ``num_blocks`` tiles -> (bh,
    rank); for query blocks, rank 0 is a head's longest block (under causal, its last).

    Heads go in sections of ``section_heads`` (a divisor of batch * heads); inside a section
    the tiles go rank by rank across its heads, so the longest tiles of several heads start
    first and no SM is left finishing a long tile while the others idle (longest processing
    time first, FlashAttention-3's causal scheduler). A section's K/V fit in L2, so its tiles
    read them from there. ``section_heads`` = 1: one head after another (rank = block)."""
    per_section = section_heads * num_blocks
    section = tile // per_section
    within = tile - section * per_section
    rank = within // section_heads
    bh = section * section_heads + (within - rank * section_heads)
    return bh, rank


def visited_key_blocks(m_block: int, len_q: int, len_k: int, window_left: int, window_right: int,
                       block_m: int, block_n: int) -> int:
    """Host twin of ``n_block_range``'s n_max - n_min: how many key blocks query block
    ``m_block`` visits (negative window sizes: unbounded)."""
    shift = len_k - len_q
    row_lo = m_block * block_m
    n_max = ceil_div(len_k, block_n)
    n_min = 0
    if window_right >= 0:
        col_end = min(row_lo + block_m - 1 + shift + window_right + 1, len_k)
        n_max = max(ceil_div(max(col_end, 0), block_n), 0)
    if window_left >= 0:
        n_min = max(row_lo + shift - window_left, 0) // block_n
    return n_max - min(n_min, n_max)


def persistent_schedule(num_bh: int, num_m_blocks: int, section_heads: int, len_q: int, len_k: int,
                        window_left: int, window_right: int, block_m: int, block_n: int,
                        num_ctas: int, overhead: int = 1) -> tuple:
    """Tiles of a query-block launch (``launch_order``: tile t is rank (t mod
    section_heads * num_m_blocks) // section_heads of its section) for ``num_ctas``
    persistent CTAs, as a one-tile-per-CTA launch would run them: in launch order, each tile
    to the CTA whose tiles so far cost least (``visited_key_blocks`` + ``overhead``, a tile's
    fixed cost in key blocks: Q load, O store, pipeline fill; ties to the lower CTA).
    Longest first, so the last tiles are short and the CTAs finish together; a static
    round-robin instead leaves a CTA with every round's longest tile (15-25% over the
    average on causal launches).

    Returns (offsets..., tiles...): CTA p walks tiles[offsets[p]:offsets[p + 1]] in order,
    offsets has ``num_ctas`` + 1 entries, tiles every tile exactly once."""
    cost = [visited_key_blocks(num_m_blocks - 1 - rank, len_q, len_k, window_left, window_right,
                               block_m, block_n) + overhead
            for rank in range(num_m_blocks)]
    per_section = section_heads * num_m_blocks
    free_at = [(0, p) for p in range(num_ctas)]
    walks = [[] for _ in range(num_ctas)]
    for tile in range(num_bh * num_m_blocks):
        t, p = free_at[0]
        heapq.heapreplace(free_at, (t + cost[(tile % per_section) // section_heads], p))
        walks[p].append(tile)
    offsets = [0]
    for w in walks:
        offsets.append(offsets[-1] + len(w))
    return tuple(offsets) + tuple(t for w in walks for t in w)


# ``split_schedule``'s estimate of a piece's own cost in key blocks beyond a tile's: its
# fp32 partial output written and read back, and its share of the combining launch
PIECE_OVERHEAD = 2
# ... and the least saving, as a fraction of the launch's estimated time, for which it cuts
# tiles at all: the merge's launch and the pieces' walk cost more than that estimate says.
# Measured on the H200 (``benchmarks/NOTES.md`` at fb45c0d, section 3afe79e): in five
# interleaved rounds beside the uncut walk, 2x8192x16x128 (estimate 2.5%) 643.5 -> 651.7
# TFLOPS and 2x8192x8x256 (2.5%) 674.3 -> 687.6, the seed (2.8%) 698.4 / 694.3,
# 4x4096x16x128 (2.0%) 624.3 / 625.7; in the complete run of 3afe79e, which cut at any
# saving, the rows estimated at 2.0% or less
# (4x4096 and 8x2048 at 128 and 256) lost 0.7-3.3% of their ratio to cuDNN against
# c0c4f9a's run, while rows cut in neither run gained 1.6-2.1% between the two runs
SPLIT_MIN_SAVING = 0.0225


def split_schedule(num_tiles: int, num_blocks: int, num_ctas: int, persistent: bool,
                   overhead: int = 1, always: bool = False):
    """Tiles of ``num_blocks`` key blocks each (a launch without masks: every tile visits
    them all) for ``num_ctas`` CTAs, the last round's key blocks split evenly: with F, r =
    divmod(num_tiles, num_ctas), tiles [0, F * num_ctas) are walked whole, and the r * num_blocks
    key blocks of the other r tiles (in tile order, then block order) are cut into
    ``num_ctas`` consecutive shares (at most r * num_blocks of them, one block at least), a
    share cut again where it crosses from one tile into the next. A whole tile then ends the
    launch at the cost of F + 1 tiles; the shares at F tiles and a share (stream-K's
    remainder split). Done where that saves at least ``SPLIT_MIN_SAVING`` of the launch's
    time with the pieces' fixed costs counted (``overhead`` per tile, ``PIECE_OVERHEAD`` per
    piece, two pieces per CTA at most); ``always``: whenever a round is part empty (tests).

    ``persistent``: CTA c walks tiles c, c + num_ctas, ..., then its share; else one CTA per
    whole tile, then one per share. Returns None (not worth it), or (walks, pieces): walks[c]
    a list of (tile, lo, hi, piece), key blocks [lo, hi) of ``tile``, ``piece`` -1 for a
    whole tile, else the piece's slot; pieces a list of (tile, first slot, slots) for every
    tile cut into pieces (its slots consecutive)."""
    F, r = divmod(num_tiles, num_ctas)
    if r == 0 or num_blocks == 0:
        return None
    total = r * num_blocks
    shares = min(num_ctas, total)
    whole = (F + 1) * (num_blocks + overhead)  # a CTA's estimated time, in key blocks
    cut = F * (num_blocks + overhead) + total / shares + 2 * (overhead + PIECE_OVERHEAD)
    if not always and whole - cut < SPLIT_MIN_SAVING * whole:
        return None
    if persistent:
        walks = [[(c + i * num_ctas, 0, num_blocks, -1) for i in range(F)] for c in range(num_ctas)]
        tail = walks[:shares]
    else:
        walks = [[(t, 0, num_blocks, -1)] for t in range(F * num_ctas)]
        tail = [[] for _ in range(shares)]
        walks += tail
    pieces = []
    slot = 0
    for c in range(shares):
        b, end = c * total // shares, (c + 1) * total // shares
        while b < end:
            t, lo = divmod(b, num_blocks)
            hi = min(num_blocks, lo + end - b)
            tile = F * num_ctas + t
            if hi - lo == num_blocks:
                tail[c].append((tile, lo, hi, -1))
            else:
                if not pieces or pieces[-1][0] != tile:
                    pieces.append((tile, slot, 0))
                pieces[-1] = (tile, pieces[-1][1], pieces[-1][2] + 1)
                tail[c].append((tile, lo, hi, slot))
                slot += 1
            b += hi - lo
    return walks, pieces


def split_table(num_tiles: int, num_blocks: int, num_ctas: int, persistent: bool,
                overhead: int = 1, always: bool = False):
    """``split_schedule`` flattened for the device: None, or (table, ctas, slots, tiles cut):
    table = offsets (ctas + 1: CTA c walks entries [offsets[c], offsets[c + 1])), the
    entries (tile, lo, hi, piece; 4 each), then (tile, first slot, slots) of every tile cut."""
    plan = split_schedule(num_tiles, num_blocks, num_ctas, persistent, overhead, always)
    if plan is None:
        return None
    walks, pieces = plan
    offsets = [0]
    for w in walks:
        offsets.append(offsets[-1] + len(w))
    entries = tuple(x for w in walks for e in w for x in e)
    cut = tuple(x for p in pieces for x in p)
    slots = sum(p[2] for p in pieces)
    return tuple(offsets) + entries + cut, len(walks), slots, len(pieces)


@triton.jit
def seqlen_info(batch, seqlen_q, seqlen_k, total_q, total_k,
                cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                IS_VARLEN: tl.constexpr, HAS_SEQUSED_Q: tl.constexpr, HAS_SEQUSED_K: tl.constexpr,
                DENSE_K: tl.constexpr = False):
    """Return (start_q, len_q, start_k, len_k) of sequence ``batch``.

    Varlen starts and ends are clamped to the tensor's token count, so malformed
    ``cu_seqlens`` can shorten a sequence but never make a kernel read out of bounds.
    ``DENSE_K`` (with IS_VARLEN): packed queries over a dense batch of keys, each sequence's
    ``seqlen_k`` rows (a KV cache: ``flash_attn_with_kvcache`` with ``cu_seqlens_q``).
    """
    if IS_VARLEN:
        start_q = tl.minimum(tl.maximum(tl.load(cu_seqlens_q + batch), 0), total_q)
        end_q = tl.minimum(tl.load(cu_seqlens_q + batch + 1), total_q)
        if DENSE_K:
            start_k = 0
            len_q = tl.maximum(end_q - start_q, 0)
            len_k = seqlen_k
        else:  # (this statement order keeps the dispatched kernels' code as GPU-tested)
            start_k = tl.minimum(tl.maximum(tl.load(cu_seqlens_k + batch), 0), total_k)
            end_k = tl.minimum(tl.load(cu_seqlens_k + batch + 1), total_k)
            len_q = tl.maximum(end_q - start_q, 0)
            len_k = tl.maximum(end_k - start_k, 0)
    else:
        start_q = 0
        start_k = 0
        len_q = seqlen_q
        len_k = seqlen_k
    if HAS_SEQUSED_Q:
        len_q = tl.minimum(tl.maximum(tl.load(seqused_q + batch), 0), len_q)
    if HAS_SEQUSED_K:
        len_k = tl.minimum(tl.maximum(tl.load(seqused_k + batch), 0), len_k)
    return start_q, len_q, start_k, len_k


@triton.jit
def cache_batch(KV_BATCH, batch, num_batches, HAS_KV_BATCH: tl.constexpr):
    """The KV-cache batch that sequence ``batch`` reads and appends to: KV_BATCH[batch]
    (``cache_batch_idx``, clamped to the cache so that a bad index cannot fault), or batch."""
    b = batch
    if HAS_KV_BATCH:
        b = tl.minimum(tl.maximum(tl.load(KV_BATCH + batch), 0), num_batches - 1)
    return b


@triton.jit
def paged_rows(page_row, rows, ok, page_size, num_blocks):
    """(block, row in block), int64, of a sequence's logical KV-cache rows ``rows`` in a
    paged cache: row r lives in block page_row[r // page_size] (the sequence's page-table
    row; clamped to the cache, so that a bad entry cannot fault) at row r % page_size."""
    block = page_block_of(page_entries(page_row, rows, ok, page_size), num_blocks)
    return block, (rows % page_size).to(tl.int64)


@triton.jit
def page_entries(page_row, rows, ok, page_size):
    """The page-table entries of logical rows ``rows`` (0 where not ``ok``), as stored: a
    loop can read them ahead of ``page_block_of``."""
    return tl.load(page_row + rows // page_size, mask=ok, other=0)


@triton.jit
def page_block_of(entries, num_blocks):
    """The cache block (int64) of page-table ``entries``, clamped to the cache's
    ``num_blocks`` so that a bad entry cannot fault."""
    return tl.minimum(tl.maximum(entries, 0), num_blocks - 1).to(tl.int64)


@triton.jit
def _floor_div(a, b):
    # Triton's // truncates toward zero; block bounds need floor for negative numerators.
    return tl.where(a >= 0, a // b, -((-a + b - 1) // b))


@triton.jit
def n_block_range(m_block, len_q, len_k, window_left, window_right,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Key blocks visited by query block ``m_block``.

    Returns (n_min, n_full_min, n_full_max, n_max): blocks in [n_min, n_max) hold at least
    one visible key for some row; blocks in [n_full_min, n_full_max) are visible to every
    row of the query block and lie wholly inside the sequence, so they need no mask.
    """
    shift = len_k - len_q
    row_lo = m_block * BLOCK_M
    row_hi = row_lo + BLOCK_M - 1
    n_max = tl.cdiv(len_k, BLOCK_N)
    full_max = len_k // BLOCK_N
    n_min = 0
    full_min = 0
    if HAS_RIGHT:
        # last visible column of the last row is row_hi + shift + right
        col_end = tl.minimum(row_hi + shift + window_right + 1, len_k)
        n_max = tl.maximum(tl.cdiv(tl.maximum(col_end, 0), BLOCK_N), 0)
        full_max = tl.minimum(full_max, _floor_div(row_lo + shift + window_right + 1, BLOCK_N))
    if HAS_LEFT:
        col_start = tl.maximum(row_lo + shift - window_left, 0)
        n_min = col_start // BLOCK_N
        full_min = tl.maximum(tl.cdiv(tl.maximum(row_hi + shift - window_left, 0), BLOCK_N), 0)
    n_min = tl.minimum(n_min, n_max)
    full_min = tl.minimum(tl.maximum(full_min, n_min), n_max)
    full_max = tl.minimum(tl.maximum(full_max, full_min), n_max)
    return n_min, full_min, full_max, n_max


@triton.jit
def m_block_range(n_block, len_q, len_k, window_left, window_right,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Query blocks that visit key block ``n_block`` (the transpose of ``n_block_range``).

    Returns (m_min, m_full_min, m_full_max, m_max) with the same meaning. Rows past len_q
    inside the last query block are harmless without a mask: the backward loads them with
    lse = +inf, so their probabilities are exactly 0.
    """
    shift = len_k - len_q
    col_lo = n_block * BLOCK_N
    col_hi = col_lo + BLOCK_N - 1
    m_min = 0
    m_max = tl.cdiv(len_q, BLOCK_M)
    full_min = 0
    full_max = m_max
    if col_hi >= len_k:  # the block reaches past the keys: every row needs the tail mask
        full_max = 0
    if HAS_RIGHT:
        # row i sees col j only if i >= j - shift - right
        row_start = tl.maximum(col_lo - shift - window_right, 0)
        m_min = row_start // BLOCK_M
        full_min = tl.maximum(tl.cdiv(tl.maximum(col_hi - shift - window_right, 0), BLOCK_M), 0)
    if HAS_LEFT:
        # row i sees col j only if i <= j - shift + left
        row_end = tl.minimum(col_hi - shift + window_left + 1, len_q)
        m_max = tl.maximum(tl.cdiv(tl.maximum(row_end, 0), BLOCK_M), 0)
        full_max = tl.minimum(full_max, _floor_div(col_lo - shift + window_left + 1, BLOCK_M))
    m_min = tl.minimum(m_min, m_max)
    full_min = tl.minimum(tl.maximum(full_min, m_min), m_max)
    full_max = tl.minimum(tl.maximum(full_max, full_min), m_max)
    return m_min, full_min, full_max, m_max


@triton.jit
def visible(rows, cols, len_q, len_k, window_left, window_right,
            HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Element mask for a (rows x cols) tile; ``rows``/``cols`` are broadcastable index vectors."""
    mask = cols < len_k
    shift = len_k - len_q
    if HAS_RIGHT:
        mask = mask & (cols <= rows + shift + window_right)
    if HAS_LEFT:
        mask = mask & (cols >= rows + shift - window_left)
    return mask


@triton.jit
def chunk_start(pos, chunk):
    """The first column of the chunk of bottom-right aligned position ``pos`` (floor, also
    for the negative positions of rows that see no key)."""
    return pos - (pos % chunk + chunk) % chunk


@triton.jit
def in_chunk(rows, cols, len_q, len_k, chunk):
    """``attention_chunk``'s element mask: column j is in row i's chunk (module docstring)."""
    first = chunk_start(rows + len_k - len_q, chunk)
    return (cols >= first) & (cols < first + chunk)


@triton.jit
def chunk_block_range(pos_lo, pos_hi, chunk, n_min, full_min, full_max, n_max, BLOCK_N: tl.constexpr):
    """``n_block_range``'s four cut to the chunks of bottom-right aligned positions
    ``pos_lo`` .. ``pos_hi`` (a tile's first and last row): visited blocks from the first
    row's chunk to the last row's, unmasked ones only inside a chunk every row shares."""
    lo_start = chunk_start(pos_lo, chunk)
    hi_start = chunk_start(pos_hi, chunk)
    n_min = tl.maximum(n_min, tl.maximum(lo_start, 0) // BLOCK_N)
    n_max = tl.minimum(n_max, tl.cdiv(tl.maximum(hi_start + chunk, 0), BLOCK_N))
    full_min = tl.maximum(full_min, tl.cdiv(tl.maximum(hi_start, 0), BLOCK_N))
    full_max = tl.minimum(full_max, tl.maximum(lo_start + chunk, 0) // BLOCK_N)
    n_min = tl.minimum(n_min, n_max)
    full_min = tl.minimum(tl.maximum(full_min, n_min), n_max)
    full_max = tl.minimum(tl.maximum(full_max, full_min), n_max)
    return n_min, full_min, full_max, n_max


@triton.jit
def tanh(x):
    # tanh(x) = 1 - 2 / (exp(2x) + 1): exact limits at +-inf, portable to the interpreter.
    return 1.0 - 2.0 / (tl.exp2(x * (2.0 * 1.4426950408889634)) + 1.0)


@triton.jit
def scores(qk, qk_scale_log2, softcap_log2, SOFTCAP: tl.constexpr):
    """Scaled (and soft-capped) scores in the log2 domain.

    Without softcap ``qk_scale_log2 = softmax_scale * log2(e)``; with softcap,
    ``qk_scale_log2 = softmax_scale / softcap`` and ``softcap_log2 = softcap * log2(e)``,
    so that s = softcap * tanh(scale * qk / softcap), returned times log2(e).
    """
    if SOFTCAP:
        return tanh(qk * qk_scale_log2) * softcap_log2
    else:
        return qk * qk_scale_log2


@triton.jit
def cache_bases(K, V, kv_batch, head_kv, first_key, stride_k, stride_v, PAGED: tl.constexpr):
    """(K, V) pointers of one (sequence, KV head)'s keys, ``stride_k`` / ``stride_v`` the
    (batch, token, head) strides: in a paged cache the head alone (each key block finds its
    rows through the page table), else also the cache batch and the first key, in 64 bits."""
    stride_kb, stride_kn, stride_kh = stride_k
    stride_vb, stride_vn, stride_vh = stride_v
    if PAGED:
        k_base = K + head_kv.to(tl.int64) * stride_kh
        v_base = V + head_kv.to(tl.int64) * stride_vh
    else:
        k_base = (K + kv_batch.to(tl.int64) * stride_kb + head_kv.to(tl.int64) * stride_kh
                  + first_key.to(tl.int64) * stride_kn)
        v_base = (V + kv_batch.to(tl.int64) * stride_vb + head_kv.to(tl.int64) * stride_vh
                  + first_key.to(tl.int64) * stride_vn)
    return k_base, v_base


@triton.jit
def fp8_descales(descales, batch, head_kv):
    """FlashAttention-3's fp8 descales of one (sequence, KV head): ``descales`` is (Q_DESCALE,
    K_DESCALE, V_DESCALE, their (batch, head) strides as one 6-tuple). Returns (q_descale x
    k_descale, which scales the scores, and v_descale, which scales the output)."""
    ds = descales[3]
    b, h = batch.to(tl.int64), head_kv.to(tl.int64)
    q_descale = tl.load(descales[0] + b * ds[0] + h * ds[1])
    k_descale = tl.load(descales[1] + b * ds[2] + h * ds[3])
    v_descale = tl.load(descales[2] + b * ds[4] + h * ds[5])
    return q_descale * k_descale, v_descale


@triton.jit
def softmax_step(acc, m_i, l_i, s, v):
    """One key block of the online softmax: scores ``s`` (log2 domain, -inf where masked),
    values ``v``; a row that has seen no key yet keeps m = -inf and adds nothing (never NaN).
    Returns the new (acc, m_i, l_i)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that saw nothing yet
    p = tl.exp2(s - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i


@triton.jit
def to_output(x, dtype: tl.constexpr, UPCAST: tl.constexpr):
    """Cast an fp32 tile to the output dtype, rounding to nearest even.

    The 3.6 interpreter truncates fp32 -> bf16; under it (UPCAST) the rounding bias is
    added to the bits first so the CPU results round like the GPU's cvt.rn.bf16.f32.
    """
    if UPCAST and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)  # now exactly representable in bf16
    return x.to(dtype)
