"""The feature table, as tests: forward and backward of flash_attn_func against an fp32
reference, with FlashAttention-3's tolerance rule (error <= rtol x the error of the same
computation done in the input dtype, + a few ulps).

The grid is the feature table: dtype x head dim x mask (none / causal / sliding window /
softcap) x head sharing (MHA / GQA / MQA) x seqlen pairs that are not tile multiples.
Under the CPU interpreter (CI) each (dtype, head dim) meets every mask; head sharing and
seqlen pairs rotate through that grid so each value appears, and a second grid runs every
seqlen pair. With CUDA the same tests run at realistic sizes.
"""
import pytest
import torch

import triflash
from triflash.testing import (assert_forward_matches, assert_matches_reference, attention_ref, fa_tolerance,
                              max_err)

from conftest import DEVICE

ON_GPU = DEVICE == "cuda"
DTYPES = [torch.float16, torch.bfloat16]
HEADDIMS = [8, 40, 64, 72, 96, 128, 136, 192, 256]
# (causal, window_size, softcap)
MASKS = {
    "none": (False, (-1, -1), 0.0),
    "causal": (False, (-1, -1), 0.0),
    "window": (False, (17, 5), 0.0),
    "causal-window-softcap": (True, (29, -1), 15.0),
}
MASKS["causal"] = (True, (-1, -1), 0.0)
SEQLENS = [(1, 1), (113, 203), (128, 217), (239, 1), (1, 239), (799, 3), (64, 128), (217, 113)]
if ON_GPU:
    SEQLENS += [(1024, 1024), (1023, 2049), (2048, 2048), (4096, 4096)]
HEADS = [(4, 4), (4, 2), (4, 1)] if not ON_GPU else [(8, 8), (8, 2), (8, 1)]  # MHA, GQA, MQA
BATCH = 2 if not ON_GPU else 4
GRID_BATCH = 1 if not ON_GPU else 4  # the grid is large; batch > 1 runs in the other tests


def _inputs(batch, sq, sk, h, hk, d, dv, dtype, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(DEVICE, dtype).requires_grad_()
    return rnd(batch, sq, h, d), rnd(batch, sk, hk, d), rnd(batch, sk, hk, dv)


def check_attention(batch, sq, sk, h, hk, d, dtype, causal, window, softcap,
                    dv=None, deterministic=False, seed=0):
    dv = d if dv is None else dv
    q, k, v = _inputs(batch, sq, sk, h, hk, d, dv, dtype, seed)
    kw = dict(causal=causal, window_size=window, softcap=softcap)
    out, lse = triflash.flash_attn_func(q, k, v, deterministic=deterministic,
                                        return_attn_probs=True, **kw)
    out_ref, lse_ref = attention_ref(q, k, v, upcast=True, **kw)
    out_pt, _ = attention_ref(q, k, v, upcast=False, **kw)
    assert out.shape == (batch, sq, h, dv) and out.dtype == dtype
    assert lse.shape == (batch, h, sq) and lse.dtype == torch.float32
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1)).to(out)
    grads = assert_matches_reference(out, lse, out_ref, lse_ref, out_pt, (q, k, v), dout, softcap)
    return grads


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("d", HEADDIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_feature_grid(dtype, d, mask):
    causal, window, softcap = MASKS[mask]
    # rotate head sharing and seqlen pairs through the grid so each value meets every dim
    i = HEADDIMS.index(d) + list(MASKS).index(mask) + DTYPES.index(dtype)
    h, hk = HEADS[i % len(HEADS)]
    sq, sk = SEQLENS[(3 * i) % len(SEQLENS)]
    # both backward paths: atomic dQ and the separate deterministic dQ kernel
    check_attention(GRID_BATCH, sq, sk, h, hk, d, dtype, causal, window, softcap,
                    deterministic=bool(i % 2))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"{s[0]}x{s[1]}")
def test_seqlens(seqlens, causal):
    sq, sk = seqlens
    check_attention(BATCH, sq, sk, 4, 2, 64, torch.float16, causal, (-1, -1), 0.0)


