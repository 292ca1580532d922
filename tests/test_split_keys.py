"""The forward's key-split tail (``HopperFwdConfig.split_keys``) on the CPU: the host's
schedule (``common.split_schedule``) and the merge of pieces (``hopper.split_combine``,
plain Triton, under the interpreter) against the fp32 reference. The Gluon kernel that
computes the pieces runs in tests/test_hopper_tier.py (GPU)."""
import math

import pytest
import torch

from conftest import DEVICE
from triflash.kernels.common import (PIECE_OVERHEAD, SPLIT_MIN_SAVING, launch_sections, split_schedule,
                                     split_table)


def _check_schedule(T, nb, P, persistent, always):
    plan = split_schedule(T, nb, P, persistent, always=always)
    F, r = divmod(T, P)
    if plan is None:
        return None
    walks, pieces = plan
    seen = {}
    slots = []
    for w in walks:
        assert sum(e[3] >= 0 for e in w) <= 2, "at most two pieces per CTA"
        for tile, lo, hi, piece in w:
            assert 0 <= lo < hi <= nb and 0 <= tile < T
            assert (piece == -1) == (hi - lo == nb), "whole tiles, and only they, have no slot"
            for b in range(lo, hi):
                assert (tile, b) not in seen, f"block {b} of tile {tile} twice"
                seen[(tile, b)] = piece
            if piece >= 0:
                slots.append((tile, piece))
    assert len(seen) == T * nb, "every key block of every tile once"
    assert sorted(p for _, p in slots) == list(range(len(slots))), "slots 0.. once each"
    for tile, first, count in pieces:  # a cut tile's slots are consecutive and all its own
        assert sorted(p for t, p in slots if t == tile) == list(range(first, first + count))
    assert {t for t, _ in slots} == {t for t, _, _ in pieces}
    # the tail's shares: equal to a block, the whole tiles walked first
    tail = walks[F * P:] if not persistent else walks
    shares = [sum(hi - lo for t, lo, hi, _ in w if t >= F * P) for w in tail]
    shares = [s for s in shares if s]
    assert max(shares) - min(shares) <= 1 and sum(shares) == r * nb
    if persistent:
        assert len(walks) == P
        for c, w in enumerate(walks):
            assert [e[0] for e in w[:F]] == [c + i * P for i in range(F)]
    else:
        assert len(walks) == F * P + min(P, r * nb)
        assert all(len(w) == 1 and w[0] == (t, 0, nb, -1) for t, w in enumerate(walks[:F * P]))
    return plan


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("T,nb,P", [(2304, 128, 132), (2048, 64, 132), (2752, 64, 132), (16, 4, 132),
                                    (7, 3, 5), (13, 1, 4), (1, 7, 3), (300, 17, 132), (133, 2, 132)])
def test_split_schedule_covers_every_block_once(T, nb, P, persistent):
    plan = _check_schedule(T, nb, P, persistent, always=True)
    assert (plan is None) == (T % P == 0)


def test_split_schedule_only_where_it_pays():
    """Without ``always``: none where the rounds are full, none where the shares plus their
    pieces' fixed costs save less than ``SPLIT_MIN_SAVING`` of the launch's estimate."""
    assert split_schedule(2 * 132, 128, 132, False) is None
    assert split_schedule(2304, 128, 132, False) is not None  # the seed: 17.45 rounds at 256
    assert split_schedule(2048, 64, 132, True) is not None    # 2 x 8192 x 16 heads at 128
    assert split_schedule(1024, 256, 132, False) is not None  # 1 x 16384 x 8 heads at 256
    # 4 x 4096 and 8 x 2048 (2048 tiles at 128, 1024 at 256; 2.0% or less)
    for T, nb in ((2048, 32), (2048, 16), (1024, 64), (1024, 32), (1024, 16)):
        assert split_schedule(T, nb, 132, False) is None
    assert split_schedule(16, 64, 132, False) is not None     # few tiles, long keys: idle SMs
    for nb in (4, 20, 100):
        for F in (0, 1, 5):
            for r in range(1, 132):
                whole = (F + 1) * (nb + 1)
                cut = F * (nb + 1) + r * nb / min(132, r * nb) + 2 * (1 + PIECE_OVERHEAD)
                assert (split_schedule(F * 132 + r, nb, 132, True) is not None) == \
                    (whole - cut >= SPLIT_MIN_SAVING * whole)


def test_split_table_layout():
    table, ctas, slots, ncut = split_table(7, 3, 5, True, always=True)
    walks, pieces = split_schedule(7, 3, 5, True, always=True)
    assert ctas == 5 and ncut == len(pieces) and slots == sum(p[2] for p in pieces)
    offsets = table[:ctas + 1]
    entries = table[ctas + 1:ctas + 1 + 4 * offsets[-1]]
    assert [tuple(entries[4 * i:4 * i + 4]) for i in range(offsets[-1])] == [e for w in walks for e in w]
    assert table[len(table) - 3 * ncut:] == tuple(x for p in pieces for x in p)


