"""FlashAttention-3's forward-only extras, against the fp32 reference (FA3's tolerance rule):

* ``attention_chunk`` C > 0 (chunked local attention, Llama 4): query i, at bottom-right
  aligned position p = i + seqlen_k - seqlen_q, sees only keys floor(p / C) * C ..
  floor(p / C) * C + C - 1, intersected with causal / window (FA3's ``construct_chunk_mask``);
  rows whose position is negative see no key. Dense, varlen, qkvpacked and KV-cache calls
  (the decode kernel and the portable forward), chunks smaller and larger than a tile;
* ``qv`` (MLA's absorbed form): scores q k^T + qv v^T, default scale (d + dv) ** -0.5;
* headdim_v up to 512 (FA3's headdim 64 / headdim_v 512);
* each of them raises in the backward, as FA3's asserts.
"""
import pytest
import torch

import triflash
from triflash.testing import assert_forward_matches, attention_ref, attention_varlen_ref, reversed_pages

from conftest import DEVICE, sm90_compile_in_subprocess

ON_GPU = DEVICE == "cuda"
SCALE = 8 if ON_GPU else 1


def rnd(*shape, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(DEVICE, dtype)


def check(out, lse, q, k, v, **kw):
    """FA3's forward checks of one dense call against ``attention_ref``."""
    out_ref, lse_ref = attention_ref(q, k, v, upcast=True, **kw)
    out_lowp, _ = attention_ref(q, k, v, upcast=False, **kw)
    assert out.shape == out_ref.shape and lse.shape == lse_ref.shape
    assert_forward_matches(out, lse, out_ref, lse_ref, out_lowp)


# (seqlen_q, seqlen_k, causal, window, chunk)
CHUNKS = [
    (113, 203, True, (-1, -1), 16),
    (113, 203, False, (-1, -1), 40),
    (239, 1, False, (-1, -1), 7),      # more queries than keys: negative positions see nothing
    (217, 113, True, (-1, -1), 64),
    (64, 128, False, (17, 5), 32),     # a window inside the chunks
    (1, 239, True, (-1, -1), 100),
    (128, 128, True, (-1, -1), 1),
    (77, 300, False, (-1, -1), 4096),  # a chunk longer than the keys
]


@pytest.mark.parametrize("sq,sk,causal,window,chunk", CHUNKS)
def test_chunk_dense(sq, sk, causal, window, chunk):
    b, h, hk, d = 2, 4, 2, 64
    q, k, v = rnd(b, sq * SCALE, h, d, seed=1), rnd(b, sk * SCALE, hk, d, seed=2), rnd(b, sk * SCALE, hk, d, seed=3)
    kw = dict(causal=causal, window_size=window, attention_chunk=chunk)
    out, lse = triflash.flash_attn_func(q, k, v, return_attn_probs=True, **kw)
    check(out, lse, q, k, v, **kw)


def test_chunk_varlen_and_seqused():
    h, hk, d, chunk = 4, 1, 40, 24
    lens_q, lens_k = [37, 1, 90, 0], [64, 50, 90, 11]
    cu_q = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    seqused_k = torch.tensor([60, 50, 45, 11], dtype=torch.int32, device=DEVICE)
    q, k, v = rnd(sum(lens_q), h, d, seed=4), rnd(sum(lens_k), hk, d, seed=5), rnd(sum(lens_k), hk, d, seed=6)
    kw = dict(causal=True, attention_chunk=chunk)
    out, lse = triflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), seqused_k=seqused_k,
                                               return_attn_probs=True, **kw)
    out_ref, lse_ref = attention_varlen_ref(q, k, v, cu_q, cu_k, seqused_k=seqused_k, upcast=True, **kw)
    out_lowp, _ = attention_varlen_ref(q, k, v, cu_q, cu_k, seqused_k=seqused_k, upcast=False, **kw)
    assert_forward_matches(out, lse, out_ref, lse_ref, out_lowp)


def test_chunk_varlen_decoding_step():
    # a serving engine's decoding call (packed queries over a dense batch of caches with
    # seqused_k): the decode kernel, chunked
    h, hk, d, cap, chunk = 8, 2, 64, 150, 32
    cu = torch.tensor([0, 2, 3, 5], dtype=torch.int32, device=DEVICE)
    used = torch.tensor([150, 33, 64], dtype=torch.int32, device=DEVICE)
    q, k, v = rnd(5, h, d, seed=33), rnd(3, cap, hk, d, seed=34), rnd(3, cap, hk, d, seed=35)
    out, lse = triflash.flash_attn_varlen_func(q, k, v, cu, None, 2, None, seqused_k=used, causal=True,
                                               attention_chunk=chunk, num_splits=0, return_attn_probs=True)
    for b in range(3):
        s = slice(int(cu[b]), int(cu[b + 1]))
        check(out[None, s], lse[None, :, s], q[None, s], k[b:b + 1, :int(used[b])], v[b:b + 1, :int(used[b])],
              causal=True, attention_chunk=chunk)


