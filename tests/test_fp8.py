"""FlashAttention-3's fp8 forward (float8_e4m3fn q, k, v; bf16 output), against the fp32
reference on the dequantized inputs:

* scores q k^T x q_descale x k_descale x softmax_scale, output P v x v_descale, the
  descales float32 (batch, nheads_kv) tensors, per sequence and KV head (any strides, e.g.
  serving engines' expanded scalars), None meaning 1;
* dense, varlen (descales per sequence), qkvpacked and KV-cache calls (the decode kernel,
  split or not, dense and paged caches, fp8 appends with and without rotary, the forward
  over a cache for longer queries);
* the backward raises, as FA3's; bad descales, fp8 with qv and mixed dtypes are refused.

The low-precision comparison ("the same computation in the input dtype", FA3's tolerance
rule) is the reference in bf16 on the dequantized inputs rounded to bf16, as FA3's tests
round ``x * descale``; the kernels compute in fp16 on the exact fp8 values.
"""
import pytest
import torch

import triflash
from triflash.testing import assert_forward_matches, attention_ref, reversed_pages

from conftest import DEVICE, sm90_compile_in_subprocess

ON_GPU = DEVICE == "cuda"
SCALE = 8 if ON_GPU else 1
F8 = torch.float8_e4m3fn


def rnd8(*shape, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(F8).to(DEVICE)


def descales(batch, hk, seed):
    g = torch.Generator().manual_seed(seed)
    return [(torch.rand(batch, hk, generator=g) * 2 + 0.05).to(DEVICE) for _ in range(3)]


def deq(x, d, group=1):
    """x (b, s, h, dim) fp8 times its (b, h_kv) descale, fp32 (``group`` query heads per KV head)."""
    if d is None:
        return x.float()
    return x.float() * d.repeat_interleave(group, dim=1)[:, None, :, None].float()


def check(out, lse, q, k, v, qd, kd, vd, **kw):
    """FA3's forward checks of one dense fp8 call against the dequantized reference."""
    group = q.shape[2] // k.shape[2]
    qf, kf, vf = deq(q, qd, group), deq(k, kd), deq(v, vd)
    out_ref, lse_ref = attention_ref(qf, kf, vf, upcast=True, **kw)
    out_lowp, _ = attention_ref(qf.bfloat16(), kf.bfloat16(), vf.bfloat16(), upcast=False, **kw)
    assert out.dtype == torch.bfloat16 and out.shape == out_ref.shape and lse.shape == lse_ref.shape
    assert_forward_matches(out, lse, out_ref, lse_ref, out_lowp, softcap=kw.get("softcap", 0.0))


CASES = [  # (seqlen_q, seqlen_k, d, causal, window, softcap)
    (113, 203, 64, False, (-1, -1), 0.0),
    (113, 203, 64, True, (-1, -1), 0.0),
    (239, 1, 128, False, (-1, -1), 0.0),
    (64, 128, 128, True, (-1, -1), 0.0),
    (77, 150, 40, False, (20, 7), 0.0),
    (128, 97, 64, True, (-1, -1), 15.0),
    (1, 239, 256, True, (-1, -1), 0.0),
]


@pytest.mark.parametrize("sq,sk,d,causal,window,softcap", CASES)
@pytest.mark.parametrize("hk", [4, 1], ids=["mha", "mqa"])
def test_fp8_dense(sq, sk, d, causal, window, softcap, hk):
    b, h = 2, 4
    q = rnd8(b, sq * SCALE, h, d, seed=1, scale=softcap / 4 if softcap else 1.0)
    k, v = rnd8(b, sk * SCALE, hk, d, seed=2), rnd8(b, sk * SCALE, hk, d, seed=3)
    qd, kd, vd = descales(b, hk, seed=4)
    kw = dict(causal=causal, window_size=window, softcap=softcap)
    out, lse = triflash.flash_attn_func(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd,
                                        return_attn_probs=True, **kw)
    check(out, lse, q, k, v, qd, kd, vd, **kw)


def test_fp8_descale_forms():
    # None is 1; an expanded scalar (stride 0, vLLM's form) and a transposed view read by strides
    b, sq, sk, h, hk, d = 3, 45, 70, 4, 2, 64
    q, k, v = rnd8(b, sq, h, d, seed=5), rnd8(b, sk, hk, d, seed=6), rnd8(b, sk, hk, d, seed=7)
    out, lse = triflash.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    check(out, lse, q, k, v, None, None, None, causal=True)
    qd = torch.tensor(0.5, device=DEVICE).expand(b, hk)
    kd = (torch.rand(hk, b) + 0.5).to(DEVICE).t()
    out, lse = triflash.flash_attn_func(q, k, v, causal=True, q_descale=qd, k_descale=kd, return_attn_probs=True)
    check(out, lse, q, k, v, qd, kd, None, causal=True)
    # the descales change the result (the kernel reads them)
    vd = torch.full((b, hk), 2.0, device=DEVICE)
    out2 = triflash.flash_attn_func(q, k, v, causal=True, q_descale=qd, k_descale=kd, v_descale=vd)
    torch.testing.assert_close(out2.float(), 2 * out.float(), rtol=1e-2, atol=1e-2)


def test_fp8_requires_grad_forward_then_backward_raises():
    # FA3's tests build fp8 leaves that require grad and run the forward only
    q, k, v = (rnd8(1, 40, 2, 64, seed=s).requires_grad_() for s in (8, 9, 10))
    out = triflash.flash_attn_func(q, k, v, causal=True)
    assert out.dtype == torch.bfloat16 and out.requires_grad
    with pytest.raises(NotImplementedError, match="fp8"):
        out.float().sum().backward()


def test_fp8_varlen():
    h, hk, d = 4, 2, 64
    lens_q, lens_k = [37, 1, 90 * SCALE, 0], [64, 50, 90 * SCALE, 11]
    cu_q = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    q, k, v = rnd8(sum(lens_q), h, d, seed=11), rnd8(sum(lens_k), hk, d, seed=12), rnd8(sum(lens_k), hk, d, seed=13)
    qd, kd, vd = descales(len(lens_q), hk, seed=14)
    out, lse = triflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                               q_descale=qd, k_descale=kd, v_descale=vd, return_attn_probs=True)
    assert out.dtype == torch.bfloat16
    for b in range(len(lens_q)):
        sq, sk = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        if lens_q[b] == 0:
            continue
        check(out[None, sq], lse[None, :, sq], q[None, sq], k[None, sk], v[None, sk], qd[b:b + 1], kd[b:b + 1],
              vd[b:b + 1], causal=True)


