"""Learnable attention sinks (gpt-oss; FA4's ``learnable_sink``, transformers' ``s_aux``): one
more softmax column per query head with the sink's logit and no value. Forward, dq, dk and
dv against the fp32 reference with the sink in its softmax (FlashAttention-3's tolerance
rule), the sink's gradient against its formula on the call's own output (``_assert_dsink``);
dense, varlen, KV cache, torch.compile."""
import pytest
import torch

import triflash
from triflash.testing import (assert_forward_matches, assert_grads_match, attention_ref, attention_varlen_ref,
                              fa_tolerance, max_err)

from conftest import DEVICE

ON_GPU = DEVICE == "cuda"
DTYPES = [torch.float16, torch.bfloat16]
# (causal, window_size, softcap)
MASKS = {
    "none": (False, (-1, -1), 0.0),
    "causal": (True, (-1, -1), 0.0),
    "window": (False, (17, 5), 0.0),
    "causal-window-softcap": (True, (29, -1), 15.0),
}
# (seqlen_q, seqlen_k): odd sizes; 217 x 113 causal leaves the first 104 rows without a key
SEQLENS = [(113, 203), (217, 113), (1, 239)]
if ON_GPU:
    SEQLENS += [(1023, 2049), (2048, 2048)]


def _rand(shape, dtype, g, scale=1.0):
    return (scale * torch.randn(*shape, generator=g)).to(DEVICE, dtype).requires_grad_()


def _sink(h, dtype, g):
    """Logits of the size gpt-oss learns (a few units around 0), some large enough to take
    most of a row's weight."""
    return _rand((h,), dtype, g, scale=3.0)


def _dsink_formula(dout, out, lse, sink):
    """-sum over rows of p_sink * Delta in fp64, from an attention's output and lse with the
    sink (out', lse'): p_sink = exp(sink - lse'), Delta = rowsum(dout * out'). Returns it and
    the sum of its terms' magnitudes (what bounds its rounding error in fp32), per head.
    ``lse`` (batch, heads, seqlen) or varlen (heads, total)."""
    lse = lse.double()
    s = sink.detach().double()[:, None] if lse.dim() == 2 else sink.detach().double()[None, :, None]
    weight = torch.nan_to_num(torch.exp(s - lse), nan=0.0)
    weight = weight.transpose(0, 1) if lse.dim() == 2 else weight.transpose(1, 2)  # out's row layout
    terms = (weight * (dout.double() * out.double()).sum(-1)).flatten(0, -2)
    return -terms.sum(0), terms.abs().sum(0)


def _assert_dsink(dsink, dout, out, lse, sink):
    """The sink's gradient is ``_dsink_formula`` (the gradient: ``test_sink_gradient_formula``)
    on the call's own out and lse, as every FlashAttention backward takes Delta from the
    output it returned: within fp32 rounding of its terms (2^-16 of the sum of their
    magnitudes) plus one unit in the last place of the sink's dtype. So d sink's distance
    from the reference is the output's and lse's own error carried through the formula, and
    those are held to FlashAttention-3's forward rule (``assert_forward_matches``). The sum
    over every row of a head is not held to that elementwise rule itself: noise within it,
    at the 16-bit reference's own size, moves the sum past 2x the 16-bit reference's sum."""
    assert dsink.dtype == sink.dtype and dsink.shape == sink.shape
    assert not dsink.isnan().any(), "dsink has NaN"
    want, mag = _dsink_formula(dout, out, lse, sink)
    err = (dsink.double() - want).abs()
    tol = 2.0 ** -16 * mag + torch.finfo(sink.dtype).eps * want.abs()
    assert (err <= tol).all(), f"dsink {dsink.tolist()} vs the formula's {want.tolist()} (tolerance {tol.tolist()})"


def _check_call(out, lse, inputs, ref, dout, softcap):
    """The forward and all four gradients of one call: out, lse, dq, dk, dv against the
    reference (``ref(q, k, v, sink, upcast)`` -> (out, lse)) in fp32 and the same computation
    in the input dtype (FlashAttention-3's rule), d sink as ``_assert_dsink``."""
    q, k, v, sink = inputs
    out_ref, lse_ref = ref(q, k, v, sink, True)
    out_low, _ = ref(q, k, v, sink, False)
    assert_forward_matches(out, lse, out_ref, lse_ref, out_low, softcap)
    grads = torch.autograd.grad(out, inputs, dout)
    grads_ref = torch.autograd.grad(out_ref, inputs[:3], dout)
    grads_low = torch.autograd.grad(out_low, inputs[:3], dout)
    assert_grads_match(grads[:3], grads_ref, grads_low, softcap)
    _assert_dsink(grads[3], dout, out, lse, sink)
    return grads


