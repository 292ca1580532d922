"""triflash.context_parallel (ring-flash-attn's API) across processes.

The parent draws the global q, k, v and dout, each rank runs its shard, and the parent puts
the shards' out / lse / dq / dk / dv back in global order and checks them against attention
over the whole sequence in fp32 with FlashAttention-3's tolerance rule (triflash.testing),
and against triflash.flash_attn_func / flash_attn_varlen_func over the whole sequence: that
passes the same rule, and the two lie within its tolerance of each other.

* CPU (CI): gloo process groups of 2 and 3 ranks on CPU tensors (fp16) under Triton's
  interpreter. A world of one (no process group) must equal flash_attn_func exactly.
* One GPU (the ``gpu`` tests): bf16, head dims 64 / 128 / 256, odd lengths, GQA / MQA /
  MHA, by 2 and 3 processes that all use cuda:0. NCCL refuses two ranks on one device
  ("Duplicate GPU detected"), and gloo's send / recv hand the tensor's memory to its TCP
  transport as host memory (CUDA tensors are not supported there; gloo stages CUDA tensors
  through the host for its collectives only). So these ranks talk through
  ``HostStagedGloo``: a process group that copies the CUDA tensors the functions send to the
  host, runs gloo on the copies and copies what it receives back into the CUDA buffer at
  wait(); ``test_host_staged_backend_on_cpu`` runs it in CI. A world of one on the GPU, with
  no process group and with a gloo group of one rank, must equal flash_attn_func /
  flash_attn_varlen_func bit for bit (deterministic backward).

This module imports triflash only inside functions: a spawned rank imports it to unpickle
the worker, and a CPU rank must set TRITON_INTERPRET before triflash is imported.
"""
import datetime
import os
import zlib
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ON_GPU = torch.cuda.is_available()
HAS_GLOO = dist.is_available() and dist.is_gloo_available()
needs_dist = pytest.mark.skipif(not HAS_GLOO, reason="torch.distributed with gloo is not available")
on_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
cpu_ranks = pytest.mark.skipif(ON_GPU, reason="CPU ranks under Triton's interpreter (CI); a GPU machine runs "
                               "test_gpu_* instead (the H200's numpy 2.4 breaks the interpreter's loops)")


class Case(NamedTuple):
    world: int
    layout: str            # "ring", "zigzag" or "llama3"
    causal: bool
    hk: int                # KV heads
    kw: tuple = ()         # more keyword arguments, (name, value) pairs
    h: int = 4             # query heads
    d: int = 32            # head dim
    local: int = 24        # tokens per rank (not a tile multiple; zigzag: even, two chunks)
    cu: tuple = ()         # llama3: the global cu_seqlens (its total local * world)
    batch: int = 1         # ring / zigzag


VARLEN_CU = (0, 10, 40, 48)  # llama3 over 2 ranks of 24: sequences across the ranks' boundaries
CASES = {
    "ring-causal-gqa": Case(2, "ring", True, 2),
    "ring-gqa": Case(2, "ring", False, 2),
    "ring-causal-scale-det": Case(2, "ring", True, 4, (("softmax_scale", 0.3), ("deterministic", True))),
    "zigzag-causal-gqa": Case(2, "zigzag", True, 2),
    "zigzag-gqa": Case(2, "zigzag", False, 2),
    "llama3-causal-gqa": Case(2, "llama3", True, 2, (("heads_k_stride", 1),), cu=VARLEN_CU),
    "llama3-gqa": Case(2, "llama3", False, 2, (("heads_k_stride", 2),), cu=VARLEN_CU),
    "zigzag-causal-gqa-3": Case(3, "zigzag", True, 2),
    "ring-causal-gqa-3": Case(3, "ring", True, 2),
}
ONE = Case(1, "ring", False, 2)  # a world of one, no process group