def test_fp8_qkvpacked():
    qkv = rnd8(2, 97, 3, 2, 64, seed=15)
    qd, kd, vd = descales(2, 2, seed=16)
    out, lse = triflash.flash_attn_qkvpacked_func(qkv, causal=True, q_descale=qd, k_descale=kd, v_descale=vd,
                                                  return_attn_probs=True)
    q, k, v = qkv.unbind(2)
    check(out, lse, q, k, v, qd, kd, vd, causal=True)


def _cache_check(out, lse, q, k_cache, v_cache, lens, qd, kd, vd, **kw):
    for b in range(q.shape[0]):
        one = [d[b:b + 1] if d is not None else None for d in (qd, kd, vd)]
        check(out[b:b + 1], lse[b:b + 1], q[b:b + 1], k_cache[b:b + 1, :lens[b]], v_cache[b:b + 1, :lens[b]],
              *one, **kw)


@pytest.mark.parametrize("seqlen_q", [1, 4, 40])
@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_fp8_kvcache(seqlen_q, paged):
    # seqlen_q x group <= 64 rows: the decode kernel (split with num_splits=3); 40 x 4 rows: the
    # portable forward over the cache
    b, h, hk, d, cap, page = 3, 8, 2, 128, 192 * SCALE, 16
    lens = [cap, 77, 150 * SCALE]
    q = rnd8(b, seqlen_q, h, d, seed=17)
    k_cache, v_cache = rnd8(b, cap, hk, d, seed=18), rnd8(b, cap, hk, d, seed=19)
    qd, kd, vd = descales(b, hk, seed=20)
    kw = dict(cache_seqlens=torch.tensor(lens, dtype=torch.int32, device=DEVICE))
    kc, vc = k_cache, v_cache
    if paged:  # the same rows, pages in reverse order
        kc, vc, kw["page_table"] = reversed_pages(k_cache, v_cache, page)
    for causal, splits in ((True, 3), (False, 0)):
        out, lse, *_ = triflash.flash_attn_with_kvcache(q, kc, vc, causal=causal, q_descale=qd, k_descale=kd,
                                                        v_descale=vd, num_splits=splits, return_softmax_lse=True,
                                                        **kw)
        _cache_check(out, lse, q, k_cache, v_cache, lens, qd, kd, vd, causal=causal)


