"""Decoding: a few query tokens per sequence against a long KV cache (FlashDecoding with
FlashAttention-3's packed GQA), plain Triton, every target and the CPU interpreter.

A decoding step reads the whole cache once for a handful of query rows, so its speed is the
bytes it streams per second. Two things make a launch stream at the card's bandwidth:

* **packed GQA**: the query heads of one KV head are rows of one tile (row r of a tile is
  query token r // GROUP of query head ``head_kv * GROUP + r % GROUP``), so each K/V block
  is read once per KV head, not once per query head;
* **longest first**: with per-sequence key counts (``cache_seqlens``) the programs take
  the sequences in order of decreasing length (``longest_first``), so the GPU, which starts
  CTAs in program order, starts the longest work first and a ragged batch's tail is made of
  short sequences;
* **split keys**: when batch x KV heads x query tiles leaves SMs idle, each tile's key
  blocks are cut into ``num_splits`` equal shares, one program each. A share leaves its rows'
  output normalized by its own row sums (fp32) and their natural-log log-sum-exps in a
  workspace; ``decode_combine_kernel`` merges a tile's shares: with lse = log(sum_i
  exp(lse_i)), O = sum_i exp(lse_i - lse) O_i. On sm90 the combine is a programmatic
  dependent launch (``chained``): its CTAs take the SMs the shares leave and wait there for
  the shares' memory, instead of being launched after the last share ends.

The cache is addressed as ``problem.CacheAddressing`` says (dense, cache_batch_idx,
cache_leftpad, a page table of any page size); key j of a sequence is its logical cache row
``k_start + j``. Masks (causal, sliding window) are bottom-right aligned to the sequence's
keys as in every other kernel (``common`` module docstring), per query token.

The launch plan (``plan``) depends only on shapes, so a captured CUDA graph replays it.
"""
import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .common import (FP_FUSION, cache_bases, cache_batch, ceil_div, chunk_start, fp8_descales, in_chunk, page_block_of,
                     page_entries, scores, seqlen_info, softmax_step, to_output, visible)
from .problem import CacheAddressing, alloc_fwd_outputs, bshd_strides, lse_strides


@dataclass(frozen=True)
class DecodeConfig:
    """A decode tile: ``block_n`` keys per step, ``num_stages`` of them in flight."""
    block_n: int
    num_warps: int
    num_stages: int


class DecodeMeta(NamedTuple):
    """A launch's compile-time constants (the kernels' ``META``)."""
    GROUP: int            # query heads per KV head, packed into a tile's rows
    HEADDIM: int
    HEADDIM_V: int
    BLOCK_M: int          # packed rows (query tokens x GROUP) per tile
    BLOCK_N: int          # keys per step
    BLOCK_D: int          # HEADDIM and HEADDIM_V rounded up to powers of two
    BLOCK_DV: int
    IS_VARLEN: bool       # q packed by cu_seqlens_q
    HAS_SEQUSED_K: bool   # per-sequence key counts (cache_seqlens)
    HAS_LEFT: bool        # a sliding window's left edge
    HAS_RIGHT: bool       # causal or a window's right edge
    SOFTCAP: bool
    UPCAST: bool          # fp32 operands (the interpreter)
    HAS_KV_BATCH: bool    # cache_batch_idx
    HAS_K_START: bool     # cache_leftpad
    PAGED: bool           # page_table
    SPLIT: bool           # shares merged by decode_combine_kernel
    PAGE_BLOCK: bool = False  # paged, every key block inside one page: one page-table read per block
    PAGE_SIZE: int = 0        # paged: the page size when a power of two (static_page_size), else 0
    BLOCK_B: int = 0          # > 0: sequences taken longest first (``longest_first``), batch <= BLOCK_B
    CHAINED: bool = False     # SPLIT, the combine launched as its dependent (``chained``)
    KV_SAME: bool = False     # K and V with the same (block, row) strides: one offset serves both (``shared_offsets``)
    WIDE_ROWS: bool = False   # paged, row offsets inside a page computed in 64 bits (``wide_rows``)
    HAS_CHUNK: bool = False   # FA3's attention_chunk: ``score`` carries the chunk as a fifth value
    FP8: bool = False         # float8_e4m3fn q / caches, converted to fp16 as loaded; ``score`` carries the descales


# How many query rows (tokens x GROUP) a tile packs at most; calls with more rows per KV head
# are prefill, which the dense kernels serve.
MAX_ROWS = 64
# Splits per tile at most (the combine loops over them) and keys per split at least.
MAX_SPLITS = 128
MIN_BLOCKS_PER_SPLIT = 4
# Batches up to this size with per-sequence lengths run their sequences longest first.
MAX_ORDERED_BATCH = 128


