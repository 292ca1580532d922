"""The decode kernel (kernels/decode.py): flash_attn_with_kvcache with a few query tokens per
KV head's query heads, packed GQA and split keys, against the fp32 reference under FA3's
tolerance rule, over dense and paged caches, ragged lengths, masks and explicit splits.
On the CPU the kernel runs under Triton's interpreter; on a GPU at the same sizes, plus a
CUDA-graph replay that must equal eager bit for bit."""
import os
import subprocess
import sys

import pytest
import torch

import triflash
from conftest import DEVICE
from triflash import dispatch
from triflash.kernels import decode
from triflash.testing import assert_forward_matches, attention_ref

I32 = dict(dtype=torch.int32, device=DEVICE)


def _cache(batch, cap, hk, d, dv, page, dtype, gen):
    """(k_cache, v_cache, page_table, logical(): each sequence's cache rows in order); paged
    caches are K and V as views of one tensor, pages in a random order (a serving layout)."""
    if page is None:
        k = torch.randn(batch, cap, hk, d, device=DEVICE, generator=gen).to(dtype)
        v = torch.randn(batch, cap, hk, dv, device=DEVICE, generator=gen).to(dtype)
        return k, v, None, lambda c: c
    pages = -(-cap // page)
    blocks = batch * pages + 3
    kv = torch.randn(blocks, page, hk, d + dv, device=DEVICE, generator=gen).to(dtype)
    k, v = kv[..., :d], kv[..., d:]
    table = torch.randperm(blocks, device=DEVICE, generator=gen)[:batch * pages].to(torch.int32).view(batch, pages)
    return k, v, table, lambda c: c[table.long()].reshape(batch, pages * page, *c.shape[2:])[:, :cap]


def _record_metas(monkeypatch):
    """The ``META`` of every decode_kernel launch from now on (a list that fills)."""
    metas, real = [], decode.decode_kernel

    class Spy:
        def __getitem__(self, grid):
            return lambda *a, **kw: metas.append(kw["META"]) or real[grid](*a, **kw)
    monkeypatch.setattr(decode, "decode_kernel", Spy())
    return metas


CASES = [
    # batch, cap, h, hk, d, dv, sq, page, mask, softcap, num_splits
    (3, 97, 8, 2, 64, 64, 1, None, "causal", 0.0, 0),
    (2, 300, 16, 1, 64, 64, 1, 16, "causal", 0.0, 3),       # GQA 16, paged 16, splits
    (4, 130, 4, 4, 128, 128, 2, None, "none", 0.0, 5),      # MHA, 2 tokens
    (2, 257, 12, 4, 40, 40, 3, 1, "causal", 0.0, 2),        # odd head dim, page size 1
    (1, 500, 8, 1, 32, 32, 4, 64, "window", 0.0, 7),        # sliding window across splits
    (3, 200, 6, 2, 256, 256, 1, None, "causal", 30.0, 4),   # head dim 256, softcap
    (2, 129, 2, 2, 64, 32, 5, 4, "causal", 0.0, 0),         # headdim_v != headdim
    (2, 64, 16, 4, 64, 64, 16, None, "causal", 0.0, 2),     # 64 rows: the most one tile packs
    (2, 700, 8, 2, 128, 128, 1, 256, "causal", 0.0, 0),     # pages holding whole dense key blocks
    (3, 333, 4, 1, 64, 64, 2, 128, "none", 0.0, 3),         # the same with splits
    (2, 150, 8, 2, 64, 64, 1, 24, "causal", 0.0, 2),        # a page size not a power of two
]
MASKS = {"none": (False, (-1, -1)), "causal": (True, (-1, -1)), "window": (True, (37, 0))}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_decode_matches_reference(case, dtype, monkeypatch):
    batch, cap, h, hk, d, dv, sq, page, mask, softcap, splits = case
    causal, window = MASKS[mask]
    gen = torch.Generator(device=DEVICE).manual_seed(hash(case) % 10007)
    k_cache, v_cache, table, logical = _cache(batch, cap, hk, d, dv, page, dtype, gen)
    q = torch.randn(batch, sq, h, d, device=DEVICE, generator=gen).to(dtype)
    lens = torch.randint(sq, cap + 1, (batch,), device=DEVICE, generator=gen).to(torch.int32)
    lens[0] = cap
    seen = []
    real_fwd = decode.fwd
    monkeypatch.setattr(decode, "fwd", lambda *a, **k: seen.append(a[-1]) or real_fwd(*a, **k))
    out, lse, *_ = triflash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, page_table=table,
                                                causal=causal, window_size=window, softcap=softcap,
                                                num_splits=splits, return_softmax_lse=True)
    assert seen == [splits], "the decode kernel serves this call"
    kl, vl = logical(k_cache), logical(v_cache)
    for b in range(batch):
        n = int(lens[b])
        kw = dict(causal=causal, window_size=window, softcap=softcap)
        ref, lse_ref = attention_ref(q[b:b + 1], kl[b:b + 1, :n], vl[b:b + 1, :n], **kw)
        lowp, _ = attention_ref(q[b:b + 1], kl[b:b + 1, :n], vl[b:b + 1, :n], upcast=False, **kw)
        assert_forward_matches(out[b:b + 1], lse[b:b + 1], ref, lse_ref, lowp, softcap)


