"""FlashAttention-3's call forms (hopper/flash_attn_interface.py, the C++ binding it calls,
hopper/flash_api.cpp, and its tests, hopper/test_flash_attn.py), as a specification: every
argument form FA3 accepts is accepted, and gives what the same call in canonical form gives,
bitwise; where FA3 gives a form a meaning of its own (cache_batch_idx picking page-table rows,
a dense side in the varlen call) the result is also checked against the fp32 reference.

fp16 throughout (the interpreter's bf16 arithmetic is not the GPU's); small odd sizes."""
import inspect

import numpy as np
import pytest
import torch

import triflash
from conftest import DEVICE
from triflash.testing import assert_forward_matches, attention_ref

I32 = dict(dtype=torch.int32, device=DEVICE)


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, torch.float16)


def _qkv(b=2, sq=37, sk=37, h=4, hk=2, d=40, seed=0):
    return _rand(b, sq, h, d, seed=seed), _rand(b, sk, hk, d, seed=seed + 1), _rand(b, sk, hk, d, seed=seed + 2)


def _same(a, b):
    """Bitwise equal outputs: tensors, or tuples of them."""
    if isinstance(a, tuple):
        assert isinstance(b, tuple) and len(a) == len(b)
        return all(_same(x, y) for x, y in zip(a, b))
    return a.shape == b.shape and torch.equal(a, b)


def _cu(lens):
    return torch.tensor([0] + np.cumsum(lens).tolist(), **I32)


# ---- the signatures: FA3's names, order and defaults ------------------------------------------

FA3_SIGNATURES = {  # hopper/flash_attn_interface.py
    "flash_attn_func": "q k v softmax_scale=None causal=False qv=None q_descale=None k_descale=None "
                       "v_descale=None window_size=(-1,-1) attention_chunk=0 softcap=0.0 num_splits=1 "
                       "pack_gqa=None deterministic=False sm_margin=0 return_attn_probs=False",
    "flash_attn_varlen_func": "q k v cu_seqlens_q cu_seqlens_k max_seqlen_q max_seqlen_k seqused_q=None "
                              "seqused_k=None softmax_scale=None causal=False qv=None q_descale=None "
                              "k_descale=None v_descale=None window_size=(-1,-1) attention_chunk=0 "
                              "softcap=0.0 num_splits=1 pack_gqa=None deterministic=False sm_margin=0 "
                              "return_attn_probs=False",
    "flash_attn_qkvpacked_func": "qkv softmax_scale=None causal=False q_descale=None k_descale=None "
                                 "v_descale=None window_size=(-1,-1) attention_chunk=0 softcap=0.0 "
                                 "deterministic=False num_heads_q=None sm_margin=0 return_attn_probs=False",
    "flash_attn_with_kvcache": "q k_cache v_cache k=None v=None qv=None rotary_cos=None rotary_sin=None "
                               "cache_seqlens=None cache_batch_idx=None cache_leftpad=None page_table=None "
                               "cu_seqlens_q=None cu_seqlens_k_new=None max_seqlen_q=None rotary_seqlens=None "
                               "q_descale=None k_descale=None v_descale=None softmax_scale=None causal=False "
                               "window_size=(-1,-1) attention_chunk=0 softcap=0.0 rotary_interleaved=True "
                               "scheduler_metadata=None num_splits=0 pack_gqa=None sm_margin=0 "
                               "return_softmax_lse=False",
    # the low-level pair FA3's module also exports (callers import them by name)
    "_flash_attn_forward": "q k v k_new=None v_new=None qv=None out_=None cu_seqlens_q=None cu_seqlens_k=None "
                           "cu_seqlens_k_new=None seqused_q=None seqused_k=None max_seqlen_q=None "
                           "max_seqlen_k=None page_table=None kv_batch_idx=None leftpad_k=None rotary_cos=None "
                           "rotary_sin=None seqlens_rotary=None q_descale=None k_descale=None v_descale=None "
                           "softmax_scale=None causal=False window_size_left=-1 window_size_right=-1 "
                           "attention_chunk=0 softcap=0.0 rotary_interleaved=True scheduler_metadata=None "
                           "num_splits=1 pack_gqa=None sm_margin=0",
    "_flash_attn_backward": "dout q k v out softmax_lse cu_seqlens_q=None cu_seqlens_k=None sequed_q=None "
                            "sequed_k=None max_seqlen_q=None max_seqlen_k=None dq=None dk=None dv=None "
                            "softmax_scale=None is_causal=False window_size_left=-1 window_size_right=-1 "
                            "softcap=0.0 deterministic=False sm_margin=0",
}


# triflash's keyword-only additions (FA4's names): they change no positional binding
KEYWORD_EXTRAS = {name: ["learnable_sink=None"]
                  for name in ("flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache")}


@pytest.mark.parametrize("name", list(FA3_SIGNATURES))
def test_signature_is_fa3s(name):
    """Same parameter names in the same order with the same defaults: every positional or
    keyword call written for FA3 binds the same way."""
    ours, extras = [], []
    for p in inspect.signature(getattr(triflash, name)).parameters.values():
        if p.kind is inspect.Parameter.KEYWORD_ONLY:  # beyond FA3's: by name only, after all of FA3's
            extras.append(f"{p.name}={p.default!r}")
            continue
        ours.append(p.name if p.default is inspect.Parameter.empty else f"{p.name}={p.default!r}".replace(" ", ""))
    assert ours == FA3_SIGNATURES[name].split()
    assert extras == KEYWORD_EXTRAS.get(name, [])