@pytest.mark.parametrize("window", [(0, 0), (3, -1), (-1, 3), (50, 50), (300, 0)])
def test_windows(window):
    check_attention(BATCH, 113, 203, 2, 1, 32, torch.float16, False, window, 0.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("d", [64, 96, 256])
def test_deterministic_matches_and_reproduces(dtype, d):
    sq, sk = (128, 217) if not ON_GPU else (2048, 2048)
    g1 = check_attention(BATCH, sq, sk, 4, 2, d, dtype, True, (-1, -1), 0.0, deterministic=True)
    g2 = check_attention(BATCH, sq, sk, 4, 2, d, dtype, True, (-1, -1), 0.0, deterministic=True)
    for a, b in zip(g1, g2):
        assert torch.equal(a, b), "deterministic backward is not bitwise reproducible"


@pytest.mark.parametrize("d", [1, 59, 111, 250])
def test_head_dims_not_multiples_of_8(d):
    """Any head dim from 1 to 256 (FA2's range; FA3 takes multiples of 8): the portable
    kernels compute it on the next power-of-two tile width with a masked head-dim axis,
    rows not 16-byte aligned. Forward and backward (both dQ paths), varlen, and a decoding
    step with new keys appended."""
    sq, sk = (113, 203) if not ON_GPU else (1023, 2049)
    check_attention(BATCH, sq, sk, 4, 2, d, torch.bfloat16, True, (-1, -1), 0.0, deterministic=d % 2 == 1)
    check_attention(BATCH, sk, sq, 4, 1, d, torch.float16, False, (40, 7), 0.0, dv=max(1, d - 2))
    lens = [37, 1, 90]
    cu = torch.tensor([0, 37, 38, 128], dtype=torch.int32, device=DEVICE)
    q, k, v = (x.detach()[0, :128].reshape(128, *x.shape[2:]) for x in _inputs(1, 128, 128, 4, 2, d, d, torch.float16, 3))
    out = triflash.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True)
    for i in range(3):
        s = slice(int(cu[i]), int(cu[i + 1]))
        ref, _ = attention_ref(q[None, s], k[None, s], v[None, s], causal=True)
        low, _ = attention_ref(q[None, s], k[None, s], v[None, s], causal=True, upcast=False)
        assert max_err(out[None, s], ref) <= fa_tolerance(ref, low)
    k_cache, v_cache = (x.detach().clone() for x in _inputs(2, 150, 150, 2, 2, d, d, torch.float16, 4)[1:])
    q1, k1, v1 = (x.detach() for x in _inputs(2, 1, 1, 8, 2, d, d, torch.float16, 5))
    out = triflash.flash_attn_with_kvcache(q1, k_cache, v_cache, k1, v1, cache_seqlens=100, causal=True)
    assert torch.equal(k_cache[:, 100], k1[:, 0]) and torch.equal(v_cache[:, 100], v1[:, 0])
    ref, _ = attention_ref(q1, k_cache[:, :101], v_cache[:, :101], causal=True)
    low, _ = attention_ref(q1, k_cache[:, :101], v_cache[:, :101], causal=True, upcast=False)
    assert max_err(out, ref) <= fa_tolerance(ref, low)


def test_seqlen_k_zero():
    q, k, v = _inputs(2, 5, 0, 2, 2, 16, 16, torch.float16)
    out, lse = triflash.flash_attn_func(q, k, v, return_attn_probs=True)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.isneginf(lse).all()
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert torch.equal(dq, torch.zeros_like(dq)) and dk.shape == k.shape


def test_rows_without_keys_are_zero():
    """seqlen_q > seqlen_k with causal: the first rows see no key at all."""
    q, k, v = _inputs(1, 40, 8, 2, 2, 16, 16, torch.bfloat16)
    out, lse = triflash.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert torch.equal(out[:, :32], torch.zeros_like(out[:, :32]))
    assert torch.isneginf(lse[:, :, :32]).all() and torch.isfinite(lse[:, :, 32:]).all()
    dq, _, _ = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert torch.equal(dq[:, :32], torch.zeros_like(dq[:, :32]))
    assert not dq.isnan().any()


