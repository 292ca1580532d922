"""The pieces of a split forward merged (``HopperFwdConfig.split_keys``).

Where a launch's last round of tiles would leave CTAs idle, ``common.split_schedule`` cuts
that round's key blocks into equal shares: a tile may be computed as pieces, each over its
own range of key blocks, by different CTAs at the same time. Each piece leaves its rows'
output normalized by its own row sums (fp32) and their log-sum-exps in a workspace slot
(``fwd._store_piece``); this kernel, launched after the forward, merges a tile's slots into
O and LSE: with lse = log(sum_i exp(lse_i)), O = sum_i exp(lse_i - lse) O_i.

Plain Triton (no Hopper instruction): it also runs under the CPU interpreter, where the
tests merge pieces computed by the reference.
"""
import triton
import triton.language as tl

from ..common import FP_FUSION, launch_order, launch_sections

COMBINE_ROWS = 16  # rows per program


@triton.jit
def split_combine_kernel(WS, WSL, CUT, O, LSE, stride_ob, stride_om, stride_oh,
                         stride_lseb, stride_lseh, stride_lsem, nheads, seqlen_q, num_m_blocks, section_heads,
                         BMT: tl.constexpr, DV: tl.constexpr, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr):
    """Program (cut tile c, rows block): CUT[3c:3c+3] = (tile, first slot, slots)."""
    pid = tl.program_id(0)
    c = pid // (BMT // ROWS)
    r = (pid - c * (BMT // ROWS)) * ROWS + tl.arange(0, ROWS)
    tile = tl.load(CUT + 3 * c)
    first = tl.load(CUT + 3 * c + 1)
    count = tl.load(CUT + 3 * c + 2)
    bh, rank = launch_order(tile, num_m_blocks, section_heads)
    batch = bh // nheads
    head = bh - batch * nheads
    rows = (num_m_blocks - 1 - rank) * BMT + r
    cols = tl.arange(0, DV)
    m = tl.full([ROWS], float("-inf"), tl.float32)
    for i in range(count):
        m = tl.maximum(m, tl.load(WSL + (first + i).to(tl.int64) * BMT + r))
    m_use = tl.where(m == float("-inf"), 0.0, m)  # (rows past the sequence: every slot -inf)
    acc = tl.zeros([ROWS, DV], tl.float32)
    total = tl.zeros([ROWS], tl.float32)
    for i in range(count):
        slot = (first + i).to(tl.int64) * BMT + r
        w = tl.exp(tl.load(WSL + slot) - m_use)
        acc += w[:, None] * tl.load(WS + slot[:, None] * DV + cols[None, :])
        total += w
    seen = total > 0.0
    out = acc / tl.where(seen, total, 1.0)[:, None]
    lse = tl.where(seen, m_use + tl.log(tl.where(seen, total, 1.0)), float("-inf"))
    ok = rows < seqlen_q
    tl.store(LSE + batch.to(tl.int64) * stride_lseb + head.to(tl.int64) * stride_lseh
             + rows.to(tl.int64) * stride_lsem, lse, mask=ok)
    tl.store(O + batch.to(tl.int64) * stride_ob + head.to(tl.int64) * stride_oh
             + rows.to(tl.int64)[:, None] * stride_om + cols[None, :],
             out.to(O.dtype.element_ty), mask=ok[:, None] & (cols[None, :] < HEAD_DIM))


def combine_args(out, lse, ws, wsl, cut, q, k, v, params, block_m):
    """(grid, args) of ``split_combine_kernel`` merging the pieces of the tiles listed in
    ``cut`` (the (tile, first slot, slots) rows of ``common.split_table``, on the device) into
    ``out`` (batch, seqlen_q, heads, dim) and ``lse`` (batch, heads, seqlen_q)."""
    seqlen_q = q.shape[1]
    sections = launch_sections(q.shape[0], q.shape[2], k, v, k.shape[1], params.window_left, params.window_right)
    args = [ws, wsl, cut, out, lse, out.stride(0), out.stride(1), out.stride(2),
            lse.stride(0), lse.stride(1), lse.stride(2), q.shape[2], seqlen_q, triton.cdiv(seqlen_q, block_m),
            sections, block_m, ws.numel() // wsl.numel(), out.shape[-1], COMBINE_ROWS]
    return (cut.numel() // 3 * (block_m // COMBINE_ROWS),), args


def combine(out, lse, ws, wsl, cut, q, k, v, params, block_m):
    """``split_combine_kernel`` launched by the JIT (the forward launches the same arguments
    through ``common.launch``: ``fwd.fwd``)."""
    grid, args = combine_args(out, lse, ws, wsl, cut, q, k, v, params, block_m)
    split_combine_kernel[grid](*args, enable_fp_fusion=FP_FUSION)