def test_chunk_qkvpacked():
    qkv = rnd(2, 97, 3, 2, 64, seed=7)
    out, lse = triflash.flash_attn_qkvpacked_func(qkv, causal=True, attention_chunk=32, return_attn_probs=True)
    q, k, v = qkv.unbind(2)
    check(out, lse, q, k, v, causal=True, attention_chunk=32)


def _cache_ref(q, k_cache, v_cache, lens, starts, **kw):
    """Per sequence: attention over its cache rows starts[b] .. lens[b] - 1."""
    outs, lses = [], []
    for b in range(q.shape[0]):
        kb, vb = k_cache[b:b + 1, starts[b]:lens[b]], v_cache[b:b + 1, starts[b]:lens[b]]
        o, l = attention_ref(q[b:b + 1], kb, vb, **kw)
        outs.append(o)
        lses.append(l)
    return torch.cat(outs), torch.cat(lses)


@pytest.mark.parametrize("seqlen_q", [1, 4, 40])
@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_chunk_kvcache(seqlen_q, paged):
    # seqlen_q x group <= 64 rows: the decode kernel; 40 x 4: the portable forward
    b, h, hk, d, cap, chunk, page = 3, 8, 2, 64, 192 * SCALE, 48, 16
    lens = [cap, 77, 150 * SCALE]
    starts = [0, 5, 20]
    q = rnd(b, seqlen_q, h, d, seed=8)
    k_cache, v_cache = rnd(b, cap, hk, d, seed=9), rnd(b, cap, hk, d, seed=10)
    kw = dict(cache_seqlens=torch.tensor(lens, dtype=torch.int32, device=DEVICE),
              cache_leftpad=torch.tensor(starts, dtype=torch.int32, device=DEVICE))
    kc, vc = k_cache, v_cache
    if paged:  # the same rows, pages in reverse order
        kc, vc, kw["page_table"] = reversed_pages(k_cache, v_cache, page)
    for causal in (True, False):
        out, lse, *_ = triflash.flash_attn_with_kvcache(q, kc, vc, causal=causal, attention_chunk=chunk,
                                                        return_softmax_lse=True, num_splits=3 if seqlen_q == 1 else 0,
                                                        **kw)
        out_ref, lse_ref = _cache_ref(q, k_cache, v_cache, lens, starts, causal=causal, attention_chunk=chunk)
        out_lowp, _ = _cache_ref(q, k_cache, v_cache, lens, starts, causal=causal, attention_chunk=chunk,
                                 upcast=False)
        assert_forward_matches(out, lse, out_ref, lse_ref, out_lowp)


def test_chunk_kvcache_dense_prefill():
    # a plain dense cache and a long query: the forward over the cache (not the decode kernel)
    q, k_cache, v_cache = rnd(2, 90, 4, 64, seed=11), rnd(2, 200, 4, 64, seed=12), rnd(2, 200, 4, 64, seed=13)
    out, lse, *_ = triflash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=150, causal=True,
                                                    attention_chunk=64, return_softmax_lse=True)
    check(out, lse, q, k_cache[:, :150], v_cache[:, :150], causal=True, attention_chunk=64)


@pytest.mark.parametrize("dv", [256, 512])
@pytest.mark.parametrize("causal", [False, True])
def test_qv_dense(dv, causal):
    b, sq, sk, h, hk, d = 2, 57 * SCALE, 131 * SCALE, 4, 1, 64
    q, k, v = rnd(b, sq, h, d, seed=14), rnd(b, sk, hk, d, seed=15), rnd(b, sk, hk, dv, seed=16)
    qv = rnd(b, sq, h, dv, seed=17)
    out, lse = triflash.flash_attn_func(q, k, v, qv=qv, causal=causal, return_attn_probs=True)
    check(out, lse, q, k, v, qv=qv, causal=causal)