@pytest.mark.parametrize("rotary", [False, True], ids=["plain", "rotary"])
def test_fp8_kvcache_append(rotary):
    # new fp8 keys written into an fp8 cache (as given, or rotated in fp32 and rounded to
    # fp8), then a decoding step over it
    b, h, hk, d, cap, new = 2, 4, 2, 64, 96 * SCALE, 3
    k_cache, v_cache = rnd8(b, cap, hk, d, seed=21), rnd8(b, cap, hk, d, seed=22)
    q, k, v = rnd8(b, new, h, d, seed=23), rnd8(b, new, hk, d, seed=24), rnd8(b, new, hk, d, seed=25)
    starts = [10, 50 * SCALE]
    seqlens = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
    kw = {}
    if rotary:
        g = torch.Generator().manual_seed(26)
        angle = torch.rand(cap, d // 4, generator=g) * 6.28
        kw = dict(rotary_cos=torch.cos(angle).to(F8).to(DEVICE), rotary_sin=torch.sin(angle).to(F8).to(DEVICE),
                  rotary_interleaved=False)
    kc, vc = k_cache.clone(), v_cache.clone()
    out, lse, *_ = triflash.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, causal=True,
                                                    return_softmax_lse=True, **kw)
    k_ref, v_ref, q_ref = k_cache.clone(), v_cache.clone(), q
    if rotary:  # GPT-NeoX halves at positions cache_seqlens + i, in fp32, rounded to fp8
        def rotate(x):
            pos = seqlens.long()[:, None] + torch.arange(new, device=DEVICE)[None, :]
            c, s = kw["rotary_cos"].float()[pos][:, :, None], kw["rotary_sin"].float()[pos][:, :, None]
            x1, x2, rest = x.float()[..., :d // 4], x.float()[..., d // 4:d // 2], x.float()[..., d // 2:]
            return torch.cat((x1 * c - x2 * s, x1 * s + x2 * c, rest), dim=-1).to(F8)
        k, q_ref = rotate(k), rotate(q)
    for i, s in enumerate(starts):
        k_ref[i, s:s + new], v_ref[i, s:s + new] = k[i], v[i]
    # the caches: every row as the reference writes it, the rest untouched (bitwise)
    assert torch.equal(kc.view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), v_ref.view(torch.uint8))
    _cache_check(out, lse, q_ref, k_ref, v_ref, [s + new for s in starts], None, None, None, causal=True)


def test_fp8_kvcache_dense_prefill():
    # a plain dense cache and a long query: the forward over the cache (portable on every target)
    q, k_cache, v_cache = rnd8(2, 90, 4, 64, seed=27), rnd8(2, 200, 4, 64, seed=28), rnd8(2, 200, 4, 64, seed=29)
    qd, kd, vd = descales(2, 4, seed=30)
    out, lse, *_ = triflash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=150, causal=True,
                                                    q_descale=qd, k_descale=kd, v_descale=vd,
                                                    return_softmax_lse=True)
    check(out, lse, q, k_cache[:, :150], v_cache[:, :150], qd, kd, vd, causal=True)


