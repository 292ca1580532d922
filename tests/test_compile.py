"""Ecosystem fit: torch.library ops pass opcheck, and torch.compile(fullgraph=True) traces
flash_attn_func / flash_attn_varlen_func (forward and backward) without graph breaks."""
import torch

import triflash
from triflash.testing import max_err

from conftest import DEVICE

# On the CPU the interpreter runs the kernels; aot_eager traces through AOTAutograd (the
# fake implementations and the autograd formula) without compiling C++.
BACKEND = "inductor" if DEVICE == "cuda" else "aot_eager"


def _qkv(b=1, sq=33, sk=47, h=2, hk=1, d=32, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, s, n, d, generator=g).to(DEVICE, dtype).requires_grad_()
            for s, n in ((sq, h), (sk, hk), (sk, hk))]


def test_opcheck_fwd_and_bwd():
    q, k, v = _qkv()
    args = (q, k, v, None, None, None, None, [33, 47, -1, 0, 0], [32 ** -0.5, 0.0])
    torch.library.opcheck(torch.ops.triflash.fwd.default, args)
    out, lse = torch.ops.triflash.fwd(*args)
    dout = torch.randn_like(out)
    bwd_args = (dout, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), None, None, None, None,
                [33, 47, -1, 0, 1], [32 ** -0.5, 0.0])
    torch.library.opcheck(torch.ops.triflash.bwd.default, bwd_args,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


def test_compile_fullgraph_no_graph_breaks():
    q, k, v = _qkv()

    def layer(q, k, v):
        out = triflash.flash_attn_func(q, k, v, causal=True, window_size=(20, -1), softcap=5.0,
                                       deterministic=True)  # bitwise comparable grads
        return (out.float() * 2).sum()

    compiled = torch.compile(layer, fullgraph=True, backend=BACKEND)
    loss = compiled(q, k, v)
    grads = torch.autograd.grad(loss, (q, k, v))
    loss_eager = layer(q, k, v)
    grads_eager = torch.autograd.grad(loss_eager, (q, k, v))
    assert torch.allclose(loss, loss_eager)
    for a, b in zip(grads, grads_eager):
        assert max_err(a, b) == 0.0


def test_compile_varlen_fullgraph():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(50, 2, 16, generator=g).to(DEVICE, torch.bfloat16).requires_grad_()
               for _ in range(3))
    cu = torch.tensor([0, 20, 50], dtype=torch.int32, device=DEVICE)

    def f(q, k, v):
        return triflash.flash_attn_varlen_func(q, k, v, cu, cu, 30, 30, causal=True,
                                              deterministic=True).float().sum()

    loss = torch.compile(f, fullgraph=True, backend=BACKEND)(q, k, v)
    grads = torch.autograd.grad(loss, (q, k, v))
    grads_eager = torch.autograd.grad(f(q, k, v), (q, k, v))
    for a, b in zip(grads, grads_eager):
        assert max_err(a, b) == 0.0


def test_return_lse_under_compile():
    q, k, v = _qkv(seed=2)

    def f(q, k, v):
        return triflash.flash_attn_func(q, k, v, return_attn_probs=True)

    out, lse = torch.compile(f, fullgraph=True, backend=BACKEND)(q, k, v)
    out_e, lse_e = f(q, k, v)
    assert torch.equal(out, out_e) and torch.equal(lse, lse_e)
    # lse is not differentiable, compiled as eager (its gradient would be left out otherwise)
    assert out.requires_grad and not lse.requires_grad and not lse_e.requires_grad


def test_compile_dynamic_shapes():
    """torch.compile(dynamic=True): sizes and the scale symbolic; one graph serves two
    sequence lengths, forward and backward equal to eager."""
    def f(q, k, v):
        return triflash.flash_attn_func(q, k, v, softmax_scale=0.2, causal=True, deterministic=True)

    compiled = torch.compile(f, fullgraph=True, dynamic=True, backend=BACKEND)
    for sq, sk in ((33, 47), (21, 30)):
        q, k, v = _qkv(sq=sq, sk=sk, seed=sq)
        out = compiled(q, k, v)
        dout = torch.randn_like(out)
        out_e = f(q, k, v)
        assert torch.equal(out, out_e)
        for a, b in zip(torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(out_e, (q, k, v), dout)):
            assert max_err(a, b) == 0.0