def test_qv_varlen():
    h, hk, d, dv = 4, 2, 64, 256
    lens = [33, 70, 5]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    q, k, v = rnd(sum(lens), h, d, seed=18), rnd(sum(lens), hk, d, seed=19), rnd(sum(lens), hk, dv, seed=20)
    qv = rnd(sum(lens), h, dv, seed=21)
    out, lse = triflash.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), qv=qv, causal=True,
                                               return_attn_probs=True)
    for i in range(len(lens)):
        s = slice(cu[i], cu[i + 1])
        check(out[None, s], lse[None, :, s], q[None, s], k[None, s], v[None, s], qv=qv[None, s], causal=True)


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_qv_kvcache_mla_decode(paged):
    # MLA's absorbed decode as FA3 takes it: 64-wide rope keys, a 512-wide latent as values
    b, h, d, dv, cap, page = 2, 16, 64, 512, 96 * SCALE, 32
    lens = [cap - 3, 40]
    q, qv = rnd(b, 1, h, d, seed=22), rnd(b, 1, h, dv, seed=23)
    k_cache, v_cache = rnd(b, cap, 1, d, seed=24), rnd(b, cap, 1, dv, seed=25)
    kw = dict(cache_seqlens=torch.tensor(lens, dtype=torch.int32, device=DEVICE))
    kc, vc = k_cache, v_cache
    if paged:
        kc, vc = k_cache.reshape(-1, page, 1, d), v_cache.reshape(-1, page, 1, dv)
        kw["page_table"] = torch.arange(b * cap // page, dtype=torch.int32, device=DEVICE).reshape(b, -1)
    out, lse, *_ = triflash.flash_attn_with_kvcache(q, kc, vc, qv=qv, causal=True, return_softmax_lse=True, **kw)
    for i in range(b):
        check(out[i:i + 1], lse[i:i + 1], q[i:i + 1], k_cache[i:i + 1, :lens[i]], v_cache[i:i + 1, :lens[i]],
              qv=qv[i:i + 1], causal=True)


def test_headdim_v_512_forward_only():
    q, k, v = rnd(1, 45, 2, 64, seed=26), rnd(1, 70, 2, 64, seed=27), rnd(1, 70, 2, 512, seed=28)
    out, lse = triflash.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    check(out, lse, q, k, v, causal=True)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    with pytest.raises(NotImplementedError, match="headdim_v=512"):
        triflash.flash_attn_func(q, k, v).sum().backward()
    with pytest.raises(ValueError, match="v head dim=520"):
        triflash.flash_attn_func(q, k, rnd(1, 70, 2, 520))


@pytest.mark.parametrize("kwargs", [dict(attention_chunk=16), dict(qv=True)], ids=["chunk", "qv"])
def test_extras_raise_in_backward(kwargs):
    q, k, v = rnd(1, 40, 2, 64, seed=29), rnd(1, 40, 2, 64, seed=30), rnd(1, 40, 2, 64, seed=31)
    if "qv" in kwargs:
        kwargs = dict(qv=rnd(1, 40, 2, 64, seed=32))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = triflash.flash_attn_func(q, k, v, causal=True, **kwargs)
    with pytest.raises(NotImplementedError, match="forward-only"):
        out.sum().backward()


_COMPILE = """
import json, sys, torch
from tools import sm90_report as R
from triflash.kernels import configs, portable, problem
d, dv, qv, chunk, s, h = {args}
meta = dict(device="meta", dtype=torch.bfloat16)
q, k, v = torch.empty(1, s, h, d, **meta), torch.empty(1, s, 2, d, **meta), torch.empty(1, s, 2, dv, **meta)
p = problem.AttnParams(softmax_scale=0.1, window_left=-1, window_right=0, softcap=0.0, max_seqlen_q=s,
                       max_seqlen_k=s, chunk=chunk)
with R._recording() as log:
    portable.fwd(q, k, v, None, None, None, None, p, configs.fwd_config("sm90", d, dv), upcast=False,
                 qv=torch.empty(1, s, h, dv, **meta) if qv else None)
[(fn, args, kwargs)] = log
m = args[-1]
assert (m.HAS_CHUNK, m.HAS_QV, m.WIDE_ROWS) == (chunk > 0, qv, s * h * d >= 2 ** 31), m
signature, constexprs, attrs, options = R._specialize(fn, args, kwargs)
r = R._compile_spec(dict(module=fn.fn.__module__, name=fn.__name__, signature=signature,
                         constexprs=sorted(constexprs.items()), attrs=sorted(attrs.items()), options=options))
print(json.dumps(dict(shared=r["shared"], spills=r["spill_stores"] + r["spill_loads"])))
"""


@pytest.mark.sm90
@pytest.mark.parametrize("args", [(128, 128, False, 1024, 4096, 16), (64, 512, True, 1024, 4096, 16),
                                  (128, 128, False, 0, 131073, 128)],
                         ids=["chunk-d128", "qv-chunk-d64v512", "wide-rows-d128"])
def test_extras_forward_fits_sm90(args):
    """The portable forward's launches with the extras, and with 64-bit rows (a sequence of
    131073 x 128 heads x 128: ``portable.wide_rows``), compile for sm_90a within Hopper's
    shared memory (the decode kernel's forms with the extras: tools/decode_compile.py EXTRAS)."""
    r = sm90_compile_in_subprocess(_COMPILE.format(args=args))
    assert r["shared"] <= 232448, r