def config(target: str, headdim: int, headdim_v: int, page_size: int = 0, split: bool = True,
           fp8: bool = False) -> DecodeConfig:
    """The tile of a decode launch over a cache with pages of ``page_size`` rows (0: dense);
    ``split``: the plan cuts the tiles' keys into shares. Pages that hold whole 128-key blocks
    (``page_block``) and, unsplit at head dim 128, pages of a power-of-two size (its divisions
    compiled as shifts: ``static_page_size``) take the dense tiles."""
    if target == "interpret":
        return DecodeConfig(block_n=16, num_warps=4, num_stages=1)
    # (block_n x warps x stages) measured on the H200 with CUDA-graph replay, K+V TB/s
    # (scripts/decode_probe.py; benchmarks/results/probes/decode-tiles-graph.txt at 0ac98e0):
    # head dim 256, 32 x 8192, 16/2 heads: 64x8x3 4.19, 32x4x4 4.12, 32x8x6 3.27; head dim 128,
    # dense 64 x 8192: 128x8x3 4.39, 128x4x2 4.46, 128x4x3 4.43, 64x4x4 4.39 (128x4x2 falls to
    # 3.50 on 8 x 32768, 128x8x3 keeps 4.35); paged, pages of 64 / 16 / 1: 32x4x6 4.32 / 4.24 /
    # 4.27, 64x4x4 3.07 / 3.59 / 3.32. Dense 256 x 2048 (one share per tile; probes/
    # decode-splits-cfg-bbc4951.json at 6b96f5f): 128x8x3 4.17, 128x4x2 4.44, 64x8x3 4.37,
    # 64x4x4 4.35 (SDPA-cuDNN 4.47). So at head dim 128 an unsplit launch takes 128x4x2, a
    # split one 128x8x3. Paged, the page size a compile-time power of two (``PAGE_SIZE``;
    # probes/decode-pagesize-constexpr-p*-302815e.json at d150566), pages of 64 / 16 / 1:
    # 128x4x2 4.38 / 4.28 / 4.32, ragged pages of 64 / 16 3.50 / 3.47 (32x4x6 with the page
    # size at run time: 4.36 / 4.25 / 4.30, ragged 3.34 / 2.65); pages of 256 (``page_block``,
    # whole 128-key blocks per page; probes/decode-pageblock-302815e.json at d150566): 128x4x2
    # 4.45, per key 4.06 (dense cache 4.48, SDPA-cuDNN 4.46).
    if max(headdim, headdim_v) > 256:  # (FA3's MLA shape, 64 / 512: K and V stages within shared memory)
        return DecodeConfig(block_n=32, num_warps=8, num_stages=2)
    if max(headdim, headdim_v) > 128:
        return DecodeConfig(block_n=64, num_warps=8, num_stages=3)
    if page_size and page_size % 128:  # rows gathered through the page table
        if not split and headdim == headdim_v == 128 and static_page_size(page_size):
            return DecodeConfig(block_n=128, num_warps=4, num_stages=2)
        return DecodeConfig(block_n=32, num_warps=4, num_stages=6)  # narrower steps, more in flight
    if not split and headdim == headdim_v == 128 and not fp8:
        return DecodeConfig(block_n=128, num_warps=4, num_stages=2)
    # (fp8 caches, unsplit and dense at head dim 128: 128x4x2 with the conversions to fp16 spills
    # 140 B under triton 3.8 (none under 3.6), 128x8x3 none under either; picked by its sm_90a
    # compile, not timed: tools/decode_compile.py form d128-dense-fp8)
    return DecodeConfig(block_n=128, num_warps=8, num_stages=3)


def static_page_size(page_size: int) -> int:
    """The page size the kernel is compiled for (``DecodeMeta.PAGE_SIZE``): a power of two, so
    that a key's page and row are a shift and a mask; 0 (any other size, or a dense cache):
    read at run time."""
    return page_size if page_size > 0 and page_size & (page_size - 1) == 0 else 0


def page_block(page_size: int, block_n: int, has_k_start: bool) -> bool:
    """Whether every key block of ``block_n`` keys lies inside one page of ``page_size`` rows
    (the sequence's keys starting at its first row: no ``cache_leftpad``): then a block's rows
    are one page-table read and contiguous rows of that page, as in a dense cache."""
    return page_size > 0 and page_size % block_n == 0 and not has_k_start