def _launch_order(tile, num_blocks, section_heads):  # host twin of common.launch_order
    per = section_heads * num_blocks
    section, within = divmod(tile, per)
    rank = within // section_heads
    return section * section_heads + within - rank * section_heads, rank


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b,sq,sk,h,hk,d,bn,P", [
    (2, 113, 203, 3, 3, 64, 32, 5),     # tails: rows past the sequence, a short last key block
    (1, 70, 33, 2, 1, 96, 16, 4),       # a last key block of one key; a padded head dim
    (2, 64, 257, 4, 2, 128, 64, 7),     # GQA
    (1, 33, 100, 1, 1, 256, 16, 4)])
def test_combine_merges_pieces(b, sq, sk, h, hk, d, bn, P, dtype):
    """Pieces of a split schedule computed by the fp32 reference over their key blocks
    (each row normalized by its own sum, its log-sum-exp beside), merged by
    ``split_combine_kernel``: the output and lse of the whole attention, for every tile cut.
    The outputs start poisoned (NaN); rows of tiles not cut stay so."""
    from triflash.kernels.hopper.split_combine import combine
    torch.manual_seed(sq * sk + d)
    bmt = 32
    q = torch.randn(b, sq, h, d, dtype=dtype, device=DEVICE)
    k = torch.randn(b, sk, hk, d, dtype=dtype, device=DEVICE)
    v = torch.randn(b, sk, hk, d, dtype=dtype, device=DEVICE)
    scale = 1 / math.sqrt(d)
    kk = k.float().repeat_interleave(h // hk, dim=2)
    vv = v.float().repeat_interleave(h // hk, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), kk) * scale      # (b, h, sq, sk)
    ref = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), vv)
    lse_ref = s.logsumexp(-1)                                        # (b, h, sq)
    nm, nb = -(-sq // bmt), -(-sk // bn)
    T = b * h * nm
    table, ctas, slots, ncut = split_table(T, nb, P, True, always=True)
    walks, pieces = split_schedule(T, nb, P, True, always=True)
    sections = launch_sections(b, h, k, v, sk, -1, -1)
    dv = 1 << (d - 1).bit_length()
    ws = torch.full((slots, bmt, dv), float("nan"), device=DEVICE)
    wsl = torch.full((slots, bmt), float("nan"), device=DEVICE)
    for w in walks:
        for tile, lo, hi, piece in w:
            if piece < 0:
                continue
            bh, rank = _launch_order(tile, nm, sections)
            bi, hi_ = divmod(bh, h)
            r0 = (nm - 1 - rank) * bmt
            rows = torch.arange(r0, r0 + bmt)
            ok = rows < sq
            sp = s[bi, hi_, rows[ok]][:, lo * bn:min(hi * bn, sk)]
            ws[piece, :ok.sum(), :d] = sp.softmax(-1) @ vv[bi, lo * bn:min(hi * bn, sk), hi_]
            ws[piece, ok.sum():] = 0.0   # (rows past the sequence: what the kernel writes)
            ws[piece, :, d:] = 0.0
            wsl[piece, :ok.sum()] = sp.logsumexp(-1)
            wsl[piece, ok.sum():] = float("-inf")
    out = torch.full_like(q, float("nan"))
    lse = torch.full((b, h, sq), float("nan"), device=DEVICE)
    combine(out, lse, ws.flatten(), wsl.flatten(), torch.tensor(table[len(table) - 3 * ncut:], dtype=torch.int32,
                                                                 device=DEVICE),
            q, k, v, _Params(), bmt)
    cut = torch.zeros(b, h, sq, dtype=torch.bool)
    for tile, _, _ in pieces:
        bh, rank = _launch_order(tile, nm, sections)
        r0 = (nm - 1 - rank) * bmt
        cut[bh // h, bh % h, r0:r0 + bmt] = True
    assert cut.any()
    got, want = out.permute(0, 2, 1, 3)[cut].float(), ref.permute(0, 2, 1, 3)[cut]
    # one rounding to the output dtype past the fp32 merge
    torch.testing.assert_close(got, want.to(dtype).float(), rtol=2 ** -7, atol=2 ** -9)
    torch.testing.assert_close(lse[cut], lse_ref[cut], rtol=1e-5, atol=1e-5)
    assert out.permute(0, 2, 1, 3)[~cut].isnan().all() and lse[~cut].isnan().all()


class _Params:
    window_left = window_right = -1
