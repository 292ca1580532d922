"""triflash as torch's SDPA flash backend (triflash/integrations/sdpa.py).

On the CPU the override functions run under Triton's interpreter, called directly with
SDPA's layouts and through the dispatcher after activating them for the CPU dispatch key
(the test-only ``sdpa._DISPATCH_KEY``): aten's flash ops have no CPU kernel of their own,
so what runs there is triflash's. Cases triflash does not serve go to a fake previous
kernel. With an sm90 GPU the same tests run on CUDA tensors (the dispatcher cycle on the
CUDA key, torch's kernel behind it), and ``test_sdpa_on_gpu`` runs
``F.scaled_dot_product_attention`` with the backend activated; the
``test_torch_context_parallel_*`` tests run it under torch's context parallelism
(``test_torch_ring_steps_on_cpu``: torch's ring itself, over 2 gloo ranks on the CPU).
"""
import pytest
import torch
import torch.nn.functional as F

import triflash
from triflash import dispatch
from triflash.integrations import sdpa
from triflash.testing import (assert_forward_matches, assert_grads_match, attention_ref,
                              attention_varlen_ref, fa_tolerance, max_err)

from conftest import DEVICE

ON_GPU = DEVICE == "cuda"
INTERPRETING = dispatch.interpreting()
# where the backend serves calls: the interpreter (CPU) or an sm90 GPU
served_here = pytest.mark.skipif(ON_GPU and torch.cuda.get_device_capability()[0] != 9,
                                 reason="a GPU other than sm90: the backend hands every call to torch")
attention = torch.nn.attention
HAS_REGISTRY = hasattr(attention, "register_flash_attention_impl")
needs_registry = pytest.mark.skipif(not HAS_REGISTRY, reason="torch without the flash-attention registry (< 2.10)")
KEYSET = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
SDPA_FWD = "_scaled_dot_product_flash_attention"


class FakeKernel:
    """Stands for the previous kernel: records what it is handed."""

    def __init__(self):
        self.calls = []

    def call_boxed(self, keyset, *args, **kwargs):
        self.calls.append((keyset, args, kwargs))
        return "fallback"


def _kernels(**fallbacks):
    return sdpa.Kernels(fallbacks, "CPU")


def _rand(*shape, dtype=torch.float16, g):
    return torch.randn(*shape, generator=g).to(DEVICE, dtype)


def _sdpa_inputs(b, h, hk, sq, sk, d, layout, dtype=torch.float16, seed=0):
    """q, k, v as SDPA takes them, (batch, heads, seqlen, dim): transposed views of
    (batch, seqlen, heads, dim) tensors (``bshd``, what models make) or contiguous (``bhsd``)."""
    g = torch.Generator().manual_seed(seed)
    if layout == "bshd":
        return tuple(_rand(b, s, n, d, dtype=dtype, g=g).transpose(1, 2)
                     for s, n in ((sq, h), (sk, hk), (sk, hk)))
    return tuple(_rand(b, n, s, d, dtype=dtype, g=g) for s, n in ((sq, h), (sk, hk), (sk, hk)))


def _ref(q, k, v, **kw):
    """attention_ref on (batch, heads, seqlen, dim) tensors: (out, lse, out_lowp)."""
    t = (lambda x: x.transpose(1, 2))
    out_ref, lse_ref = attention_ref(t(q), t(k), t(v), upcast=True, **kw)
    out_lowp, _ = attention_ref(t(q), t(k), t(v), upcast=False, **kw)
    return t(out_ref), lse_ref, t(out_lowp)


def _ref_grads(q, k, v, dout, **kw):
    """Gradients of the fp32 and the low-precision reference, autograd, (batch, heads, ...)."""
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    out_ref, _, out_lowp = _ref(*leaves, **kw)
    return (torch.autograd.grad(out_ref, leaves, dout), torch.autograd.grad(out_lowp, leaves, dout))


# ---- registration ------------------------------------------------------------------------

@needs_registry
def test_registered_not_active():
    assert sdpa.available() and sdpa.unavailable_reason == ""
    assert "triflash" in attention.list_flash_attention_impls()
    assert attention.current_flash_attention_impl() != "triflash"
    assert sdpa._active is None  # import triflash overrode nothing


def test_without_registry_the_reason_is_reported(monkeypatch):
    monkeypatch.setattr(sdpa, "unavailable_reason", sdpa.unavailable_reason)  # (restored after)
    if HAS_REGISTRY:
        monkeypatch.delattr(attention, "register_flash_attention_impl")
    assert sdpa.register() is False
    assert not sdpa.available()
    assert "register_flash_attention_impl" in sdpa.unavailable_reason and "2.10" in sdpa.unavailable_reason
    triflash._register_sdpa_backend()  # what import triflash runs: no exception either
    assert not sdpa.available()


@needs_registry
def test_activate_for_cuda_keeps_torchs_kernels_as_fallbacks():
    """The real activation (the CUDA key; harmless without a GPU): every overridden op has
    torch's kernel to hand unsupported calls to, and restore removes the override."""
    attention.activate_flash_attention_impl("triflash")
    try:
        assert attention.current_flash_attention_impl() == "triflash"
        handle = sdpa._active
        assert handle.dispatch_key == "CUDA"
        expected = {SDPA_FWD, SDPA_FWD + "_backward", "_flash_attention_forward", "_flash_attention_backward"}
        if hasattr(torch.ops.aten, "_flash_attention_forward_no_dropout_inplace"):  # torch >= 2.13
            expected.add("_flash_attention_forward_no_dropout_inplace")
        assert set(handle.ops) == expected
        assert all(handle.kernels.fallbacks[name] is not None for name in expected)
    finally:
        attention.restore_flash_attention_impl()
    assert attention.current_flash_attention_impl() is None
    assert sdpa._active is None and handle.library is None


