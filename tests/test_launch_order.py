"""The launch order of query-block tiles (``common.launch_order`` with the host's
``common.section_heads``): every (batch*head, block) exactly once, longest first inside each
section of heads, sections in order. Runs the jitted function through a one-line kernel (the
interpreter on the CPU)."""
import pytest
import torch
import triton
import triton.language as tl

from conftest import DEVICE
from triflash.kernels.common import L2_SECTION_BYTES, launch_order, section_heads


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
    from triflash.kernels import configs, portable
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
    p = portable.AttnParams(softmax_scale=0.1, window_left=-1, window_right=0, softcap=0.0,
                            max_seqlen_q=3, max_seqlen_k=3)
    out, lse = portable.fwd(q, q, q, None, None, None, None, p, configs.INTERPRET_FWD, upcast=True)
    for det in (False, True):
        portable.bwd(q, q, q, q, out, lse, None, None, None, None, p, configs.INTERPRET_BWD,
                     deterministic=det, upcast=True)
    try:
        from triflash.kernels.hopper import bwd as hopper_bwd
        from triflash.kernels.hopper.common import Problem
    except ImportError:  # Triton without Gluon
        hopper_bwd = None
    if hopper_bwd is not None:
        monkeypatch.setattr(hopper_bwd, "bwd_stats_kernel", Record("bwd_stats_kernel"))
        hopper_bwd.stats(Problem(q, q, p), q, q, lse)
        names.append("bwd_stats_kernel")
    assert {name for name, _ in grids} == set(names)
    for name, grid in grids:
        assert grid[0] < 2 ** 31 and all(axis <= 65535 for axis in grid[1:]), (name, grid)


def test_forward_persistent_only_where_tiles_are_equal():
    """The Hopper forward walks tiles with persistent CTAs (two Q slots) only on a dense batch
    without causal / window mask and without seqused: elsewhere tiles differ in length and
    one CTA per tile lets the hardware balance them."""
    import dataclasses

    import torch
    fwd = pytest.importorskip("triflash.kernels.hopper.fwd")
    from triflash.kernels import configs
    from triflash.kernels.hopper.common import Problem
    from triflash.kernels.portable import AttnParams
    q = torch.empty(2, 300, 4, 128, dtype=torch.bfloat16)
    k = torch.empty(2, 200, 2, 128, dtype=torch.bfloat16)
    cfg = configs.SM90_HOPPER_FWD[128]
    assert cfg.persistent_unmasked and cfg.q_slots == 2

    def persistent(left=-1, right=-1, cfg=cfg, **seq):
        p = AttnParams(0.1, left, right, 0.0, 300, 200)
        return fwd.is_persistent(cfg, p, Problem(q, k, p, **seq))
    assert persistent()
    assert not persistent(right=0)                      # causal
    assert not persistent(left=64) and not persistent(left=8, right=8)
    assert not persistent(seqused_k=torch.full((2,), 100, dtype=torch.int32))  # KV cache form
    qv, kv = q.flatten(0, 1), k.flatten(0, 1)
    cu_q = torch.tensor([0, 300, 600], dtype=torch.int32)
    cu_k = torch.tensor([0, 200, 400], dtype=torch.int32)
    p = AttnParams(0.1, -1, -1, 0.0, 300, 200)
    assert not fwd.is_persistent(cfg, p, Problem(qv, kv, p, cu_q, cu_k))  # varlen
    off = dataclasses.replace(cfg, persistent_unmasked=False)
    assert not persistent(cfg=off)
    assert persistent(right=0, cfg=dataclasses.replace(off, persistent=True))  # forced
