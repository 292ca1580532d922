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
# (query tokens x GQA group <= 64: the decode kernel; the last case, 80 rows, prefill: at
# 64/96/128/192/256 with equal head dims the Hopper forward on sm90, else the portable one)
@pytest.mark.parametrize("d,dv,h,hk,sq", [(64, 64, 4, 2, 1), (40, 40, 2, 2, 7), (64, 32, 6, 1, 3),
                                          (128, 128, 4, 4, 5), (256, 256, 2, 1, 1), (96, 96, 3, 1, 9),
                                          (192, 192, 2, 2, 2), (64, 64, 4, 1, 20)])
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
    out, lse, *_ = triflash.flash_attn_with_kvcache(
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
    out, lse, *_ = triflash.flash_attn_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=torch.tensor(lens, dtype=torch.int32, device=DEVICE),
        causal=True, return_softmax_lse=True)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isneginf(lse[0]).all()
    assert not out.isnan().any()
    _check_rows(out, lse, q, k_cache, v_cache, lens, causal=True)
    out, lse, *_ = triflash.flash_attn_with_kvcache(q, k_cache, v_cache, return_softmax_lse=True)
    _check_rows(out, lse, q, k_cache, v_cache, [rows] * batch)


def test_append_of_no_tokens():
    """New k/v of zero tokens (dense, and packed with every sequence empty): the caches stay as
    they were and each sequence attends to its cache_seqlens keys, as without new keys."""
    torch.manual_seed(3)
    batch, rows, h, d, sq = 3, 40, 2, 32, 2
    k_cache, v_cache = _rand(batch, rows, h, d, dtype=torch.float16), _rand(batch, rows, h, d, dtype=torch.float16)
    q = _rand(batch, sq, h, d, dtype=torch.float16)
    lens = torch.tensor([5, 0, 33], dtype=torch.int32, device=DEVICE)
    k0, v0 = k_cache.clone(), v_cache.clone()
    empty = _rand(batch, 0, h, d, dtype=torch.float16)
    packed = _rand(0, h, d, dtype=torch.float16)
    cu = torch.zeros(batch + 1, dtype=torch.int32, device=DEVICE)
    for kw in (dict(k=empty, v=empty), dict(k=packed, v=packed, cu_seqlens_k_new=cu)):
        out, lse, *_ = triflash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, causal=True,
                                                    return_softmax_lse=True, **kw)
        assert torch.equal(k_cache, k0) and torch.equal(v_cache, v0)
        _check_rows(out, lse, q, k_cache, v_cache, lens.tolist(), causal=True)