def test_positional_calls_bind_as_in_fa3():
    q, k, v = _qkv()
    cu = _cu([37, 37])
    kw = dict(softmax_scale=0.2, causal=True, window_size=(9, 0), softcap=4.0, return_attn_probs=True)
    by_name = triflash.flash_attn_func(q, k, v, **kw)
    assert _same(triflash.flash_attn_func(q, k, v, 0.2, True, None, None, None, None, (9, 0), 0, 4.0, 1,
                                          None, False, 0, True), by_name)
    qp, kp, vp = (x.flatten(0, 1) for x in (q, k, v))
    by_name = triflash.flash_attn_varlen_func(qp, kp, vp, cu, cu, 37, 37, **kw)
    assert _same(triflash.flash_attn_varlen_func(qp, kp, vp, cu, cu, 37, 37, None, None, 0.2, True, None,
                                                 None, None, None, (9, 0), 0, 4.0, 1, None, False, 0, True),
                 by_name)


# ---- window_size ------------------------------------------------------------------------------

WINDOW_FORMS = {  # each means (5, 3)
    "list": [5, 3],
    "tuple-of-0d-tensors": (torch.tensor(5), torch.tensor(3)),
    "tensor-randint": torch.tensor([5, 3]),  # FA3's test: torch.randint(0, seqlen_k, (2,))
    "tensor-int32": torch.tensor([5, 3], dtype=torch.int32),
    "numpy-ints": (np.int64(5), np.int32(3)),
    "one-element-tensors": (torch.tensor([5]), 3),
}


def _window_calls():
    """name -> f(window, causal): one call of each public function with that window."""
    q, k, v = _qkv(sq=19, sk=37)
    cu_q, cu_k = _cu([19, 19]), _cu([37, 37])
    qkv = torch.stack(_qkv(b=1, sq=37, hk=4), dim=2)
    lens = torch.tensor([30, 11], **I32)
    return {
        "func": lambda w, c: triflash.flash_attn_func(q, k, v, causal=c, window_size=w, return_attn_probs=True),
        "varlen": lambda w, c: triflash.flash_attn_varlen_func(
            q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_q, cu_k, 19, 37, causal=c, window_size=w),
        "qkvpacked": lambda w, c: triflash.flash_attn_qkvpacked_func(qkv, causal=c, window_size=w),
        "kvcache": lambda w, c: triflash.flash_attn_with_kvcache(
            q[:, :3], k, v, cache_seqlens=lens, causal=c, window_size=w, return_softmax_lse=True),
    }


@pytest.mark.parametrize("fn", ["func", "varlen", "qkvpacked", "kvcache"])
def test_window_size_forms(fn):
    call = _window_calls()[fn]
    want = call((5, 3), False)
    for form, window in WINDOW_FORMS.items():
        assert _same(call(window, False), want), form
    # any negative side is unbounded, as in FA3 (its kernels test "< 0")
    assert _same(call((-7, -2), False), call((-1, -1), False))
    # a side past any sequence is unbounded, up to the largest int32 (the kernels' mask sums
    # of row, shift and window must not wrap)
    assert _same(call((2 ** 31 - 1, 2 ** 31 - 1), False), call((-1, -1), False))
    assert _same(call((2 ** 31 - 1, -1), True), call((-1, -1), True))
    assert _same(call([-3, torch.tensor(-9)], True), call((-1, -1), True))


def test_window_list_is_not_cached_as_a_tuple():
    """The dense fast path's signature cache keys only exact tuples of ints: other forms are
    validated on every call and mean the same."""
    from triflash import interface
    interface._VALIDATED.clear()
    q, k, v = _qkv()
    first = triflash.flash_attn_func(q, k, v, window_size=(5, 3))
    for window in WINDOW_FORMS.values():
        assert _same(triflash.flash_attn_func(q, k, v, window_size=window), first)
    assert len(interface._VALIDATED) == 1
    assert _same(triflash.flash_attn_func(q, k, v, window_size=(5, 3)), first)


# ---- flags and scalars ------------------------------------------------------------------------

TRUE_FORMS = [1, 2, np.bool_(True), np.int64(1), torch.tensor(True), torch.tensor([1])]
FALSE_FORMS = [0, None, np.bool_(False), torch.tensor(0)]


def test_causal_forms():
    """causal is a bool in FA3's C++ schema: its binding reads integers, numpy bools, None and
    one-element tensors by truth value."""
    q, k, v = _qkv(sq=23)
    yes, no = (triflash.flash_attn_func(q, k, v, causal=c, return_attn_probs=True) for c in (True, False))
    for form in TRUE_FORMS:
        assert _same(triflash.flash_attn_func(q, k, v, causal=form, return_attn_probs=True), yes), form
    for form in FALSE_FORMS:
        assert _same(triflash.flash_attn_func(q, k, v, causal=form, return_attn_probs=True), no), form
    lens = torch.tensor([30, 0], **I32)
    want = triflash.flash_attn_with_kvcache(q[:, :4], k, v, cache_seqlens=lens, causal=True)
    assert _same(triflash.flash_attn_with_kvcache(q[:, :4], k, v, cache_seqlens=lens, causal=np.bool_(True)), want)


def test_deterministic_forms_through_the_backward():
    q, k, v = (x.requires_grad_() for x in _qkv(b=1, h=2, hk=1))
    dout = _rand(1, 37, 2, 40, seed=9)

    def grads(det):
        out = triflash.flash_attn_func(q, k, v, causal=True, deterministic=det)
        return torch.autograd.grad(out, (q, k, v), dout)
    want = grads(True)
    for form in (1, np.bool_(True), torch.tensor(True)):
        assert _same(grads(form), want), form
    assert _same(grads(None), grads(False))