def _gpu_cases():
    """bf16 on one GPU. Tokens per rank: ring 333, zigzag 2 x 167 (every chunk odd), llama3
    333 of sequences of odd lengths that cross the ranks' boundaries."""
    ring, zigzag, packed = dict(local=333, batch=2), dict(local=2 * 167, batch=2), dict(local=333)
    cu = {2: (0, 101, 430, 433, 666), 3: (0, 1, 500, 777, 999)}
    cases = {}
    for d in (64, 128, 256):
        cases[f"ring-causal-d{d}"] = Case(2, "ring", True, 2, h=8, d=d, **ring)
        cases[f"ring-d{d}"] = Case(2, "ring", False, 2, h=8, d=d, **ring)
        cases[f"zigzag-causal-d{d}"] = Case(2, "zigzag", True, 2, h=8, d=d, **zigzag)
        cases[f"llama3-causal-d{d}"] = Case(2, "llama3", True, 2, (("heads_k_stride", 1),), h=8, d=d, cu=cu[2],
                                            **packed)
        cases[f"llama3-d{d}"] = Case(2, "llama3", False, 2, (("heads_k_stride", 2),), h=8, d=d, cu=cu[2], **packed)
    cases["ring-mha-d64"] = Case(2, "ring", False, 8, h=8, d=64, **ring)
    cases["zigzag-d128"] = Case(2, "zigzag", False, 2, h=8, d=128, **zigzag)
    cases["zigzag-causal-mqa-d256"] = Case(2, "zigzag", True, 1, h=8, d=256, **zigzag)
    cases["ring-causal-scale-det-d128"] = Case(2, "ring", True, 2, (("softmax_scale", 0.05), ("deterministic", True)),
                                               h=8, d=128, **ring)
    cases["ring-causal-d128-3"] = Case(3, "ring", True, 2, h=8, d=128, **ring)
    cases["zigzag-causal-d64-3"] = Case(3, "zigzag", True, 2, h=8, d=64, **zigzag)
    cases["llama3-causal-d256-3"] = Case(3, "llama3", True, 2, (("heads_k_stride", 1),), h=8, d=256, cu=cu[3],
                                         **packed)
    return cases


GPU_CASES = _gpu_cases()


# ---- a process group for ranks that share one GPU ------------------------------------------

if HAS_GLOO:
    class _Staged(dist.Work):
        """A gloo work on host copies; wait() also copies the received host tensor into its
        destination (a CUDA buffer), so a rank reading the buffer before waiting reads what
        it held before, as with NCCL."""

        def __init__(self, work, host=None, dest=None):
            super().__init__()
            self._work, self._host, self._dest = work, host, dest

        def wait(self, timeout=None):
            self._work.wait()
            if self._dest is not None:
                self._dest.copy_(self._host)
                self._dest = self._host = None
            return True

    class HostStagedGloo(dist.ProcessGroup):
        """gloo for CUDA tensors of ranks that share a GPU: the operations the context-parallel
        functions use (send, recv, all_gather_into_tensor, reduce_scatter_tensor) on host
        copies. Test harness only: every transfer passes through host memory and a
        synchronous device-to-host copy."""

        NAME = "host_staged_gloo"

        def __init__(self, store, rank, world_size, timeout):
            super().__init__(rank, world_size)
            self._gloo = dist.ProcessGroupGloo(store, rank, world_size, timeout)

        @classmethod
        def register(cls):
            """Make NAME a backend of init_process_group (once per process)."""
            if not hasattr(dist.Backend, cls.NAME.upper()):
                dist.Backend.register_backend(cls.NAME, cls, devices=["cpu", "cuda"])
            return cls.NAME

        def getBackendName(self):
            return self.NAME

        def _get_backend(self, device):
            # torch >= 2.14's batch_isend_irecv asks the group for its backend on the
            # tensors' device (to pick coalescing); this group registers none there, so it
            # answers with its gloo group (no coalescing: each send / recv goes through the
            # methods below)
            return self._gloo

        @staticmethod
        def _host(t):
            return t.detach().to("cpu", copy=True).contiguous()

        def send(self, tensors, dst, tag=0):
            (t,) = tensors
            return _Staged(self._gloo.send([self._host(t)], dst, tag))

        def recv(self, tensors, src, tag=0):
            (t,) = tensors
            host = torch.empty(t.shape, dtype=t.dtype)
            return _Staged(self._gloo.recv([host], src, tag), host, t)

        def _allgather_base(self, output, input, opts=None):
            host = torch.empty(output.shape, dtype=output.dtype)
            return _Staged(self._gloo._allgather_base(host, self._host(input)), host, output)

        def _reduce_scatter_base(self, output, input, opts=None):
            host = torch.empty(output.shape, dtype=output.dtype)
            args = (host, self._host(input)) + ((opts,) if opts is not None else ())
            return _Staged(self._gloo._reduce_scatter_base(*args), host, output)

        # torch >= 2.14 calls these names (2.11: the two above)
        def all_gather_single(self, output, input, opts=None):
            return self._allgather_base(output, input, opts)

        def reduce_scatter_single(self, output, input, opts=None):
            return self._reduce_scatter_base(output, input, opts)