def test_splits_agree_and_empty_sequences():
    """Every split count gives the same answer within rounding; a sequence with no keys (or a
    split that gets none) leaves output 0 and lse -inf, never NaN."""
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    q = torch.randn(3, 1, 8, 64, device=DEVICE, generator=gen).half()
    k = torch.randn(3, 200, 2, 64, device=DEVICE, generator=gen).half()
    v = torch.randn(3, 200, 2, 64, device=DEVICE, generator=gen).half()
    lens = torch.tensor([0, 3, 200], **I32)
    outs = []
    for splits in (1, 2, 5, 13):
        out, lse, *_ = triflash.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, num_splits=splits,
                                                    return_softmax_lse=True, causal=True)
        assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isneginf(lse[0]).all()
        assert torch.isfinite(out).all() and torch.isfinite(lse[1:]).all()
        outs.append((out.float(), lse))
    for out, lse in outs[1:]:
        assert (out - outs[0][0]).abs().max() < 2e-3
        assert (lse[1:] - outs[0][1][1:]).abs().max() < 1e-4


def test_varlen_queries_and_cache_forms():
    """Packed queries (speculative decoding: 1-3 tokens per sequence), cache_batch_idx and
    cache_leftpad through the decode kernel."""
    gen = torch.Generator(device=DEVICE).manual_seed(11)
    batch, cap, h, hk, d = 3, 90, 8, 2, 64
    q_lens = [3, 1, 2]
    cu = torch.tensor([0, 3, 4, 6], **I32)
    q = torch.randn(6, h, d, device=DEVICE, generator=gen).half()
    k = torch.randn(batch + 2, cap, hk, d, device=DEVICE, generator=gen).half()
    v = torch.randn(batch + 2, cap, hk, d, device=DEVICE, generator=gen).half()
    idx = torch.tensor([4, 0, 2], **I32)
    leftpad = torch.tensor([0, 7, 30], **I32)
    lens = torch.tensor([90, 41, 77], **I32)
    out, lse, *_ = triflash.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, cache_batch_idx=idx,
                                                cache_leftpad=leftpad, cu_seqlens_q=cu, max_seqlen_q=3,
                                                causal=True, num_splits=3, return_softmax_lse=True)
    for b in range(batch):
        s, e = int(cu[b]), int(cu[b + 1])
        kb = k[int(idx[b]):int(idx[b]) + 1, int(leftpad[b]):int(lens[b])]
        vb = v[int(idx[b]):int(idx[b]) + 1, int(leftpad[b]):int(lens[b])]
        ref, lse_ref = attention_ref(q[None, s:e], kb, vb, causal=True)
        lowp, _ = attention_ref(q[None, s:e], kb, vb, causal=True, upcast=False)
        assert_forward_matches(out[None, s:e], lse[None, :, s:e], ref, lse_ref, lowp)
    assert q_lens == [e - s for s, e in zip(cu[:-1].tolist(), cu[1:].tolist())]