def test_strided_inputs_without_copies():
    """Non-contiguous q/k/v (last dim contiguous) run as given, e.g. slices of a packed tensor."""
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(2, 70, 3, 4, 40, generator=g).to(DEVICE, torch.float16)
    big_k = torch.randn(2, 70, 6, 40, generator=g).to(DEVICE, torch.float16)
    q, k, v = qkv[:, :, 0], big_k[:, :, ::3], qkv[:, :, 2, :2]
    out = triflash.flash_attn_func(q, k, v)
    ref, _ = attention_ref(q, k, v)
    pt, _ = attention_ref(q, k, v, upcast=False)
    assert max_err(out, ref) <= fa_tolerance(ref, pt)


def test_softmax_scale_and_headdim_v():
    q, k, v = _inputs(2, 50, 77, 4, 2, 64, 32, torch.float16)
    out = triflash.flash_attn_func(q, k, v, softmax_scale=0.3, causal=True)
    ref, _ = attention_ref(q, k, v, softmax_scale=0.3, causal=True)
    pt, _ = attention_ref(q, k, v, softmax_scale=0.3, causal=True, upcast=False)
    assert out.shape == (2, 50, 4, 32)
    assert max_err(out, ref) <= fa_tolerance(ref, pt)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("dv", [32, 128])
def test_headdim_v_backward(dv, dtype):
    check_attention(2, 65, 97, 4, 2, 64 if dv == 32 else 192, dtype, True, (-1, -1), 0.0, dv=dv)


def test_qkvpacked():
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(2, 67, 3, 4, 64, generator=g).to(DEVICE, torch.float16).requires_grad_()
    out = triflash.flash_attn_qkvpacked_func(qkv, causal=True)
    q, k, v = qkv.unbind(2)
    ref, _ = attention_ref(q, k, v, causal=True)
    pt, _ = attention_ref(q, k, v, causal=True, upcast=False)
    assert max_err(out, ref) <= fa_tolerance(ref, pt)
    dout = torch.randn_like(out)
    # one packed dqkv, no concatenation: the packed op's backward (eager: its autograd.Function)
    assert "qkvpacked" in type(out.grad_fn).__name__.lower()
    (dqkv,) = torch.autograd.grad(out, qkv, dout)
    (dqkv_ref,) = torch.autograd.grad(ref, qkv, dout)
    (dqkv_pt,) = torch.autograd.grad(pt, qkv, dout)
    assert dqkv.shape == qkv.shape and not dqkv.isnan().any()
    assert max_err(dqkv, dqkv_ref) <= fa_tolerance(dqkv_ref, dqkv_pt)


@pytest.mark.parametrize("deterministic", [False, True])
def test_qkvpacked_gqa(deterministic):
    g = torch.Generator().manual_seed(4)
    qkv = torch.randn(2, 45, 4 + 2 * 2, 32, generator=g).to(DEVICE, torch.bfloat16).requires_grad_()
    out = triflash.flash_attn_qkvpacked_func(qkv, num_heads_q=4, window_size=(9, 2),
                                             deterministic=deterministic)
    q, k, v = qkv.split([4, 2, 2], dim=2)
    ref, _ = attention_ref(q, k, v, window_size=(9, 2))
    pt, _ = attention_ref(q, k, v, window_size=(9, 2), upcast=False)
    assert out.shape == (2, 45, 4, 32)
    assert max_err(out, ref) <= fa_tolerance(ref, pt)
    dout = torch.randn(out.shape, generator=g).to(out)
    (dqkv,) = torch.autograd.grad(out, qkv, dout)
    (dqkv_ref,) = torch.autograd.grad(ref, qkv, dout)
    (dqkv_pt,) = torch.autograd.grad(pt, qkv, dout)
    assert not dqkv.isnan().any()
    assert max_err(dqkv, dqkv_ref) <= fa_tolerance(dqkv_ref, dqkv_pt)