# ---- sharding, the ranks, the checks --------------------------------------------------------

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


def _inputs(case, dtype=torch.float16, seed=0):
    """Global q, k, v, dout (CPU): (batch, seqlen, heads, dim), llama3 (total, heads, dim)."""
    g = torch.Generator().manual_seed(seed)
    n = case.local * case.world
    lead = (n,) if case.layout == "llama3" else (case.batch, n)
    shapes = [lead + (case.h, case.d), lead + (case.hk, case.d), lead + (case.hk, case.d), lead + (case.h, case.d)]
    return tuple(torch.randn(s, generator=g).to(dtype) for s in shapes)


def _run_case(cp, case, rank, data, device):
    """One rank's forward and backward: its out, lse, dq, dk, dv (on the CPU)."""
    q, k, v, dout = (_shard(x, case.layout, rank, case.world).to(device).clone() for x in data)
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    kw = dict(case.kw)
    if case.layout == "llama3":
        cu = torch.tensor(case.cu, dtype=torch.int32, device=device)
        cu_q, cu_k, max_q, max_k, k_slice = cp.llama3_flash_attn_prepare_cu_seqlens(cu, case.causal, rank,
                                                                                    case.world)
        out, lse, _ = cp.llama3_flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k,
                                                       local_k_slice=k_slice, causal=case.causal,
                                                       return_attn_probs=True, **kw)
    else:
        fn = cp.ring_flash_attn_func if case.layout == "ring" else cp.zigzag_ring_flash_attn_func
        out, lse, _ = fn(q, k, v, causal=case.causal, return_attn_probs=True, **kw)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    return {key: t.detach().cpu() for key, t in dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv).items()}


def _worker(rank, world, tmp, cases, device, backend):
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before triflash is imported (CPU tensors)
        torch.set_num_threads(1)
    else:
        torch.cuda.set_device(0)  # every rank on the one GPU
    if backend == "host_staged_gloo":
        HostStagedGloo.register()
    store = f"{tmp}/store-{zlib.crc32(' '.join(sorted(cases)).encode()):08x}"  # one rendezvous per group
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120 if device == "cpu" else 900))
    from triflash import context_parallel as cp
    from triflash.kernels import problem
    problem.POISON = True  # kernel outputs start as NaN, as under the suite's fixture
    try:
        for name, case in cases.items():
            data = torch.load(f"{tmp}/{name}.pt")
            torch.save(_run_case(cp, case, rank, data, device), f"{tmp}/{name}.rank{rank}.pt")
    finally:
        dist.destroy_process_group()


_RESULTS = {}


def _results(cases, name, device, backend, request, tmp_path_factory):
    """(inputs, [per-rank results]) of case ``name``. The cases of its world size that this
    session runs go to one spawned group (the ranks import triflash, and compile its
    kernels, once; pytest-xdist workers share the group's files)."""
    from conftest import selected_params, shared_results_dir
    if (device, backend, name) not in _RESULTS:
        world = cases[name].world
        names = [n for n in selected_params(request, "name", cases) if cases[n].world == world]
        names += [] if name in names else [name]
        dtype = torch.float16 if device == "cpu" else torch.bfloat16

        def produce(tmp, missing):
            for n in missing:
                torch.save(_inputs(cases[n], dtype), f"{tmp}/{n}.pt")
            mp.start_processes(_worker, args=(world, tmp, {n: cases[n] for n in missing}, device, backend),
                               nprocs=world, start_method="spawn")
        tmp = shared_results_dir(tmp_path_factory, f"cp{world}-{device}-{backend}", names, produce)
        for n in names:
            _RESULTS[(device, backend, n)] = (torch.load(f"{tmp}/{n}.pt"),
                                              [torch.load(f"{tmp}/{n}.rank{r}.pt") for r in range(world)])
    return _RESULTS[(device, backend, name)]