@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_sink_dense(dtype, mask, seqlens):
    causal, window, softcap = MASKS[mask]
    sq, sk = seqlens
    i = list(MASKS).index(mask) + DTYPES.index(dtype) + SEQLENS.index(seqlens)
    h, hk = [(4, 4), (4, 2), (4, 1)][i % 3]
    d = [64, 128, 40][i % 3] if not ON_GPU else [64, 128, 256][i % 3]
    batch = 2
    g = torch.Generator().manual_seed(i)
    q, k, v = _rand((batch, sq, h, d), dtype, g), _rand((batch, sk, hk, d), dtype, g), _rand((batch, sk, hk, d), dtype, g)
    sink = _sink(h, [torch.float32, dtype][i % 2], g)
    kw = dict(causal=causal, window_size=window, softcap=softcap)
    out, lse = triflash.flash_attn_func(q, k, v, learnable_sink=sink, deterministic=bool(i % 2),
                                        return_attn_probs=True, **kw)
    assert out.shape == (batch, sq, h, d) and out.dtype == dtype and lse.shape == (batch, h, sq)
    dout = torch.randn(out.shape, generator=g).to(out)
    _check_call(out, lse, (q, k, v, sink),
                lambda q, k, v, sink, upcast: attention_ref(q, k, v, upcast=upcast, learnable_sink=sink, **kw),
                dout, softcap)


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_sink_gradient_formula(varlen):
    """``_dsink_formula`` on an attention's out and lse is the sink's gradient: autograd of
    attention with a sink column, all in fp64 (causal with more queries than keys, so some
    rows see only the sink; the varlen layout is the same rows packed, lse (heads, total))."""
    g = torch.Generator().manual_seed(11)
    b, sq, sk, h, d = 2, 19, 13, 3, 8
    q, k, v = (torch.randn(b, n, h, d, generator=g, dtype=torch.float64) for n in (sq, sk, sk))
    sink = (3 * torch.randn(h, generator=g, dtype=torch.float64)).requires_grad_()
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * d ** -0.5
    s = s.masked_fill(torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq).logical_not(), float("-inf"))
    s = torch.cat([s, sink[None, :, None, None].expand(b, h, sq, 1)], dim=-1)  # the sink's column
    lse = torch.logsumexp(s, dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, dim=-1)[..., :sk], v)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    (dsink,) = torch.autograd.grad(out, (sink,), dout)
    out, lse = out.detach(), lse.detach()
    if varlen:
        out, dout, lse = out.flatten(0, 1), dout.flatten(0, 1), lse.transpose(0, 1).flatten(1, 2)
    want, _ = _dsink_formula(dout, out, lse, sink)
    assert torch.allclose(dsink, want, rtol=1e-12, atol=1e-12), (dsink, want)


def test_sink_rows_without_keys():
    """A row that sees no key: out 0 and lse the head's sink (FA4's convention); its sink
    gradient is 0 (its out, hence Delta, is 0)."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (_rand((1, s, 2, 32), torch.float16, g) for s in (40, 10, 10))
    sink = torch.tensor([0.5, -1.25], device=DEVICE, requires_grad=True)
    out, lse = triflash.flash_attn_func(q, k, v, causal=True, learnable_sink=sink, return_attn_probs=True)
    blind = 40 - 10  # bottom-right causal: the first 30 queries see no key
    assert torch.equal(out[:, :blind], torch.zeros_like(out[:, :blind]))
    assert torch.equal(lse[0, :, :blind], sink.detach()[:, None].expand(2, blind))
    dout = torch.zeros_like(out)
    dout[:, :blind] = 1.0
    (dsink,) = torch.autograd.grad(out, (sink,), dout)
    assert torch.equal(dsink, torch.zeros_like(dsink))


def test_sink_minus_inf_is_no_sink():
    """A sink of -inf takes no weight: the same out and lse as no sink, and dq/dk/dv too."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (_rand((2, s, 4, 64), torch.bfloat16, g) for s in (77, 91, 91))
    sink = torch.full((4,), float("-inf"), device=DEVICE)
    out, lse = triflash.flash_attn_func(q, k, v, causal=True, learnable_sink=sink, return_attn_probs=True)
    out0, lse0 = triflash.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert torch.equal(out, out0) and torch.equal(lse, lse0)
    dout = torch.randn(out.shape, generator=g).to(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(out0, (q, k, v), dout)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_sink_varlen(dtype):
    """Packed sequences of odd lengths (one of them empty), seqused counts, GQA, causal:
    each sequence's rows against the reference; tokens outside every used sequence get
    out 0."""
    g = torch.Generator().manual_seed(5)
    lens_q, lens_k = [37, 0, 90, 5], [60, 12, 90, 41]
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    used_q = torch.tensor([30, 0, 90, 5], dtype=torch.int32, device=DEVICE)
    h, hk, d = 4, 2, 64
    q, k, v = (_rand((n, hh, d), dtype, g) for n, hh in ((sum(lens_q), h), (sum(lens_k), hk), (sum(lens_k), hk)))
    sink = _sink(h, torch.float32, g)
    out, lse = triflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), seqused_q=used_q,
                                               causal=True, learnable_sink=sink, return_attn_probs=True)
    out_ref, lse_ref = attention_varlen_ref(q, k, v, cu_q, cu_k, used_q, None, causal=True, learnable_sink=sink)
    out_low, _ = attention_varlen_ref(q, k, v, cu_q, cu_k, used_q, None, causal=True, learnable_sink=sink,
                                      upcast=False)
    assert max_err(out, out_ref) <= fa_tolerance(out_ref, out_low)
    rows = torch.isfinite(lse_ref)  # the used rows
    assert max_err(lse[rows], lse_ref[rows]) <= 1e-3 * max(1.0, lse_ref[rows].abs().max().item())
    dout = torch.randn(out.shape, generator=g).to(out)
    inputs = (q, k, v, sink)
    grads, grads_ref = torch.autograd.grad(out, inputs, dout), torch.autograd.grad(out_ref, inputs[:3], dout)
    assert_grads_match(grads[:3], grads_ref, torch.autograd.grad(out_low, inputs[:3], dout))
    _assert_dsink(grads[3], dout, out, lse, sink)