def test_rotary_interleaved_forms():
    q, k_cache, v_cache = _qkv(sq=3)
    k_new, v_new = _rand(2, 3, 2, 40, seed=5), _rand(2, 3, 2, 40, seed=6)
    angle = torch.rand(40, 16, generator=torch.Generator().manual_seed(0)).to(DEVICE) * 6.283
    cos, sin = angle.cos().half(), angle.sin().half()

    def call(interleaved):
        kc, vc = k_cache.clone(), v_cache.clone()
        out = triflash.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, rotary_cos=cos, rotary_sin=sin,
                                               cache_seqlens=torch.tensor([4, 30], **I32), causal=True,
                                               rotary_interleaved=interleaved)
        return out, kc
    assert _same(call(0), call(False)) and _same(call(np.bool_(True)), call(True))
    assert not _same(call(0), call(1))


def test_return_flags_by_truth_value():
    """FA3 returns (out, lse) when ``return_attn_probs`` is truthy, (out, lse, out_accum,
    lse_accum) when ``return_softmax_lse`` is."""
    q, k, v = _qkv()
    out, lse = triflash.flash_attn_func(q, k, v, return_attn_probs=1)
    assert lse.shape == (2, 4, 37)
    res = triflash.flash_attn_with_kvcache(q, k, v, return_softmax_lse=1)  # FA3's test's form
    assert len(res) == 4 and res[1].shape == (2, 4, 37)  # (out, lse, out_accum, lse_accum)
    assert res[2].numel() == 0 and res[3].numel() == 0


def test_arguments_fa3_reads_only_with_others():
    """FA3 reads ``cu_seqlens_k_new`` only with new k / v, and the descales only for fp8
    inputs: with neither they change nothing (SGLang passes both unconditionally)."""
    q, k_cache, v_cache = _qkv(sq=1)
    lens = torch.tensor([30, 11], **I32)
    cu_q = torch.tensor([0, 1, 2], **I32)
    want = triflash.flash_attn_with_kvcache(q.flatten(0, 1), k_cache, v_cache, cache_seqlens=lens, cu_seqlens_q=cu_q,
                                            max_seqlen_q=1, causal=True)
    got = triflash.flash_attn_with_kvcache(q.flatten(0, 1), k_cache, v_cache, cache_seqlens=lens, cu_seqlens_q=cu_q,
                                           cu_seqlens_k_new=lens.new_tensor([0, 30, 41]), max_seqlen_q=1,
                                           causal=True)
    assert _same(got, want)
    scale = torch.ones(2, 2, dtype=torch.float32, device=q.device)
    got = triflash.flash_attn_with_kvcache(q.flatten(0, 1), k_cache, v_cache, cache_seqlens=lens, cu_seqlens_q=cu_q,
                                           max_seqlen_q=1, causal=True, q_descale=scale, k_descale=scale,
                                           v_descale=scale)
    assert _same(got, want)
    q, k, v = _qkv()
    assert _same(triflash.flash_attn_func(q, k, v, causal=True, k_descale=scale),
                 triflash.flash_attn_func(q, k, v, causal=True))


@pytest.mark.parametrize("form,canonical", [
    (np.float32(0.25), 0.25), (np.float64(0.125), 0.125), (torch.tensor(0.25), 0.25),
    (1, 1.0), (np.int64(1), 1.0)], ids=repr)
def test_softmax_scale_forms(form, canonical):
    q, k, v = _qkv()
    assert _same(triflash.flash_attn_func(q, k, v, softmax_scale=form, return_attn_probs=True),
                 triflash.flash_attn_func(q, k, v, softmax_scale=canonical, return_attn_probs=True))


@pytest.mark.parametrize("form,canonical", [
    (5, 5.0), (np.float32(5.0), 5.0), (torch.tensor(5.0), 5.0), (torch.tensor(5), 5.0),
    (-1.0, 0.0), (-3, 0.0)], ids=repr)
def test_softcap_forms(form, canonical):
    """softcap: a number in any of FA3's forms; FA3 soft-caps only when softcap > 0 (its
    docstring: "Anything > 0 activates softcapping"), so a negative one is none."""
    q, k, v = _qkv()
    assert _same(triflash.flash_attn_func(q, k, v, softcap=form, causal=True, return_attn_probs=True),
                 triflash.flash_attn_func(q, k, v, softcap=canonical, causal=True, return_attn_probs=True))
    cu = _cu([37, 37])
    qp, kp, vp = (x.flatten(0, 1) for x in (q, k, v))
    assert _same(triflash.flash_attn_varlen_func(qp, kp, vp, cu, cu, 37, 37, softcap=form),
                 triflash.flash_attn_varlen_func(qp, kp, vp, cu, cu, 37, 37, softcap=canonical))


def test_performance_hints_are_accepted():
    """num_splits, pack_gqa, sm_margin (and kvcache's scheduler_metadata) steer FA3's
    scheduling only: any value FA3 takes gives the same output."""
    q, k, v = _qkv()
    want = triflash.flash_attn_func(q, k, v, causal=True)
    for num_splits, pack_gqa, sm_margin in ((0, True, 8), (3, False, 0), (-1, None, 2)):
        assert _same(triflash.flash_attn_func(q, k, v, causal=True, num_splits=num_splits, pack_gqa=pack_gqa,
                                              sm_margin=sm_margin), want)
    lens = torch.tensor([5, 37], **I32)
    want = triflash.flash_attn_with_kvcache(q[:, :1], k, v, cache_seqlens=lens)
    assert _same(triflash.flash_attn_with_kvcache(q[:, :1], k, v, cache_seqlens=lens, num_splits=3,
                                                  pack_gqa=True, sm_margin=4), want)


