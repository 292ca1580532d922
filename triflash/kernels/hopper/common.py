"""Pieces every Hopper (Gluon) kernel shares, written once: accumulator layouts, the view of a
2D shared tile as a rank-4 TMA box, and the host-side TMA descriptors."""
import functools
import os

import torch
import triton
import triton.language as tl
from triton import knobs
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton._C.libtriton import ir
from triton.language.core import _unwrap_if_constexpr
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.runtime import driver

from ..common import (FP_FUSION, launch_order, launch_sections, m_block_range, n_block_range,
                      persistent_schedule, seqlen_info, split_table)


# TMA copies under the name the running Triton gives them: 3.8 named them async_load /
# async_store and kept the 3.6 names as aliases; 3.9 removed the old names.
tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
tma_store = tma.async_store if hasattr(tma, "async_store") else tma.async_copy_shared_to_global


# setmaxnreg of every kernel's loader warp, and of its consumer warpgroups' threads (the
# forward's: configs.HopperFwdConfig.consumer_regs, 160 with three consumers): FA3's split
# of the register file.
LOADER_REGS = 24
CONSUMER_REGS = 240


@gluon.constexpr_function
def _acc_layout(n, dtype):
    """wgmma accumulator of one warpgroup: instr m16 x n x k(16 for 16-bit inputs)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                     instr_shape=[16, n, 256 // dtype.primitive_bitwidth])


@builtin
def tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """``cp.reduce.async.bulk.tensor.add`` of shared tile ``src`` into the box of
    ``tensor_desc`` at ``coord`` (the L2 adds, elementwise, atomically per element; the
    order of concurrent adds is not fixed). Like ``tma_store`` it
    joins the thread's bulk group: ``tma.store_wait`` before ``src`` is written again.
    (Gluon 3.6 builds the op but exports no wrapper for it.)"""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord,
                                              src.handle)


@gluon.jit
def opaque_zero(x):
    """0 for a non-negative int32 ``x`` (its sign bit), which the compiler cannot prove. Added
    to a loop-invariant value inside a loop it keeps LLVM / ptxas from hoisting what depends
    on it out of the loop and holding it in registers across it: shared tiles' wgmma
    descriptors (``HopperBwdConfig.fresh_tiles``; the dQ kernel's Q / dO / V slots) and the
    mask's per-element thresholds."""
    return x >> 31


@gluon.jit
def to_16bit(x, dtype: gl.constexpr):
    """fp32 ``x`` -> ``dtype`` (bf16 / fp16), round to nearest even, two at a time
    (``cvt.rn.{bf16,f16}x2.f32``, consecutive elements of a thread into one register, the
    first in the low half): LLVM's one-at-a-time ``x.to(dtype)`` comes out of ptxas as packs
    in the wrong order plus two byte permutes (PRMT) per register when the result feeds a
    wgmma from registers (P in the forward: 576 PRMT at head dim 64, 384 at 128, 192 at 256;
    none here). The same values either way (docs/performance.md, "Tried and not kept")."""
    if dtype == gl.bfloat16:
        return gl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [x],
                                         dtype=gl.bfloat16, is_pure=True, pack=2)
    else:
        return gl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,r,r", [x],
                                         dtype=gl.float16, is_pure=True, pack=2)