def test_sink_kvcache_decode_and_prefill():
    """flash_attn_with_kvcache (forward only): a decoding step (one query token, GQA, ragged
    cache lengths, the decode kernel) and a prefill over the cache, each against the
    reference on each sequence's keys."""
    g = torch.Generator().manual_seed(6)
    b, n, h, hk, d = 3, 96, 8, 2, 64
    k_cache, v_cache = (torch.randn(b, n, hk, d, generator=g).to(DEVICE, torch.float16) for _ in range(2))
    lens = torch.tensor([96, 17, 50], dtype=torch.int32, device=DEVICE)
    sink = 2.0 * torch.randn(h, generator=g).to(DEVICE)
    for sq in (1, 21):
        q = torch.randn(b, sq, h, d, generator=g).to(DEVICE, torch.float16)
        out, lse, *_ = triflash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, causal=True,
                                                        learnable_sink=sink, return_softmax_lse=True)
        for i, m in enumerate(lens.tolist()):
            kw = dict(causal=True, learnable_sink=sink)
            ref, lse_ref = attention_ref(q[i:i + 1], k_cache[i:i + 1, :m], v_cache[i:i + 1, :m], **kw)
            low, _ = attention_ref(q[i:i + 1], k_cache[i:i + 1, :m], v_cache[i:i + 1, :m], upcast=False, **kw)
            assert max_err(out[i:i + 1], ref) <= fa_tolerance(ref, low), (sq, i)
            assert max_err(lse[i:i + 1], lse_ref) <= 1e-3 * max(1.0, lse_ref.abs().max().item())


def test_sink_under_torch_compile():
    """torch.compile(fullgraph=True) traces the sink's forward and backward (the custom ops
    inside): the same loss and gradients as eager, bit for bit through aot_eager (CPU);
    through inductor (GPU), which compiles the fold's elementwise ops itself, within a few
    units in the last place."""
    g = torch.Generator().manual_seed(7)
    q, k, v = (_rand((1, s, 2, 32), torch.float16, g) for s in (33, 47, 47))
    sink = _sink(2, torch.float32, g)

    def layer(q, k, v, sink):
        out = triflash.flash_attn_func(q, k, v, causal=True, learnable_sink=sink, deterministic=True)
        return (out.float() * 2).sum()

    backend = "inductor" if ON_GPU else "aot_eager"
    loss = torch.compile(layer, fullgraph=True, backend=backend)(q, k, v, sink)
    grads = torch.autograd.grad(loss, (q, k, v, sink))
    loss_eager = layer(q, k, v, sink)
    grads_eager = torch.autograd.grad(loss_eager, (q, k, v, sink))
    if backend == "aot_eager":
        assert torch.equal(loss, loss_eager)
        for a, b in zip(grads, grads_eager):
            assert torch.equal(a, b)
    else:
        assert max_err(loss, loss_eager) <= 1e-3 * abs(loss_eager.item())
        for a, b in zip(grads, grads_eager):
            assert max_err(a, b) <= 4 * torch.finfo(a.dtype).eps * max(1.0, b.abs().max().item())


@pytest.mark.parametrize("bad,exc,match", [
    (torch.zeros(3), ValueError, r"learnable_sink.shape=\(3,\).*\(nheads,\) = \(4,\)"),
    (torch.zeros(1, 4), ValueError, r"learnable_sink.shape"),
    (torch.zeros(4, dtype=torch.int32), TypeError, r"learnable_sink.dtype=torch.int32"),
    ([0.0] * 4, TypeError, r"learnable_sink=list"),
])
def test_sink_refused(bad, exc, match):
    q = k = v = torch.randn(1, 8, 4, 16, device=DEVICE, dtype=torch.float16)
    if isinstance(bad, torch.Tensor):
        bad = bad.to(DEVICE)
    with pytest.raises(exc, match=match):
        triflash.flash_attn_func(q, k, v, learnable_sink=bad)
    with pytest.raises(exc, match=match):
        triflash.flash_attn_varlen_func(q[0], k[0], v[0], *(torch.tensor([0, 8], dtype=torch.int32, device=DEVICE),) * 2,
                                        8, 8, learnable_sink=bad)
    with pytest.raises(exc, match=match):
        triflash.flash_attn_with_kvcache(q, k, v, learnable_sink=bad)