@needs_registry
def test_reactivating_never_falls_back_to_itself():
    h1 = sdpa.activate_kernels("CPU")
    h2 = sdpa.activate_kernels("CPU")
    try:
        assert h1.library is None and sdpa._active is h2
        # aten's flash ops have no CPU kernel: nothing (not h1's kernels) to fall back to
        assert all(f is None for f in h2.kernels.fallbacks.values())
    finally:
        h2.remove()
    assert sdpa._active is None


# ---- the SDPA ops, called directly ---------------------------------------------------------

SDPA_CASES = {  # (causal, heads q, heads kv, seqlen q, seqlen k, layout, scale)
    "full": (False, 4, 4, 37, 37, "bshd", None),
    "causal-gqa": (True, 4, 2, 37, 37, "bhsd", None),
    "causal-mqa-bottom-right": (True, 4, 1, 37, 53, "bshd", None),
    "gqa-scale": (False, 4, 2, 37, 53, "bhsd", 0.3),
}


@served_here
@pytest.mark.parametrize("case", list(SDPA_CASES))
def test_sdpa_override_matches(case):
    causal, h, hk, sq, sk, layout, scale = SDPA_CASES[case]
    b, d = 2, 64
    q, k, v = _sdpa_inputs(b, h, hk, sq, sk, d, layout)
    kernels = _kernels()
    res = kernels.sdpa_forward(KEYSET, q, k, v, 0.0, causal, False, scale=scale)
    assert len(res) == 9
    out, lse, cum_q, cum_k, max_q, max_k, rng_state, unused, debug_mask = res
    # the conventions of torch's meta kernel
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride() == torch.empty_like(q).stride()
    assert lse.shape == (b, h, sq) and lse.dtype == torch.float32 and lse.is_contiguous()
    assert cum_q is None and cum_k is None and (max_q, max_k) == (sq, sk)
    assert rng_state.shape == (2,) and rng_state.dtype == torch.uint64
    assert unused.shape == () and unused.dtype == torch.uint64
    assert debug_mask.shape == (0,) and debug_mask.dtype == q.dtype

    # the same kernels as flash_attn_func on the (batch, seqlen, heads, dim) views
    t = (lambda x: x.transpose(1, 2))
    qf, kf, vf = (t(x).detach().requires_grad_() for x in (q, k, v))
    out_fa, lse_fa = triflash.flash_attn_func(qf, kf, vf, softmax_scale=scale, causal=causal,
                                              return_attn_probs=True)
    assert torch.equal(t(out), out_fa) and torch.equal(lse, lse_fa)
    # and the fp32 reference (causal bottom-right aligned, as torch's flash op)
    out_ref, lse_ref, out_lowp = _ref(q, k, v, softmax_scale=scale, causal=causal)
    assert_forward_matches(out, lse, out_ref, lse_ref, out_lowp)

    dout = _rand(*out.shape, g=torch.Generator().manual_seed(1))
    grads = kernels.sdpa_backward(KEYSET, dout, q, k, v, out, lse, None, None, sq, sk, 0.0, causal,
                                  rng_state, unused, scale=scale)
    for g_, x in zip(grads, (q, k, v)):
        assert g_.shape == x.shape and g_.dtype == x.dtype and g_.stride() == torch.empty_like(x).stride()
    grads_fa = torch.autograd.grad(out_fa, (qf, kf, vf), t(dout))
    for g_, g_fa in zip(grads, grads_fa):  # (a GPU's atomic dQ adds in no fixed order)
        assert torch.equal(t(g_), g_fa) if INTERPRETING else max_err(t(g_), g_fa) <= 1e-2
    grads_ref, grads_lowp = _ref_grads(q, k, v, dout, softmax_scale=scale, causal=causal)
    assert_grads_match(grads, grads_ref, grads_lowp)


@served_here
def test_sdpa_backward_is_deterministic_as_torch_says(monkeypatch):
    seen = []
    run_bwd = dispatch.run_bwd

    def spy(*args, **kwargs):
        seen.append(args[11])  # deterministic
        return run_bwd(*args, **kwargs)
    monkeypatch.setattr(dispatch, "run_bwd", spy)
    q, k, v = _sdpa_inputs(1, 2, 2, 19, 19, 32, "bshd")
    kernels = _kernels()
    out, lse, *_ = kernels.sdpa_forward(KEYSET, q, k, v)
    dout = torch.randn_like(out)
    args = (KEYSET, dout, q, k, v, out, lse, None, None, 19, 19, 0.0, False, None, None)
    previous = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True, warn_only=True)
        g_det = kernels.sdpa_backward(*args)
        torch.use_deterministic_algorithms(False)
        g_atomic = kernels.sdpa_backward(*args)
    finally:
        torch.use_deterministic_algorithms(previous)
    assert seen == [True, False]
    for a, b in zip(g_det, g_atomic):
        assert max_err(a, b) <= 1e-2


# ---- the flash ops: (batch, seqlen, heads, dim) and varlen -----------------------------------