def test_kvcache_bad_input():
    q = _rand(2, 1, 2, 32, dtype=torch.float16)
    kc, vc = _rand(2, 10, 2, 32, dtype=torch.float16), _rand(2, 10, 2, 32, dtype=torch.float16)
    kn = _rand(2, 1, 2, 32, dtype=torch.float16)
    i32 = dict(dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"cu_seqlens_k_new.shape"):
        triflash.flash_attn_with_kvcache(q, kc, vc, k=kn[0], v=kn[0], cache_seqlens=1,
                                         cu_seqlens_k_new=torch.zeros(4, **i32))
    with pytest.raises(ValueError, match="page_table"):
        triflash.flash_attn_with_kvcache(q, kc, vc, page_table=torch.zeros(3, 1, **i32))
    with pytest.raises(ValueError, match=r"k_cache.shape\[0\]"):
        triflash.flash_attn_with_kvcache(q, kc[:1], vc[:1])
    with pytest.raises(ValueError, match="rotary_cos, rotary_sin"):
        triflash.flash_attn_with_kvcache(q, kc, vc, kn, kn, cache_seqlens=1, rotary_cos=torch.ones(10, 8))
    with pytest.raises(ValueError, match=r"rotary_cos.shape\[1\]"):
        triflash.flash_attn_with_kvcache(q, kc, vc, kn, kn, cache_seqlens=1,
                                         rotary_cos=torch.ones(10, 17, device=DEVICE), rotary_sin=torch.ones(10, 17, device=DEVICE))
    with pytest.raises(ValueError, match="new k and v"):
        triflash.flash_attn_with_kvcache(q, kc, vc, rotary_cos=torch.ones(10, 8, device=DEVICE),
                                         rotary_sin=torch.ones(10, 8, device=DEVICE))
    with pytest.raises(ValueError, match="max_seqlen_q"):
        triflash.flash_attn_with_kvcache(q[0], kc, vc, cu_seqlens_q=torch.tensor([0, 1, 1], **i32))
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
        with pytest.raises(ValueError, match=r"cache_seqlens=\[3, 9\]"):  # 9 + 2 new > 10 rows
            triflash.flash_attn_with_kvcache(q, kc, vc, k=kn[0].expand(3, 2, 32), v=kn[0].expand(3, 2, 32),
                                             cache_seqlens=torch.tensor([3, 9], **i32),
                                             cu_seqlens_k_new=torch.tensor([0, 1, 3], **i32))
        with pytest.raises(ValueError, match=r"cache_seqlens=\[3, 10\]"):
            triflash.flash_attn_with_kvcache(q, kc, vc, k=kn, v=kn,
                                             cache_seqlens=torch.tensor([3, 10], dtype=torch.int32, device=DEVICE))
        with pytest.raises(ValueError, match="cache_batch_idx"):
            triflash.flash_attn_with_kvcache(q, kc, vc, cache_batch_idx=torch.tensor([0, 2], **i32))
        with pytest.raises(ValueError, match="cache_leftpad"):
            triflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=2, cache_leftpad=torch.tensor([0, 3], **i32))
        with pytest.raises(ValueError, match="page_table"):
            triflash.flash_attn_with_kvcache(q, kc, vc, page_table=torch.tensor([[0], [2]], **i32))
        with pytest.raises(ValueError, match=r"cache_batch_idx=\[0, 2\].*page_table rows"):
            triflash.flash_attn_with_kvcache(q, kc, vc, page_table=torch.zeros(2, 1, **i32),
                                             cache_batch_idx=torch.tensor([0, 2], **i32))
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


# ---- the KV cache's other forms: paged, cache_batch_idx, cache_leftpad, rotary, varlen q ----