def _gathered(case, per_rank, device):
    """The ranks' results in global order: out, dq, dk, dv like q; lse (b, h, n) / (h, n)."""
    seq_dim = {"out": 0 if case.layout == "llama3" else 1, "lse": 1 if case.layout == "llama3" else 2}
    return {key: _unshard([r[key] for r in per_rank], case.layout, seq_dim.get(key, seq_dim["out"])).to(device)
            for key in ("out", "lse", "dq", "dk", "dv")}


def _check_full(case, got, data, device):
    """``got`` (the gathered results) against attention over the whole sequence: FA3's rule
    against the fp32 reference, and flash_attn_func / flash_attn_varlen_func (which passes
    the same rule) within that rule's tolerance."""
    import triflash
    from triflash.testing import (assert_forward_matches, assert_grads_match, attention_ref, attention_varlen_ref,
                                  fa_tolerance, max_err)
    q, k, v, dout = (x.to(device) for x in data)
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    kw = dict(case.kw)
    ref_kw = dict(causal=case.causal, softmax_scale=kw.get("softmax_scale"))
    fa_kw = dict(ref_kw, deterministic=kw.get("deterministic", False), return_attn_probs=True)
    if case.layout == "llama3":
        cu = torch.tensor(case.cu, dtype=torch.int32, device=device)
        ref = attention_varlen_ref(q, k, v, cu, cu, upcast=True, **ref_kw)
        lowp = attention_varlen_ref(q, k, v, cu, cu, upcast=False, **ref_kw)
        longest = max(b - a for a, b in zip(case.cu, case.cu[1:]))
        fa = triflash.flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, **fa_kw)
    else:
        ref = attention_ref(q, k, v, upcast=True, **ref_kw)
        lowp = attention_ref(q, k, v, upcast=False, **ref_kw)
        fa = triflash.flash_attn_func(q, k, v, **fa_kw)
    assert got["out"].dtype == q.dtype and got["out"].shape == ref[0].shape
    assert got["lse"].dtype == torch.float32 and got["lse"].shape == ref[1].shape
    assert_forward_matches(got["out"], got["lse"], ref[0], ref[1], lowp[0])
    assert_forward_matches(fa[0], fa[1], ref[0], ref[1], lowp[0])
    tol = fa_tolerance(ref[0], lowp[0])
    assert max_err(got["out"], fa[0]) <= tol, f"out: {max_err(got['out'], fa[0])} from flash_attn's > {tol}"
    grads_ref = torch.autograd.grad(ref[0], (q, k, v), dout)
    grads_lowp = torch.autograd.grad(lowp[0], (q, k, v), dout)
    grads_fa = torch.autograd.grad(fa[0], (q, k, v), dout)
    grads = (got["dq"], got["dk"], got["dv"])
    for g, x in zip(grads, (q, k, v)):
        assert g.dtype == x.dtype and g.shape == x.shape
    assert_grads_match(grads, grads_ref, grads_lowp)
    assert_grads_match(grads_fa, grads_ref, grads_lowp)
    for name, g, g_fa, g_ref, g_lowp in zip(("dq", "dk", "dv"), grads, grads_fa, grads_ref, grads_lowp):
        tol = fa_tolerance(g_ref, g_lowp)
        assert max_err(g, g_fa) <= tol, f"{name}: {max_err(g, g_fa)} from flash_attn's > {tol}"


# ---- CPU (CI) -------------------------------------------------------------------------------