def test_window_normalization_is_flash_attention_2s():
    assert sdpa._window(None, None, False, 100) == (-1, -1)
    assert sdpa._window(None, None, True, 100) == (-1, 0)
    assert sdpa._window(-7, 3, False, 100) == (-1, 3)
    assert sdpa._window(100, 99, False, 100) == (-1, 99)   # a side >= seqlen_k is unbounded
    assert sdpa._window(20, 100, True, 100) == (20, 0)


@served_here
@pytest.mark.parametrize("causal,window", [(False, (None, None)), (True, (9, None)), (False, (5, 3))])
def test_flash_ops_dense(causal, window):
    b, h, hk, sq, sk, d = 2, 4, 2, 37, 45, 64
    g = torch.Generator().manual_seed(2)
    q, k, v = _rand(b, sq, h, d, g=g), _rand(b, sk, hk, d, g=g), _rand(b, sk, hk, d, g=g)
    left, right = window
    kernels = _kernels()
    out, lse, rng_state, unused, debug_mask = kernels.flash_forward(
        KEYSET, q, k, v, None, None, sq, sk, 0.0, causal, False, scale=None,
        window_size_left=left, window_size_right=right)
    assert lse.shape == (b, h, sq) and debug_mask.numel() == 0 and rng_state.shape == (2,)
    ws = (-1 if left is None else left, -1 if right is None else right)
    out_ref, lse_ref = attention_ref(q, k, v, causal=causal, window_size=ws)
    out_lowp, _ = attention_ref(q, k, v, causal=causal, window_size=ws, upcast=False)
    assert_forward_matches(out, lse, out_ref, lse_ref, out_lowp)
    out_fa = triflash.flash_attn_func(q, k, v, causal=causal, window_size=ws)
    assert torch.equal(out, out_fa)

    dout = _rand(*out.shape, g=g)
    grads = kernels.flash_backward(KEYSET, dout, q, k, v, out, lse, None, None, sq, sk, 0.0, causal,
                                   rng_state, unused, scale=None, window_size_left=left,
                                   window_size_right=right)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    grads_ref = torch.autograd.grad(attention_ref(*leaves, causal=causal, window_size=ws)[0], leaves, dout)
    grads_lowp = torch.autograd.grad(attention_ref(*leaves, causal=causal, window_size=ws, upcast=False)[0],
                                     leaves, dout)
    assert_grads_match(grads, grads_ref, grads_lowp)


def _varlen_inputs(seed=3):
    lens_q, lens_k = [37, 5, 20], [40, 7, 20]
    h, hk, d = 4, 2, 64
    g = torch.Generator().manual_seed(seed)
    q = _rand(sum(lens_q), h, d, g=g)
    k, v = _rand(sum(lens_k), hk, d, g=g), _rand(sum(lens_k), hk, d, g=g)
    cu = [torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
          for lens in (lens_q, lens_k)]
    return q, k, v, cu[0], cu[1], max(lens_q), max(lens_k)


@served_here
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_flash_ops_varlen(causal):
    q, k, v, cu_q, cu_k, max_q, max_k = _varlen_inputs()
    kernels = _kernels()
    out, lse, rng_state, unused, _ = kernels.flash_forward(KEYSET, q, k, v, cu_q, cu_k, max_q, max_k,
                                                           0.0, causal, False)
    assert lse.shape == (q.shape[1], q.shape[0])
    out_fa, lse_fa = triflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal,
                                                     return_attn_probs=True)
    assert torch.equal(out, out_fa) and torch.equal(lse, lse_fa)
    out_ref, _ = attention_varlen_ref(q, k, v, cu_q, cu_k, causal=causal)
    out_lowp, _ = attention_varlen_ref(q, k, v, cu_q, cu_k, causal=causal, upcast=False)
    assert max_err(out, out_ref) <= fa_tolerance(out_ref, out_lowp)

    dout = torch.randn_like(out)
    grads = kernels.flash_backward(KEYSET, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, causal,
                                   rng_state, unused)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    grads_ref = torch.autograd.grad(attention_varlen_ref(*leaves, cu_q, cu_k, causal=causal)[0], leaves, dout)
    grads_lowp = torch.autograd.grad(attention_varlen_ref(*leaves, cu_q, cu_k, causal=causal, upcast=False)[0],
                                     leaves, dout)
    assert_grads_match(grads, grads_ref, grads_lowp)


@served_here
def test_flash_forward_inplace():
    """``_flash_attention_forward_no_dropout_inplace`` (torch >= 2.13): into the given out."""
    q, k, v, cu_q, cu_k, max_q, max_k = _varlen_inputs()
    kernels = _kernels()
    out, lse, *_ = kernels.flash_forward(KEYSET, q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False)
    out2 = torch.full_like(q, float("nan"))
    lse2 = kernels.flash_forward_inplace(KEYSET, out2, q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False,
                                         seqused_k=None, block_table=None, num_splits=None)
    assert torch.equal(out2, out) and torch.equal(lse2, lse)


# ---- what goes to the previous kernel -------------------------------------------------------

def _sdpa_call(d=64, dtype=torch.float16, dropout_p=0.0, return_debug_mask=False):
    q, k, v = _sdpa_inputs(1, 2, 2, 9, 9, d, "bshd", dtype=dtype)
    return (q, k, v, dropout_p, True, return_debug_mask)


FALLBACKS = {
    "dropout": (_sdpa_call(dropout_p=0.1), "dropout"),
    "headdim-512": (_sdpa_call(d=512), "head dims"),
    "headdim-36": (_sdpa_call(d=36), "head dims"),
    "fp32": (_sdpa_call(dtype=torch.float32), "dtype"),
    "debug-mask": (_sdpa_call(return_debug_mask=True), "return_debug_mask"),
}