def _rotate_ref(x, cos, sin, offsets, interleaved, same_position=False):
    """FlashAttention's reference rotation (rotate_half form), one sequence at a time, fp32."""
    out = x.clone()
    rot = 2 * cos.shape[1]
    for b in range(x.shape[0]):
        for i in range(x.shape[1]):
            p = int(offsets[b]) + (0 if same_position else i)
            if rot == 0 or p >= cos.shape[0]:
                continue
            c, s_ = cos[p].float(), sin[p].float()
            c = c.repeat_interleave(2) if interleaved else torch.cat([c, c])
            s_ = s_.repeat_interleave(2) if interleaved else torch.cat([s_, s_])
            xr = x[b, i, :, :rot].float()
            if interleaved:
                half = torch.stack((-xr[..., 1::2], xr[..., 0::2]), dim=-1).flatten(-2)
            else:
                half = torch.cat((-xr[..., rot // 2:], xr[..., :rot // 2]), dim=-1)
            out[b, i, :, :rot] = (xr * c + half * s_).to(x.dtype)
    return out


SCENARIOS = {
    # name: page_size (None: dense), batch_idx, leftpad, rotary fraction, interleaved, varlen q, mask
    "paged-1": (1, False, False, 0.0, False, False, "causal"),
    "paged-16-leftpad": (16, False, True, 0.0, False, False, "causal"),
    "paged-8-rotary": (8, False, False, 1.0, True, False, "window"),
    "batch-idx": (None, True, False, 0.0, False, False, "none"),
    "batch-idx-leftpad-rotary": (None, True, True, 0.5, False, False, "causal"),
    "leftpad": (None, False, True, 0.0, False, False, "window"),
    "rotary-neox-noncausal": (None, False, False, 0.5, False, False, "none"),
    "rotary-gptj-causal": (None, False, False, 1.0, True, False, "causal"),
    "varlen-q": (None, False, False, 0.0, False, True, "causal"),
    "varlen-q-paged-rotary": (4, False, True, 0.5, True, True, "causal"),
    "varlen-q-batch-idx": (None, True, False, 0.0, False, True, "none"),
    # 40 query tokens x 2 heads per KV head: prefill over the cache (the portable forward)
    "paged-16-leftpad-prefill": (16, False, True, 0.0, False, False, "causal"),
    "batch-idx-rotary-prefill": (None, True, False, 1.0, False, False, "window"),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_kvcache_forms(scenario, dtype):
    """Each form against the reference built the way FlashAttention-3's test builds it: the
    logical cache of sequence b (its pages in order / its cache_batch_idx row), the rotated
    new keys written at cache_seqlens, attention of the rotated q over keys cache_leftpad ..
    cache_seqlens + seqlen_new - 1."""
    page, use_idx, use_leftpad, rot_frac, interleaved, varlen, mask = SCENARIOS[scenario]
    causal, window, _ = MASKS[mask]
    torch.manual_seed(hash(scenario) % 1000)
    batch, h, hk, d, cap, sq, sn = 3, 4, 2, 64, 48, 4, 3
    if scenario.endswith("-prefill"):
        sq = 40
    kw = dict(dtype=dtype)
    rot = int(rot_frac * d) // 16 * 16
    q = _rand(batch, sq, h, d, **kw)
    k_new, v_new = _rand(batch, sn, hk, d, **kw), _rand(batch, sn, hk, d, **kw)
    i32 = dict(dtype=torch.int32, device=DEVICE)
    seqlens = torch.tensor([0, 17, cap - sn], **i32)
    leftpad = torch.tensor([0, 5, 30], **i32) if use_leftpad else None
    if page:
        pages = cap // page
        num_blocks = batch * pages * 2
        k_blocks, v_blocks = _rand(num_blocks, page, hk, d, **kw), _rand(num_blocks, page, hk, d, **kw)
        table = torch.randperm(num_blocks, device=DEVICE)[:batch * pages].to(torch.int32).view(batch, pages)
        k_cache, v_cache, idx = k_blocks, v_blocks, None

        def logical(blocks):
            return blocks[table.long()].reshape(batch, cap, hk, d)
    else:
        table = None
        cache_batch = batch + 2 if use_idx else batch
        k_cache, v_cache = _rand(cache_batch, cap, hk, d, **kw), _rand(cache_batch, cap, hk, d, **kw)
        idx = torch.tensor([2, 0, 4], **i32) if use_idx else None

        def logical(c):
            return c[idx.long()] if idx is not None else c.clone()
    cos = sin = None
    if rot:
        angle = torch.rand(cap + sq, rot // 2, device=DEVICE) * 6.283
        cos, sin = torch.cos(angle).to(dtype), torch.sin(angle).to(dtype)
    # the reference: logical caches updated with the (rotated) new keys
    k_ref, v_ref = logical(k_cache), logical(v_cache)
    k_rot = _rotate_ref(k_new, cos, sin, seqlens, interleaved) if rot else k_new
    q_rot = _rotate_ref(q, cos, sin, seqlens, interleaved, same_position=not (causal or window != (-1, -1))) if rot else q
    for b in range(batch):
        s0 = int(seqlens[b])
        k_ref[b, s0:s0 + sn], v_ref[b, s0:s0 + sn] = k_rot[b], v_new[b]
    if varlen:
        lens = [4, 1, 3]
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), **i32)
        q_in = torch.cat([q[b, :n] for b, n in enumerate(lens)])
    else:
        lens, cu, q_in = [sq] * batch, None, q
    out, lse, *_ = triflash.flash_attn_with_kvcache(
        q_in, k_cache, v_cache, k_new, v_new, rotary_cos=cos, rotary_sin=sin, cache_seqlens=seqlens,
        cache_batch_idx=idx, cache_leftpad=leftpad, page_table=table, cu_seqlens_q=cu,
        max_seqlen_q=max(lens) if varlen else None, causal=causal, window_size=window,
        rotary_interleaved=interleaved, return_softmax_lse=True)
    # the caches were written in place, in the logical order
    assert torch.allclose(logical(k_cache).float(), k_ref.float(), atol=1e-2 if rot else 0, rtol=0)
    assert torch.equal(logical(v_cache), v_ref)
    assert out.shape == q_in.shape and lse.shape == ((h, q_in.shape[0]) if varlen else (batch, h, sq))
    for b in range(batch):
        start, end, n = int(leftpad[b]) if leftpad is not None else 0, int(seqlens[b]) + sn, lens[b]
        qb = q_rot[b:b + 1, :n]
        kb, vb = k_ref[b:b + 1, start:end], v_ref[b:b + 1, start:end]
        ref, lse_ref = attention_ref(qb, kb, vb, causal=causal, window_size=window)
        lowp, _ = attention_ref(qb, kb, vb, causal=causal, window_size=window, upcast=False)
        if varlen:
            o, l_ = out[int(cu[b]):int(cu[b + 1])][None], lse[:, int(cu[b]):int(cu[b + 1])][None]
        else:
            o, l_ = out[b:b + 1], lse[b:b + 1]
        assert_forward_matches(o, l_, ref, lse_ref, lowp)


def test_rotary_matches_the_reference_form():
    """triflash.rotary (pair formulas) against the rotate_half form, both layouts, positions
    past the tables left unrotated."""
    from triflash.rotary import apply_rotary, token_positions
    torch.manual_seed(0)
    x = torch.randn(2, 5, 3, 64, device=DEVICE, dtype=torch.bfloat16)
    cos, sin = torch.randn(6, 16, device=DEVICE), torch.randn(6, 16, device=DEVICE)
    offsets = torch.tensor([0, 3], dtype=torch.int32, device=DEVICE)
    cu = torch.tensor([0, 5, 10], dtype=torch.int32, device=DEVICE)
    for interleaved in (False, True):
        for same in (False, True):
            got = apply_rotary(x, cos, sin, token_positions(offsets, 5, same), interleaved)
            want = _rotate_ref(x, cos, sin, offsets, interleaved, same_position=same)
            assert torch.allclose(got.float(), want.float(), atol=1e-2, rtol=0)
            assert torch.equal(got[..., 32:], x[..., 32:])
            # packed tokens take their sequence's positions
            packed = apply_rotary(x.flatten(0, 1), cos, sin, token_positions(offsets, 5, same, cu, 10), interleaved)
            assert torch.equal(packed, got.flatten(0, 1))


def test_scheduler_metadata_passes_through():
    """FA3's get_scheduler_metadata exists (serving engines call it) and its result is
    accepted by flash_attn_with_kvcache."""
    q = _rand(2, 1, 2, 32, dtype=torch.float16)
    kc, vc = _rand(2, 10, 2, 32, dtype=torch.float16), _rand(2, 10, 2, 32, dtype=torch.float16)
    seqlens = torch.tensor([3, 10], dtype=torch.int32, device=DEVICE)
    md = triflash.get_scheduler_metadata(2, 1, 10, 2, 2, 32, seqlens, qkv_dtype=torch.float16)
    out = triflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, scheduler_metadata=md)
    ref = triflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("num_splits", [1, 3, 17])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_flash_attn_combine(num_splits, dtype):
    """FA3's combine of split attention against the reference formula, on non-contiguous
    inputs, with whole rows whose splits all saw nothing (out 0, lse -inf) and half the
    splits empty for the first sequence."""
    torch.manual_seed(num_splits)
    b, s, h, d = 3, 7, 4, 40
    out_p = torch.randn(num_splits * 2, b, h, s, d, device=DEVICE).transpose(2, 3)[:num_splits]
    lse_p = torch.randn(num_splits, b, h * 2, s, device=DEVICE).transpose(-1, -2)[:, :, :, :h]
    lse_p[num_splits // 2:, :1] = float("-inf")
    lse_p[:, 2, 3] = float("-inf")
    out, lse = triflash.flash_attn_combine(out_p, lse_p, out_dtype=dtype)
    lse_ref = torch.logsumexp(lse_p, dim=0)
    w = torch.exp(lse_p - lse_ref)
    w = torch.where(w.isnan() | w.isinf(), 0.0, w)
    out_ref = (w.unsqueeze(-1) * out_p).sum(0)
    assert out.dtype == dtype and out.shape == (b, s, h, d) and lse.shape == (b, s, h)
    assert torch.allclose(lse, lse_ref, atol=1e-5, rtol=1e-5)
    assert (out.float() - out_ref).abs().max() <= 2 * (out_ref.to(dtype).float() - out_ref).abs().max() + 1e-5
    assert torch.isneginf(lse[2, 3]).all() and (out[2, 3] == 0).all()
    dest = torch.empty(b, s, h, d, device=DEVICE, dtype=dtype)
    assert triflash.flash_attn_combine(out_p, lse_p, out=dest, return_lse=False) is dest
    assert torch.equal(dest, out)
    with pytest.raises(TypeError, match="out_partial"):
        triflash.flash_attn_combine(out_p.half(), lse_p)
    with pytest.raises(ValueError, match="lse_partial.shape"):
        triflash.flash_attn_combine(out_p, lse_p[..., :2])


@pytest.mark.parametrize("page", [None, 4])
@pytest.mark.parametrize("rotary", [False, True])
def test_varlen_append(page, rotary):
    """FA3's varlen append (``cu_seqlens_k_new``): sequence b's new tokens, rows
    cu[b] .. cu[b + 1] - 1 of packed k/v, land at its cache_seqlens[b] (rotated at those
    positions) exactly as the same tokens given densely would, and attention covers them."""
    torch.manual_seed(7)
    batch, cap, h, hk, d = 3, 40, 4, 2, 32
    new_lens = [2, 0, 5]
    cu = torch.tensor([0, 2, 2, 7], dtype=torch.int32, device=DEVICE)
    seqlens = torch.tensor([10, 3, 35], dtype=torch.int32, device=DEVICE)
    k_new, v_new = _rand(7, hk, d, dtype=torch.float16), _rand(7, hk, d, dtype=torch.float16)
    q = _rand(batch, 1, h, d, dtype=torch.float16)
    cos = sin = None
    if rotary:
        angle = torch.rand(cap, d // 4, device=DEVICE) * 6.283
        cos, sin = torch.cos(angle).half(), torch.sin(angle).half()
    if page:
        k_cache, v_cache = _rand(batch * cap // page, page, hk, d, dtype=torch.float16), _rand(batch * cap // page, page, hk, d, dtype=torch.float16)
        table = torch.randperm(batch * cap // page, device=DEVICE).to(torch.int32).view(batch, cap // page)
    else:
        k_cache, v_cache = _rand(batch, cap, hk, d, dtype=torch.float16), _rand(batch, cap, hk, d, dtype=torch.float16)
        table = None
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    out, lse, *_ = triflash.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, rotary_cos=cos, rotary_sin=sin,
                                                cache_seqlens=seqlens, page_table=table, cu_seqlens_k_new=cu,
                                                causal=True, return_softmax_lse=True)
    # the same tokens, one sequence at a time, through the dense form
    for b in range(batch):
        n, s = new_lens[b], int(cu[b])
        if n == 0:
            continue
        triflash.flash_attn_with_kvcache(q[b:b + 1], k_ref, v_ref, k_new[None, s:s + n], v_new[None, s:s + n],
                                         rotary_cos=cos, rotary_sin=sin, cache_seqlens=seqlens[b:b + 1],
                                         page_table=table[b:b + 1] if table is not None else None,
                                         cache_batch_idx=None if table is not None else torch.tensor([b], dtype=torch.int32, device=DEVICE),
                                         causal=True)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    logical_k = k_cache[table.long()].reshape(batch, cap, hk, d) if page else k_cache
    logical_v = v_cache[table.long()].reshape(batch, cap, hk, d) if page else v_cache
    for b in range(batch):
        n = int(seqlens[b]) + new_lens[b]
        qb = q[b:b + 1]
        if rotary:  # q (causal) rotated as FA3 does: token i at cache_seqlens[b] + i
            qb = _rotate_ref(qb, cos, sin, seqlens[b:b + 1], True)
        ref, lse_ref = attention_ref(qb, logical_k[b:b + 1, :n], logical_v[b:b + 1, :n], causal=True)
        lowp, _ = attention_ref(qb, logical_k[b:b + 1, :n], logical_v[b:b + 1, :n], causal=True, upcast=False)
        assert_forward_matches(out[b:b + 1], lse[b:b + 1], ref, lse_ref, lowp)
