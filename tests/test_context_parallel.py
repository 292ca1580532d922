"""triflash.context_parallel (ring-flash-attn's API) across processes: gloo process groups of
2 and 3 ranks on CPU tensors under Triton's interpreter. The parent draws the global q, k, v
and dout, each rank runs its shard, and the parent puts the shards' out / lse / dq / dk / dv
back in global order and checks them against attention over the whole sequence in fp32,
with FlashAttention-3's tolerance rule (triflash.testing). A world of one (no process group)
must equal triflash.flash_attn_func exactly.

This module imports triflash only inside functions: a spawned rank imports it to unpickle
the worker, and must set TRITON_INTERPRET before triflash is imported.
"""
import datetime
import os

import pytest
import torch
import torch.multiprocessing as mp

needs_dist = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="torch.distributed with gloo is not available")

H, D = 4, 32  # query heads, head dim
LOCAL = 24    # tokens per rank (not a tile multiple; even, for zigzag's two chunks)
VARLEN_CU = {2: [0, 10, 40, 48]}  # llama3: sequences across the ranks' boundaries

# name -> (world, function, causal, kv heads, extra kwargs)
CASES = {
    "ring-causal-gqa": (2, "ring", True, 2, {}),
    "ring-gqa": (2, "ring", False, 2, {}),
    "ring-causal-scale-det": (2, "ring", True, 4, dict(softmax_scale=0.3, deterministic=True)),
    "zigzag-causal-gqa": (2, "zigzag", True, 2, {}),
    "zigzag-gqa": (2, "zigzag", False, 2, {}),
    "llama3-causal-gqa": (2, "llama3", True, 2, dict(heads_k_stride=1)),
    "llama3-gqa": (2, "llama3", False, 2, dict(heads_k_stride=2)),
    "zigzag-causal-gqa-3": (3, "zigzag", True, 2, {}),
    "ring-causal-gqa-3": (3, "ring", True, 2, {}),
}


