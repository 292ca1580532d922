"""flash_attn_varlen_func: every feature of the dense API, per sequence, in packed batches
with sequences of length 0 and 1 among them; checked one sequence at a time against the
fp32 reference with FlashAttention-3's tolerance rule."""
import pytest
import torch

import triflash
from triflash.testing import assert_matches_reference, attention_varlen_ref

from conftest import DEVICE

ON_GPU = DEVICE == "cuda"


def _packed(lens_q, lens_k, h, hk, d, dv, dtype, seed, pad=0):
    g = torch.Generator().manual_seed(seed)
    total_q, total_k = sum(lens_q) + pad, sum(lens_k) + pad

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(DEVICE, dtype).requires_grad_()

    def cu(lens):
        return torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32, device=DEVICE)
    return (rnd(total_q, h, d), rnd(total_k, hk, d), rnd(total_k, hk, dv), cu(lens_q), cu(lens_k))


def _random_lens(batch, max_len, seed):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, max_len + 1, (batch,), generator=g).tolist()
    lens[0], lens[-1] = 0, 1  # zero-length and single-token sequences are legal
    return lens


def check_varlen(lens_q, lens_k, h, hk, d, dtype, causal=False, window=(-1, -1), softcap=0.0,
                 dv=None, deterministic=False, seqused=None, seed=0, pad=0):
    dv = d if dv is None else dv
    q, k, v, cu_q, cu_k = _packed(lens_q, lens_k, h, hk, d, dv, dtype, seed, pad)
    seqused_q = seqused_k = None
    if seqused is not None:
        seqused_q = torch.tensor(seqused[0], dtype=torch.int32, device=DEVICE)
        seqused_k = torch.tensor(seqused[1], dtype=torch.int32, device=DEVICE)
    kw = dict(causal=causal, window_size=window, softcap=softcap)
    out, lse = triflash.flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), seqused_q=seqused_q, seqused_k=seqused_k,
        deterministic=deterministic, return_attn_probs=True, **kw)
    out_ref, lse_ref = attention_varlen_ref(q, k, v, cu_q, cu_k, seqused_q, seqused_k, upcast=True, **kw)
    out_pt, _ = attention_varlen_ref(q, k, v, cu_q, cu_k, seqused_q, seqused_k, upcast=False, **kw)
    assert out.shape == (q.shape[0], h, dv) and lse.shape == (h, q.shape[0])
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1)).to(out)
    grads = assert_matches_reference(out, lse, out_ref, lse_ref, out_pt, (q, k, v), dout, softcap)
    return grads


MAX_LEN = 100 if not ON_GPU else 1500
BATCH = 4 if not ON_GPU else 16


@pytest.mark.parametrize("mask", ["none", "causal", "window", "softcap"])
@pytest.mark.parametrize("d", [64, 72, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_varlen_grid(dtype, d, mask):
    i = [64, 72, 128, 256].index(d) + ["none", "causal", "window", "softcap"].index(mask)
    causal, window, softcap = {"none": (False, (-1, -1), 0.0), "causal": (True, (-1, -1), 0.0),
                               "window": (False, (19, 3), 0.0), "softcap": (True, (-1, -1), 10.0)}[mask]
    lens_q = _random_lens(BATCH, MAX_LEN, seed=i)
    lens_k = _random_lens(BATCH, MAX_LEN, seed=100 + i)
    h, hk = [(4, 4), (4, 2), (4, 1)][i % 3]
    check_varlen(lens_q, lens_k, h, hk, d, dtype, causal, window, softcap, seed=i,
                 deterministic=bool(i % 2))


def test_varlen_seqused_and_padding():
    """seqused limits each sequence; tokens past cu_seqlens[-1] (padding) stay untouched rows."""
    lens_q, lens_k = [40, 0, 77, 1], [50, 9, 33, 20]
    check_varlen(lens_q, lens_k, 2, 1, 64, torch.float16, causal=True,
                 seqused=([30, 0, 77, 1], [50, 3, 10, 0]), pad=7)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_varlen_headdim_v(dtype):
    check_varlen([33, 70, 1], [64, 5, 90], 4, 2, 192, dtype, causal=True, dv=128)


def test_varlen_deterministic_reproducible():
    lens = [60, 1, 0, 130]
    g1 = check_varlen(lens, lens, 4, 2, 64, torch.float16, causal=True, deterministic=True)
    g2 = check_varlen(lens, lens, 4, 2, 64, torch.float16, causal=True, deterministic=True)
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))


def test_varlen_matches_dense_at_equal_lengths():
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(3, 70, 2, 32, generator=g).to(DEVICE, torch.float16) for _ in range(3))
    dense = triflash.flash_attn_func(q, k, v, causal=True)
    cu = torch.arange(0, 4 * 70, 70, dtype=torch.int32, device=DEVICE)
    packed = triflash.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1),
                                             cu, cu, 70, 70, causal=True)
    assert torch.equal(packed.view_as(dense), dense)