@pytest.mark.parametrize("num_splits", [1, 3])
def test_longest_first_order(num_splits, monkeypatch):
    """Ragged lengths with ties and empty sequences: the programs take the sequences
    longest first (``decode.longest_first``), and every sequence's every head is still computed
    once, into its own rows (outputs poisoned before the call)."""
    gen = torch.Generator(device=DEVICE).manual_seed(11)
    batch, cap, h, hk, d = 37, 90, 4, 2, 64
    q = torch.randn(batch, 1, h, d, device=DEVICE, generator=gen).half()
    k = torch.randn(batch, cap, hk, d, device=DEVICE, generator=gen).half()
    v = torch.randn(batch, cap, hk, d, device=DEVICE, generator=gen).half()
    lens = torch.randint(0, cap + 1, (batch,), device=DEVICE, generator=gen).to(torch.int32)
    lens[3:9] = 41  # ties
    lens[10], lens[20], lens[30] = cap, 0, cap
    metas = _record_metas(monkeypatch)
    poison = torch.full((batch, 1, h, d), float("nan"), dtype=q.dtype, device=DEVICE)
    real_alloc = decode.alloc_fwd_outputs
    monkeypatch.setattr(decode, "alloc_fwd_outputs",
                        lambda *a: (lambda o, l: (o.copy_(poison), l.fill_(float("nan"))))(*real_alloc(*a)))
    out, lse, *_ = triflash.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, num_splits=num_splits,
                                                return_softmax_lse=True)
    assert [m.BLOCK_B for m in metas] == [64]
    for b in range(batch):
        n = int(lens[b])
        if n == 0:
            assert torch.equal(out[b], torch.zeros_like(out[b])) and torch.isneginf(lse[b]).all()
            continue
        ref, lse_ref = attention_ref(q[b:b + 1], k[b:b + 1, :n], v[b:b + 1, :n])
        lowp, _ = attention_ref(q[b:b + 1], k[b:b + 1, :n], v[b:b + 1, :n], upcast=False)
        assert_forward_matches(out[b:b + 1], lse[b:b + 1], ref, lse_ref, lowp, 0.0)
    assert decode.longest_first(37, False) == 0 and decode.longest_first(1, True) == 0
    assert decode.longest_first(decode.MAX_ORDERED_BATCH + 1, True) == 0