@pytest.mark.parametrize("case", list(FALLBACKS))
def test_sdpa_fallbacks(case):
    args, why = FALLBACKS[case]
    fake = FakeKernel()
    kernels = _kernels(**{SDPA_FWD: fake})
    assert kernels.sdpa_forward(KEYSET, *args, scale=0.125) == "fallback"
    (keyset, got_args, got_kwargs), = fake.calls
    assert keyset is KEYSET and got_kwargs == {"scale": 0.125}
    assert len(got_args) == len(args) and all(a is b for a, b in zip(got_args, args))
    assert sdpa.last_fallback[0] == SDPA_FWD and why in sdpa.last_fallback[1]


def test_sdpa_backward_fallback_and_no_previous_kernel():
    q, k, v = _sdpa_inputs(1, 2, 2, 9, 9, 64, "bshd")
    out, lse = torch.zeros_like(q), torch.zeros(1, 2, 9)
    args = (q, q, k, v, out, lse, None, None, 9, 9, 0.1, False, None, None)
    fake = FakeKernel()
    assert _kernels(**{SDPA_FWD + "_backward": fake}).sdpa_backward(KEYSET, *args) == "fallback"
    assert all(a is b for a, b in zip(fake.calls[0][1], args)) and fake.calls[0][2] == {"scale": None}
    with pytest.raises(NotImplementedError, match="dropout_p > 0"):
        _kernels().sdpa_backward(KEYSET, *args)  # no previous kernel: torch's own error kind


@served_here
@pytest.mark.parametrize("kwargs,why", [
    (dict(alibi_slopes=torch.ones(4)), "alibi_slopes"),
    (dict(block_table=torch.zeros(2, 1, dtype=torch.int32)), "block_table"),  # torch >= 2.13
    (dict(a_future_argument=1), "a_future_argument"),
])
def test_flash_forward_fallbacks(kwargs, why):
    q, k, v, cu_q, cu_k, max_q, max_k = _varlen_inputs()
    fake = FakeKernel()
    kernels = _kernels(_flash_attention_forward=fake)
    args = (q, k, v, cu_q, cu_k, max_q, max_k, 0.0, False, False)
    assert kernels.flash_forward(KEYSET, *args, **kwargs) == "fallback"
    (_, got_args, got_kwargs), = fake.calls
    assert len(got_args) == len(args) and all(a is b for a, b in zip(got_args, args))
    assert all(got_kwargs[name] is value for name, value in kwargs.items())
    assert why in sdpa.last_fallback[1]
    # num_splits is a hint: served
    assert kernels.flash_forward(KEYSET, *args, num_splits=4)[0].shape == q.shape


def test_device_decisions(monkeypatch):
    if INTERPRETING:
        assert sdpa._device_reason(torch.device("cpu")) == ""  # (these tests)
    assert "meta" in sdpa._device_reason(torch.device("meta"))
    monkeypatch.setattr(sdpa, "_DEVICE_REASONS", {})
    monkeypatch.setattr(dispatch, "target_of", lambda device: "default")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    assert "A100 is not sm90" in sdpa._device_reason(torch.device("cuda", 0))
    monkeypatch.setattr(sdpa, "_DEVICE_REASONS", {})
    monkeypatch.setattr(dispatch, "target_of", lambda device: "sm90")
    assert sdpa._device_reason(torch.device("cuda", 0)) == ""
    # CPU tensors without the interpreter go to the previous kernel
    monkeypatch.setattr(dispatch, "interpreting", lambda: False)
    fake = FakeKernel()
    q = torch.randn(1, 2, 9, 64, dtype=torch.float16)
    assert _kernels(**{SDPA_FWD: fake}).sdpa_forward(KEYSET, q, q, q) == "fallback"
    assert "device cpu" in sdpa.last_fallback[1]


# ---- the whole cycle through torch's dispatcher (CPU key) ----------------------------------