def longest_first(batch: int, has_seqused_k: bool) -> int:
    """``DecodeMeta.BLOCK_B``: with per-sequence key counts (``cache_seqlens``) the programs
    take the sequences in order of decreasing length, so the GPU, which starts CTAs in
    program order, schedules the longest work first and a ragged batch does not end on one
    long sequence's CTAs (longest-processing-time-first). Each program finds its sequence
    from the key counts itself (``_by_length``: no sort launch, graph-safe); 0: program order
    (no counts, one sequence, or batches over ``MAX_ORDERED_BATCH``)."""
    if not has_seqused_k or batch < 2 or batch > MAX_ORDERED_BATCH:
        return 0
    return max(16, triton.next_power_of_2(batch))


def chained(target: str) -> bool:
    """Whether a split launch's combine is launched as its programmatic dependent (PDL,
    sm90's ``griddepcontrol``): every share lets it launch as soon as it starts, so the
    combine's CTAs are placed on the SMs the shares leave and wait there
    (``griddepcontrol.wait``) for the shares' memory, instead of being launched after them."""
    return target == "sm90"


def shared_offsets(k, v) -> bool:
    """``DecodeMeta.KV_SAME``: whether K and V step through their blocks (or sequences) and
    rows with the same strides (separate caches allocated alike, or K and V as views of one
    tensor), so that one 64-bit offset per key addresses both."""
    return k.stride()[:2] == v.stride()[:2]


def wide_rows(page_size: int, k, v) -> bool:
    """``DecodeMeta.WIDE_ROWS``: whether a row's offset inside a page (row x row stride) can
    pass 2^31 elements; else it is computed in 32 bits and only the page's is 64-bit."""
    return page_size * max(abs(k.stride(1)), abs(v.stride(1))) >= 2 ** 31