def test_fa3_drop_in_module():
    import triflash as flash_attn_interface
    for name in ("flash_attn_func", "flash_attn_varlen_func", "flash_attn_qkvpacked_func"):
        assert callable(getattr(flash_attn_interface, name))


@pytest.mark.parametrize("deterministic", [False, True])
def test_split_dkdv_passes(monkeypatch, deterministic):
    """The two-pass dK/dV backward (one accumulator per pass) computes the same gradients,
    whatever tile table the target uses."""
    import dataclasses
    from triflash.kernels import configs
    original = configs.bwd_config
    monkeypatch.setattr(configs, "bwd_config", lambda *a: dataclasses.replace(original(*a), split_dkdv=True))
    check_attention(BATCH, 113, 203, 4, 2, 64, torch.float16, True, (-1, -1), 0.0,
                    deterministic=deterministic)
    check_attention(1, 128, 217, 4, 1, 40, torch.bfloat16, False, (17, 5), 0.0,
                    deterministic=deterministic)
    check_attention(1, 239, 65, 2, 2, 72, torch.float16, True, (29, -1), 15.0,
                    deterministic=deterministic)


@pytest.mark.parametrize("shape", [(0, 5, 7), (2, 0, 7)], ids=["batch0", "seqlen_q0"])
def test_empty_problems(shape):
    batch, sq, sk = shape
    q, k, v = _inputs(batch, sq, sk, 2, 1, 16, 16, torch.float16)
    out, lse = triflash.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert out.shape == (batch, sq, 2, 16) and lse.shape == (batch, 2, sq)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert dq.shape == q.shape and torch.equal(dk, torch.zeros_like(dk)) and torch.equal(dv, torch.zeros_like(dv))


def test_forward_rescaling():
    """The forward's running-max rescale (scale folded into exp2 on unmasked blocks) on
    scores whose max keeps rising along the keys, causal and not, with and without softcap."""
    g = torch.Generator().manual_seed(3)
    b, s, h, d = 1, 300 if DEVICE == "cpu" else 2000, 2, 64
    q = torch.randn(b, s, h, d, generator=g)
    drift = torch.linspace(0, 8, s)[None, :, None, None] * q.mean(1, keepdim=True)
    k = torch.randn(b, s, h, d, generator=g) + drift
    v = torch.randn(b, s, h, d, generator=g)
    q, k, v = (x.to(DEVICE, torch.float16) for x in (q, k, v))
    for causal, softcap in ((False, 0.0), (True, 0.0), (False, 30.0)):
        kw = dict(softmax_scale=0.5, causal=causal, softcap=softcap)
        with triflash.force_backend("portable"):
            out, lse = triflash.flash_attn_func(q, k, v, return_attn_probs=True, **kw)
        ref, lse_ref = attention_ref(q, k, v, **kw)
        pt, _ = attention_ref(q, k, v, upcast=False, **kw)
        assert_forward_matches(out, lse, ref, lse_ref, pt, softcap)