@needs_registry
@served_here
def test_activate_call_restore_through_the_dispatcher(monkeypatch):
    """activate -> aten's ops (and their autograd formulas) -> restore. On the CPU key there
    is no kernel before ours (an unserved call raises, as without ours); on CUDA, torch's."""
    monkeypatch.setattr(sdpa, "_DISPATCH_KEY", "CUDA" if ON_GPU else "CPU")
    monkeypatch.setattr(sdpa, "last_fallback", None)
    q, k, v = (x.requires_grad_() for x in _sdpa_inputs(2, 4, 2, 37, 37, 64, "bshd"))
    attention.activate_flash_attention_impl("triflash")
    try:
        assert attention.current_flash_attention_impl() == "triflash"
        out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, is_causal=True)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)  # aten's formula -> the backward op
        out_ref, lse_ref, out_lowp = _ref(q, k, v, causal=True)
        assert_forward_matches(out, lse, out_ref, lse_ref, out_lowp)
        assert_grads_match(grads, *_ref_grads(q, k, v, dout, causal=True))

        # _flash_attention_forward with a window, and its backward, through autograd
        t = (lambda x: x.detach().transpose(1, 2).requires_grad_())
        qf, kf, vf = t(q), t(k), t(v)
        out_f, *_ = torch.ops.aten._flash_attention_forward(qf, kf, vf, None, None, 37, 37, 0.0, True, False,
                                                            window_size_left=7)
        out_ref, _ = attention_ref(qf, kf, vf, causal=True, window_size=(7, -1))
        out_lowp, _ = attention_ref(qf, kf, vf, causal=True, window_size=(7, -1), upcast=False)
        assert max_err(out_f, out_ref) <= fa_tolerance(out_ref, out_lowp)
        dout_f = torch.randn_like(out_f)
        grads_f = torch.autograd.grad(out_f, (qf, kf, vf), dout_f)
        grads_ref = torch.autograd.grad(out_ref, (qf, kf, vf), dout_f)
        grads_lowp = torch.autograd.grad(out_lowp, (qf, kf, vf), dout_f)
        assert_grads_match(grads_f, grads_ref, grads_lowp)

        assert sdpa.last_fallback is None
        # not served: to the kernel before ours (on the CPU key, none)
        if ON_GPU:
            torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.5)
        else:
            with pytest.raises(NotImplementedError, match="dropout_p > 0"):
                torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.5)
        # (on a GPU torch's own SDPA kernel calls _flash_attention_forward, which falls back too)
        assert sdpa.last_fallback in ((SDPA_FWD, "dropout_p > 0"), ("_flash_attention_forward", "dropout_p > 0"))
    finally:
        attention.restore_flash_attention_impl()
    assert attention.current_flash_attention_impl() is None and sdpa._active is None
    sdpa.last_fallback = None
    if ON_GPU:  # torch's kernel, not ours
        torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.5)
        assert sdpa.last_fallback is None
    else:
        with pytest.raises(NotImplementedError, match="CPU"):  # torch's (absent) CPU kernel again
            torch.ops.aten._scaled_dot_product_flash_attention(q, k, v)


def test_flash_first():
    flash, cudnn, eff, math = (int(b) for b in (torch.nn.attention.SDPBackend.FLASH_ATTENTION,
                               torch.nn.attention.SDPBackend.CUDNN_ATTENTION,
                               torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION,
                               torch.nn.attention.SDPBackend.MATH))
    assert sdpa._flash_first([cudnn, flash, eff, math]) == [flash, cudnn, eff, math]  # torch's sm90 order
    assert sdpa._flash_first([eff, cudnn, math, flash]) == [eff, flash, cudnn, math]
    assert sdpa._flash_first([flash, eff, math, cudnn]) is None  # flash ahead already
    assert sdpa._flash_first([eff, math]) is None


class _TorchPriority:
    """torch's SDPA priority order as ``sdp_utils.cpp`` keeps it: a default set by the
    context, replaced once, at the first choice of a backend on a GPU, by ``installed``
    (cuDNN first on sm90)."""

    def __init__(self, default, installed):
        self.order, self.installed, self.init, self.choices = list(default), installed, False, 0

    def get(self):
        return list(self.order)

    def set(self, order):
        self.order = list(order)

    def choose(self, q, k, v, *args, **kwargs):
        self.choices += 1
        if not self.init:
            self.init = True
            self.order = list(self.installed)
        return self.order[0]


def test_activation_puts_flash_ahead_of_cudnn_on_sm90(monkeypatch):
    """Where torch tries cuDNN first (sm90, recent cuDNN), a plain SDPA call reaches the
    flash backend only if activation moves flash ahead; restoring puts torch's order back
    unless something changed it in between. Elsewhere (another GPU, the CPU key) nothing."""
    SDPBackend = torch.nn.attention.SDPBackend
    flash, cudnn, eff, math = (int(SDPBackend.FLASH_ATTENTION), int(SDPBackend.CUDNN_ATTENTION),
                               int(SDPBackend.EFFICIENT_ATTENTION), int(SDPBackend.MATH))
    torch_sm90 = [cudnn, flash, eff, math]
    prio = _TorchPriority([flash, eff, math, cudnn], torch_sm90)
    monkeypatch.setattr(torch._C, "_get_sdp_priority_order", prio.get)
    monkeypatch.setattr(torch._C, "_set_sdp_priority_order", prio.set)
    monkeypatch.setattr(torch, "_fused_sdp_choice", prio.choose)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch, "zeros", lambda *a, **kw: None)  # (no CUDA tensor here)
    target = {"t": "sm90"}
    monkeypatch.setattr(dispatch, "target_of", lambda device: target["t"])

    assert sdpa._prefer_flash("CPU") is None and prio.choices == 0
    priority = sdpa._prefer_flash("CUDA")
    assert prio.init, "torch's one-time default must be installed before the order is set"
    assert priority == (torch_sm90, [flash, cudnn, eff, math]) and prio.get() == [flash, cudnn, eff, math]
    assert prio.choose(None, None, None) == flash  # a later choice keeps it
    sdpa._Handle(None, None, (), "CUDA", priority).remove()
    assert prio.get() == torch_sm90

    priority = sdpa._prefer_flash("CUDA")
    prio.set([math, flash, cudnn, eff])  # the user's own order after activation: left alone
    sdpa._Handle(None, None, (), "CUDA", priority).remove()
    assert prio.get() == [math, flash, cudnn, eff]

    prio.set(torch_sm90)
    target["t"] = "default"  # not sm90: triflash hands every call on, the order stays torch's
    assert sdpa._prefer_flash("CUDA") is None and prio.get() == torch_sm90


# ---- on an sm90 GPU: F.scaled_dot_product_attention -------------------------------------

def _kernel_names(fn):
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        result = fn()
        torch.cuda.synchronize()
    return result, {e.name for e in prof.events()}