def test_fp8_varlen_decoding_step():
    # a serving engine's decoding call (packed queries over a dense batch of fp8 caches with
    # seqused_k, expanded descales): the decode kernel
    h, hk, d, cap = 8, 2, 64, 150
    cu = torch.tensor([0, 2, 3, 5], dtype=torch.int32, device=DEVICE)
    used = torch.tensor([150, 33, 64], dtype=torch.int32, device=DEVICE)
    q, k, v = rnd8(5, h, d, seed=31), rnd8(3, cap, hk, d, seed=32), rnd8(3, cap, hk, d, seed=33)
    qd = torch.tensor(0.7, device=DEVICE).expand(3, hk)
    kd, vd = torch.tensor(1.3, device=DEVICE).expand(3, hk), torch.tensor(0.4, device=DEVICE).expand(3, hk)
    out, lse = triflash.flash_attn_varlen_func(q, k, v, cu, None, 2, None, seqused_k=used, causal=True,
                                               q_descale=qd, k_descale=kd, v_descale=vd, num_splits=0,
                                               return_attn_probs=True)
    for b in range(3):
        s = slice(int(cu[b]), int(cu[b + 1]))
        check(out[None, s], lse[None, :, s], q[None, s], k[b:b + 1, :int(used[b])], v[b:b + 1, :int(used[b])],
              qd[b:b + 1], kd[b:b + 1], vd[b:b + 1], causal=True)


def test_fp8_refusals():
    q, k, v = rnd8(2, 16, 4, 64, seed=34), rnd8(2, 16, 2, 64, seed=35), rnd8(2, 16, 2, 64, seed=36)
    with pytest.raises(ValueError, match=r"q_descale=tensor\(2, 4\)"):
        triflash.flash_attn_func(q, k, v, q_descale=torch.ones(2, 4, device=DEVICE))
    with pytest.raises(ValueError, match="v_descale=.*float16"):
        triflash.flash_attn_func(q, k, v, v_descale=torch.ones(2, 2, dtype=torch.float16, device=DEVICE))
    with pytest.raises(TypeError, match="dtypes"):
        triflash.flash_attn_func(q, k.bfloat16(), v)
    with pytest.raises(TypeError, match="float8_e5m2"):
        triflash.flash_attn_func(q.to(torch.float8_e5m2), k.to(torch.float8_e5m2), v.to(torch.float8_e5m2))
    with pytest.raises(NotImplementedError, match="qv"):
        triflash.flash_attn_func(q, k, v, qv=rnd8(2, 16, 4, 64, seed=37))
    with pytest.raises(ValueError, match="v head dim=512"):
        triflash.flash_attn_func(q, k, rnd8(2, 16, 2, 512, seed=38))
    # the training paths do not take fp8: SDPA's dtypes and the context-parallel API
    # are fp16 / bf16 (their checks name the dtype)
    from triflash import validation
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        validation.check_qkv(q, k, v, varlen=False)


def test_fp16_descales_ignored():
    # FA3 reads the descales only for fp8 inputs
    q = torch.randn(1, 20, 2, 64, device=DEVICE, dtype=torch.bfloat16)
    ref = triflash.flash_attn_func(q, q, q)
    out = triflash.flash_attn_func(q, q, q, q_descale=torch.full((1, 2), 3.0, device=DEVICE))
    assert torch.equal(out, ref)


_COMPILE = """
import json, sys, torch
from tools import sm90_report as R
from triflash.kernels import configs, portable, problem
d, s, h, hk, softcap = {args}
meta = dict(device="meta", dtype=torch.float8_e4m3fn)
ds = tuple(torch.empty((), device="meta", dtype=torch.float32).expand(2, hk) for _ in range(3))
p = problem.AttnParams(softmax_scale=0.1, window_left=-1, window_right=0, softcap=softcap, max_seqlen_q=s,
                       max_seqlen_k=s)
q, k, v = (torch.empty(2, s, n, d, **meta) for n in (h, hk, hk))
with R._recording() as log:
    portable.fwd(q, k, v, None, None, None, None, p, configs.fwd_config("sm90", d, d, fp8=True), upcast=False,
                 descale=ds)
[(fn, args, kwargs)] = log
assert args[-1].FP8
signature, constexprs, attrs, options = R._specialize(fn, args, kwargs)
r = R._compile_spec(dict(module=fn.fn.__module__, name=fn.__name__, signature=signature,
                         constexprs=sorted(constexprs.items()), attrs=sorted(attrs.items()), options=options))
print(json.dumps(dict(shared=r["shared"], spills=r["spill_stores"] + r["spill_loads"])))
"""