@needs_dist
@cpu_ranks
@pytest.mark.parametrize("name", list(CASES))
def test_matches_full_attention(name, request, tmp_path_factory):
    case = CASES[name]
    data, per_rank = _results(CASES, name, "cpu", "gloo", request, tmp_path_factory)
    _check_full(case, _gathered(case, per_rank, "cpu"), data, "cpu")


STAGED_CASES = {name: CASES[name] for name in ("ring-causal-gqa", "zigzag-causal-gqa", "llama3-gqa")}


@needs_dist
@cpu_ranks
@pytest.mark.parametrize("name", list(STAGED_CASES))
def test_host_staged_backend_on_cpu(name, request, tmp_path_factory):
    """The GPU tests' process group (HostStagedGloo) on CPU tensors: the same results as
    plain gloo, bit for bit."""
    case = STAGED_CASES[name]
    data, per_rank = _results(STAGED_CASES, name, "cpu", "host_staged_gloo", request, tmp_path_factory)
    _, plain = _results(CASES, name, "cpu", "gloo", request, tmp_path_factory)
    for staged, want in zip(per_rank, plain):
        for key in want:
            assert torch.equal(staged[key], want[key]), key
    _check_full(case, _gathered(case, per_rank, "cpu"), data, "cpu")


def _check_world_of_one(device, case, causal, lengths, exact_grads):
    """ring / zigzag against flash_attn_func and llama3 against flash_attn_varlen_func, with
    no other rank: equal forward (out, lse), and backward too where ``exact_grads`` (the CPU
    interpreter, or deterministic=True on a GPU); FA3's rule against the fp32 reference."""
    import triflash
    from triflash import context_parallel as cp
    from triflash.testing import (assert_forward_matches, assert_grads_match, assert_matches_reference,
                                  attention_ref, attention_varlen_ref)
    det = device != "cpu"
    dtype = torch.float16 if device == "cpu" else torch.bfloat16
    ring_len, zigzag_len, cu = lengths
    for fn, n in ((cp.ring_flash_attn_func, ring_len), (cp.zigzag_ring_flash_attn_func, zigzag_len)):
        q, k, v, dout = (x.to(device).requires_grad_(i < 3)
                         for i, x in enumerate(_inputs(case._replace(local=n), dtype)))
        want, want_lse = triflash.flash_attn_func(q, k, v, causal=causal, deterministic=det, return_attn_probs=True)
        want_grads = torch.autograd.grad(want, (q, k, v), dout)
        out, lse, none = fn(q, k, v, causal=causal, deterministic=det, return_attn_probs=True)
        assert none is None and torch.equal(out, want) and torch.equal(lse, want_lse)
        ref, lowp = attention_ref(q, k, v, causal=causal), attention_ref(q, k, v, causal=causal, upcast=False)
        grads = assert_matches_reference(out, lse, ref[0], ref[1], lowp[0], (q, k, v), dout)
        if exact_grads:
            for g, w in zip(grads, want_grads):
                assert torch.equal(g, w)
    # llama3 over packed sequences, KV heads gathered one at a time and all at once
    total = cu[-1]
    q, k, v, dout = (x.to(device).requires_grad_(i < 3)
                     for i, x in enumerate(_inputs(case._replace(layout="llama3", local=total), dtype)))
    cu_t = torch.tensor(cu, dtype=torch.int32, device=device)
    longest = max(b - a for a, b in zip(cu, cu[1:]))
    cu_q, cu_k, max_q, max_k, k_slice = cp.llama3_flash_attn_prepare_cu_seqlens(cu_t, causal, 0, 1)
    assert k_slice == slice(0, total) and torch.equal(cu_q, cu_t) and torch.equal(cu_k, cu_t)
    assert max_q == max_k == longest
    want, want_lse = triflash.flash_attn_varlen_func(q, k, v, cu_t, cu_t, longest, longest, causal=causal,
                                                     deterministic=det, return_attn_probs=True)
    want_grads = torch.autograd.grad(want, (q, k, v), dout)
    ref = attention_varlen_ref(q, k, v, cu_t, cu_t, causal=causal)
    lowp = attention_varlen_ref(q, k, v, cu_t, cu_t, causal=causal, upcast=False)
    grads_ref = torch.autograd.grad(ref[0], (q, k, v), dout)
    grads_lowp = torch.autograd.grad(lowp[0], (q, k, v), dout)
    for stride in (1, case.hk):
        out, lse, _ = cp.llama3_flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, stride, k_slice,
                                                       causal=causal, deterministic=det, return_attn_probs=True)
        # one KV head per call may be scheduled otherwise on a GPU (fewer heads, another
        # split of the work): equal there only when every head goes in one call
        same_calls = device == "cpu" or stride == case.hk
        if same_calls:
            assert torch.equal(out, want) and torch.equal(lse, want_lse)
        assert_forward_matches(out, lse, ref[0], ref[1], lowp[0])
        grads = torch.autograd.grad(out, (q, k, v), dout)
        assert_grads_match(grads, grads_ref, grads_lowp)
        if exact_grads and same_calls:
            for g, w in zip(grads, want_grads):
                assert torch.equal(g, w)