TRIFLASH_KERNELS = ("hopper_fwd_kernel", "hopper_bwd", "hopper_dq_kernel", "flash_fwd_kernel", "bwd_dkdv_kernel")


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@needs_registry
@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_sdpa_on_gpu(d, causal, gqa, monkeypatch):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    monkeypatch.setattr(sdpa, "last_fallback", None)
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the backend serves sm90 GPUs; elsewhere every call goes to torch's kernel")
    b, h, s = 2, 16, 1024
    hk = 4 if gqa else h
    q, k, v = (x.requires_grad_() for x in _sdpa_inputs(b, h, hk, s, s, d, "bshd", dtype=torch.bfloat16))
    dout = torch.randn(b, h, s, d, generator=torch.Generator().manual_seed(5)).to(DEVICE, torch.bfloat16)

    def run():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
        return out, torch.autograd.grad(out, (q, k, v), dout)

    attention.activate_flash_attention_impl("triflash")
    try:
        assert attention.current_flash_attention_impl() == "triflash"
        (out, grads), names = _kernel_names(run)
        assert sdpa.last_fallback is None or sdpa.last_fallback[0] != SDPA_FWD, sdpa.last_fallback
    finally:
        attention.restore_flash_attention_impl()
    assert any("hopper_fwd_kernel" in n for n in names), sorted(names)
    assert any("hopper_bwd" in n or "hopper_dq" in n for n in names), sorted(names)
    assert not any("pytorch_flash" in n for n in names), sorted(names)

    out_ref, _, out_lowp = _ref(q, k, v, causal=causal)
    assert max_err(out, out_ref) <= fa_tolerance(out_ref, out_lowp)
    assert_grads_match(grads, *_ref_grads(q, k, v, dout, causal=causal))

    # restored: torch's own flash kernel, none of triflash's
    (out_builtin, _), names = _kernel_names(run)
    assert any("flash" in n for n in names) and not any(n.startswith(TRIFLASH_KERNELS) for n in names), sorted(names)
    assert max_err(out_builtin, out_ref) <= fa_tolerance(out_ref, out_lowp)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@needs_registry
