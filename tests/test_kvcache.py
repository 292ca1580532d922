"""flash_attn_with_kvcache: new keys/values written into the caches in place, then attention
of q over each sequence's first cache_seqlens + seqlen_new keys, against the fp32
reference under FA3's tolerance rule. Forward only (the API has no backward)."""
import pytest
import torch

import triflash
from conftest import DEVICE
from triflash.testing import assert_forward_matches, attention_ref

DTYPES = [torch.float16, torch.bfloat16]
MASKS = {"none": (False, (-1, -1), 0.0), "causal": (True, (-1, -1), 0.0),
         "window": (False, (20, 3), 0.0), "causal-softcap": (True, (-1, -1), 15.0)}


def _rand(*shape, dtype):
    return torch.randn(*shape, device=DEVICE, dtype=dtype)


def _check_rows(out, lse, q, k_cache, v_cache, lens, **kw):
    """Each sequence b against the reference over its first lens[b] cache rows."""
    for b, n in enumerate(lens):
        qb, kb, vb = q[b:b + 1], k_cache[b:b + 1, :n], v_cache[b:b + 1, :n]
        ref, lse_ref = attention_ref(qb, kb, vb, **kw)
        lowp, _ = attention_ref(qb, kb, vb, upcast=False, **kw)
        assert_forward_matches(out[b:b + 1], lse[b:b + 1], ref, lse_ref, lowp, kw.get("softcap", 0.0))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("seqlens", ["tensor", "int"])
# (64/128/256, equal head dims: the Hopper forward on sm90; the others: the portable one)
@pytest.mark.parametrize("d,dv,h,hk,sq", [(64, 64, 4, 2, 1), (40, 40, 2, 2, 7), (64, 32, 6, 1, 3),
                                          (128, 128, 4, 4, 5), (256, 256, 2, 1, 1)])
def test_kvcache_append_then_attend(dtype, mask, seqlens, d, dv, h, hk, sq):
    torch.manual_seed(0)
    causal, window, softcap = MASKS[mask]
    batch, cache_rows = 3, 97
    k_cache, v_cache = _rand(batch, cache_rows, hk, d, dtype=dtype), _rand(batch, cache_rows, hk, dv, dtype=dtype)
    k_new, v_new = _rand(batch, sq, hk, d, dtype=dtype), _rand(batch, sq, hk, dv, dtype=dtype)
    q = _rand(batch, sq, h, d, dtype=dtype)
    if seqlens == "tensor":
        starts = [0, 41, cache_rows - sq]
        cache_seqlens = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
    else:
        starts, cache_seqlens = [30] * batch, 30
    k_before, v_before = k_cache.clone(), v_cache.clone()
    out, lse = triflash.flash_attn_with_kvcache(
        q, k_cache, v_cache, k_new, v_new, cache_seqlens=cache_seqlens, causal=causal,
        window_size=window, softcap=softcap, return_softmax_lse=True)
    assert out.shape == (batch, sq, h, dv) and lse.shape == (batch, h, sq)
    for b, s in enumerate(starts):  # written in place, nothing else touched
        for cache, before, new in ((k_cache, k_before, k_new), (v_cache, v_before, v_new)):
            assert torch.equal(cache[b, s:s + sq], new[b])
            assert torch.equal(cache[b, :s], before[b, :s]) and torch.equal(cache[b, s + sq:], before[b, s + sq:])
    _check_rows(out, lse, q, k_cache, v_cache, [s + sq for s in starts],
                causal=causal, window_size=window, softcap=softcap)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kvcache_without_new_keys(dtype):
    """No new k/v: attention over cache_seqlens keys; an empty cache gives 0 and lse -inf;
    cache_seqlens None uses the whole cache."""
    torch.manual_seed(1)
    batch, rows, h, d, sq = 3, 50, 2, 32, 4
    k_cache, v_cache, q = _rand(batch, rows, h, d, dtype=dtype), _rand(batch, rows, h, d, dtype=dtype), \
        _rand(batch, sq, h, d, dtype=dtype)
    lens = [0, 1, 50]
    out, lse = triflash.flash_attn_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=torch.tensor(lens, dtype=torch.int32, device=DEVICE),
        causal=True, return_softmax_lse=True)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isneginf(lse[0]).all()
    assert not out.isnan().any()
    _check_rows(out, lse, q, k_cache, v_cache, lens, causal=True)
    out, lse = triflash.flash_attn_with_kvcache(q, k_cache, v_cache, return_softmax_lse=True)
    _check_rows(out, lse, q, k_cache, v_cache, [rows] * batch)


def test_kvcache_bad_input():
    q = _rand(2, 1, 2, 32, dtype=torch.float16)
    kc, vc = _rand(2, 10, 2, 32, dtype=torch.float16), _rand(2, 10, 2, 32, dtype=torch.float16)
    kn = _rand(2, 1, 2, 32, dtype=torch.float16)
    with pytest.raises(NotImplementedError, match="page_table"):
        triflash.flash_attn_with_kvcache(q, kc, vc, page_table=torch.zeros(2, 1, dtype=torch.int32))
    with pytest.raises(NotImplementedError, match="cache_batch_idx"):
        triflash.flash_attn_with_kvcache(q, kc, vc, cache_batch_idx=torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="k, v"):
        triflash.flash_attn_with_kvcache(q, kc, vc, k=kn, cache_seqlens=1)
    with pytest.raises(ValueError, match="cache_seqlens=None"):
        triflash.flash_attn_with_kvcache(q, kc, vc, k=kn, v=kn)
    with pytest.raises(ValueError, match="cache_seqlens=10"):
        triflash.flash_attn_with_kvcache(q, kc, vc, k=kn, v=kn, cache_seqlens=10)
    # the values of a cache_seqlens tensor: read on the CPU, and on a GPU under
    # set_check_inputs(True) (a device-to-host sync, off by default like the varlen checks)
    triflash.set_check_inputs(True)
    try:
        with pytest.raises(ValueError, match=r"cache_seqlens=\[3, 10\]"):
            triflash.flash_attn_with_kvcache(q, kc, vc, k=kn, v=kn,
                                             cache_seqlens=torch.tensor([3, 10], dtype=torch.int32, device=DEVICE))
    finally:
        triflash.set_check_inputs(False)
    with pytest.raises(ValueError, match="cache_seqlens"):
        triflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=torch.tensor([3, 1], device=DEVICE))
    with pytest.raises(ValueError, match="k.shape"):
        triflash.flash_attn_with_kvcache(q, kc, vc, k=kn[:, :, :1], v=kn[:, :, :1], cache_seqlens=1)
    with pytest.raises(ValueError, match="k_cache.stride"):
        wide = _rand(2, 10, 2, 64, dtype=torch.float16)[..., ::2]
        triflash.flash_attn_with_kvcache(q, wide, vc, k=kn, v=kn, cache_seqlens=1)
    with pytest.raises(ValueError, match="k_cache head dim"):
        triflash.flash_attn_with_kvcache(q, kc[..., :16], vc)