@pytest.mark.parametrize("causal", [False, True])
def test_world_of_one_equals_flash_attn(causal):
    """Without a process group (a world of one) every function is flash_attn_func /
    flash_attn_varlen_func, bit for bit, forward and backward (on a GPU: deterministic)."""
    from conftest import DEVICE
    _check_world_of_one(DEVICE, ONE, causal, (ONE.local, ONE.local, (0, 7, ONE.local)), exact_grads=True)


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
    q, k, v, _ = (x.to(DEVICE) for x in _inputs(ONE))
    for fn in (cp.ring_flash_attn_func, cp.zigzag_ring_flash_attn_func):
        with pytest.raises(exc, match=message.replace("(", r"\(").replace(")", r"\)")):
            fn(q, k, v, **kwargs)
    with pytest.raises(ValueError, match="q.shape.1.=23 is not supported"):  # zigzag's two chunks
        cp.zigzag_ring_flash_attn_func(q[:, :23], k[:, :23], v[:, :23], causal=True)


def test_llama3_checks_max_seqlens():
    """As flash_attn_varlen_func: a max_seqlen below the longest sequence is an error (host
    checks: on the CPU, or with set_check_inputs(True)), not a silently truncated result."""
    import triflash
    from triflash import context_parallel as cp
    from conftest import DEVICE
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(64, 2, 32, generator=g).to(DEVICE, torch.float16) for _ in range(3))
    cu = torch.tensor([0, 60, 64], dtype=torch.int32, device=DEVICE)
    triflash.set_check_inputs(True)
    try:
        for name, args in (("max_seqlen_q", (8, 60)), ("max_seqlen_k", (60, 8))):
            with pytest.raises(ValueError, match=f"{name}=8 .*longest sequence, 60"):
                cp.llama3_flash_attn_varlen_func(q, k, v, cu, cu, *args, 1, slice(0, 64), causal=True)
        cp.llama3_flash_attn_varlen_func(q, k, v, cu, cu, 60, 60, 1, slice(0, 64), causal=True)
    finally:
        triflash.set_check_inputs(False)


