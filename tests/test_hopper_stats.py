"""The Hopper backward's per-row statistics (``hopper.bwd_stats.stats``: lse in log2 units and
Delta = rowsum(dO * O), padded per sequence so that TMA boxes never leave a sequence's rows)
for dense and varlen batches. The stats kernel is plain Triton, so this runs on the CPU
under the interpreter too; the layout is the one ``common.stat_row0`` defines."""
import math

import pytest
import torch

from conftest import DEVICE

bwd_stats = pytest.importorskip("triflash.kernels.hopper.bwd_stats")
from triflash.kernels.hopper.common import Problem  # noqa: E402
from triflash.kernels.problem import AttnParams  # noqa: E402

BM = bwd_stats.BLOCK_M


def _expected(o, do, lse, rows):
    """(lse_log2 with +inf where lse is -inf or past the rows used, Delta) of one sequence."""
    delta = (o.float() * do.float()).sum(-1).transpose(0, 1)  # (heads, rows)
    stat = torch.where(lse == float("-inf"), float("inf"), lse * math.log2(math.e))
    return stat[:, :rows], delta[:, :rows]


@pytest.mark.parametrize("seqused", [False, True])
def test_varlen_stats_are_padded_per_sequence(seqused):
    g = torch.Generator().manual_seed(0)
    lens, h, d = [0, 1, 70, 128, 5], 3, 32
    total = sum(lens) + 3  # padding rows no sequence covers
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    used = torch.tensor([0, 1, 64, 100, 5], dtype=torch.int32) if seqused else None
    o, do = (torch.randn(total, h, d, generator=g).to(DEVICE, torch.float16) for _ in range(2))
    lse = torch.randn(h, total, generator=g).to(DEVICE)
    lse[1, 10] = float("-inf")  # a row that saw no key
    cu_d, used_d = cu.to(DEVICE), (used.to(DEVICE) if seqused else None)
    pb = Problem(o, o, AttnParams(1.0, -1, -1, 0.0, max(lens), max(lens)), cu_d, cu_d, used_d, None)
    stat, delta = bwd_stats.stats(pb, o, do, lse)
    assert stat.shape == (1, h, bwd_stats.stat_rows(total, len(lens), BM))
    for b, n in enumerate(lens):
        start = int(cu[b])
        rows = int(used[b]) if seqused else n
        row0 = (start + b * BM) // BM * BM  # common.stat_row0
        want_stat, want_delta = _expected(o[start:start + rows], do[start:start + rows],
                                          lse[:, start:start + rows], rows)
        pad = -(-rows // BM) * BM  # the whole tiles a kernel may read
        got_stat, got_delta = stat[0, :, row0:row0 + pad], delta[0, :, row0:row0 + pad]
        torch.testing.assert_close(got_stat[:, :rows], want_stat, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got_delta[:, :rows], want_delta, rtol=1e-3, atol=1e-3)
        assert (got_stat[:, rows:] == float("inf")).all() and (got_delta[:, rows:] == 0).all()


@pytest.mark.parametrize("d", [16, 96])
def test_dense_stats_pad_to_whole_tiles(d):
    """Head dim 96 (a padded head dim of the Hopper tier) reads a power-of-two tile with its
    columns past 96 masked: O and dO are views into rows whose next columns hold NaN, so a
    read past the head dim would make Delta NaN."""
    g = torch.Generator().manual_seed(1)
    b, s, h = 2, 77, 2

    def rows_with_nan_tail():
        x = torch.full((b, s, h, d + 16), float("nan"))
        x[..., :d] = torch.randn(b, s, h, d, generator=g)
        return x.to(DEVICE, torch.bfloat16)[..., :d]
    o, do = rows_with_nan_tail(), rows_with_nan_tail()
    lse = torch.randn(b, h, s, generator=g).to(DEVICE)
    pb = Problem(o, o, AttnParams(1.0, -1, -1, 0.0, s, s))
    stat, delta = bwd_stats.stats(pb, o, do, lse)
    assert stat.shape == (b, h, -(-s // BM) * BM)
    for i in range(b):
        want_stat, want_delta = _expected(o[i], do[i], lse[i], s)
        torch.testing.assert_close(stat[i, :, :s], want_stat, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(delta[i, :, :s], want_delta, rtol=1e-2, atol=1e-2)
        assert (stat[i, :, s:] == float("inf")).all() and (delta[i, :, s:] == 0).all()