def test_fa3_low_level_backward_compiles_fullgraph():
    from triflash import _flash_attn_backward, _flash_attn_forward
    q, k, v = (x.detach() for x in _qkv(seed=3))

    def f(q, k, v, dout):
        out, lse, *_ = _flash_attn_forward(q, k, v, causal=True)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        _flash_attn_backward(dout, q, k, v, out, lse, None, None, None, None, None, None, dq, dk, dv,
                             None, True, deterministic=True)
        return dq, dk, dv

    dout = torch.randn(q.shape, device=DEVICE, dtype=q.dtype)
    got = torch.compile(f, fullgraph=True, backend=BACKEND)(q, k, v, dout)
    assert all(torch.equal(a, b) for a, b in zip(got, f(q, k, v, dout)))


def test_permuted_layout_under_compile():
    """q stored as (batch, heads, seqlen, dim) and viewed as (batch, seqlen, heads, dim): the
    fake implementations must report the strides the real ops return."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 40, 32, generator=g).to(DEVICE, torch.float16).transpose(1, 2)
               .requires_grad_() for _ in range(3))

    def f(q, k, v):
        out = triflash.flash_attn_func(q, k, v, causal=True, deterministic=True)
        return (out.float() * 2).sum()

    grads = torch.autograd.grad(torch.compile(f, fullgraph=True, backend=BACKEND)(q, k, v), (q, k, v))
    grads_eager = torch.autograd.grad(f(q, k, v), (q, k, v))
    for a, b in zip(grads, grads_eager):
        assert max_err(a, b) == 0.0
    out, lse = torch.ops.triflash.fwd(q, k, v, None, None, None, None, [40, 40, -1, 0, 1], [32 ** -0.5, 0.0])
    torch.library.opcheck(torch.ops.triflash.bwd.default,
                          (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out.detach(),
                           lse.detach(), None, None, None, None, [40, 40, -1, 0, 1], [32 ** -0.5, 0.0]),
                          test_utils=("test_faketensor",))


def test_qkvpacked_ops_opcheck_and_compile():
    g = torch.Generator().manual_seed(6)
    qkv = torch.randn(1, 37, 3, 2, 32, generator=g).to(DEVICE, torch.float16).requires_grad_()
    args = (qkv, [0, -1, 0, 1], [32 ** -0.5, 0.0])
    torch.library.opcheck(torch.ops.triflash.fwd_qkvpacked.default, args)
    out, lse = torch.ops.triflash.fwd_qkvpacked(*args)
    torch.library.opcheck(torch.ops.triflash.bwd_qkvpacked.default,
                          (torch.randn_like(out), qkv.detach(), out.detach(), lse.detach(),
                           [0, -1, 0, 1], [32 ** -0.5, 0.0]),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))

    def f(qkv):
        return (triflash.flash_attn_qkvpacked_func(qkv, causal=True, deterministic=True).float() * 2).sum()

    (grad,) = torch.autograd.grad(torch.compile(f, fullgraph=True, backend=BACKEND)(qkv), qkv)
    (grad_eager,) = torch.autograd.grad(f(qkv), qkv)
    assert max_err(grad, grad_eager) == 0.0


def test_eager_path_matches_the_op():
    """The public API's eager path (ops.attention: an autograd.Function, no torch.library
    dispatch) and the registered op with its autograd formula (what torch.compile traces)
    give bitwise-identical outputs, lse and gradients, dense and packed."""
    from triflash import ops
    q, k, v = _qkv(sq=45, sk=70, h=4, hk=2, dtype=torch.bfloat16, seed=7)
    ints, floats = ops.pack_scalars(45, 70, 32 ** -0.5, 11, 0, 3.0, True)
    dout = torch.randn(1, 45, 4, 32, generator=torch.Generator().manual_seed(8)).to(q)
    results = []
    for fn in (ops.attention, ops.fwd):
        out, lse = fn(q, k, v, None, None, None, None, ints, floats)
        results.append((out, lse) + torch.autograd.grad(out, (q, k, v), dout))
    for a, b in zip(*results):
        assert torch.equal(a, b)
    qkv = torch.randn(1, 37, 3, 2, 32, generator=torch.Generator().manual_seed(9)).to(
        DEVICE, torch.float16).requires_grad_()
    pints, pfloats = [0, -1, 0, 1], [32 ** -0.5, 0.0]
    dout = torch.randn(1, 37, 2, 32, generator=torch.Generator().manual_seed(10)).to(qkv)
    results = []
    for fn in (ops.attention_qkvpacked, ops.fwd_qkvpacked):
        out, lse = fn(qkv, pints, pfloats)
        results.append((out, lse) + torch.autograd.grad(out, (qkv,), dout))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_kvcache_compiles_fullgraph():
    """flash_attn_with_kvcache under torch.compile(fullgraph=True): the in-place append is a
    custom op with a declared mutation (opcheck), so the caches end up as in eager mode."""
    g = torch.Generator().manual_seed(3)
    q, k_new, v_new = (torch.randn(2, 1, 2, 32, generator=g).to(DEVICE, torch.float16) for _ in range(3))
    k_cache, v_cache = (torch.randn(2, 20, 2, 32, generator=g).to(DEVICE, torch.float16) for _ in range(2))
    cache_seqlens = torch.tensor([3, 7], dtype=torch.int32, device=DEVICE)
    torch.library.opcheck(torch.ops.triflash.append_kv.default,
                          (k_new, v_new, k_cache.clone(), v_cache.clone(), cache_seqlens))
    k_eager, v_eager = k_cache.clone(), v_cache.clone()
    ref = triflash.flash_attn_with_kvcache(q, k_eager, v_eager, k_new, v_new,
                                           cache_seqlens=cache_seqlens, causal=True)

    def step(q, k_cache, v_cache, k_new, v_new, cache_seqlens):
        return triflash.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new,
                                                cache_seqlens=cache_seqlens, causal=True)

    out = torch.compile(step, backend=BACKEND, fullgraph=True)(q, k_cache, v_cache, k_new, v_new, cache_seqlens)
    assert max_err(out, ref) == 0.0
    assert torch.equal(k_cache, k_eager) and torch.equal(v_cache, v_eager)


def test_kvcache_paged_rotary_compiles_fullgraph():
    """The paged / rotary / varlen-q forms trace too: the rotation and the varlen padding are
    torch ops, the attention is triflash::fwd_kvcache (opcheck), the append triflash::append_kv."""
    g = torch.Generator().manual_seed(4)
    i32 = dict(dtype=torch.int32, device=DEVICE)
    q = torch.randn(5, 4, 32, generator=g).to(DEVICE, torch.float16)           # varlen: 2 + 3 tokens
    k_new, v_new = (torch.randn(2, 1, 2, 32, generator=g).to(DEVICE, torch.float16) for _ in range(2))
    k_blocks, v_blocks = (torch.randn(8, 4, 2, 32, generator=g).to(DEVICE, torch.float16) for _ in range(2))
    table = torch.tensor([[5, 1, 6], [0, 7, 2]], **i32)
    cos, sin = (torch.randn(20, 8, generator=g).to(DEVICE, torch.float16) for _ in range(2))
    cu = torch.tensor([0, 2, 5], **i32)
    seqlens, leftpad = torch.tensor([4, 9], **i32), torch.tensor([1, 0], **i32)
    torch.library.opcheck(torch.ops.triflash.append_kv.default,
                          (k_new, v_new, k_blocks.clone(), v_blocks.clone(), seqlens, None, table))
    qd = torch.randn(2, 3, 4, 32, generator=g).to(DEVICE, torch.float16)
    torch.library.opcheck(torch.ops.triflash.fwd_kvcache.default,
                          (qd, k_blocks, v_blocks, None, seqlens + 1, None, leftpad,
                           table, [3, 12, -1, 0, 0], [32 ** -0.5, 0.0]))
    torch.library.opcheck(torch.ops.triflash.fwd_kvcache.default,
                          (q, k_blocks, v_blocks, cu, seqlens + 1, None, leftpad,
                           table, [3, 12, -1, 0, 0], [32 ** -0.5, 0.0]))

    def step(q, k_cache, v_cache, k_new, v_new):
        return triflash.flash_attn_with_kvcache(
            q, k_cache, v_cache, k_new, v_new, rotary_cos=cos, rotary_sin=sin, cache_seqlens=seqlens,
            cache_leftpad=leftpad, page_table=table, cu_seqlens_q=cu, max_seqlen_q=3, causal=True,
            return_softmax_lse=True)

    k_eager, v_eager = k_blocks.clone(), v_blocks.clone()
    ref, lse_ref, *_ = step(q, k_eager, v_eager, k_new, v_new)
    out, lse, *_ = torch.compile(step, backend=BACKEND, fullgraph=True)(q, k_blocks, v_blocks, k_new, v_new)
    assert max_err(out, ref) == 0.0 and torch.equal(lse, lse_ref)
    assert torch.equal(k_blocks, k_eager) and torch.equal(v_blocks, v_eager)