def _shard(x, layout, rank, world):
    """Rank ``rank``'s part of x (batch, seqlen, ...) (llama3: packed (total, ...))."""
    if layout == "zigzag":
        chunks = x.chunk(2 * world, dim=1)
        return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]], dim=1)
    dim = 0 if layout == "llama3" else 1
    return x.narrow(dim, rank * (x.shape[dim] // world), x.shape[dim] // world)


def _unshard(parts, layout, dim):
    """The inverse of ``_shard`` along ``dim`` (seqlen's dim of that tensor)."""
    if layout != "zigzag":
        return torch.cat(parts, dim=dim)
    world = len(parts)
    halves = [p.chunk(2, dim=dim) for p in parts]
    return torch.cat([halves[i][0] for i in range(world)] + [halves[i][1] for i in reversed(range(world))], dim=dim)


def _inputs(layout, world, hk, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = LOCAL * world
    shapes = [(1, n, H, D), (1, n, hk, D), (1, n, hk, D), (1, n, H, D)]
    q, k, v, dout = (torch.randn(s, generator=g).half() for s in shapes)
    if layout == "llama3":
        q, k, v, dout = (x[0] for x in (q, k, v, dout))
    return q, k, v, dout


def _run_case(cp, name, rank, world, data):
    _, layout, causal, _, kw = CASES[name]
    q, k, v, dout = (_shard(x, layout, rank, world).clone() for x in data)
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    kw = dict(kw)
    if layout == "llama3":
        cu = torch.tensor(VARLEN_CU[world], dtype=torch.int32)
        cu_q, cu_k, max_q, max_k, k_slice = cp.llama3_flash_attn_prepare_cu_seqlens(cu, causal, rank, world)
        out, lse, _ = cp.llama3_flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k,
                                                       local_k_slice=k_slice, causal=causal,
                                                       return_attn_probs=True, **kw)
    else:
        fn = cp.ring_flash_attn_func if layout == "ring" else cp.zigzag_ring_flash_attn_func
        out, lse, _ = fn(q, k, v, causal=causal, return_attn_probs=True, **kw)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    return dict(out=out.detach(), lse=lse, dq=dq, dk=dk, dv=dv)


def _worker(rank, world, tmp, names):
    os.environ["TRITON_INTERPRET"] = "1"  # before triflash is imported (CPU tensors)
    torch.set_num_threads(1)
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    from triflash import context_parallel as cp
    try:
        for name in names:
            data = torch.load(f"{tmp}/{name}.pt")
            torch.save(_run_case(cp, name, rank, world, data), f"{tmp}/{name}.rank{rank}.pt")
    finally:
        dist.destroy_process_group()


_RESULTS = {}


def _results(world, tmp_path_factory):
    """Every case of one world size, run by one spawned group (the ranks import triflash
    once): {name: (inputs, [per-rank results])}."""
    if world not in _RESULTS:
        tmp = str(tmp_path_factory.mktemp(f"cp{world}"))
        names = [n for n, c in CASES.items() if c[0] == world]
        inputs = {}
        for n in names:
            _, layout, _, hk, _ = CASES[n]
            inputs[n] = _inputs(layout, world, hk)
            torch.save(inputs[n], f"{tmp}/{n}.pt")
        mp.start_processes(_worker, args=(world, tmp, names), nprocs=world, start_method="spawn")
        _RESULTS[world] = {n: (inputs[n], [torch.load(f"{tmp}/{n}.rank{r}.pt") for r in range(world)])
                           for n in names}
    return _RESULTS[world]


@needs_dist
@pytest.mark.parametrize("name", list(CASES))
def test_matches_full_attention(name, tmp_path_factory):
    from triflash.testing import assert_forward_matches, assert_grads_match, attention_ref, attention_varlen_ref
    world, layout, causal, _, kw = CASES[name]
    (q, k, v, dout), per_rank = _results(world, tmp_path_factory)[name]
    seq_dim = {"out": 0 if layout == "llama3" else 1, "lse": 1 if layout == "llama3" else 2}
    got = {key: _unshard([r[key] for r in per_rank], layout, seq_dim.get(key, seq_dim["out"]))
           for key in ("out", "lse", "dq", "dk", "dv")}
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    ref_kw = dict(causal=causal, softmax_scale=kw.get("softmax_scale"))
    if layout == "llama3":
        cu = torch.tensor(VARLEN_CU[world], dtype=torch.int32)
        ref = attention_varlen_ref(q, k, v, cu, cu, upcast=True, **ref_kw)
        lowp = attention_varlen_ref(q, k, v, cu, cu, upcast=False, **ref_kw)
    else:
        ref = attention_ref(q, k, v, upcast=True, **ref_kw)
        lowp = attention_ref(q, k, v, upcast=False, **ref_kw)
    assert got["out"].dtype == torch.float16 and got["out"].shape == ref[0].shape
    assert got["lse"].dtype == torch.float32 and got["lse"].shape == ref[1].shape
    assert_forward_matches(got["out"], got["lse"], ref[0], ref[1], lowp[0])
    grads_ref = torch.autograd.grad(ref[0], (q, k, v), dout)
    grads_lowp = torch.autograd.grad(lowp[0], (q, k, v), dout)
    for key, x in zip(("dq", "dk", "dv"), (q, k, v)):
        assert got[key].dtype == torch.float16 and got[key].shape == x.shape
    assert_grads_match((got["dq"], got["dk"], got["dv"]), grads_ref, grads_lowp)


@pytest.mark.parametrize("causal", [False, True])
def test_world_of_one_equals_flash_attn(causal):
    """Without a process group (a world of one) every function is flash_attn_func /
    flash_attn_varlen_func, bit for bit, forward and backward."""
    import triflash
    from triflash import context_parallel as cp
    from conftest import DEVICE
    q, k, v, dout = (x.to(DEVICE).requires_grad_(i < 3) for i, x in enumerate(_inputs("ring", 1, 2)))
    want, want_lse = triflash.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    want_grads = torch.autograd.grad(want, (q, k, v), dout)
    for fn in (cp.ring_flash_attn_func, cp.zigzag_ring_flash_attn_func):
        out, lse, none = fn(q, k, v, causal=causal, return_attn_probs=True)
        assert none is None and torch.equal(out, want) and torch.equal(lse, want_lse)
        for g, w in zip(torch.autograd.grad(out, (q, k, v), dout), want_grads):
            assert torch.equal(g, w)
    # llama3 over one packed sequence, KV heads gathered one at a time
    q1, k1, v1, dout1 = (x[0].detach().requires_grad_(i < 3) for i, x in enumerate((q, k, v, dout)))
    cu = torch.tensor([0, LOCAL], dtype=torch.int32, device=q.device)
    cu_q, cu_k, max_q, max_k, k_slice = cp.llama3_flash_attn_prepare_cu_seqlens(cu, causal, 0, 1)
    assert k_slice == slice(0, LOCAL) and torch.equal(cu_q, cu) and torch.equal(cu_k, cu)
    out = cp.llama3_flash_attn_varlen_func(q1, k1, v1, cu_q, cu_k, max_q, max_k, 1, k_slice, causal=causal)
    want = triflash.flash_attn_varlen_func(q1, k1, v1, cu, cu, LOCAL, LOCAL, causal=causal)
    assert torch.equal(out, want)
    for g, w in zip(torch.autograd.grad(out, (q1, k1, v1), dout1),
                    torch.autograd.grad(want, (q1, k1, v1), dout1)):
        assert torch.equal(g, w)


def test_prepare_cu_seqlens():
    """ring-flash-attn's llama3 slicing: rank 1 of 2 over sequences [0, 10), [10, 40), [40, 48)
    holds tokens 24..47: the tail of the second sequence and the third."""
    from triflash.context_parallel import llama3_flash_attn_prepare_cu_seqlens as prepare
    cu = torch.tensor([0, 10, 40, 48], dtype=torch.int32)
    cu_q, cu_k, max_q, max_k, k_slice = prepare(cu, True, 1, 2)
    assert cu_q.tolist() == [0, 16, 24] and cu_k.tolist() == [0, 30, 38]
    assert (max_q, max_k, k_slice) == (16, 30, slice(10, 48))
    cu_q, cu_k, max_q, max_k, k_slice = prepare(cu, True, 0, 2)  # causal: keys up to the rank's end
    assert cu_q.tolist() == [0, 10, 24] and cu_k.tolist() == [0, 10, 24] and k_slice == slice(0, 24)
    cu_q, cu_k, max_q, max_k, k_slice = prepare(cu, False, 0, 2)  # not causal: the whole sequence
    assert cu_k.tolist() == [0, 10, 40] and (max_q, max_k, k_slice) == (14, 30, slice(0, 40))


@pytest.mark.parametrize("kwargs, exc, message", [
    (dict(dropout_p=0.1), NotImplementedError, "dropout_p=0.1 is not supported"),
    (dict(alibi_slopes=torch.ones(4)), NotImplementedError, "alibi_slopes=a tensor is not supported"),
    (dict(window_size=(8, 0), causal=True), NotImplementedError, "window_size=(8, 0) is not supported"),
])
def test_refuses_unsupported(kwargs, exc, message):
    from triflash import context_parallel as cp
    from conftest import DEVICE
    q, k, v, _ = (x.to(DEVICE) for x in _inputs("ring", 1, 2))
    for fn in (cp.ring_flash_attn_func, cp.zigzag_ring_flash_attn_func):
        with pytest.raises(exc, match=message.replace("(", r"\(").replace(")", r"\)")):
            fn(q, k, v, **kwargs)
    with pytest.raises(ValueError, match="q.shape.1.=23 is not supported"):  # zigzag's two chunks
        cp.zigzag_ring_flash_attn_func(q[:, :23], k[:, :23], v[:, :23], causal=True)


def test_merge_handles_rows_without_keys():
    """A partial result whose row saw no key (out 0, lse -inf) leaves the other side exactly;
    two such sides stay out 0, lse -inf (no NaN from exp(-inf - -inf))."""
    from triflash.context_parallel import _merge
    inf = float("-inf")
    out = torch.tensor([[[[1.0, 2.0]], [[0.0, 0.0]], [[0.0, 0.0]]]])  # (b=1, s=3, h=1, d=2)
    lse = torch.tensor([[[0.5, inf, inf]]])                            # (b=1, h=1, s=3)
    block_out = torch.tensor([[[[0.0, 0.0]], [[3.0, 4.0]], [[0.0, 0.0]]]]).half()
    block_lse = torch.tensor([[[inf, -0.25, inf]]])
    _merge(out, lse, block_out, block_lse)
    assert out.tolist() == [[[[1.0, 2.0]], [[3.0, 4.0]], [[0.0, 0.0]]]]
    assert lse.tolist() == [[[0.5, -0.25, inf]]]
    out2, lse2 = torch.ones(1, 1, 1, 2), torch.zeros(1, 1, 1)  # equal lse: the mean, lse + log 2
    _merge(out2, lse2, torch.full((1, 1, 1, 2), 3.0).half(), torch.zeros(1, 1, 1))
    assert out2.tolist() == [[[[2.0, 2.0]]]] and abs(lse2.item() - 0.6931472) < 1e-6