@pytest.mark.sm90
@pytest.mark.parametrize("args", [(64, 4096, 16, 4, 0.0), (64, 4096, 16, 4, 15.0), (128, 4096, 16, 4, 0.0),
                                  (256, 4096, 8, 8, 0.0)],
                         ids=["d64", "d64-softcap", "d128", "d256"])
def test_fp8_forward_fits_sm90(args):
    """The portable forward's fp8 launches compile for sm_90a within Hopper's shared memory,
    spilling at most 32 B (none under triton 3.6; 24-32 B at head dim 256 under 3.8) (the
    decode kernel's fp8 forms: tools/decode_compile.py, its compile test in test_decode.py)."""
    r = sm90_compile_in_subprocess(_COMPILE.format(args=args))
    assert r["shared"] <= 232448 and r["spills"] <= 32, r


def test_fp8_through_fa3_operator():
    # torch.ops.flash_attn_3.fwd as FA3's C++ entry point takes fp8 (bf16 out, descales by
    # keyword), with its fake implementation's dtype
    from triflash.integrations import fa3_ops
    if not fa3_ops.register():
        pytest.skip("FlashAttention-3 itself is installed: torch.ops.flash_attn_3 are its own")
    q, k, v = rnd8(2, 33, 4, 64, seed=40), rnd8(2, 50, 2, 64, seed=41), rnd8(2, 50, 2, 64, seed=42)
    qd, kd, vd = descales(2, 2, seed=43)
    res = torch.ops.flash_attn_3.fwd(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd, is_causal=True)
    out, lse = triflash.flash_attn_func(q, k, v, causal=True, q_descale=qd, k_descale=kd, v_descale=vd,
                                        return_attn_probs=True)
    assert res[0].dtype == torch.bfloat16 and torch.equal(res[0], out) and torch.equal(res[1], lse)
    assert torch.library.opcheck(torch.ops.flash_attn_3.fwd.default, (q, k, v), {},
                                 test_utils=("test_faketensor",)) == {"test_faketensor": "SUCCESS"}


def test_fp8_serving_engine_decode_call():
    # a serving engine's fp8 decoding step as it calls FA3: packed queries cast to fp8, a
    # cache of pages of 1 token, cu_seqlens_k_new without new keys (ignored, as in FA3),
    # expanded per-layer k / v scales, no q scale
    b, h, hk, d, pages = 3, 8, 2, 128, 400
    lens = [37, 120, 1]
    cu_q = torch.arange(b + 1, dtype=torch.int32, device=DEVICE)
    q = rnd8(b, h, d, seed=44)
    k_pool, v_pool = rnd8(pages, 1, hk, d, seed=45), rnd8(pages, 1, hk, d, seed=46)
    g = torch.Generator().manual_seed(47)
    table = torch.randperm(pages, generator=g)[:b * 128].view(b, 128).to(torch.int32).to(DEVICE)
    kd = torch.tensor(0.8, device=DEVICE).expand(b, hk)
    vd = torch.tensor(1.7, device=DEVICE).expand(b, hk)
    out = triflash.flash_attn_with_kvcache(q, k_pool, v_pool, page_table=table,
                                           cache_seqlens=torch.tensor(lens, dtype=torch.int32, device=DEVICE),
                                           cu_seqlens_q=cu_q, cu_seqlens_k_new=cu_q, max_seqlen_q=1,
                                           softmax_scale=d ** -0.5, causal=True, window_size=(-1, -1), softcap=0.0,
                                           k_descale=kd, v_descale=vd, return_softmax_lse=True)
    out, lse = out[0], out[1]
    assert out.shape == (b, h, d) and out.dtype == torch.bfloat16 and lse.shape == (h, b)
    for i, n in enumerate(lens):
        rows = table[i, :n].long()
        check(out[None, i:i + 1], lse[None, :, i:i + 1], q[None, i:i + 1], k_pool[rows, 0][None], v_pool[rows, 0][None],
              None, kd[i:i + 1], vd[i:i + 1], causal=True)