# ---- integer arguments: max_seqlen, cache_seqlens, num_heads_q --------------------------------

INT_FORMS = {"numpy-int64": np.int64, "numpy-int32": np.int32, "tensor-0d": torch.tensor,
             "tensor-0d-int32": lambda n: torch.tensor(n, dtype=torch.int32), "tensor-1": lambda n: torch.tensor([n])}


@pytest.mark.parametrize("form", list(INT_FORMS))
def test_max_seqlen_forms(form):
    """FA3's tests pass max_seqlen from ``seqlens.max().item()``; its binding also takes numpy
    ints and one-element integer tensors (e.g. ``seqlens.max()`` itself)."""
    as_form = INT_FORMS[form]
    lens_q, lens_k = [7, 0, 19], [37, 5, 23]
    q, k, v = _rand(26, 4, 64, seed=1), _rand(65, 2, 64, seed=2), _rand(65, 2, 64, seed=3)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    want = triflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 19, 37, causal=True, return_attn_probs=True)
    got = triflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, as_form(19), as_form(37), causal=True,
                                          return_attn_probs=True)
    assert _same(got, want)
    k_cache, v_cache = _rand(3, 37, 2, 64, seed=4), _rand(3, 37, 2, 64, seed=5)
    lens = torch.tensor([30, 2, 37], **I32)
    want = triflash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, cu_seqlens_q=cu_q,
                                            max_seqlen_q=19, causal=True)
    assert _same(triflash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, cu_seqlens_q=cu_q,
                                                  max_seqlen_q=as_form(19), causal=True), want)


def test_cache_seqlens_int_forms():
    """cache_seqlens: FA3 takes a Python int (``torch.full``-ed per sequence) or an int32 tensor;
    a numpy int is taken as the int."""
    q, k_cache, v_cache = _qkv(sq=2)
    k_new, v_new = _rand(2, 2, 2, 40, seed=7), _rand(2, 2, 2, 40, seed=8)

    def call(seqlens):
        kc, vc = k_cache.clone(), v_cache.clone()
        return triflash.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=seqlens, causal=True,
                                                return_softmax_lse=True) + (kc, vc)
    want = call(torch.tensor([21, 21], **I32))
    assert _same(call(21), want) and _same(call(np.int64(21)), want) and _same(call(np.int32(21)), want)


def test_num_heads_q_forms():
    qkv = _rand(2, 37, 8, 40)  # 4 query heads, 2 KV heads
    want = triflash.flash_attn_qkvpacked_func(qkv, causal=True, num_heads_q=4)
    for form in (np.int64(4), torch.tensor(4)):
        assert _same(triflash.flash_attn_qkvpacked_func(qkv, causal=True, num_heads_q=form), want)


# ---- varlen with a dense side (cu_seqlens None) ----------------------------------------------

@pytest.mark.parametrize("dense", ["q", "k", "both"])
def test_varlen_with_a_dense_side(dense):
    """FA3's varlen call takes cu_seqlens_q=None with q (batch, seqlen_q, ...) and/or
    cu_seqlens_k=None with k, v (batch, seqlen_k, ...): that side is a batch of equal-length
    sequences (its max_seqlen unused), seqused_q/k still counting from each row's start. Same
    as the packed call with uniform cu_seqlens, forward and backward; a dense q's out and lse
    come back in flash_attn_func's shapes."""
    b, sq, sk, h, hk, d = 3, 13, 37, 4, 2, 40
    q, k, v = _qkv(b=b, sq=sq, sk=sk, h=h, hk=hk, d=d, seed=3)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    seqused_q, seqused_k = torch.tensor([13, 4, 0], **I32), torch.tensor([37, 20, 9], **I32)
    kw = dict(seqused_q=seqused_q, seqused_k=seqused_k, causal=True, window_size=(17, 2), return_attn_probs=True)
    qp, kp, vp = q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)
    want, want_lse = triflash.flash_attn_varlen_func(qp, kp, vp, _cu([sq] * b), _cu([sk] * b), sq, sk, **kw)
    dense_q, dense_k = dense in ("q", "both"), dense in ("k", "both")
    out, lse = triflash.flash_attn_varlen_func(
        q if dense_q else qp, k if dense_k else kp, v if dense_k else vp,
        None if dense_q else _cu([sq] * b), None if dense_k else _cu([sk] * b),
        None if dense_q else sq, None if dense_k else sk, **kw)
    if dense_q:
        assert out.shape == (b, sq, h, d) and lse.shape == (b, h, sq)
        out, lse = out.flatten(0, 1), lse.transpose(0, 1).flatten(1)
    assert _same((out, lse), (want, want_lse))
    dout = _rand(b * sq, h, d, seed=11)
    got_grads = torch.autograd.grad(out, (q, k, v), dout)
    want_grads = torch.autograd.grad(want, (q, k, v), dout)
    assert _same(got_grads, want_grads)


def test_varlen_both_dense_is_flash_attn_func():
    q, k, v = _qkv(sq=19, sk=37)
    kw = dict(causal=True, softcap=3.0, return_attn_probs=True)
    assert _same(triflash.flash_attn_varlen_func(q, k, v, None, None, None, None, **kw),
                 triflash.flash_attn_func(q, k, v, **kw))