@pytest.mark.parametrize("packed", [False, True], ids=["qkv", "qkvpacked"])
def test_backward_fills_no_gradient_for_lse(packed):
    """lse is returned for inspection, not differentiated: the backward neither receives nor
    builds a gradient for it (autograd would otherwise fill a zero (batch, heads, seqlen_q)
    tensor every call). (The gradients themselves: every other backward test.)"""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Fills(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.shapes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            # (how autograd materializes a missing gradient; the kernels' own buffers, which
            # the suite poisons with fill_, are not counted)
            if func.overloadpacket in (torch.ops.aten.zeros, torch.ops.aten.zeros_like, torch.ops.aten.new_zeros):
                self.shapes.append(tuple(out.shape))
            return out

    g = torch.Generator().manual_seed(0)
    if packed:
        qkv = torch.randn(2, 37, 3, 2, 16, generator=g).to(DEVICE, torch.float16).requires_grad_()
        out, lse = triflash.flash_attn_qkvpacked_func(qkv, causal=True, return_attn_probs=True)
        inputs = (qkv,)
    else:
        q, k, v = (torch.randn(2, 37, 2, 16, generator=g).to(DEVICE, torch.float16).requires_grad_()
                   for _ in range(3))
        out, lse = triflash.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
        inputs = (q, k, v)
    dout = torch.randn(out.shape, generator=g).to(out)
    with _Fills() as fills:
        grads = torch.autograd.grad(out, inputs, dout, retain_graph=True)
    assert tuple(lse.shape) not in fills.shapes
    assert all(g_.shape == x.shape and torch.isfinite(g_).all() for g_, x in zip(grads, inputs))


def test_no_second_derivative():
    """A gradient taken with create_graph=True cannot be differentiated again: an error,
    never a second-order term silently left out (the kernels' backward has no derivative)."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 16, 2, 32, generator=g).to(DEVICE, torch.float16).requires_grad_() for _ in range(3))
    out = triflash.flash_attn_func(q, k, v)
    dq, = torch.autograd.grad(out.float().pow(2).sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="second derivative"):
        torch.autograd.grad(dq.float().pow(2).sum() + q.float().pow(2).sum(), q)
    qkv = torch.randn(1, 16, 3, 2, 32, generator=g).to(DEVICE, torch.float16).requires_grad_()
    out = triflash.flash_attn_qkvpacked_func(qkv)
    dqkv, = torch.autograd.grad(out.float().pow(2).sum(), qkv, create_graph=True)
    with pytest.raises(RuntimeError, match="second derivative"):
        torch.autograd.grad(dqkv.float().pow(2).sum(), qkv)
    # create_graph with a loss that does not differentiate attention twice still works
    out = triflash.flash_attn_func(q, k, v)
    dq, = torch.autograd.grad(out.float().sum(), q, create_graph=True)
    assert torch.autograd.grad(q.float().pow(3).sum(), q)[0] is not None


def test_dense_seqused_backward_zeroes_unused_rows(monkeypatch):
    """The ops with seqused_k on a dense batch (no public backward uses it): key rows past
    seqused_k get zero gradients, not what the allocation held."""
    from triflash import ops
    from triflash.kernels import portable
    real = portable.alloc_output
    monkeypatch.setattr(portable, "alloc_output", lambda *a, **kw: real(*a, **kw).fill_(float("nan")))
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, s, 2, 32, generator=g).to(DEVICE, torch.float16).requires_grad_()
               for s in (12, 28, 28))
    used = torch.tensor([20, 11], dtype=torch.int32, device=DEVICE)
    out, _ = ops.attention(q, k, v, None, None, None, used, [12, 28, -1, 0, 1], [32 ** -0.5, 0.0])
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert not dq.isnan().any()
    assert dk[0, 20:].eq(0).all() and dk[1, 11:].eq(0).all() and dv[0, 20:].eq(0).all() and dv[1, 11:].eq(0).all()
    assert not dk[0, :20].isnan().any() and not dk[1, :11].isnan().any()


def test_wide_rows_of_the_portable_forward(monkeypatch):
    """A Q / O row offset inside a sequence that can pass 2^31 elements (131073 queries x 128
    heads x 128) takes the 64-bit form (``portable.wide_rows``); that form computes what the
    32-bit one does."""
    from triflash.kernels import portable
    meta = dict(device="meta", dtype=torch.bfloat16)
    big, small = torch.empty(1, 131073, 128, 128, **meta), torch.empty(1, 8192, 16, 128, **meta)
    assert portable.wide_rows(131073, 128, big, big, False)
    assert not portable.wide_rows(8192, 128, small, small, False)
    assert portable.wide_rows(1, 128, big[0], big[0], True) is False  # varlen: the row stride 16384
    assert portable.wide_rows(131073, 128, big[0], big[0], True)
    q, k, v = _inputs(2, 77, 91, 4, 2, 64, 64, torch.float16, seed=5)
    with triflash.force_backend("portable"):
        want = triflash.flash_attn_func(q, k, v, causal=True)
        monkeypatch.setattr(portable, "wide_rows", lambda *a: True)
        got = triflash.flash_attn_func(q, k, v, causal=True)
    assert torch.equal(got, want)