@pytest.mark.parametrize("wide", [False, True], ids=["rows32", "rows64"])
@pytest.mark.parametrize("page", [None, 16, 1, 24, 128], ids=lambda p: f"page{p}")
def test_kv_strides_and_row_offsets(page, wide, monkeypatch):
    """K and V with different strides (V a view into a wider tensor, pages of its own
    layout: ``decode.shared_offsets`` False) and K and V the same tensor (True); a page's
    row offsets in 32 bits and in 64 (``decode.wide_rows`` forced); every addressing path:
    dense, pages walked key by key (page size 1, and 24: not a power of two) and pages
    holding whole key blocks (16 and 128 under the interpreter's 16-key blocks)."""
    gen = torch.Generator(device=DEVICE).manual_seed(17 + (page or 0))
    batch, cap, h, hk, d = 3, 160, 8, 2, 64
    q = torch.randn(batch, 1, h, d, device=DEVICE, generator=gen).half()
    lens = torch.tensor([cap, 77, 1], **I32)
    if page is None:
        k = torch.randn(batch, cap, hk, d, device=DEVICE, generator=gen).half()
        v = torch.randn(batch, cap, hk + 3, d, device=DEVICE, generator=gen).half()[:, :, 1:hk + 1]
        table = None
        kl, vl = k, v
    else:
        blocks = batch * (-(-cap // page)) + 2
        k = torch.randn(blocks, page, hk, d, device=DEVICE, generator=gen).half()
        v = torch.randn(blocks, page + 5, hk, 2 * d, device=DEVICE, generator=gen).half()[:, 2:page + 2, :, :d]
        table = torch.randperm(blocks, device=DEVICE, generator=gen)[:batch * (blocks // batch)]
        table = table.to(torch.int32).view(batch, -1)[:, :-(-cap // page)].contiguous()
        def logical(c):
            return c[table.long()].reshape(batch, -1, hk, d)[:, :cap]
        kl, vl = logical(k), logical(v)
    assert not decode.shared_offsets(k, v) and decode.shared_offsets(k, k)
    assert not decode.wide_rows(page or 1, k, v)
    monkeypatch.setattr(decode, "wide_rows", lambda *a: wide)
    for v_cache in (v, k):  # different strides, then K and V the same tensor
        with monkeypatch.context() as m:
            metas = _record_metas(m)
            out, lse, *_ = triflash.flash_attn_with_kvcache(q, k, v_cache, cache_seqlens=lens, page_table=table,
                                                        causal=True, return_softmax_lse=True)
        assert [(m.KV_SAME, m.WIDE_ROWS) for m in metas] == [(v_cache is k, wide)]
        v_log = vl if v_cache is v else kl
        for b in range(batch):
            n = int(lens[b])
            ref, lse_ref = attention_ref(q[b:b + 1], kl[b:b + 1, :n], v_log[b:b + 1, :n], causal=True)
            lowp, _ = attention_ref(q[b:b + 1], kl[b:b + 1, :n], v_log[b:b + 1, :n], causal=True, upcast=False)
            assert_forward_matches(out[b:b + 1], lse[b:b + 1], ref, lse_ref, lowp)


def test_row_offsets_width():
    """A page's row offsets go to 64 bits exactly when page size x row stride reaches 2^31."""
    t = torch.empty(0, device="meta").as_strided((4, 64, 2, 8), (1 << 40, 1 << 25, 8, 1))
    assert decode.wide_rows(64, t, t) and not decode.wide_rows(63, t, t)
    assert not decode.wide_rows(0, t, t)


def test_dispatch_decode_or_prefill():
    """Decoding-sized calls (query tokens x GQA group <= decode.MAX_ROWS per KV head) take the
    decode kernel; longer ones the prefill kernels."""
    assert dispatch.decodes(1, 32, 8, 64) and dispatch.decodes(4, 32, 8, 64)
    assert dispatch.decodes(16, 16, 4, 1) and not dispatch.decodes(17, 16, 4, 1)
    assert not dispatch.decodes(2048, 32, 8, 1)
    assert not dispatch.decodes(1, 32, 8, 70000)  # CUDA's grid z axis


def test_split_plan():
    """Splits: none when the tiles fill the GPU, enough to fill it for one long sequence,
    FA3's num_splits honoured up to the key blocks, and the plan a function of shapes only."""
    cpu = torch.device("cpu")
    many = decode.plan("sm90", cpu, 64, 1, 8192, 32, 8, 128, 128)
    one_seq = decode.plan("sm90", cpu, 1, 1, 131072, 32, 8, 128, 128)
    assert many.splits == 1
    slots = 132 * decode.ctas_per_sm(one_seq.cfg, 128, 128)
    assert 0.95 * slots <= 8 * one_seq.splits <= slots
    assert decode.plan("sm90", cpu, 1, 1, 131072, 32, 8, 128, 128, 0, 7).splits == 7
    assert decode.plan("sm90", cpu, 1, 1, 100, 32, 8, 128, 128, 0, 100).splits == 1  # one key block
    assert decode.num_splits_for(8, 10, 264) <= 10 // decode.MIN_BLOCKS_PER_SPLIT


def test_scheduler_metadata_is_the_plan():
    md = triflash.get_scheduler_metadata(2, 1, 4096, 32, 8, 128, torch.tensor([5, 9], **I32))
    assert isinstance(md, torch.Tensor) and md.dtype == torch.int32 and md.device.type == torch.device(DEVICE).type
    target = dispatch.target_of(torch.device(DEVICE))
    assert int(md[0]) == decode.plan(target, torch.device(DEVICE), 2, 1, 4096, 32, 8, 128, 128).splits


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("page", [None, 16])
def test_graph_replay_equals_eager(page):
    """A decoding step (append one token, attend, split keys) captured in a CUDA graph replays
    bit for bit what eager mode computes, with no host work at replay."""
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    batch, cap, h, hk, d = 4, 4096, 32, 8, 128
    k_cache, v_cache, table, _ = _cache(batch, cap, hk, d, d, page, torch.bfloat16, gen)
    q = torch.randn(batch, 1, h, d, device=DEVICE, generator=gen).bfloat16()
    k_new = torch.randn(batch, 1, hk, d, device=DEVICE, generator=gen).bfloat16()
    v_new = torch.randn(batch, 1, hk, d, device=DEVICE, generator=gen).bfloat16()
    lens = torch.tensor([4000, 17, 2222, 4095], **I32)
    snapshot = (k_cache.clone(), v_cache.clone())

    def step():
        return triflash.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lens,
                                                page_table=table, causal=True, return_softmax_lse=True)[:2]

    eager_out, eager_lse = (x.clone() for x in step())
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = step()
    k_cache.copy_(snapshot[0]), v_cache.copy_(snapshot[1])
    out.fill_(float("nan")), lse.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager_out) and torch.equal(lse, eager_lse)
    assert decode.plan("sm90", q.device, batch, 1, cap, h, hk, d, d, page or 0).splits > 1 or page


def _toolchain_problem():
    try:
        from tools import sm90_report
    except ImportError as e:  # pragma: no cover
        return str(e)
    return sm90_report.toolchain_problem()


@pytest.mark.sm90
def test_decode_kernels_fit_sm90():
    """Each decode form's launches compile for sm_90a within Hopper's shared memory; spills at
    most 16 bytes (the 8-warp tiles at head dims 128 / 256, measured at 4.39 / 4.19 K+V TB/s:
    decode.config's comment)."""
    problem = _toolchain_problem()
    if problem:
        pytest.skip(f"sm_90a toolchain unavailable: {problem}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-m", "tools.decode_compile", "--json"], capture_output=True,
                         text=True, env=env, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert res.returncode == 0, res.stderr[-3000:]
    import json
    rows = json.loads(res.stdout)
    assert {r["form"] for r in rows} == set(__import__("tools.decode_compile").decode_compile.FORMS)
    from tools import triton_budgets
    allowed = triton_budgets.for_release("decode")  # a release's own, where it spills more
    for r in rows:
        assert r["shared"] <= 232448, r
        assert r["spill_bytes"] <= allowed.get(r["form"], 16), r


def test_split_combine_is_chained_on_sm90():
    """On sm90 a split launch's combine is its programmatic dependent: the shares compiled to
    let it launch (``CHAINED``), the combine launched with ``launch_pdl`` and compiled to wait
    for their memory; an unsplit launch and other targets launch plainly."""
    pytest.importorskip("tools.sm90_report")
    from tools.decode_compile import launches
    from triflash.kernels import decode
    assert decode.chained("sm90") and not decode.chained("default") and not decode.chained("interpret")
    log = launches("d128-split")
    (dec, _, dec_kw), (comb, _, comb_kw) = [(fn, args, kw) for fn, args, kw in log]
    assert (dec.fn.__name__, comb.fn.__name__) == ("decode_kernel", "decode_combine_kernel")
    assert dec_kw["META"].SPLIT and dec_kw["META"].CHAINED
    assert comb_kw["CHAINED"] and comb_kw.get("launch_pdl") is True
    [(fn, _, kw)] = launches("d128-dense")
    assert not kw["META"].SPLIT and not kw["META"].CHAINED and "launch_pdl" not in kw


@pytest.mark.parametrize("num_splits", [1, 0, 3])
def test_varlen_func_decoding_step(num_splits, monkeypatch):
    """A serving engine's decoding call, flash_attn_varlen_func with packed queries, a dense
    batch of caches (cu_seqlens_k=None) and seqused_k: forward-only, it runs the decode
    kernel (num_splits as FA3 reads it: 1 no split, 0 the heuristic), with the same result
    as the reference; with gradients it keeps the differentiable path."""
    gen = torch.Generator(device=DEVICE).manual_seed(num_splits)
    h, hk, d, cap = 8, 2, 64, 120
    cu = torch.tensor([0, 2, 3, 5], **I32)
    q = torch.randn(5, h, d, device=DEVICE, generator=gen).half()
    k = torch.randn(3, cap, hk, d, device=DEVICE, generator=gen).half()
    v = torch.randn(3, cap, hk, d, device=DEVICE, generator=gen).half()
    used = torch.tensor([120, 9, 64], **I32)
    seen = []
    real_fwd = decode.fwd
    monkeypatch.setattr(decode, "fwd", lambda *a, **kw: seen.append(a[-1]) or real_fwd(*a, **kw))
    with torch.no_grad():
        out, lse = triflash.flash_attn_varlen_func(q, k, v, cu, None, 2, None, seqused_k=used, causal=True,
                                                   num_splits=num_splits, return_attn_probs=True)
    assert seen == [num_splits]
    for b in range(3):
        s, e, n = int(cu[b]), int(cu[b + 1]), int(used[b])
        ref, lse_ref = attention_ref(q[None, s:e], k[b:b + 1, :n], v[b:b + 1, :n], causal=True)
        lowp, _ = attention_ref(q[None, s:e], k[b:b + 1, :n], v[b:b + 1, :n], causal=True, upcast=False)
        assert_forward_matches(out[None, s:e], lse[None, :, s:e], ref, lse_ref, lowp)
    q.requires_grad_(True)
    out_grad = triflash.flash_attn_varlen_func(q, k, v, cu, None, 2, None, seqused_k=used, causal=True)
    assert seen == [num_splits] and out_grad.requires_grad
    assert (out_grad.detach().float() - out.float()).abs().max() < 2e-3