def ctas_per_sm(cfg: DecodeConfig, headdim: int, headdim_v: int) -> int:
    """How many decode CTAs an SM holds: shared memory of the K/V stages (2-byte elements)
    against Hopper's 227 KiB, at most 4."""
    stage = cfg.block_n * (headdim + headdim_v) * 2
    return max(1, min(4, 232448 // max(1, cfg.num_stages * stage)))


def serves(seqlen_q: int, nheads: int, nheads_kv: int) -> bool:
    """Whether a call is a decoding step: one tile's rows hold every query token of a KV
    head's query heads."""
    return seqlen_q * (nheads // nheads_kv) <= MAX_ROWS


def block_m(max_seqlen_q: int, group: int) -> int:
    return max(16, triton.next_power_of_2(max_seqlen_q * group))


def num_splits_for(tiles: int, key_blocks: int, slots: int, requested: int = 0) -> int:
    """Splits per tile. ``requested`` > 0 (FA3's ``num_splits``) is honoured up to the key
    blocks and MAX_SPLITS; 0 picks them: none when the tiles already fill most of the
    ``slots`` (CTAs the GPU runs at once), else the fewest that bring the CTAs to a wave
    efficiency within 5% of the best, each split at least MIN_BLOCKS_PER_SPLIT key blocks."""
    cap = max(1, min(MAX_SPLITS, key_blocks))
    if requested > 0:
        return min(requested, cap)
    if tiles >= 0.8 * slots:
        return 1
    cap = max(1, min(cap, key_blocks // MIN_BLOCKS_PER_SPLIT))

    def efficiency(s):
        return tiles * s / (ceil_div(tiles * s, slots) * slots)

    best = max(efficiency(s) for s in range(1, cap + 1))
    return next(s for s in range(1, cap + 1) if efficiency(s) >= 0.95 * best)


@dataclass(frozen=True)
class Plan:
    """One launch: ``splits`` shares per tile of BLOCK_M packed rows; (grid of the decode
    kernel: (splits, m tiles, batch * nheads_kv))."""
    block_m: int
    m_tiles: int
    splits: int
    cfg: DecodeConfig


_SMS = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    n = _SMS.get(device)
    if n is None:
        n = _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return n


@functools.lru_cache(maxsize=1024)
def plan(target, device, batch, max_seqlen_q, capacity, nheads, nheads_kv, headdim, headdim_v,
         page_size=0, num_splits=0, fp8=False) -> Plan:
    """``page_size``: rows per page of a paged cache, 0 for a dense one; ``fp8``: fp8 caches
    (their tile, ``config``; the splits as for 16-bit caches)."""
    cfg = config(target, headdim, headdim_v, page_size)
    group = nheads // nheads_kv
    bm = block_m(max_seqlen_q, group)
    m_tiles = ceil_div(max_seqlen_q * group, bm)
    tiles = batch * nheads_kv * m_tiles
    slots = _num_sms(device) * ctas_per_sm(cfg, headdim, headdim_v)
    splits = num_splits_for(tiles, ceil_div(capacity, cfg.block_n), slots, num_splits)
    if splits == 1:  # (the same CTAs per SM: the split count stands)
        cfg = config(target, headdim, headdim_v, page_size, split=False, fp8=fp8)
    return Plan(bm, m_tiles, splits, cfg)


@triton.jit
def _attend(acc, m_i, l_i, q, k_base, v_base, kv_strides, lo, hi, tok, len_q, len_k, k_first, page_row,
            paging, score, MASK: tl.constexpr, META: tl.constexpr):
    """Online softmax over key blocks [lo, hi); ``tok``: each row's query token (masks)."""
    stride_kn, stride_vn, stride_kb, stride_vb = kv_strides
    _, page_size, num_kv_blocks = paging
    if META.PAGE_SIZE > 0:  # a power of two known at compile time: row // page_size is a shift
        page_size = META.PAGE_SIZE
        page_u = tl.full([], META.PAGE_SIZE, tl.uint32)
    else:
        page_u = page_size.to(tl.uint32)
    qk_scale, softcap_log2, window_left, window_right = score[0], score[1], score[2], score[3]
    HEADDIM: tl.constexpr = META.HEADDIM
    HEADDIM_V: tl.constexpr = META.HEADDIM_V
    BLOCK_N: tl.constexpr = META.BLOCK_N
    BLOCK_D: tl.constexpr = META.BLOCK_D
    BLOCK_DV: tl.constexpr = META.BLOCK_DV
    HAS_LEFT: tl.constexpr = META.HAS_LEFT
    HAS_RIGHT: tl.constexpr = META.HAS_RIGHT
    SOFTCAP: tl.constexpr = META.SOFTCAP
    UPCAST: tl.constexpr = META.UPCAST
    PAGED: tl.constexpr = META.PAGED
    PAGE_BLOCK: tl.constexpr = META.PAGE_BLOCK
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    k_cols = offs_d[None, :] < HEADDIM
    v_cols = offs_dv[None, :] < HEADDIM_V
    # Paged, a page per key (one page-table read per key serves K and V): each block's
    # entries are read one block ahead, so its K / V addresses wait on no read of their own.
    AHEAD: tl.constexpr = PAGED and not PAGE_BLOCK
    if AHEAD:
        offs_lo = lo * BLOCK_N + offs_n0
        nxt = page_entries(page_row, k_first + offs_lo, offs_lo < len_k, page_size)
    for n_block in range(lo, hi):
        offs_n = n_block * BLOCK_N + offs_n0
        if AHEAD:  # (a row >= 0: its place in its page an unsigned remainder, a mask for a power of two)
            blk = page_block_of(nxt, num_kv_blocks)
            row = ((k_first + offs_n).to(tl.uint32) % page_u).to(tl.int32)
            nxt = page_entries(page_row, k_first + offs_n + BLOCK_N, offs_n + BLOCK_N < len_k, page_size)
            if META.WIDE_ROWS:
                row = row.to(tl.int64)
            k_off = blk * stride_kb + (row * stride_kn).to(tl.int64)
            v_off = k_off if META.KV_SAME else blk * stride_vb + (row * stride_vn).to(tl.int64)
            k_ptrs = k_base + k_off[:, None] + offs_d[None, :]
            v_ptrs = v_base + v_off[:, None] + offs_dv[None, :]
        elif PAGE_BLOCK:  # the block inside one page (k_first = 0): one page-table read
            first = n_block * BLOCK_N
            blk = page_block_of(tl.load(page_row + first // page_size), num_kv_blocks)
            row = (first % page_size + offs_n0).to(tl.int64)
            k_off = blk * stride_kb + row * stride_kn
            v_off = k_off if META.KV_SAME else blk * stride_vb + row * stride_vn
            k_ptrs = k_base + k_off[:, None] + offs_d[None, :]
            v_ptrs = v_base + v_off[:, None] + offs_dv[None, :]
        else:
            k_off = offs_n.to(tl.int64) * stride_kn
            v_off = k_off if META.KV_SAME else offs_n.to(tl.int64) * stride_vn
            k_ptrs = k_base + k_off[:, None] + offs_d[None, :]
            v_ptrs = v_base + v_off[:, None] + offs_dv[None, :]
        if MASK:
            k = tl.load(k_ptrs, mask=(offs_n[:, None] < len_k) & k_cols, other=0.0)
            v = tl.load(v_ptrs, mask=(offs_n[:, None] < len_k) & v_cols, other=0.0)
        elif HEADDIM == BLOCK_D and HEADDIM_V == BLOCK_DV:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        else:
            k = tl.load(k_ptrs, mask=k_cols, other=0.0)
            v = tl.load(v_ptrs, mask=v_cols, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        elif META.FP8:
            k = k.to(tl.float16)
            v = v.to(tl.float16)
        s = scores(tl.dot(q, tl.trans(k)), qk_scale, softcap_log2, SOFTCAP)
        if MASK:
            seen = visible(tok[:, None], offs_n[None, :], len_q, len_k, window_left, window_right,
                           HAS_LEFT, HAS_RIGHT)
            if META.HAS_CHUNK:
                seen = seen & in_chunk(tok[:, None], offs_n[None, :], len_q, len_k, score[4])
            s = tl.where(seen, s, float("-inf"))
        acc, m_i, l_i = softmax_step(acc, m_i, l_i, s, v)
    return acc, m_i, l_i


@triton.jit
def _by_length(seqused_k, rank, batch, BLOCK_B: tl.constexpr):
    """The sequence that is ``rank``-th in decreasing order of ``seqused_k[:batch]`` (ties in
    index order): sequence i's place is the count of sequences longer than it plus the equal
    ones before it, a permutation of 0 .. batch - 1."""
    CHUNK: tl.constexpr = 32 if BLOCK_B > 32 else BLOCK_B
    i = tl.arange(0, BLOCK_B)
    len_i = tl.maximum(tl.load(seqused_k + i, mask=i < batch, other=0), 0)
    place = tl.zeros([BLOCK_B], dtype=tl.int32)
    for j0 in tl.static_range(0, BLOCK_B, CHUNK):
        j = j0 + tl.arange(0, CHUNK)
        len_j = tl.maximum(tl.load(seqused_k + j, mask=j < batch, other=0), 0)
        ahead = (len_j[None, :] > len_i[:, None]) | ((len_j[None, :] == len_i[:, None]) & (j[None, :] < i[:, None]))
        place += tl.sum((ahead & (j < batch)[None, :]).to(tl.int32), axis=1)
    return tl.sum(tl.where((place == rank) & (i < batch), i, 0), axis=0)


@triton.jit
def decode_kernel(Q, K, V, O, LSE, O_PART, LSE_PART, stride_q, stride_k, stride_v, stride_o, stride_lse,
                  cu_seqlens_q, seqused_k, KV_BATCH, K_START, PAGE_TABLE, paging, sizes, score,
                  META: tl.constexpr):
    """Program (split, m tile, batch * nheads_kv + head_kv). Strides: (batch, token, head) of
    q, k, v, o, and (batch, head, token) of lse; ``paging`` (page-table row stride, page size,
    cache blocks); ``sizes`` (nheads_kv, seqlen_q, seqlen_k, total_q, num_splits); ``score``
    (qk_scale, softcap_log2, window_left, window_right[, attention_chunk under HAS_CHUNK or
    FP8][, Q_DESCALE, K_DESCALE, V_DESCALE, their (batch, head) strides under FP8]);
    ``META`` a ``DecodeMeta``."""
    stride_qb, stride_qm, stride_qh = stride_q
    stride_kb, stride_kn, _ = stride_k
    stride_vb, stride_vn, _ = stride_v
    stride_ob, stride_om, stride_oh = stride_o
    stride_lseb, stride_lseh, stride_lsem = stride_lse
    nheads_kv, seqlen_q, seqlen_k, total_q, num_splits = sizes
    window_left, window_right = score[2], score[3]
    GROUP: tl.constexpr = META.GROUP
    HEADDIM: tl.constexpr = META.HEADDIM
    HEADDIM_V: tl.constexpr = META.HEADDIM_V
    BLOCK_M: tl.constexpr = META.BLOCK_M
    BLOCK_N: tl.constexpr = META.BLOCK_N
    BLOCK_D: tl.constexpr = META.BLOCK_D
    BLOCK_DV: tl.constexpr = META.BLOCK_DV
    IS_VARLEN: tl.constexpr = META.IS_VARLEN
    HAS_SEQUSED_K: tl.constexpr = META.HAS_SEQUSED_K
    HAS_LEFT: tl.constexpr = META.HAS_LEFT
    HAS_RIGHT: tl.constexpr = META.HAS_RIGHT
    UPCAST: tl.constexpr = META.UPCAST
    HAS_KV_BATCH: tl.constexpr = META.HAS_KV_BATCH
    HAS_K_START: tl.constexpr = META.HAS_K_START
    PAGED: tl.constexpr = META.PAGED
    SPLIT: tl.constexpr = META.SPLIT
    stride_ptb, _, num_kv_blocks = paging
    if META.CHAINED:  # the combine may launch now; it waits for this launch's memory
        gdc_launch_dependents()
    split = tl.program_id(0)
    m_tile = tl.program_id(1)
    bh = tl.program_id(2)
    batch = bh // nheads_kv
    head_kv = bh % nheads_kv
    if META.BLOCK_B > 0:  # the programs' sequences longest first (``longest_first``)
        batch = _by_length(seqused_k, batch, tl.num_programs(2) // nheads_kv, META.BLOCK_B)
        bh = batch * nheads_kv + head_kv
    start_q, len_q, _, len_k = seqlen_info(batch, seqlen_q, seqlen_k, total_q, 0, cu_seqlens_q,
                                           cu_seqlens_q, seqused_k, seqused_k, IS_VARLEN, False,
                                           HAS_SEQUSED_K, True)
    k_first = 0
    if HAS_K_START:  # keys k_first .. len_k - 1 of the cache (left padding skipped)
        k_first = tl.minimum(tl.maximum(tl.load(K_START + batch), 0), len_k)
        len_k -= k_first

    rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    tok = rows // GROUP
    head = head_kv * GROUP + rows % GROUP
    row_ok = tok < len_q
    tile = bh * tl.num_programs(1) + m_tile
    if SPLIT:
        part = (split * tl.num_programs(2) * tl.num_programs(1) + tile).to(tl.int64) * BLOCK_M + rows - m_tile * BLOCK_M
    if m_tile * BLOCK_M >= len_q * GROUP:
        if SPLIT:  # the combine reads every share of a tile
            tl.store(LSE_PART + part, tl.full([BLOCK_M], float("-inf"), tl.float32))
        return

    # Key blocks the tile's tokens see (bottom-right aligned masks), then this split's share.
    shift = len_k - len_q
    tok_lo = (m_tile * BLOCK_M) // GROUP
    tok_hi = tl.minimum((m_tile * BLOCK_M + BLOCK_M - 1) // GROUP, len_q - 1)
    n_end = len_k
    full_end = len_k
    if HAS_RIGHT:
        n_end = tl.maximum(tl.minimum(tok_hi + shift + window_right + 1, len_k), 0)
        full_end = tl.maximum(tl.minimum(tok_lo + shift + window_right + 1, len_k), 0)
    n_start = 0
    full_start = 0
    if HAS_LEFT:
        n_start = tl.maximum(tok_lo + shift - window_left, 0)
        full_start = tl.maximum(tok_hi + shift - window_left, 0)
    if META.HAS_CHUNK:  # from the first token's chunk to the last one's; unmasked inside a shared one
        first_lo = chunk_start(tok_lo + shift, score[4])
        first_hi = chunk_start(tok_hi + shift, score[4])
        n_start = tl.maximum(n_start, first_lo)
        n_end = tl.maximum(tl.minimum(n_end, first_hi + score[4]), 0)
        full_start = tl.maximum(full_start, first_hi)
        full_end = tl.maximum(tl.minimum(full_end, first_lo + score[4]), 0)
    n_lo = n_start // BLOCK_N
    n_hi = tl.cdiv(n_end, BLOCK_N)
    per = tl.cdiv(tl.maximum(n_hi - n_lo, 0), num_splits)
    lo = tl.minimum(n_lo + split * per, n_hi)
    hi = tl.minimum(lo + per, n_hi)
    # blocks every row sees whole: no mask
    f_lo = tl.minimum(tl.maximum(tl.cdiv(full_start, BLOCK_N), lo), hi)
    f_hi = tl.minimum(tl.maximum(full_end // BLOCK_N, f_lo), hi)

    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_ptrs = (Q + batch.to(tl.int64) * stride_qb + (start_q + tok).to(tl.int64)[:, None] * stride_qm
              + head.to(tl.int64)[:, None] * stride_qh + offs_d[None, :])
    q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_d[None, :] < HEADDIM), other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    elif META.FP8:
        q = q.to(tl.float16)
    v_descale = 1.0
    if META.FP8:  # (sequence, KV head) descales: q's and k's scale the scores, v's the output
        qk_descale, v_descale = fp8_descales(score[5:], batch, head_kv)
        score = (score[0] * qk_descale, score[1], score[2], score[3], score[4])
    kv_batch = cache_batch(KV_BATCH, batch, num_kv_blocks, HAS_KV_BATCH)
    k_base, v_base = cache_bases(K, V, kv_batch, head_kv, k_first, stride_k, stride_v, PAGED)
    page_row = PAGE_TABLE + batch.to(tl.int64) * stride_ptb

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    # masked left edge (sliding window), unmasked middle, masked right edge (causal / tail)
    acc, m_i, l_i = _attend(acc, m_i, l_i, q, k_base, v_base, (stride_kn, stride_vn, stride_kb, stride_vb),
                            lo, f_lo, tok, len_q, len_k, k_first, page_row, paging, score, True, META)
    acc, m_i, l_i = _attend(acc, m_i, l_i, q, k_base, v_base, (stride_kn, stride_vn, stride_kb, stride_vb),
                            f_lo, f_hi, tok, len_q, len_k, k_first, page_row, paging, score, False, META)
    acc, m_i, l_i = _attend(acc, m_i, l_i, q, k_base, v_base, (stride_kn, stride_vn, stride_kb, stride_vb),
                            f_hi, hi, tok, len_q, len_k, k_first, page_row, paging, score, True, META)

    # A row that saw no key: output 0, lse = -inf (never NaN).
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc / l_safe[:, None]
    if META.FP8:
        out = out * v_descale
    lse = tl.where(seen, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    if SPLIT:
        tl.store(LSE_PART + part, lse)
        tl.store(O_PART + part[:, None] * BLOCK_DV + offs_dv[None, :], out)
    else:
        tl.store(O + batch.to(tl.int64) * stride_ob + (start_q + tok).to(tl.int64)[:, None] * stride_om
                 + head.to(tl.int64)[:, None] * stride_oh + offs_dv[None, :],
                 to_output(out, O.dtype.element_ty, UPCAST), mask=row_ok[:, None] & (offs_dv[None, :] < HEADDIM_V))
        tl.store(LSE + batch.to(tl.int64) * stride_lseb + head.to(tl.int64) * stride_lseh
                 + (start_q + tok).to(tl.int64) * stride_lsem, lse, mask=row_ok)


@triton.jit
def decode_combine_kernel(O, LSE, O_PART, LSE_PART, stride_o, stride_lse, cu_seqlens_q, sizes,
                          GROUP: tl.constexpr, HEADDIM_V: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr, CHUNK: tl.constexpr,
                          IS_VARLEN: tl.constexpr, UPCAST: tl.constexpr, CHAINED: tl.constexpr):
    """Program (row of a tile, tile, CHUNK columns): merges that row's ``num_splits`` shares,
    all loaded at once (BLOCK_S >= num_splits). ``sizes``: (nheads_kv, seqlen_q, total_q,
    num_splits, m_tiles). ``CHAINED``: launched as the decode launch's dependent (``chained``),
    so it waits for that launch's memory before reading the shares."""
    stride_ob, stride_om, stride_oh = stride_o
    stride_lseb, stride_lseh, stride_lsem = stride_lse
    nheads_kv, seqlen_q, total_q, num_splits, m_tiles = sizes
    r = tl.program_id(0)
    tile = tl.program_id(1)
    bh = tile // m_tiles
    m_tile = tile - bh * m_tiles
    batch = bh // nheads_kv
    head_kv = bh - batch * nheads_kv
    start_q, len_q, _, _ = seqlen_info(batch, seqlen_q, 0, total_q, 0, cu_seqlens_q, cu_seqlens_q,
                                       cu_seqlens_q, cu_seqlens_q, IS_VARLEN, False, False, True)
    row = m_tile * BLOCK_M + r
    tok = row // GROUP
    if tok >= len_q:
        return
    head = head_kv * GROUP + row % GROUP
    splits = tl.arange(0, BLOCK_S)
    cols = tl.program_id(2) * CHUNK + tl.arange(0, CHUNK)
    part = (splits * tl.num_programs(1) + tile).to(tl.int64) * BLOCK_M + r
    if CHAINED:
        gdc_wait()
    lse_s = tl.load(LSE_PART + part, mask=splits < num_splits, other=float("-inf"))
    m = tl.max(lse_s, 0)
    m_use = tl.where(m == float("-inf"), 0.0, m)  # a row no share saw a key for
    w = tl.exp(lse_s - m_use)
    total = tl.sum(w, 0)
    o_s = tl.load(O_PART + part[:, None] * BLOCK_DV + cols[None, :], mask=(splits < num_splits)[:, None], other=0.0)
    seen = total > 0.0
    t_safe = tl.where(seen, total, 1.0)
    out = tl.sum(w[:, None] * o_s, 0) / t_safe
    o_ptrs = (O + batch.to(tl.int64) * stride_ob + (start_q + tok).to(tl.int64) * stride_om
              + head.to(tl.int64) * stride_oh + cols)
    tl.store(o_ptrs, to_output(out, O.dtype.element_ty, UPCAST), mask=cols < HEADDIM_V)
    if tl.program_id(2) == 0:
        tl.store(LSE + batch.to(tl.int64) * stride_lseb + head.to(tl.int64) * stride_lseh
                 + (start_q + tok).to(tl.int64) * stride_lsem,
                 tl.where(seen, m_use + tl.log(t_safe), float("-inf")))


def fwd(q, k, v, cu_seqlens_q, seqused_k, cache, p, target: str, num_splits: int = 0, descale=None):
    """(out, lse) with FlashAttention-3's shapes of q (dense (batch, seqlen_q, nheads, d) or
    packed with ``cu_seqlens_q``) over a KV cache (``problem.CacheAddressing``; dense caches
    too), ``p.max_seqlen_k`` the cache's capacity per sequence, ``seqused_k`` (batch,) int32
    the keys each sequence has (None: the capacity). ``descale``: fp8 inputs' (q, k, v)
    descales (``validation.check_descales``), None otherwise."""
    varlen = cu_seqlens_q is not None
    batch = cu_seqlens_q.shape[0] - 1 if varlen else q.shape[0]
    nheads, nheads_kv = q.shape[-2], k.shape[-2]
    d, dv = q.shape[-1], v.shape[-1]
    out, lse = alloc_fwd_outputs(q, v, varlen)
    if batch == 0 or p.max_seqlen_q == 0 or nheads == 0:
        return out, lse
    group = nheads // nheads_kv
    page_size = k.shape[1] if cache is not None and cache.page_table is not None else 0
    pl = plan(target, q.device, batch, p.max_seqlen_q, p.max_seqlen_k, nheads, nheads_kv, d, dv, page_size,
              num_splits, fp8=descale is not None)
    block_dv = max(16, triton.next_power_of_2(dv))
    split = pl.splits > 1
    tiles = batch * nheads_kv * pl.m_tiles
    if split:
        lse_part = torch.empty((pl.splits * tiles * pl.block_m,), dtype=torch.float32, device=q.device)
        o_part = torch.empty((pl.splits * tiles * pl.block_m, block_dv), dtype=torch.float32, device=q.device)
    else:
        lse_part = o_part = lse
    cache_args, cache_flags = (cache or CacheAddressing()).kernel_args(k, q)
    qk_scale, softcap_log2 = p.score_constants()
    dummy = q
    total_q = q.shape[0] if varlen else q.shape[1]
    upcast = target == "interpret"
    chain = split and chained(target)
    kv_batch, k_start, page_table, *paging = cache_args
    meta = DecodeMeta(group, d, dv, pl.block_m, pl.cfg.block_n, max(16, triton.next_power_of_2(d)), block_dv,
                      varlen, seqused_k is not None, p.window_left >= 0, p.window_right >= 0, p.softcap > 0.0,
                      upcast, SPLIT=split, **cache_flags,
                      PAGE_BLOCK=page_block(page_size, pl.cfg.block_n, cache_flags["HAS_K_START"]),
                      PAGE_SIZE=static_page_size(page_size), BLOCK_B=longest_first(batch, seqused_k is not None),
                      CHAINED=chain, KV_SAME=shared_offsets(k, v), WIDE_ROWS=wide_rows(page_size, k, v),
                      HAS_CHUNK=p.chunk > 0, FP8=descale is not None)
    score = (qk_scale, softcap_log2, p.window_left, p.window_right)
    if p.chunk > 0 or descale is not None:
        score += (p.chunk,)
    if descale is not None:
        score += (*descale, tuple(st for t in descale for st in t.stride()))
    decode_kernel[(pl.splits, pl.m_tiles, batch * nheads_kv)](
        q, k, v, out, lse, o_part, lse_part,
        bshd_strides(q, varlen), bshd_strides(k, False), bshd_strides(v, False),
        bshd_strides(out, varlen), lse_strides(lse, varlen),
        cu_seqlens_q if varlen else dummy, seqused_k if seqused_k is not None else dummy,
        kv_batch, k_start, page_table, tuple(paging),
        (nheads_kv, p.max_seqlen_q, p.max_seqlen_k, total_q, pl.splits),
        score, META=meta, num_warps=pl.cfg.num_warps, num_stages=pl.cfg.num_stages, enable_fp_fusion=FP_FUSION)
    if split:
        block_s = triton.next_power_of_2(pl.splits)
        chunk = min(block_dv, max(16, 8192 // block_s))  # (an 8K-element tile of shares per program)
        decode_combine_kernel[(pl.block_m, tiles, block_dv // chunk)](
            out, lse, o_part, lse_part, bshd_strides(out, varlen), lse_strides(lse, varlen),
            cu_seqlens_q if varlen else dummy, (nheads_kv, p.max_seqlen_q, total_q, pl.splits, pl.m_tiles),
            GROUP=group, HEADDIM_V=dv, BLOCK_M=pl.block_m, BLOCK_DV=block_dv, BLOCK_S=block_s,
            CHUNK=chunk, IS_VARLEN=varlen, UPCAST=upcast, CHAINED=chain, num_warps=4, enable_fp_fusion=FP_FUSION,
            **({"launch_pdl": True} if chain else {}))
    return out, lse
