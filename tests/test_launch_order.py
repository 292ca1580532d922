"""The launch order of query-block tiles (``common.launch_order`` with the host's
``common.section_heads``): every (batch*head, block) exactly once, longest first inside each
section of heads, sections in order. Runs the jitted function through a one-line kernel (the
interpreter on the CPU)."""
import pytest
import torch
import triton
import triton.language as tl

from conftest import DEVICE
from triflash.kernels.common import (L2_SECTION_BYTES, launch_order, n_block_range,
                                     persistent_schedule, section_heads, visited_key_blocks)


@triton.jit
def _order_kernel(OUT, section_heads):
    num_m = tl.num_programs(0)
    tile = tl.program_id(1) * num_m + tl.program_id(0)
    bh, rank = launch_order(tile, num_m, section_heads)
    tl.store(OUT + 2 * tile, bh)
    tl.store(OUT + 2 * tile + 1, rank)


@pytest.mark.parametrize("num_bh,num_m,sec", [(36, 5, 4), (36, 5, 1), (7, 3, 7), (12, 1, 6), (6, 4, 3)])
def test_launch_order_is_a_permutation_longest_first(num_bh, num_m, sec):
    out = torch.full((num_bh * num_m, 2), -1, dtype=torch.int32, device=DEVICE)
    _order_kernel[(num_m, num_bh)](out, sec)
    pairs = [tuple(r) for r in out.cpu().tolist()]
    assert sorted(pairs) == [(b, m) for b in range(num_bh) for m in range(num_m)]
    for t, (bh, rank) in enumerate(pairs):
        section, within = divmod(t, sec * num_m)
        assert bh // sec == section, (t, bh, rank)   # sections of heads, in order
        assert rank == within // sec, (t, bh, rank)  # rank by rank across the section's heads
    if sec == 1:  # one head after another
        assert pairs == [(b, m) for b in range(num_bh) for m in range(num_m)]