def _mismatch_worker(rank, world, tmp):
    os.environ["TRITON_INTERPRET"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    from triflash import context_parallel as cp
    try:
        dtype = torch.float16 if rank == 0 else torch.bfloat16  # same size: the bytes would pass
        q, k, v = (torch.randn(1, 16, h, 32).to(dtype) for h in (2, 1, 1))
        try:
            cp.ring_flash_attn_func(q, k, v)
            result = "no error"
        except ValueError as e:
            result = str(e)
        with open(f"{tmp}/rank{rank}.txt", "w") as f:
            f.write(result)
    finally:
        dist.destroy_process_group()


@needs_dist
@cpu_ranks
def test_ranks_must_agree(tmp_path):
    """Ranks passing different dtypes (or shapes) all raise, naming every rank's values, with
    the host checks on (the CPU); unchecked, one dtype's bytes would be read as the other's."""
    mp.start_processes(_mismatch_worker, args=(2, str(tmp_path)), nprocs=2, start_method="spawn")
    for rank in range(2):
        text = (tmp_path / f"rank{rank}.txt").read_text()
        assert "every rank must pass the same" in text and "float16" in text and "bfloat16" in text, text


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


def test_ring_merge_is_flash_attn_combine():
    """The ring's merge and flash_attn_combine share merge.merge_partials. Causal attention
    computed over key blocks (flash_attn_func per block, a window standing for the causal
    mask, so that the queries before a block see none of its keys: out 0, lse -inf) and
    merged both ways passes FA3's rule against causal attention over all keys, and the two
    merges agree within its tolerance. flash_attn_combine writes into an ``out`` poisoned
    with NaN."""
    import triflash
    from triflash.context_parallel import _merge
    from triflash.testing import assert_forward_matches, attention_ref, fa_tolerance, max_err
    from conftest import DEVICE
    dtype = torch.float16 if DEVICE == "cpu" else torch.bfloat16
    n, blocks = (37, 3) if DEVICE == "cpu" else (1001, 4)
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, n, h, 64, generator=g).to(DEVICE, dtype) for h in (4, 2, 2))
    cuts = [round(i * n / blocks) for i in range(blocks + 1)]
    parts = []
    for lo, hi in zip(cuts, cuts[1:]):
        # keys lo..hi-1, bottom-right aligned to the queries: query i sees block key j' iff
        # j' <= i + (hi - lo) - n + right, i.e. lo + j' <= i with right = n - hi
        parts.append(triflash.flash_attn_func(q, k[:, lo:hi], v[:, lo:hi], window_size=(-1, n - hi),
                                              return_attn_probs=True))
    assert torch.isneginf(parts[-1][1][:, :, :cuts[-2]]).all()  # rows the last block does not reach
    out_p = torch.stack([o.float() for o, _ in parts])
    lse_p = torch.stack([lse.transpose(1, 2) for _, lse in parts])  # (blocks, b, n, h): out_p's shape without d
    dest = torch.full((2, n, 4, 64), float("nan"), dtype=dtype, device=DEVICE)
    combined, lse_c = triflash.flash_attn_combine(out_p, lse_p, out=dest)
    assert combined is dest
    out = torch.zeros(2, n, 4, 64, device=DEVICE)
    lse = torch.full((2, 4, n), float("-inf"), device=DEVICE)
    for o, block_lse in parts:
        _merge(out, lse, o, block_lse)
    ref, lowp = attention_ref(q, k, v, causal=True), attention_ref(q, k, v, causal=True, upcast=False)
    assert_forward_matches(combined, lse_c.transpose(1, 2), ref[0], ref[1], lowp[0])
    assert_forward_matches(out.to(dtype), lse, ref[0], ref[1], lowp[0])
    assert max_err(out.to(dtype), combined) <= fa_tolerance(ref[0], lowp[0])


# ---- one GPU ----------------------------------------------------------------------------------

@pytest.mark.gpu
@on_gpu
@needs_dist
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_gpu_world_of_one_equals_flash_attn(d, causal):
    """bf16, GQA (8 query heads, 2 KV heads), odd lengths (ring 1001, zigzag 2 x 501,
    llama3 sequences of 1, 299, 377 and 324 tokens), deterministic backward; without a
    process group and with a gloo group of one rank (nothing to send: each function's
    single step)."""
    case = Case(1, "ring", causal, 2, h=8, d=d, batch=2)
    lengths = (1001, 1002, (0, 1, 300, 677, 1001))
    assert not dist.is_initialized()
    for grouped in (False, True):
        if grouped:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            _check_world_of_one("cuda", case, causal, lengths, exact_grads=True)
        finally:
            if grouped:
                dist.destroy_process_group()


@pytest.mark.gpu
@on_gpu
@needs_dist
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_gpu_matches_full_attention(name, request, tmp_path_factory):
    """2 and 3 ranks, each a process on cuda:0, through HostStagedGloo (module docstring);
    GPU_CASES lists the shapes."""
    case = GPU_CASES[name]
    data, per_rank = _results(GPU_CASES, name, "cuda", "host_staged_gloo", request, tmp_path_factory)
    _check_full(case, _gathered(case, per_rank, "cuda"), data, "cuda")