@gluon.jit
def a_operand(buf, IN_REGISTERS: gl.constexpr, acc_layout: gl.constexpr):
    """A shared [M, K] tile as the A operand of wgmmas accumulating in ``acc_layout``:
    loaded once into registers (each wgmma then reads A there, not from shared memory) or
    the shared tile itself."""
    if IN_REGISTERS:
        return buf.load(gl.DotOperandLayout(operand_index=0, parent=acc_layout,
                                            k_width=32 // buf.dtype.primitive_bitwidth))
    else:
        return buf


@builtin
def _reinterpret(buf, dtype, shape, layout, _semantic=None):
    """Shared tile ``buf`` seen as ``dtype`` / ``shape`` / ``layout``: the memdesc reinterpret
    of every Gluon release (the method is ``_reinterpret`` up to Triton 3.8, ``reinterpret``
    from 3.9)."""
    return _semantic.memdesc_reinterpret(buf, _unwrap_if_constexpr(dtype),
                                         [_unwrap_if_constexpr(s) for s in shape], _unwrap_if_constexpr(layout))


@gluon.jit
def _tma_view(buf, desc):
    """A 2D [rows, dim] smem tile seen as the rank-4 (1, rows, 1, dim) box of ``desc``."""
    return _reinterpret(buf, desc.dtype, desc.block_type.shape, desc.layout)


@gluon.jit
def _nothing_past_end(past_end, lo, full_lo, full_hi, hi):
    """A block range (``common.n_block_range`` / ``m_block_range``) collapsed to empty when
    the varlen tile starts past its sequence's end (the grid covers the longest sequence)."""
    if past_end:
        full_lo = lo
        full_hi = lo
        hi = lo
    return lo, full_lo, full_hi, hi


@gluon.jit
def _seq_query_tile(tile, num_m_blocks, section_heads, nheads, nheads_kv, seqlen_q, seqlen_k, total_q, total_k,
                    CU_Q, CU_K, USED_Q, USED_K, window_left, window_right,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                    HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, IS_VARLEN: gl.constexpr,
                    HAS_SEQUSED_Q: gl.constexpr, HAS_SEQUSED_K: gl.constexpr):
    """Work tile of a kernel that walks key blocks for a query block (forward, dQ), dense or
    varlen -> (tma_batch, batch, head, head_kv, start_q, len_q, start_k, len_k, first row,
    key block range). Rows are relative to the sequence; a TMA box starts at row
    ``start_q + row`` of batch ``tma_batch`` (varlen tensors are seen as (1, total, h, d), so
    0). Tiles go longest first (the last query block under causal), ``section_heads``
    heads at a time (``common.launch_order``). A varlen query block past its sequence's end
    visits nothing."""
    bh, rank = launch_order(tile, num_m_blocks, section_heads)
    m_block = num_m_blocks - 1 - rank
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
        tma_batch = batch * 0
        n_min, n_full_min, n_full_max, n_max = _nothing_past_end(
            m_block * BLOCK_M >= len_q, n_min, n_full_min, n_full_max, n_max)
    else:
        tma_batch = batch
    return (tma_batch, batch, head, head_kv, start_q, len_q, start_k, len_k, m_block * BLOCK_M,
            n_min, n_full_min, n_full_max, n_max)


@gluon.jit
def _tile_walk(num_tiles, SCHED, SCHEDULED: gl.constexpr):
    """(first, end, step) of this CTA's walk over the tiles: tile, tile + grid, ... (one CTA
    per tile when the grid covers them all), or with ``SCHEDULED`` positions
    [SCHED[cta], SCHED[cta + 1]) of the host's schedule (``common.persistent_schedule``)."""
    if SCHEDULED:
        first = gl.load(SCHED + gl.program_id(0))
        end = gl.load(SCHED + gl.program_id(0) + 1)
        step = 1
    else:
        first = gl.program_id(0)
        end = num_tiles
        step = gl.num_programs(0)
    return first, end, step


@gluon.jit
def _tile_at(walk, SCHED, SCHEDULED: gl.constexpr):
    """The tile at position ``walk`` of ``_tile_walk``."""
    if SCHEDULED:
        tile = gl.load(SCHED + gl.num_programs(0) + 1 + walk)
    else:
        tile = walk
    return tile


# Tiles above which a masked launch keeps one CTA per tile (the schedule is built in Python,
# about a microsecond a tile, once per shape)
SCHEDULE_MAX_TILES = 1 << 15
_SCHEDULES = {}
_CAPTURED_SCHEDULES = {}  # tables CUDA graphs read: never freed
_NUM_SMS = {}


def persistent_walk(unmasked: bool, pb, params, num_tiles: int) -> str:
    """How the CTAs of a launch over ``num_tiles`` tiles take them: "grid", one CTA per tile
    (the hardware starts the next on whichever SM frees up); "strided", one persistent CTA
    per SM walking tile, tile + grid, ... (``unmasked``: asked for where every tile has the
    same length, no causal / window mask); "scheduled", under a mask, persistent CTAs
    walking the host's longest-first schedule (up to ``SCHEDULE_MAX_TILES``). Dense q and k
    only: varlen / seqused_q tiles live on the device. ``seqused_k`` alone (a KV cache's key
    counts) keeps the dense tiles and, under a bottom-right mask, their order (every tile's
    key range shifts by the same count), so it takes the schedule; unmasked, its tiles differ
    in length, so one CTA per tile."""
    varlen, used_q, used_k = pb.seq_flags
    if varlen or used_q or (used_k and not params.masked):
        return "grid"
    if not params.masked:
        return "strided" if unmasked else "grid"
    return "scheduled" if num_tiles <= SCHEDULE_MAX_TILES else "grid"


def num_sms(device) -> int:
    """The SM count of ``device`` (a persistent launch's grid), looked up once."""
    if device not in _NUM_SMS:
        _NUM_SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _NUM_SMS[device]


def schedule_table(device, key, make=persistent_schedule):
    """``make(*key)`` (``common.persistent_schedule``; ``split_plan``: ``common.split_table``)
    as an int32 tensor on ``device``, kept per shape; None while ``device``'s stream is
    capturing a CUDA graph and this shape has no table yet (the copy to the device cannot be
    captured: the caller launches one CTA per tile instead). A table a graph has captured is
    kept for as long as the process runs: every replay reads it."""
    t = _SCHEDULES.get((device, make, key))
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if t is None:
        if capturing:
            return None
        if len(_SCHEDULES) >= 64:
            _SCHEDULES.clear()
        t = torch.tensor(make(*key), dtype=torch.int32, device=device)
        _SCHEDULES[(device, make, key)] = t
    if capturing:
        _CAPTURED_SCHEDULES[(device, make, key)] = t
    return t


_SPLITS = {}


def split_plan(device, key):
    """``common.split_table(*key)`` with its table on ``device`` (``schedule_table``): None
    (no split, or a capture meeting a new shape), or (table, ctas, slots, tiles cut)."""
    if key not in _SPLITS:
        if len(_SPLITS) >= 64:
            _SPLITS.clear()
        _SPLITS[key] = split_table(*key)
    plan = _SPLITS[key]
    if plan is None:
        return None
    table = schedule_table(device, key, _split_entries)
    return None if table is None else (table, *plan[1:])


def _split_entries(*key):
    return _SPLITS[key][0] if key in _SPLITS else split_table(*key)[0]


@triton.jit
def stat_row0(batch, start_q, IS_VARLEN: tl.constexpr, BM: tl.constexpr):
    """First row of sequence ``batch`` in the backward's per-row statistics buffers (lse_log2,
    Delta). Dense: (batch, heads, seqlen_pad), row 0 of its batch. Varlen: (1, heads,
    total_pad) with every sequence at a multiple of ``BM`` and at least one padded tile
    apart, ``(start_q + batch * BM) // BM * BM``: a BM-row TMA box of the sequence's last
    query block stays in its own rows, which the stats kernel fills with +inf / 0, as the
    dense padding."""
    if IS_VARLEN:
        return (start_q + batch * BM) // BM * BM
    else:
        return start_q * 0


def stat_rows(total_q: int, batch: int, bm: int) -> int:
    """Rows per head of the varlen statistics buffers (``stat_row0``): every sequence fits."""
    return (total_q + batch * bm + bm - 1) // bm * bm


@gluon.jit
def _key_tile(nheads, nheads_kv, seqlen_q, seqlen_k, total_q, total_k,
              CU_Q, CU_K, USED_Q, USED_K, window_left, window_right,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, IS_VARLEN: gl.constexpr,
              HAS_SEQUSED_Q: gl.constexpr, HAS_SEQUSED_K: gl.constexpr):
    """This CTA's key block of a dK/dV kernel (grid: key blocks, KV heads, batch), dense or
    varlen -> (tma_batch, head_kv, group size, start_q, len_q, start_k, len_k, stat row 0,
    first key, query block range). Keys and query blocks are relative to the sequence; TMA
    boxes start at ``start_q`` / ``start_k`` / ``stat row 0`` plus them, in batch
    ``tma_batch`` (0 for varlen tensors, seen as (1, total, h, d)). A varlen key block past
    its sequence's end visits nothing (and must store nothing)."""
    return _key_tile_at(gl.program_id(0), gl.program_id(1), gl.program_id(2),
                        nheads, nheads_kv, seqlen_q, seqlen_k, total_q, total_k,
                        CU_Q, CU_K, USED_Q, USED_K, window_left, window_right,
                        BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT, IS_VARLEN, HAS_SEQUSED_Q, HAS_SEQUSED_K)


@gluon.jit
def _key_tile_at(n_block, head_kv, batch, nheads, nheads_kv, seqlen_q, seqlen_k, total_q, total_k,
                 CU_Q, CU_K, USED_Q, USED_K, window_left, window_right,
                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, IS_VARLEN: gl.constexpr,
                 HAS_SEQUSED_Q: gl.constexpr, HAS_SEQUSED_K: gl.constexpr):
    """``_key_tile`` of key block ``n_block`` of (``batch``, ``head_kv``)."""
    group = nheads // nheads_kv
    start_q, len_q, start_k, len_k = seqlen_info(
        batch, seqlen_q, seqlen_k, total_q, total_k, CU_Q, CU_K, USED_Q, USED_K,
        IS_VARLEN, HAS_SEQUSED_Q, HAS_SEQUSED_K)
    m_min, m_full_min, m_full_max, m_max = m_block_range(
        n_block, len_q, len_k, window_left, window_right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    if IS_VARLEN:
        tma_batch = batch * 0
        m_min, m_full_min, m_full_max, m_max = _nothing_past_end(
            n_block * BLOCK_N >= len_k, m_min, m_full_min, m_full_max, m_max)
    else:
        tma_batch = batch
    return (tma_batch, head_kv, group, start_q, len_q, start_k, len_k,
            stat_row0(batch, start_q, IS_VARLEN, BLOCK_M), n_block * BLOCK_N,
            m_min, m_full_min, m_full_max, m_max)


@gluon.jit
def _store_query_tile(buf, desc, PTR, stride_row, stride_head, tma_batch, head, start_q, row0, len_q,
                      IS_VARLEN: gl.constexpr, NCOLS: gl.constexpr):
    """A staged [rows, dim] output tile of query rows ``row0 + i`` of a sequence (O, dQ) to
    global memory: a TMA store (clipped at a dense sequence's end), or masked stores where a
    box would run into the next varlen sequence's rows (``PTR``: the tensor, seen (total,
    heads, dim)), its first ``NCOLS`` columns (the tensor's head dim)."""
    if IS_VARLEN:
        _store_rows(buf, PTR + head.to(gl.int64) * stride_head + (start_q + row0).to(gl.int64) * stride_row,
                    stride_row, len_q - row0, NCOLS)
    else:
        fence_async_shared()
        tma_store(desc, [tma_batch, row0, head, 0], _tma_view(buf, desc))
        tma.store_wait(0)


@gluon.jit
def _store_rows(buf, PTR, stride_row, nrows, NCOLS: gl.constexpr):
    """Rows [0, nrows), columns [0, NCOLS) of the 2D shared tile ``buf`` to ``PTR + row *
    stride_row + col`` (``PTR``: its first row and column; NCOLS < the tile's width: a
    padded head dim), where a TMA box would run into the next varlen sequence's rows: 8 or
    16 rows per step (8-16 elements per thread keep the 64-bit addresses in few registers;
    8 rows at least, the tile's swizzle period)."""
    R: gl.constexpr = buf.shape[0]
    C: gl.constexpr = buf.shape[1]
    TC: gl.constexpr = 16 if C >= 128 else C // 8
    CH: gl.constexpr = 4 * (32 // TC)
    blk: gl.constexpr = gl.BlockedLayout([1, C // TC], [32 // TC, TC], [4, 1], [1, 0])
    cols = gl.expand_dims(gl.arange(0, C, layout=gl.SliceLayout(0, blk)), 0)
    for r in gl.static_range(0, R, CH):
        rows = r + gl.arange(0, CH, layout=gl.SliceLayout(1, blk))
        if NCOLS < C:
            ok = gl.expand_dims(rows < nrows, 1) & (cols < NCOLS)
        else:
            ok = gl.expand_dims(rows < nrows, 1)
        gl.store(PTR + gl.expand_dims(rows.to(gl.int64) * stride_row, 1) + cols,
                 buf.slice(r, CH).load(blk), mask=ok)


# ---- launches without Triton's per-call argument binding ------------------------------------
#
# ``kernel[grid](*args)`` binds and specializes every argument on every call (about half of
# the ~40 us a launch costs the H200's host:
# ``benchmarks/results/probes/host-breakdown-*.json`` at fb45c0d; short sequences pay it as
# wall time). ``launch`` keys the compiled kernel by a tuple that fixes all Triton
# specializes on, cheaper to build than the binding: ints, floats, bools and None by value,
# tensors by dtype and 16-byte alignment, TMA descriptors by dtype and box (the box fixes
# the layout: ``descriptor`` / ``stat_descriptor`` derive it from the box and dtype
# alone), tuples (a kernel's strides, sizes or constexpr NamedTuple) by their type and their
# elements' keys. A repeat goes straight to the compiled kernel's launcher. TRIFLASH_VERIFY_LAUNCHES=1
# (the GPU test suite) has Triton specialize each repeat as well and checks that it picks the
# same compiled kernel.

VERIFY_LAUNCHES = os.environ.get("TRIFLASH_VERIFY_LAUNCHES", "0") == "1"
_COMPILED = {}


def _launch_key(args):
    """The specialization key of ``args`` (see above), or None for an argument it cannot key."""
    key = []
    for a in args:
        c = a.__class__
        if c is int or a is None:
            key.append(a)
        elif c is bool or c is float:
            key.append((c, a))
        elif c is TensorDescriptor:
            key.append((a.base.dtype, *a.block_shape))
        elif isinstance(a, torch.Tensor):
            key.append((a.dtype, (a.data_ptr() & 15) == 0))
        elif isinstance(a, tuple):  # (Triton specializes each element as a flat argument)
            inner = _launch_key(a)
            if inner is None:
                return None
            key.append((c, inner))
        else:
            return None
    return tuple(key)


def _hooked(hook) -> bool:
    """Whether a Triton launch hook is set (triton 3.6: an empty ``HookChain`` when none)."""
    return hook is not None and bool(getattr(hook, "calls", True))


def launch(kernel, grid, args, num_warps=4):
    """``kernel[grid](*args, num_warps=num_warps)`` (with FP fusion), ``args`` every parameter
    in order (the constexprs too). The first call of a specialization runs Triton's JIT (compiling where
    needed), later ones the compiled kernel's launcher alone; launch hooks (profilers) and
    anything the key cannot describe take the JIT every time."""
    options = dict(num_warps=num_warps, enable_fp_fusion=FP_FUSION)
    if not hasattr(kernel, "device_caches") or _hooked(knobs.runtime.launch_enter_hook) \
            or _hooked(knobs.runtime.launch_exit_hook):
        return kernel[grid](*args, **options)
    spec = _launch_key(args)
    if spec is None:
        return kernel[grid](*args, **options)
    device = driver.active.get_current_device()
    key = (kernel, device, num_warps, spec)
    compiled = _COMPILED.get(key)
    if compiled is None:
        compiled = kernel[grid](*args, **options)
        if compiled is not None and not hasattr(compiled, "result") and len(args) == len(kernel.params):
            if len(_COMPILED) >= 4096:
                _COMPILED.clear()
            _COMPILED[key] = compiled
        return compiled
    if VERIFY_LAUNCHES:
        jit = kernel.run(*args, grid=grid, warmup=True, **options)
        assert jit is compiled, f"launch key of {kernel.__name__} maps two specializations together"
    compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
                 driver.active.get_current_stream(device), compiled.function,
                 compiled.packed_metadata, None, None, None, *args)
    return compiled


# ---- launch plans: a repeat call of one problem signature --------------------------------
#
# Even with ``launch``, a forward call rebuilds its argument list (``kernel_args``: the
# problem's view, grid, launch order, schedule lookup, four descriptors) and keys it, ~30 us
# of the H200 host's ~210 us per 1k-token forward
# (``benchmarks/results/probes/host-breakdown-3c9fc25.json`` at fb45c0d), and do_bench
# times a call whose host time passes its kernel's as host time. A plan keeps the
# list of one signature (the caller's key: every shape, stride, dtype and parameter the list
# is made of) with the compiled kernel; a repeat puts the call's own tensors (and
# descriptors over them) into their slots and launches. The first call of a key, calls
# while a CUDA graph captures (the schedule table's bookkeeping, ``schedule_table``), under
# launch hooks, and with TRIFLASH_VERIFY_LAUNCHES=1 build the list as before; the last also
# checks that the plan would have launched the same kernel with the same arguments.

_PLANS = {}


def _capturing() -> bool:
    return torch.cuda.is_current_stream_capturing()  # (tests without CUDA replace _capturing)


class LaunchPlan:
    """The argument list of one launch with the call's tensors taken out: ``slots`` say where
    each of ``tensors`` goes, as itself or as the base of a TMA descriptor (box and layout
    kept). Other tensors in the list (a cached schedule table) stay in it.

    ``run`` goes past Triton's launcher wrapper as well where it can (``_direct_launcher``):
    that wrapper walks the whole list on every launch, turning each descriptor into its
    ``CUtensorMap`` and shape / strides. The plan keeps that expanded list once, with the
    call's tensors and the maps of their descriptors as the only slots; a map (a pure
    function of the base pointer and what the plan fixes: shape, strides, box, layout) is
    kept per slot and pointer."""
    __slots__ = ("compiled", "grid", "template", "slots", "direct", "flat", "flat_slots")

    def __init__(self, compiled, grid, args, tensors):
        where = {id(t): j for j, t in enumerate(tensors)}
        self.compiled, self.grid, self.template, self.slots = compiled, grid, list(args), []
        for i, a in enumerate(args):
            if a.__class__ is TensorDescriptor:
                j = where[id(a.base)]  # (a KeyError: a descriptor over a tensor not in ``tensors``)
                self.slots.append((i, j, a.block_shape, a.layout))
                self.template[i] = None
            elif id(a) in where:
                self.slots.append((i, where[id(a)], None, None))
                self.template[i] = None
        self.direct = _direct_launcher(compiled)
        if self.direct is not None:
            self._flatten(args)

    def _flatten(self, args):
        """The launcher's expanded list (``flat``) and where the call's tensors go in it
        (``flat_slots``: (position, tensor index, None), or for a descriptor (position, tensor
        index, (box, layout, its metadata, maps by pointer))), from ``slots``."""
        _, indices, meta, expand = self.direct
        slot_of = {i: (j, block, layout) for i, j, block, layout in self.slots}
        metas = iter(meta)
        self.flat, self.flat_slots = [], []
        for i, a in enumerate(args):
            j, block, layout = slot_of.get(i, (None, None, None))
            if i in indices:  # (every descriptor is a slot: __init__)
                m = next(metas)
                self.flat_slots.append((len(self.flat), j, (block, layout, m, {})))
                self.flat.extend(expand(a, m))
            else:
                if j is not None:
                    self.flat_slots.append((len(self.flat), j, None))
                self.flat.append(None if j is not None else a)  # (holds no call's tensor)

    def args(self, tensors):
        args = self.template[:]
        for i, j, block, layout in self.slots:
            args[i] = tensors[j] if block is None else _make_descriptor(tensors[j], block, layout)
        return args

    def flat_args(self, tensors):
        """The expanded list of a call with ``tensors`` (what Triton's wrapper would pass)."""
        _, _, _, expand = self.direct
        flat = self.flat[:]
        for pos, j, desc in self.flat_slots:
            t = tensors[j]
            if desc is None:
                flat[pos] = t
                continue
            block, layout, m, maps = desc
            ptr = t.data_ptr()
            piece = maps.get(ptr)
            if piece is None:
                if len(maps) >= 16:
                    maps.clear()
                piece = maps[ptr] = expand(_make_descriptor(t, block, layout), m)
            flat[pos:pos + len(piece)] = piece
        return flat

    def run(self, tensors, device):
        c, g = self.compiled, self.grid
        stream = driver.active.get_current_stream(device)
        gy, gz = g[1] if len(g) > 1 else 1, g[2] if len(g) > 2 else 1
        if self.direct is None:
            c.run(g[0], gy, gz, stream, c.function, c.packed_metadata, None, None, None, *self.args(tensors))
            return
        raw, _, _, _ = self.direct
        runner = c.run
        raw(g[0], gy, gz, stream, c.function, runner.launch_cooperative_grid, runner.launch_pdl, None, None,
            c.packed_metadata, None, None, None, *self.flat_args(tensors))


def _direct_launcher(compiled):
    """(launch, descriptor argument indices, their metadata, expand) for a compiled kernel
    whose launcher is Triton 3.6's CUDA launcher wrapped by ``wrap_handle_tensordesc`` (the
    C ``launch`` it calls, and ``make_tensordesc_arg``), or None: then plans call
    ``compiled.run`` as any launch does (another Triton, scratch buffers, no descriptor
    metadata, a stand-in kernel in tests)."""
    try:
        from triton.backends.nvidia import driver as nvidia_driver
        runner = compiled.run
        wrapper = runner.launch
        if runner.global_scratch_size or runner.profile_scratch_size:
            return None
        cells = dict(zip(wrapper.__code__.co_freevars, wrapper.__closure__))
        raw = cells["launcher"].cell_contents
        indices = cells["tensordesc_indices"].cell_contents
        meta = cells["tensordesc_meta"].cell_contents
        runner.launch_cooperative_grid, runner.launch_pdl  # (noqa: both read per launch)
    except (AttributeError, KeyError, TypeError, ValueError, ImportError):
        return None
    if wrapper.__code__.co_name != "inner" or any(m is None for m in meta) or not callable(raw):
        return None
    return raw, frozenset(indices), list(meta), nvidia_driver.make_tensordesc_arg


def _same_args(a, b, tensors=()) -> bool:
    """Two launch argument lists pass the same values: the call's ``tensors`` as the same
    objects, any other tensor (a cached table the plan kept, which its cache may have dropped
    and built again since) the same objects or the same values."""
    calls = {id(t) for t in tensors}
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x.__class__ is TensorDescriptor and y.__class__ is TensorDescriptor:
            if not (x.base is y.base and tuple(x.shape) == tuple(y.shape) and tuple(x.strides) == tuple(y.strides)
                    and list(x.block_shape) == list(y.block_shape) and x.layout == y.layout
                    and x.padding == y.padding):
                return False
        elif isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if x is y:
                continue
            if id(x) in calls or id(y) in calls or not (
                    isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.shape == y.shape
                    and x.dtype == y.dtype and x.device == y.device and torch.equal(x, y)):
                return False
        elif x != y or x.__class__ is not y.__class__:
            return False
    return True


def planned_launch(kernel, key, tensors, build):
    """Launch ``kernel`` with the arguments ``build()`` returns as (grid, args), through the
    plan of ``key`` where there is one (see above). ``key`` must fix every argument but
    ``tensors``, each of which appears in args as itself or as a descriptor's base; None
    (a batch whose arguments no key describes, e.g. varlen): build and launch, no plan."""
    if key is None or len({id(t) for t in tensors}) < len(tensors):  # (a tensor in two roles,
        grid, args = build()                                           # q is k: slots would merge)
        if grid[0] > 0:
            launch(kernel, grid, args)
        return
    device = driver.active.get_current_device()
    plan = _PLANS.get((device, key))
    aside = _hooked(knobs.runtime.launch_enter_hook) or _hooked(knobs.runtime.launch_exit_hook) or _capturing()
    if plan is not None and not aside and not VERIFY_LAUNCHES:
        plan.run(tensors, device)
        return
    grid, args = build()
    if grid[0] == 0:
        return
    compiled = launch(kernel, grid, args)
    if aside:
        return
    if plan is not None:  # (VERIFY_LAUNCHES: the plan must pass what was just built)
        assert plan.compiled is compiled and plan.grid == grid and _same_args(plan.args(tensors), args, tensors), \
            f"launch plan of {kernel.__name__} differs from the arguments built for this call"
    elif compiled is not None and not hasattr(compiled, "result") and len(args) == len(kernel.params):
        if len(_PLANS) >= 1024:
            _PLANS.clear()
        _PLANS[(device, key)] = LaunchPlan(compiled, grid, args, tensors)


def _gl_dtype(dtype):
    return {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}[dtype]


@functools.lru_cache(maxsize=None)
def _box_layout(rows, dim, dtype):
    # get_default_for costs ~9 us of Python per call: computed once per (box, dtype)
    return gl.NVMMASharedLayout.get_default_for([1, rows, 1, dim], _gl_dtype(dtype))


def _make_descriptor(x, block, layout):
    """``TensorDescriptor(x, x.shape, x.stride(), block, layout)`` without its per-call
    validation (~5 us each, 11 per backward): every caller has checked ``tma_compatible``
    and the blocks are fixed powers of two. Same class, same fields, as the launcher reads."""
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


# Head dims the Hopper kernels compute at the next tile width (their TMA boxes are that wide:
# loads zero-fill the columns past the head dim, which adds 0 to every score and to every
# product, and TMA stores clip them; register stores, and a varlen batch's masked stores
# of staged tiles (``_store_rows``), stop at the head dim).
PADDED_HEAD_DIMS = {96: 128, 192: 256}


def kernel_head_dim(d: int) -> int:
    """The head dim the Hopper kernels compute for a problem of head dim ``d``."""
    return PADDED_HEAD_DIMS.get(d, d)


def tma_compatible(*tensors) -> bool:
    """TMA needs 16-byte aligned base pointers and 16-byte multiples for the outer strides."""
    for x in tensors:  # (plain loops: this runs on every launch)
        if x.data_ptr() % 16:
            return False
        strides, size = x.stride(), x.element_size()
        if strides[-1] != 1:
            return False
        for s in strides[:-1]:
            if (s * size) % 16:
                return False
    return True


class Problem:
    """Host-side view of a dense or varlen batch as the Hopper kernels take it: 4D (batch,
    seqlen, heads, dim) tensors, varlen ones as (1, total, heads, dim) views with per-sequence
    starts and lengths from ``cu_seqlens`` / ``seqused`` (``common.seqlen_info``);
    ``seqlen_q`` / ``seqlen_k`` bound a sequence's length (the launch grids)."""
    __slots__ = ("varlen", "batch", "nheads", "nheads_kv", "seqlen_q", "seqlen_k", "total_q",
                 "total_k", "cu_q", "cu_k", "used_q", "used_k", "has_used_q", "seq_args", "seq_flags")

    def __init__(self, q, k, params, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None,
                 seqused_k=None):
        self.varlen = cu_seqlens_q is not None
        self.nheads, self.nheads_kv = q.shape[-2], k.shape[-2]
        if self.varlen:
            self.batch = cu_seqlens_q.shape[0] - 1
            self.seqlen_q, self.seqlen_k = params.max_seqlen_q, params.max_seqlen_k
            self.total_q, self.total_k = q.shape[0], k.shape[0]
        else:
            self.batch, self.seqlen_q = q.shape[0], q.shape[1]
            self.seqlen_k = k.shape[1]
            self.total_q, self.total_k = self.seqlen_q, self.seqlen_k
        dummy = q  # never dereferenced when the matching flag is off
        self.cu_q = cu_seqlens_q if self.varlen else dummy
        self.cu_k = cu_seqlens_k if self.varlen else dummy
        self.used_q = seqused_q if seqused_q is not None else dummy
        self.used_k = seqused_k if seqused_k is not None else dummy
        self.has_used_q = seqused_q is not None
        # the kernels' (total_q, total_k, CU_Q, CU_K, USED_Q, USED_K) and their flags
        self.seq_args = (self.total_q, self.total_k, self.cu_q, self.cu_k, self.used_q, self.used_k)
        self.seq_flags = (self.varlen, self.has_used_q, seqused_k is not None)

    def section_heads(self, k, v, params) -> int:
        """Heads per section of the query-tile launch order (``common.launch_order``)."""
        return launch_sections(self.batch, self.nheads, k, v, self.seqlen_k, params.window_left,
                               params.window_right)

    def view(self, x):
        """x as the kernels' 4D tensor (lse / stat buffers: 3D)."""
        return x.unsqueeze(0) if self.varlen else x

    def lse_strides(self, lse):
        """(batch, head, row) strides of lse: (batch, heads, seqlen_q), or varlen (heads, total_q)."""
        return (0, *lse.stride()) if self.varlen else lse.stride()

    def empty(self) -> bool:
        """No query sees any key: every output / gradient is its empty value."""
        return (self.batch == 0 or self.nheads == 0 or self.seqlen_q == 0 or self.seqlen_k == 0
                or self.total_q == 0 or self.total_k == 0)