# ---- flash_attn_with_kvcache -----------------------------------------------------------------

def test_rotary_seqlens_without_tables_is_ignored():
    """FA3 reads rotary_seqlens only with rotary_cos / rotary_sin (its kvcache test passes it
    whether or not rotary is on)."""
    q, k_cache, v_cache = _qkv(sq=3)
    k_new, v_new = _rand(2, 3, 2, 40, seed=5), _rand(2, 3, 2, 40, seed=6)
    lens = torch.tensor([4, 30], **I32)

    def call(**kw):
        kc, vc = k_cache.clone(), v_cache.clone()
        return triflash.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=lens, causal=True,
                                                return_softmax_lse=True, **kw) + (kc, vc)
    assert _same(call(rotary_seqlens=lens // 2), call())


PAGED_CASES = {
    # name: page size, new keys, varlen q, cache_leftpad, causal, window
    "append-causal": (5, True, False, False, True, (-1, -1)),
    "varlen-leftpad-window": (4, False, True, True, False, (6, 2)),
    "append-varlen-page1": (1, True, True, False, True, (-1, -1)),
}


@pytest.mark.parametrize("case", list(PAGED_CASES))
def test_cache_batch_idx_picks_page_table_rows(case):
    """With a page table, FA3's cache_batch_idx picks its rows: sequence b reads (and appends
    to) the pages of page_table[cache_batch_idx[b]], the table having any number of rows
    (FA3's kvcache test: batch_size_cache = 2 x batch rows). The same as passing the gathered
    rows, bitwise; against the fp32 reference over the equivalent dense caches; the pages of
    rows no sequence picked are untouched."""
    page, new_kv, varlen, use_leftpad, causal, window = PAGED_CASES[case]
    batch, rows, h, hk, d, sq, sn = 3, 5, 4, 2, 64, 4, 3
    pages = 36 // page if page > 1 else 37
    cap = pages * page
    num_blocks = rows * pages + 3
    g = torch.Generator().manual_seed(len(case))
    k_blocks, v_blocks = _rand(num_blocks, page, hk, d, seed=1), _rand(num_blocks, page, hk, d, seed=2)
    table = torch.randperm(num_blocks, generator=g)[:rows * pages].to(**I32).view(rows, pages)
    idx = torch.tensor([3, 0, 4], **I32)
    seqlens = torch.tensor([0, 17, cap - sn], **I32)
    leftpad = torch.tensor([0, 6, 20], **I32) if use_leftpad else None
    q = _rand(batch, sq, h, d, seed=3)
    k_new, v_new = (_rand(batch, sn, hk, d, seed=4), _rand(batch, sn, hk, d, seed=5)) if new_kv else (None, None)
    lens_q = [4, 1, 3] if varlen else [sq] * batch
    cu = _cu(lens_q) if varlen else None
    q_in = torch.cat([q[b, :n] for b, n in enumerate(lens_q)]) if varlen else q

    def logical(blocks):  # (rows, cap, hk, d): each page-table row's cache in order
        return blocks[table.long()].reshape(rows, cap, hk, d)
    k_ref, v_ref = logical(k_blocks)[idx.long()], logical(v_blocks)[idx.long()]
    if new_kv:
        for b in range(batch):
            s0 = int(seqlens[b])
            k_ref[b, s0:s0 + sn], v_ref[b, s0:s0 + sn] = k_new[b], v_new[b]

    def call(tbl, batch_idx):
        kb, vb = k_blocks.clone(), v_blocks.clone()
        out, lse, *_ = triflash.flash_attn_with_kvcache(
            q_in, kb, vb, k_new, v_new, cache_seqlens=seqlens, cache_batch_idx=batch_idx, cache_leftpad=leftpad,
            page_table=tbl, cu_seqlens_q=cu, max_seqlen_q=max(lens_q) if varlen else None, causal=causal,
            window_size=window, return_softmax_lse=True)
        return out, lse, kb, vb
    out, lse, kb, vb = call(table, idx)
    assert _same((out, lse, kb, vb), call(table[idx.long()], None))
    # the caches: each picked row holds the new keys at cache_seqlens, the other rows are untouched
    assert torch.equal(logical(kb)[idx.long()], k_ref) and torch.equal(logical(vb)[idx.long()], v_ref)
    others = [r for r in range(rows) if r not in idx.tolist()]
    assert torch.equal(logical(kb)[others], logical(k_blocks)[others])
    for b in range(batch):
        start, end, n = int(leftpad[b]) if use_leftpad else 0, int(seqlens[b]) + (sn if new_kv else 0), lens_q[b]
        qb, kb_, vb_ = q[b:b + 1, :n], k_ref[b:b + 1, start:end], v_ref[b:b + 1, start:end]
        ref, lse_ref = attention_ref(qb, kb_, vb_, causal=causal, window_size=window)
        lowp, _ = attention_ref(qb, kb_, vb_, causal=causal, window_size=window, upcast=False)
        if varlen:
            o, l_ = out[int(cu[b]):int(cu[b + 1])][None], lse[:, int(cu[b]):int(cu[b + 1])][None]
        else:
            o, l_ = out[b:b + 1], lse[b:b + 1]
        assert_forward_matches(o, l_, ref, lse_ref, lowp)


def test_cache_batch_idx_with_page_table_checked():
    q = _rand(2, 1, 2, 32)
    blocks = _rand(6, 4, 2, 32)
    table = torch.arange(6, **I32).view(3, 2)
    triflash.set_check_inputs(True)
    try:
        with pytest.raises(ValueError, match=r"cache_batch_idx=\[0, 3\] is not supported: .*\[0, 3\) \(page_table rows\)"):
            triflash.flash_attn_with_kvcache(q, blocks, blocks, page_table=table, cache_batch_idx=torch.tensor([0, 3], **I32))
    finally:
        triflash.set_check_inputs(False)
    with pytest.raises(ValueError, match=r"page_table=tensor\(3, 2\) .* is not supported: .*batch=2"):
        triflash.flash_attn_with_kvcache(q, blocks, blocks, page_table=table)  # rows != batch needs cache_batch_idx


# ---- what stays refused ----------------------------------------------------------------------

REFUSED = {  # name: (arguments, exception, message)
    "window-None": (dict(window_size=None), ValueError, r"window_size=None is not supported: expected a pair"),
    "window-None-None": (dict(window_size=(None, None)), ValueError, r"window_size\[0\]=None is not supported: .*FA4"),
    "window-3": (dict(window_size=(4, 2, 0)), ValueError, r"window_size=\(4, 2, 0\) is not supported"),
    "window-float-tensor": (dict(window_size=torch.tensor([4.0, 2.0])), ValueError,
                            r"window_size=tensor\(2,\) torch.float32 is not supported"),
    "window-bool": (dict(window_size=(True, -1)), ValueError, r"window_size\[0\]=True is not supported"),
    "scale-bool": (dict(softmax_scale=True), ValueError, r"softmax_scale=True is not supported"),
    "scale-2-tensor": (dict(softmax_scale=torch.tensor([0.1, 0.2])), ValueError, r"softmax_scale=tensor.* is not supported"),
    "softcap-inf": (dict(softcap=float("inf")), ValueError, r"softcap=inf is not supported"),
    "causal-str": (dict(causal="yes"), TypeError, r"causal=yes is not supported: expected a bool"),
    "causal-float": (dict(causal=1.0), TypeError, r"causal=1.0 is not supported: expected a bool"),
    "deterministic-2-tensor": (dict(deterministic=torch.tensor([1, 1])), TypeError, r"deterministic=tensor.* is not supported"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_refused_forms(name):
    """Forms FA3 refuses (window None: hopper's interface indexes window_size[0] into an int
    argument; FA4 spells unbounded None), and bools or floats FA3's binding would coerce into an
    int or float slot, a misplaced argument (``softmax_scale=True`` is a causal passed where
    FA2 put it)."""
    kw, exc, message = REFUSED[name]
    q, k, v = _qkv(sq=5, sk=5)
    with pytest.raises(exc, match=message):
        triflash.flash_attn_func(q, k, v, **kw)


def test_max_seqlen_refused_forms():
    q = _rand(10, 2, 16)
    cu = _cu([4, 6])
    with pytest.raises(ValueError, match=r"max_seqlen_q=6.0 is not supported: expected an int >= 0"):
        triflash.flash_attn_varlen_func(q, q, q, cu, cu, 6.0, 6)
    with pytest.raises(ValueError, match=r"max_seqlen_k=tensor\(\[6, 6\]\) is not supported"):
        triflash.flash_attn_varlen_func(q, q, q, cu, cu, 6, torch.tensor([6, 6]))
    with pytest.raises(ValueError, match=r"k.shape\[0\]=3 is not supported: .*batch size 2"):
        triflash.flash_attn_varlen_func(q, _rand(3, 5, 2, 16), _rand(3, 5, 2, 16), cu, None, 6, None)


# ---- FA3's low-level pair: _flash_attn_forward / _flash_attn_backward ------------------------

def test_flash_attn_forward_routes_as_fa3s_public_forwards():
    """FA3's public forwards are calls of ``_flash_attn_forward`` with these arguments; each
    gives what the public one gives, bitwise, plus two empty split accumulators."""
    from triflash import _flash_attn_forward
    q, k, v = _qkv()
    scale = 0.3
    want = triflash.flash_attn_func(q, k, v, scale, True, window_size=(9, -1), return_attn_probs=True)
    # FlashAttnFunc's positional call
    got = _flash_attn_forward(q, k, v, None, None, None, None, None, None, None, None, None, None, None, None,
                              None, None, None, None, None, None, None, None, scale, causal=True,
                              window_size_left=9, window_size_right=-1)
    assert len(got) == 4 and got[2].numel() == 0 and got[3].numel() == 0 and _same(got[:2], want)
    out_ = torch.full_like(q, float("nan"))
    got = _flash_attn_forward(q, k, v, out_=out_, softmax_scale=scale, causal=True, window_size_left=9)
    assert got[0] is out_ and _same(got[:2], want)

    lens_q, lens_k = [5, 0, 19], [11, 7, 30]
    qp, kp, vp = _rand(24, 4, 40, seed=3), _rand(48, 2, 40, seed=4), _rand(48, 2, 40, seed=5)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    want = triflash.flash_attn_varlen_func(qp, kp, vp, cu_q, cu_k, 19, 30, causal=True, return_attn_probs=True)
    got = _flash_attn_forward(qp, kp, vp, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=19,
                              max_seqlen_k=30, causal=True)
    assert _same(got[:2], want)

    q1, k_cache, v_cache = _qkv(sq=2)
    k_new, v_new = _rand(2, 2, 2, 40, seed=7), _rand(2, 2, 2, 40, seed=8)
    lens = torch.tensor([21, 9], **I32)
    kc, vc = k_cache.clone(), v_cache.clone()
    want = triflash.flash_attn_with_kvcache(q1, kc, vc, k_new, v_new, cache_seqlens=lens, causal=True,
                                            return_softmax_lse=True)
    kc2, vc2 = k_cache.clone(), v_cache.clone()
    got = _flash_attn_forward(q1, kc2, vc2, k_new, v_new, seqused_k=lens, causal=True)
    assert _same(got, want) and torch.equal(kc2, kc) and torch.equal(vc2, vc)


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_flash_attn_backward_writes_the_gradients(varlen):
    """``_flash_attn_backward`` into poisoned dq / dk / dv: the gradients autograd gives
    through the public forward (deterministic, so bitwise), and softmax_d = rowsum(dout * out)."""
    from triflash import _flash_attn_backward
    if varlen:
        lens_q, lens_k = [5, 0, 19], [11, 7, 30]
        q, k, v = _rand(24, 4, 40, seed=3), _rand(48, 2, 40, seed=4), _rand(48, 2, 40, seed=5)
        cu_q, cu_k = _cu(lens_q), _cu(lens_k)
        fwd = (lambda q, k, v: triflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 19, 30, softmax_scale=0.3,
                                                                causal=True, deterministic=True,
                                                                return_attn_probs=True))
        extra = (cu_q, cu_k, None, None, 19, 30)
    else:
        q, k, v = _qkv(sq=29)
        fwd = (lambda q, k, v: triflash.flash_attn_func(q, k, v, 0.3, True, deterministic=True,
                                                        return_attn_probs=True))
        extra = (None,) * 6
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = fwd(*leaves)
    dout = torch.randn_like(out)
    want = torch.autograd.grad(out, leaves, dout)
    dq, dk, dv = (torch.full_like(x, float("nan")) for x in (q, k, v))
    d = _flash_attn_backward(dout, q, k, v, out.detach(), lse, *extra, dq, dk, dv, 0.3, True,
                             deterministic=True)
    assert all(torch.equal(g, w) for g, w in zip((dq, dk, dv), want))
    rows = (dout.float() * out.detach().float()).sum(-1)
    assert torch.equal(d, rows.t() if varlen else rows.transpose(1, 2))
    with pytest.raises(ValueError, match="cu_seqlens_k"):
        _flash_attn_backward(dout, q, k, v, out.detach(), lse, extra[0] if varlen else torch.zeros(3, **I32))


def test_flash_attn_forward_into_out_keeps_the_gradient():
    from triflash import _flash_attn_forward
    q, k, v = (x.requires_grad_() for x in _qkv())
    buf = torch.empty_like(q)
    out, *_ = _flash_attn_forward(q, k, v, out_=buf, causal=True)
    assert out is buf and out.requires_grad
    dout = torch.randn_like(out)
    want = torch.autograd.grad(triflash.flash_attn_func(q, k, v, causal=True), (q, k, v), dout)
    got = torch.autograd.grad(out, (q, k, v), dout)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_combine_out_dtype_must_match():
    """A given ``out`` and ``out_dtype`` that disagree raise (FA3 checks them too); ``out``
    alone sets the dtype."""
    out_partial = torch.randn(3, 2, 5, 4, 16, device=DEVICE)
    lse_partial = torch.randn(3, 2, 5, 4, device=DEVICE)
    with pytest.raises(TypeError, match="out.dtype"):
        triflash.flash_attn_combine(out_partial, lse_partial, out=torch.empty(2, 5, 4, 16, device=DEVICE).half(),
                                    out_dtype=torch.bfloat16)
    out = torch.empty(2, 5, 4, 16, device=DEVICE).half()
    assert triflash.flash_attn_combine(out_partial, lse_partial, out=out, out_dtype=torch.float16)[0] is out
    assert triflash.flash_attn_combine(out_partial, lse_partial, out=out)[0] is out


# FlashAttention-3's own compatibility pins (its test_flash3_bw_compatibility), written out here
FA3_OP_SCHEMAS = {
    "fwd": "flash_attn_3::fwd(Tensor q, Tensor k, Tensor v, Tensor(k_new!)? k_new=None, "
           "Tensor(v_new!)? v_new=None, Tensor? q_v=None, Tensor(out!)? out=None, "
           "Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, "
           "Tensor? cu_seqlens_k_new=None, Tensor? seqused_q=None, Tensor? seqused_k=None, "
           "int? max_seqlen_q=None, int? max_seqlen_k=None, Tensor? page_table=None, "
           "Tensor? kv_batch_idx=None, Tensor? leftpad_k=None, Tensor? rotary_cos=None, Tensor? rotary_sin=None, "
           "Tensor? seqlens_rotary=None, Tensor? q_descale=None, Tensor? k_descale=None, Tensor? v_descale=None, "
           "float? softmax_scale=None, bool is_causal=False, int window_size_left=-1, int window_size_right=-1, "
           "int attention_chunk=0, float softcap=0., bool is_rotary_interleaved=False, "
           "Tensor? scheduler_metadata=None, int num_splits=0, bool? pack_gqa=None, int sm_margin=0) "
           "-> (Tensor(out!), Tensor, Tensor, Tensor)",
    "bwd": "flash_attn_3::bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor softmax_lse, "
           "Tensor(dq!)? dq=None, Tensor(dk!)? dk=None, Tensor(dv!)? dv=None, Tensor? cu_seqlens_q=None, "
           "Tensor? cu_seqlens_k=None, Tensor? seqused_q=None, Tensor? seqused_k=None, int? max_seqlen_q=None, "
           "int? max_seqlen_k=None, float? softmax_scale=None, bool is_causal=False, int window_size_left=-1, "
           "int window_size_right=-1, float softcap=0., bool deterministic=False, int sm_margin=0) "
           "-> (Tensor(dq!), Tensor(dk!), Tensor(dv!), Tensor, Tensor, Tensor, Tensor, Tensor)",
    "fwd_combine": "flash_attn_3::fwd_combine(Tensor out_partial, Tensor lse_partial, Tensor(out!)? out=None, "
                   "ScalarType? out_dtype=None) -> (Tensor(out!), Tensor)",
    "get_scheduler_metadata": "flash_attn_3::get_scheduler_metadata(int batch_size, int max_seqlen_q, "
                              "int max_seqlen_k, int num_heads, int num_heads_k, int headdim, int headdim_v, "
                              "ScalarType qkv_dtype, Tensor seqused_k, Tensor? cu_seqlens_q=None, "
                              "Tensor? cu_seqlens_k=None, Tensor? cu_seqlens_k_new=None, Tensor? seqused_q=None, "
                              "Tensor? leftpad_k=None, int? page_size=None, int max_seqlen_k_new=0, "
                              "bool is_causal=False, int window_size_left=-1, int window_size_right=-1, "
                              "int attention_chunk=0, bool has_softcap=False, int num_splits=0, "
                              "bool? pack_gqa=None, int sm_margin=0) -> Tensor",
}


def _fa3_ops():
    from triflash.integrations import fa3_ops
    if not fa3_ops.register():
        pytest.skip("FlashAttention-3 itself is installed: torch.ops.flash_attn_3 are its own")
    return torch.ops.flash_attn_3


@pytest.mark.parametrize("name", list(FA3_OP_SCHEMAS))
def test_fa3_operator_schemas(name):
    from torch._C import parse_schema
    op = getattr(_fa3_ops(), name).default
    assert op._schema.is_backward_compatible_with(parse_schema(FA3_OP_SCHEMAS[name]))


def test_fa3_operators_compute_what_the_functions_do():
    ops = _fa3_ops()
    q, k, v = _qkv()
    out, lse = triflash.flash_attn_func(q, k, v, causal=True, window_size=(9, -1), return_attn_probs=True)
    given = torch.full_like(out, float("nan"))
    res = ops.fwd(q, k, v, out=given, is_causal=True, window_size_left=9)
    assert len(res) == 4 and res[0].data_ptr() == given.data_ptr()
    assert _same((res[0], res[1]), (out, lse)) and res[2].numel() == 0 and res[3].numel() == 0
    # varlen and the KV cache through the same operator, as FA3's C++ entry point takes them
    lens = [5, 30]
    cu = _cu(lens)
    qp, kp, vp = (torch.cat([x[b, :n] for b, n in enumerate(lens)]) for x in (q, k, v))
    res = ops.fwd(qp, kp, vp, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=30, max_seqlen_k=30, is_causal=True)
    assert _same(res[0], triflash.flash_attn_varlen_func(qp, kp, vp, cu, cu, 30, 30, causal=True))
    seqlens = torch.tensor([20, 37], **I32)
    res = ops.fwd(q[:, :1], k, v, seqused_k=seqlens, is_causal=True, num_splits=1)
    assert _same(res[0], triflash.flash_attn_with_kvcache(q[:, :1], k, v, cache_seqlens=seqlens, causal=True,
                                                          num_splits=1))
    # backward: FA3's eight returns, gradients those of autograd
    dout = _rand(*out.shape, seed=9)
    dq, dk, dv, softmax_d, lse_log2, *accums = ops.bwd(dout, q, k, v, out, lse, is_causal=True, window_size_left=9)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    triflash.flash_attn_func(qg, kg, vg, causal=True, window_size=(9, -1)).backward(dout)
    assert _same((dq, dk, dv), (qg.grad, kg.grad, vg.grad))
    assert torch.allclose(softmax_d, (dout.float() * out.float()).sum(-1).transpose(1, 2), atol=1e-3)
    assert torch.allclose(lse_log2, lse * 1.4426950408889634) and all(a.numel() == 0 for a in accums)
    parts, part_lse = torch.randn(3, 2, 5, 4, 16, device=DEVICE), torch.randn(3, 2, 5, 4, device=DEVICE)
    assert _same(ops.fwd_combine(parts, part_lse, out_dtype=torch.float16),
                 triflash.flash_attn_combine(parts, part_lse, out_dtype=torch.float16))
    plan = ops.get_scheduler_metadata(2, 1, 37, 4, 2, 40, 40, torch.float16, seqlens)
    assert _same(plan, triflash.get_scheduler_metadata(2, 1, 37, 4, 2, 40, seqlens, torch.float16))


def test_fa3_operators_trace_with_fake_tensors():
    ops = _fa3_ops()
    q, k, v = _qkv()
    for op, args in ((ops.fwd.default, (q, k, v)), (ops.bwd.default, (q, q, k, v, q, _rand(2, 4, 37, seed=3).float())),
                     (ops.fwd_combine.default, (torch.randn(3, 2, 5, 4, 16, device=DEVICE),
                                                torch.randn(3, 2, 5, 4, device=DEVICE)))):
        assert torch.library.opcheck(op, args, {}, test_utils=("test_schema", "test_faketensor")) == \
            {"test_schema": "SUCCESS", "test_faketensor": "SUCCESS"}