def test_section_heads():
    kv = 2 * 256 * 2  # (d + dv) * bytes per key, head dim 256
    # unmasked: every block costs the same, one head after another
    assert section_heads(36, 36, 36, 8192, kv, masked=False) == 1
    # the seed case: 8 MB of K/V per head, 4 heads in 32 MB, and 4 divides 36
    assert section_heads(36, 36, 36, 8192, kv, masked=True) == L2_SECTION_BYTES // (8192 * kv) == 4
    # a divisor of batch * heads, never above what fits
    assert section_heads(37, 37, 37, 8192, kv, masked=True) == 1
    assert section_heads(36, 36, 36, 1024, kv, masked=True) == 18
    # GQA: query heads sharing a KV head share its L2 footprint
    assert section_heads(32, 32, 8, 8192, kv, masked=True) == 16
    # keys longer than the L2 share: still one head at a time
    assert section_heads(36, 36, 36, 1 << 20, kv, masked=True) == 1
    for n in range(1, 60):
        s = section_heads(n, n, n, 4096, 4096, masked=True)
        assert n % s == 0 and s <= max(1, L2_SECTION_BYTES // (4096 * 4096))


def test_launch_grids_fit_cuda_limits(monkeypatch):
    """Batch * heads above 65535 (CUDA's limit for grid axes y and z): every launch of the
    portable tier and the Hopper statistics kernel keeps its axes within the limits. The
    launches are recorded, not run."""
    from triflash.kernels import configs, portable, problem
    grids = []

    class Record:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            grids.append((self.name, tuple(grid)))
            return lambda *args, **kwargs: None

    names = ["flash_fwd_kernel", "bwd_preprocess_kernel", "bwd_dkdv_kernel", "bwd_dq_kernel"]
    for name in names:
        monkeypatch.setattr(portable, name, Record(name))
    batch, heads = 35001, 2  # batch * heads = 70002
    q = torch.zeros(batch, 3, heads, 8, dtype=torch.float16)
    p = problem.AttnParams(softmax_scale=0.1, window_left=-1, window_right=0, softcap=0.0,
                            max_seqlen_q=3, max_seqlen_k=3)
    out, lse = portable.fwd(q, q, q, None, None, None, None, p, configs.INTERPRET_FWD, upcast=True)
    for det in (False, True):
        portable.bwd(q, q, q, q, out, lse, None, None, None, None, p, configs.INTERPRET_BWD,
                     deterministic=det, upcast=True)
    try:
        from triflash.kernels.hopper import bwd_stats
        from triflash.kernels.hopper.common import Problem
    except ImportError:  # Triton without Gluon
        bwd_stats = None
    if bwd_stats is not None:
        monkeypatch.setattr(bwd_stats, "bwd_stats_kernel", Record("bwd_stats_kernel"))
        bwd_stats.stats(Problem(q, q, p), q, q, lse)
        names.append("bwd_stats_kernel")
    assert {name for name, _ in grids} == set(names)
    for name, grid in grids:
        assert grid[0] < 2 ** 31 and all(axis <= 65535 for axis in grid[1:]), (name, grid)


def test_forward_walks():
    """How the Hopper forward's CTAs take their tiles (``fwd.walk``): one persistent CTA per SM
    walking tile, tile + grid, ... (two Q slots) on a dense batch without causal / window
    mask and seqused (every tile the same length) where the tile says ``persistent_unmasked``;
    under a causal / window mask on a dense batch, persistent CTAs on the host's
    longest-first schedule, also with ``seqused_k`` alone (a KV cache's key counts shift every
    tile's keys by the same count: the dense tiles, in the same order); everywhere else
    (varlen, seqused_q, seqused_k unmasked, too many tiles) one CTA per tile, which the
    hardware balances."""
    import dataclasses

    import torch
    fwd = pytest.importorskip("triflash.kernels.hopper.fwd")
    from tools import kernel_arg
    from triflash.kernels import configs
    from triflash.kernels.hopper.common import SCHEDULE_MAX_TILES, Problem
    from triflash.kernels.problem import AttnParams
    q = torch.empty(2, 300, 4, 128, dtype=torch.bfloat16)
    k = torch.empty(2, 200, 2, 128, dtype=torch.bfloat16)
    base = dataclasses.replace(configs.SM90_HOPPER_FWD[128], persistent_unmasked=True)

    def how(left=-1, right=-1, cfg=base, tiles=12, **seq):
        p = AttnParams(0.1, left, right, 0.0, 300, 200)
        return fwd.walk(cfg, p, Problem(q, k, p, **seq), tiles)
    assert how() == "strided"
    assert how(right=0) == how(left=64) == how(left=8, right=8) == "scheduled"  # causal / window
    used_k = torch.full((2,), 100, dtype=torch.int32)
    assert how(seqused_k=used_k) == "grid"  # unmasked KV cache form: tiles of different lengths
    assert how(right=0, seqused_k=used_k) == how(left=64, seqused_k=used_k) == "scheduled"  # prefill over a cache
    assert how(right=0, seqused_k=used_k, tiles=SCHEDULE_MAX_TILES + 1) == "grid"
    assert how(right=0, seqused_q=used_k, seqused_k=used_k) == "grid"
    assert how(right=0, tiles=SCHEDULE_MAX_TILES + 1) == "grid"
    assert how(right=0, seqused_q=torch.full((2,), 100, dtype=torch.int32)) == "grid"
    qv, kv = q.flatten(0, 1), k.flatten(0, 1)
    cu_q = torch.tensor([0, 300, 600], dtype=torch.int32)
    cu_k = torch.tensor([0, 200, 400], dtype=torch.int32)
    for left, right in ((-1, -1), (-1, 0)):
        p = AttnParams(0.1, left, right, 0.0, 300, 200)
        assert fwd.walk(base, p, Problem(qv, kv, p, cu_q, cu_k), 12) == "grid"  # varlen
    off = dataclasses.replace(base, persistent_unmasked=False)
    assert how(cfg=off) == "grid"
    assert how(right=0, cfg=off) == "scheduled"
    # the launch: a persistent grid of at most one CTA per SM, and the schedule only when used
    out = torch.empty_like(q)
    lse = torch.empty(2, 4, 300)
    for cfg, right, grid, scheduled in ((off, -1, 2 * 4 * 3, False), (base, 0, 5, True),
                                        (base, -1, 5, False)):
        p = AttnParams(0.1, -1, right, 0.0, 300, 200)
        g, args = fwd.kernel_args(q, k, k, out, lse, p, cfg, num_sms=5)
        assert g == (grid,) and kernel_arg(fwd.hopper_fwd_kernel, args, "META").SCHEDULED is scheduled
        sched = [a for a in args if isinstance(a, torch.Tensor) and a.dtype == torch.int32]
        assert len(sched) == int(scheduled)
        if scheduled:
            walks = sched[0].tolist()
            assert len(walks) == 5 + 1 + 2 * 4 * 3 and walks[5] == 2 * 4 * 3


def test_schedule_tables_under_cuda_graph_capture(monkeypatch):
    """A stream capturing a CUDA graph cannot copy a new schedule to the device:
    ``schedule_table`` answers None there and the launches fall back to one CTA per tile; a
    table the capture does read is kept beyond the cache's clearing (replays read it)."""
    fwd = pytest.importorskip("triflash.kernels.hopper.fwd")
    from tools import kernel_arg
    from triflash.kernels import configs
    from triflash.kernels.hopper import common as hc
    from triflash.kernels.problem import AttnParams
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(hc, "_SCHEDULES", {})
    monkeypatch.setattr(hc, "_CAPTURED_SCHEDULES", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert hc.schedule_table(cuda, (1, 2, 3)) is None and not hc._SCHEDULES
    table = torch.zeros(3, dtype=torch.int32)
    hc._SCHEDULES[(cuda, hc.persistent_schedule, (1, 2, 3))] = table
    assert hc.schedule_table(cuda, (1, 2, 3)) is table
    hc._SCHEDULES.clear()
    assert list(hc._CAPTURED_SCHEDULES.values()) == [table]
    # the split tail (fwd.split_keys) of a shape without a table: none, the plain walk instead
    monkeypatch.setattr(hc, "_SPLITS", {})
    assert hc.split_plan(cuda, (2304, 128, 132, False, 1, True)) is None and not hc._SCHEDULES
    # the forward's launch without a table: one CTA per tile, one Q slot, no schedule
    q = torch.empty(2, 300, 4, 128, dtype=torch.bfloat16)
    k = torch.empty(2, 200, 2, 128, dtype=torch.bfloat16)
    cfg = configs.SM90_HOPPER_FWD[128]
    p = AttnParams(0.1, -1, 0, 0.0, 300, 200)
    monkeypatch.setattr(fwd, "schedule_table", lambda *a, **kw: None)
    g, args = fwd.kernel_args(q, k, k, torch.empty_like(q), torch.empty(2, 4, 300), p, cfg, num_sms=5)
    assert g == (2 * 4 * -(-300 // (64 * cfg.num_consumers)),)
    assert kernel_arg(fwd.hopper_fwd_kernel, args, "META").SCHEDULED is False
    assert kernel_arg(fwd.hopper_fwd_kernel, args, "META").Q_SLOTS == 1
    assert not [a for a in args if isinstance(a, torch.Tensor) and a.dtype == torch.int32]


@triton.jit
def _visited_kernel(OUT, m_block, len_q, len_k, left, right, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    n_min, _, _, n_max = n_block_range(m_block, len_q, len_k, left, right, BLOCK_M, BLOCK_N,
                                       HAS_LEFT, HAS_RIGHT)
    tl.store(OUT, n_max - n_min)


def test_visited_key_blocks_matches_the_kernels():
    """The host's count of visited key blocks (what the persistent schedule costs a tile by)
    equals ``n_block_range``'s, for causal, windows, seqlen_q != seqlen_k and tails."""
    import random
    rng = random.Random(0)
    out = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    cases = [(m, lq, lk, left, right, bm, bn)
             for (lq, lk) in ((300, 200), (200, 300), (128, 128), (1, 777))
             for (left, right) in ((-1, -1), (-1, 0), (64, 0), (5, 17), (0, -1))
             for (bm, bn) in ((128, 128), (192, 64))
             for m in range(-(-lq // bm))]
    for case in rng.sample(cases, 40):
        m, lq, lk, left, right, bm, bn = case
        _visited_kernel[(1,)](out, m, lq, lk, left, right, bm, bn, left >= 0, right >= 0)
        assert int(out.item()) == visited_key_blocks(*case), case


@pytest.mark.parametrize("num_bh,num_m,sec,ctas", [(36, 64, 4, 132), (3, 5, 3, 4), (8, 16, 8, 132),
                                                    (32, 8, 16, 132), (7, 1, 7, 3)])
@pytest.mark.parametrize("window", [(-1, 0), (256, 0), (-1, -1)])
@pytest.mark.parametrize("overhead", [1, 3])
def test_persistent_schedule(num_bh, num_m, sec, ctas, window, overhead):
    """The persistent forward's schedule: every tile of the launch exactly once, each CTA's
    tiles in launch order, and loads balanced as a greedy longest-first list schedule
    guarantees (no CTA more than one tile over the average), where round-robin is not."""
    bm, bn, s = 128, 128, num_m * 128 - 37
    ctas = min(ctas, num_bh * num_m)
    flat = persistent_schedule(num_bh, num_m, sec, s, s, *window, bm, bn, ctas, overhead)
    offsets, tiles = flat[:ctas + 1], flat[ctas + 1:]
    assert offsets[0] == 0 and list(offsets) == sorted(offsets) and offsets[-1] == len(tiles)
    assert sorted(tiles) == list(range(num_bh * num_m))
    per_section = sec * num_m

    def cost(t):
        rank = (t % per_section) // sec
        return visited_key_blocks(num_m - 1 - rank, s, s, *window, bm, bn) + overhead
    loads = []
    for p in range(ctas):
        walk = tiles[offsets[p]:offsets[p + 1]]
        assert list(walk) == sorted(walk)
        loads.append(sum(cost(t) for t in walk))
    biggest = max(cost(t) for t in tiles)
    assert max(loads) <= sum(loads) / ctas + biggest
    if window == (-1, -1):  # equal tiles: as even as round-robin
        assert max(loads) - min(loads) <= biggest
    elif (num_bh, num_m) == (36, 64) and window == (-1, 0):  # the seed causal: round-robin breaks it
        rr = [sum(cost(t) for t in range(p, num_bh * num_m, ctas)) for p in range(ctas)]
        assert max(rr) > sum(rr) / ctas + biggest