def test_plain_sdpa_call_runs_triflash_on_gpu(monkeypatch):
    """Activation alone, no sdpa_kernel: a plain F.scaled_dot_product_attention call on sm90
    runs triflash (torch would try cuDNN first there), and restoring gives torch back its
    priority order."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the backend serves sm90 GPUs; elsewhere every call goes to torch's kernel")
    q, k, v = _sdpa_inputs(2, 16, 4, 1024, 1024, 128, "bshd", dtype=torch.bfloat16)
    F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # torch's order installed
    before = torch._C._get_sdp_priority_order()
    attention.activate_flash_attention_impl("triflash")
    try:
        out, names = _kernel_names(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    finally:
        attention.restore_flash_attention_impl()
    assert any("hopper_fwd_kernel" in n for n in names), sorted(names)
    assert torch._C._get_sdp_priority_order() == before
    out_ref, _, out_lowp = _ref(q, k, v, causal=True)
    assert max_err(out, out_ref) <= fa_tolerance(out_ref, out_lowp)


# ---- torch's context parallelism over triflash (one GPU) -----------------------------------
#
# torch.distributed.tensor.experimental.context_parallel shards the buffers it is given along
# the sequence and patches F.scaled_dot_product_attention: its inputs become DTensors, and
# torch's ring (_templated_ring_attention, _templated_ring_attention_backward) calls
# aten._scaled_dot_product_flash_attention and its backward on the local shards once per ring
# step; triflash's override serves those calls. With one rank the ring has one step (the
# whole causal or full block, nothing rotated); the steps with another rank's K/V block (a
# rectangle, not causal: all local queries against half the block, or half the queries
# against all of it, under torch's head-tail load balancing) need a second rank.

def _record_runs(module):
    """Wrap ``module.run_fwd`` / ``run_bwd`` (triflash.dispatch): returns the list that gets
    (kind, seqlen_q, seqlen_k, causal) of every forward / backward triflash runs, and a
    function that restores them."""
    runs, fwd, bwd = [], module.run_fwd, module.run_bwd

    def note(kind, params):
        runs.append((kind, params.max_seqlen_q, params.max_seqlen_k, params.window_right == 0))

    def run_fwd(*args, **kwargs):
        note("fwd", args[7])
        return fwd(*args, **kwargs)

    def run_bwd(*args, **kwargs):
        note("bwd", args[10])
        return bwd(*args, **kwargs)
    module.run_fwd, module.run_bwd = run_fwd, run_bwd

    def restore():
        module.run_fwd, module.run_bwd = fwd, bwd
    return runs, restore


def _torch_context_parallel(mesh, q, k, v, dout, causal, gqa):
    """F.scaled_dot_product_attention forward and backward under torch's context_parallel:
    q, k, v, dout (batch, heads, seqlen, dim) sharded along the sequence (torch's head-tail
    load balancing when causal; torch refuses it otherwise); returns the unsharded out, dq,
    dk, dv."""
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import _cp_options, context_parallel_unshard
    from torch.nn.attention import SDPBackend, sdpa_kernel
    previous, sdpa_fn = _cp_options.enable_load_balance, F.scaled_dot_product_attention
    _cp_options.enable_load_balance = causal
    try:
        cp_q, cp_k, cp_v, cp_dout = (x.detach().clone() for x in (q, k, v, dout))
        with context_parallel(mesh, buffers=[cp_q, cp_k, cp_v, cp_dout], buffer_seq_dims=[2, 2, 2, 2]):
            leaves = (cp_q, cp_k, cp_v)
            for x in leaves:
                x.requires_grad_()
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                out = F.scaled_dot_product_attention(cp_q, cp_k, cp_v, is_causal=causal, enable_gqa=gqa)
            out.backward(cp_dout)
            grads = [x.grad for x in leaves]
            for x in leaves:  # (context_parallel restores the buffers with resize_)
                x.requires_grad_(False)
        return context_parallel_unshard(mesh, [out.detach()] + grads, [2, 2, 2, 2])
    finally:
        _cp_options.enable_load_balance = previous
        F.scaled_dot_product_attention = sdpa_fn  # (context_parallel leaves its patch when its body raises)


def _torch_cp_inputs(d, causal, gqa, seqlen, dtype=torch.bfloat16, heads=8, seed=6):
    """q, k, v, dout (batch 2, ``heads`` query heads, a quarter of them KV heads with gqa),
    contiguous (batch, heads, seqlen, dim)."""
    q, k, v = _sdpa_inputs(2, heads, heads // 4 if gqa else heads, seqlen, seqlen, d, "bhsd", dtype=dtype, seed=seed)
    dout = _rand(*q.shape, dtype=dtype, g=torch.Generator().manual_seed(seed + 1))
    return q, k, v, dout


def _expected_runs(world, rank, seqlen, causal):
    """What torch's ring hands triflash on rank ``rank``: (kind, seqlen_q, seqlen_k, causal)
    per ring step, forward then backward. Causal (head-tail load balancing, the rank holding
    chunks rank and 2 * world - 1 - rank): step 0 the causal diagonal; a later step all local
    queries against the first chunk of an earlier rank's K/V, or the second half of the local
    queries against all of a later rank's. Not causal: every step the whole local block."""
    local = seqlen // world
    steps = []
    for i in range(world):
        if not causal:
            steps.append((local, local, False))
        elif i == 0:
            steps.append((local, local, True))
        elif i <= rank:
            steps.append((local, local // 2, False))
        else:
            steps.append((local // 2, local, False))
    return [("fwd",) + s for s in steps] + [("bwd",) + s for s in steps]


def _check_torch_cp(got, q, k, v, dout, causal):
    out, dq, dk, dv = got
    assert out.shape == q.shape and not out.isnan().any()
    out_ref, _, out_lowp = _ref(q, k, v, causal=causal)
    err, tol = max_err(out, out_ref), fa_tolerance(out_ref, out_lowp)
    assert err <= tol, f"out: max error {err} > tolerance {tol}"
    assert_grads_match((dq, dk, dv), *_ref_grads(q, k, v, dout, causal=causal))


def _torch_ring_functions():
    """torch's ring (private: torch/distributed/tensor/experimental/_context_parallel/
    _attention.py at torch 2.11), or None where it moved."""
    try:
        from torch.distributed.tensor.experimental._context_parallel import _attention
        return (_attention._cp_options, _attention._templated_ring_attention,
                _attention._templated_ring_attention_backward)
    except (ImportError, AttributeError):
        return None


def _cp_shard_index(seqlen, world, rank, causal):
    """The sequence positions rank ``rank`` holds: torch's head-tail load balancing under
    causal (chunks rank and 2 * world - 1 - rank of 2 * world), else contiguous."""
    if not causal:
        return torch.arange(rank * seqlen // world, (rank + 1) * seqlen // world)
    c = seqlen // (2 * world)
    return torch.cat([torch.arange(rank * c, (rank + 1) * c), torch.arange(seqlen - (rank + 1) * c, seqlen - rank * c)])


TORCH_RING_CASES = {"causal": (True, 36), "full": (False, 34)}  # (causal, seqlen): 2 ranks, odd chunks


def _torch_ring_worker(rank, world, tmp, names):
    import torch.distributed as dist
    cp_options, ring_fwd, ring_bwd = _torch_ring_functions()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{_store(tmp, names)}", rank=rank, world_size=world)
    handle = sdpa.activate_kernels("CPU")  # aten's flash ops on CPU tensors: triflash under the interpreter
    runs, restore = _record_runs(dispatch)
    aten = torch.ops.aten
    try:
        for name in names:
            causal, seqlen = TORCH_RING_CASES[name]
            cp_options.enable_load_balance = causal
            idx = _cp_shard_index(seqlen, world, rank, causal)
            q, k, v, dout = (x[:, :, idx].contiguous() for x in torch.load(f"{tmp}/{name}.pt"))
            runs.clear()
            out, lse, *rest = ring_fwd(dist.group.WORLD, 2, aten._scaled_dot_product_flash_attention, q, k, v,
                                       is_causal=causal, dropout_p=0.0, scale=None)
            cum_q, cum_k, max_q, max_k, rng_state, unused, _ = rest
            dq, dk, dv, *_ = ring_bwd(dist.group.WORLD, 2, aten._scaled_dot_product_flash_attention_backward.default,
                                      grad_out=dout, grad_out_name="grad_out", query=q, key=k, value=v, out=out,
                                      logsumexp=lse, is_causal=causal, cum_seq_q=cum_q, cum_seq_k=cum_k, max_q=max_q,
                                      max_k=max_k, dropout_p=0.0, philox_seed=rng_state, philox_offset=unused,
                                      scale=None)
            torch.save(dict(got=[out, dq, dk, dv], runs=list(runs), fallback=sdpa.last_fallback),
                       f"{tmp}/{name}.rank{rank}.pt")
        # neither rank tears the group down while the other's last exchange is in flight (a
        # gloo thread still joinable at teardown aborts the process: "terminate called without
        # an active exception", once in CI under torch 2.12)
        dist.barrier()
    finally:
        restore()
        handle.remove()
        dist.destroy_process_group()


_TWO_RANK_RESULTS = {}


def _store(tmp, names):
    """The rendezvous file of the group that runs ``names``."""
    import zlib
    return f"{tmp}/store-{zlib.crc32(' '.join(names).encode()):08x}"


def _two_rank_results(worker, key, cases, name, request, tmp_path_factory, inputs):
    """The 2 ranks' results of case ``name``: ``worker(rank, 2, directory, names)`` spawned
    once for the cases of ``cases`` this session runs (pytest-xdist workers share its
    files), each case's inputs ``inputs(*cases[case])`` (CPU) saved for it."""
    import torch.multiprocessing as mp
    from conftest import selected_params, shared_results_dir
    if (key, name) not in _TWO_RANK_RESULTS:
        names = selected_params(request, "name", cases)
        names += [] if name in names else [name]

        def produce(tmp, missing):
            for n in missing:
                torch.save([x.cpu() for x in inputs(*cases[n])], f"{tmp}/{n}.pt")
            mp.start_processes(worker, args=(2, tmp, missing), nprocs=2, start_method="spawn")
        tmp = shared_results_dir(tmp_path_factory, key, names, produce)
        for n in names:
            _TWO_RANK_RESULTS[(key, n)] = [torch.load(f"{tmp}/{n}.rank{r}.pt") for r in range(2)]
    return _TWO_RANK_RESULTS[(key, name)]


@needs_registry
@pytest.mark.skipif(ON_GPU, reason="CPU tensors under the interpreter; on a GPU: test_torch_context_parallel_*")
@pytest.mark.skipif(_torch_ring_functions() is None, reason="torch's private ring functions moved (2.11's place)")
@pytest.mark.parametrize("name", list(TORCH_RING_CASES))
def test_torch_ring_steps_on_cpu(name, request, tmp_path_factory):
    """The ring torch's context_parallel runs (its private _templated_ring_attention and
    _backward), called as context_parallel calls them, over 2 gloo ranks on CPU tensors with
    triflash's kernels on the CPU dispatch key: every step is triflash's, with the shapes
    _expected_runs says (the GPU tests assert the same), and the merged result passes FA3's
    rule against attention over the whole sequence."""
    causal, seqlen = TORCH_RING_CASES[name]
    per_rank = _two_rank_results(_torch_ring_worker, "torch_ring", TORCH_RING_CASES, name, request, tmp_path_factory,
                                 lambda causal, seqlen: _torch_cp_inputs(32, causal, True, seqlen, dtype=torch.float16,
                                                                         heads=4))
    q, k, v, dout = _torch_cp_inputs(32, causal, True, seqlen, dtype=torch.float16, heads=4)
    got = [torch.empty_like(x) for x in (q, q, k, v)]
    for rank, result in enumerate(per_rank):
        assert result["fallback"] is None, (rank, result["fallback"])
        assert [tuple(r) for r in result["runs"]] == _expected_runs(2, rank, seqlen, causal), (rank, result["runs"])
        for whole, part in zip(got, result["got"]):
            whole[:, :, _cp_shard_index(seqlen, 2, rank, causal)] = part
    _check_torch_cp(got, q, k, v, dout, causal)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@needs_registry
@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_torch_context_parallel_world_of_one(d, causal, gqa, monkeypatch):
    """torch's context_parallel on a device mesh of one GPU (a process group of one rank),
    triflash activated: SDPA's forward and backward match the fp32 reference (FA3's rule),
    the profiler names triflash's Hopper kernels (and not torch's flash kernel), and the one
    ring step's forward and backward were triflash's, over the whole sequence (odd chunks:
    1001 tokens, 2 x 501 under causal load balancing). The second rank's steps run on 2 gloo
    ranks on the CPU (test_torch_ring_steps_on_cpu): two ranks on one GPU through gloo
    crashed (SIGSEGV in a rank on the H200, gloo moving CUDA tensors), so that test is gone."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the backend serves sm90 GPUs; elsewhere every call goes to torch's kernel")
    monkeypatch.setattr(sdpa, "last_fallback", None)
    seqlen = 1002 if causal else 1001
    q, k, v, dout = _torch_cp_inputs(d, causal, gqa, seqlen)
    assert not dist.is_initialized()
    torch.cuda.set_device(0)
    dist.init_process_group("cpu:gloo,cuda:nccl" if dist.is_nccl_available() else "gloo",
                            store=dist.HashStore(), rank=0, world_size=1)
    runs, restore = _record_runs(dispatch)
    try:
        mesh = init_device_mesh("cuda", (1,))
        attention.activate_flash_attention_impl("triflash")
        try:
            got, names = _kernel_names(lambda: _torch_context_parallel(mesh, q, k, v, dout, causal, gqa))
            assert sdpa.last_fallback is None, sdpa.last_fallback
        finally:
            attention.restore_flash_attention_impl()
    finally:
        restore()
        dist.destroy_process_group()
    assert any("hopper_fwd_kernel" in n for n in names), sorted(names)
    assert any("hopper_bwd" in n or "hopper_dq" in n for n in names), sorted(names)
    assert not any("pytorch_flash" in n for n in names), sorted(names)
    assert runs == _expected_runs(1, 0, seqlen, causal), runs
    _check_torch_cp(got, q, k, v, dout, causal)
