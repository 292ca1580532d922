"""FlashAttention-3's KV-cache test grid, ported: the parameter grid and the semantics of
``test_flash_attn_kvcache`` in Dao-AILab/flash-attention ``hopper/test_flash_attn.py``
(its cache, page-table, cache_batch_idx, leftpad, varlen-q, new-key and rotary set-up, its
local windows, its tolerance rule and its check that the caches were written in place),
rewritten here against ``triflash.flash_attn_with_kvcache`` (FA3's signature).

What one case does, as FA3's does:

* q (batch, seqlen_q, nheads, d); with ``varlen_q`` each sequence keeps a random prefix of
  max(1, seqlen_q - 20) .. seqlen_q tokens, packed, with cu_seqlens_q / max_seqlen_q;
* new keys/values (``new_kv``) of seqlen_new = seqlen_q tokens (or a random 1 .. seqlen_q),
  packed under ``varlen_q`` the same way and given with cu_seqlens_k_new;
* a dense cache (batch_cache, seqlen_k, ...), or blocks of ``page_size`` rows, three times
  as many as the sequences need, in a random order (the page table's rows are random
  permutation slices); ``cache_batch_idx``: batch_cache = 2 x batch, a random choice of
  cache rows (page-table rows when paged); ``cache_leftpad`` random below cache_seqlens;
* cache_seqlens random, leaving room for the new tokens (and for the rotated queries under
  causal/local rotary, whose positions run to cache_seqlens + seqlen_q);
* rotary over the first rotary_fraction x d channels (a multiple of 16), cos/sin tables
  with a row per cache row, GPT-J (interleaved) or GPT-NeoX pairs, new keys at positions
  cache_seqlens + i, queries likewise when causal or local, else all at cache_seqlens;
* local: window_size drawn as FA3 draws it, a 2-element integer tensor in [0, seqlen_k);
* fp8 (e4m3) as FA3 draws it (its grid runs each case in bf16 and in fp8, no descales): q, the
  caches, the new keys and the rotary tables in fp8, the output bf16; the rotated keys within
  FA3's fp8 tolerance (0.1); "the same computation in the input dtype" is the reference in
  bf16 on the fp8 values (the kernels compute in fp16 on them);
* causal / local: FA3 also runs each case with an ``attention_chunk`` drawn in [1, 2 x
  seqlen_k) (chunked local attention); here a case of its own, the chunk drawn from the case;
* each call (FA3's num_splits 1 / 3 / 0, without and with get_scheduler_metadata, that
  one used twice) starts from the same caches; after it, the written rows hold the new
  (rotated) tokens, every other row of the physical caches is untouched, and the output
  and lse match the fp32 reference over keys cache_leftpad .. cache_seqlens + new - 1
  (causal and windows bottom-right aligned to them) under FA3's rule: max error <= 2 x the
  same computation's error in the input dtype + a small atol (``assert_forward_matches``),
  mean error <= 1.5 x its mean error.

Pruned from FA3's grid, with the reason:

* ``qv``: FA3's grid draws it only for d = 64 with dv >= 256; its kvcache grid has d = 128,
  dv = 128, so it never does (tests/test_fa3_extras.py tests qv, MLA's decode included);
* has_rotary_seqlens: FA3's grid runs only False (True is commented out there); kept so;
* exact duplicates run once: rotary_interleaved without rotary, and the seqlen_new choice
  without new keys, change nothing in what is computed.

On the GPU the remaining grid (95,040 cases: 47,520 each in bf16 and fp8, 38,016 with an
attention_chunk) runs at
FA3's sizes (batch 5, 6 heads, d 128, seqlen pairs 1 x 128 .. 2048 x 3577 and 16 x 20000, page
sizes None / 1 / 4 / 128): whole with ``TRIFLASH_FA3_KVCACHE_GRID=full``, else a fixed sample
of 256 of its cases (seed 0) in the default suite. On the CPU (Triton's interpreter) a
hand-picked subset at small sizes covers every feature and both
of triflash's routes (the decode kernel for a few query rows per KV head, the prefill
kernels beyond 64), with one (num_splits, metadata) choice per case.
"""
import itertools
import math
import os
import random
import zlib
from typing import NamedTuple, Optional

import pytest
import torch

import triflash
from conftest import DEVICE
from triflash.testing import assert_forward_matches, attention_ref, max_err

ON_GPU = DEVICE == "cuda"
I32 = dict(dtype=torch.int32, device=DEVICE)
F8 = torch.float8_e4m3fn
MASKS = {"none": (False, False), "causal": (True, False), "local": (False, True)}  # (causal, local)
HEADS = {"mha": lambda h: h, "mqa": lambda h: 1, "gqa": lambda h: h // 2}  # FA3: 6 -> 6 / 1 / 3


class Case(NamedTuple):
    seqlen_q: int
    seqlen_k: int
    d: int
    mha: str
    mask: str
    new_kv: bool
    seqlen_new_eq_seqlen_q: bool
    page_size: Optional[int]
    has_batch_idx: bool
    has_leftpad: bool
    varlen_q: bool
    rotary_fraction: float
    rotary_interleaved: bool
    runs: tuple  # (num_splits, precomputed scheduler metadata) per call
    dtype: torch.dtype = torch.bfloat16  # (FA3's grid: bf16 and fp8 e4m3)
    chunk: int = 0  # attention_chunk

    def id(self):
        parts = [f"q{self.seqlen_q}", f"k{self.seqlen_k}", f"d{self.d}", self.mha, self.mask,
                 "new" + ("" if self.seqlen_new_eq_seqlen_q else "-short") if self.new_kv else "nonew",
                 f"page{self.page_size}" if self.page_size else "dense"]
        parts += [name for name, on in (("bidx", self.has_batch_idx), ("leftpad", self.has_leftpad),
                                        ("varlen", self.varlen_q)) if on]
        if self.rotary_fraction:
            parts.append(f"rot{self.rotary_fraction}{'-gptj' if self.rotary_interleaved else '-neox'}")
        parts.append("runs" + "_".join(f"{s}{'m' if m else ''}" for s, m in self.runs))
        if self.dtype != torch.bfloat16:
            parts.append(str(self.dtype).replace("torch.", ""))
        if self.chunk:
            parts.append(f"chunk{self.chunk}")
        return "-".join(parts)


# FA3's runs per case: num_splits 1, 3, 0 (its heuristic), each without and with
# get_scheduler_metadata (the metadata used twice, as FA3 does to test its reuse)
FA3_RUNS = tuple((s, m) for s in (1, 3, 0) for m in (False, True))
FA3_SEQLENS = [(1, 128), (1, 339), (3, 1024), (64, 800), (64, 256), (3, 799), (64, 2048),
               (16, 20000), (128, 128), (256, 512), (2048, 3577)]


def _fa3_grid():
    """FA3's grid (bf16 and fp8; d 128), its skips applied, exact duplicates dropped (docstring)."""
    cases = []
    for ((sq, sk), varlen_q, batch_idx, leftpad, page, rot, inter, new_eq, mask, new_kv, mha) in itertools.product(
            FA3_SEQLENS, (False, True), (False, True), (False, True), (None, 1, 4, 128), (0.0, 0.5, 1.0),
            (False, True), (True, False), ("none", "causal", "local"), (False, True), ("mha", "mqa", "gqa")):
        if page is not None and sk % page != 0:
            continue  # FA3's skips
        if sq > sk and new_kv:
            continue
        if not new_kv and rot > 0.0:
            continue
        if (rot == 0.0 and inter) or (not new_kv and not new_eq):
            continue  # the same computation as another case
        for dtype in (torch.bfloat16, F8):
            case = Case(sq, sk, 128, mha, mask, new_kv, new_eq, page, batch_idx, leftpad, varlen_q, rot, inter,
                        FA3_RUNS, dtype)
            cases.append(case)
            if mask != "none":  # FA3's attention_chunk draw, randint(1, 2 * seqlen_k), fixed per case
                chunk = random.Random(zlib.crc32(case.id().encode())).randrange(1, 2 * sk)
                cases.append(case._replace(chunk=chunk))
    return cases


def _cpu_grid():
    """Every feature of FA3's grid at least once, at interpreter sizes (batch 3, 4 heads).
    The decode kernel serves seqlen_q x (heads per KV head) <= 64 rows; the cases at 40 and
    48 query tokens under GQA/MQA run the prefill kernels (portable forward)."""
    C = Case
    return [
        # seqlen_q, seqlen_k, d, heads, mask, new_kv, new=seqlen_q, page, batch_idx, leftpad, varlen_q,
        # rotary fraction, interleaved, runs
        C(1, 128, 128, "mha", "none", False, True, None, False, False, False, 0.0, False, ((1, False),)),
        C(1, 64, 64, "mqa", "causal", True, True, 1, False, False, False, 0.0, False, ((0, False),)),
        C(3, 48, 64, "gqa", "local", True, False, 4, True, False, False, 0.0, False, ((3, False),)),
        C(3, 128, 64, "mha", "causal", True, True, 128, False, True, False, 1.0, True, ((0, True),)),
        C(4, 64, 64, "gqa", "causal", True, True, None, True, True, False, 0.5, False, ((1, True),)),
        C(2, 40, 64, "mqa", "none", True, True, None, False, False, False, 1.0, False, ((3, False),)),
        C(5, 60, 64, "mha", "local", True, True, 4, False, False, False, 0.5, True, ((0, False),)),
        C(6, 48, 64, "gqa", "none", True, False, 1, True, True, True, 0.0, False, ((0, False),)),
        C(7, 56, 64, "mha", "causal", True, False, None, False, True, True, 1.0, True, ((3, False),)),
        C(4, 64, 64, "mqa", "local", False, True, 4, False, True, True, 0.0, False, ((1, False),)),
        C(8, 96, 64, "gqa", "causal", True, True, 4, True, False, True, 0.5, True, ((0, True),)),
        C(16, 48, 64, "mha", "none", False, True, None, True, False, False, 0.0, False, ((0, False),)),
        C(16, 64, 64, "gqa", "local", True, True, None, False, False, False, 1.0, False, ((1, False),)),
        C(12, 128, 64, "mha", "causal", False, True, 128, True, True, False, 0.0, False, ((3, True),)),
        # prefill: 40 x 2 / 48 x 4 query rows per KV head
        C(40, 96, 64, "gqa", "causal", True, True, None, False, False, False, 0.0, False, ((0, False),)),
        C(40, 80, 64, "gqa", "local", True, False, 4, False, True, False, 1.0, True, ((0, False),)),
        C(48, 48, 64, "mqa", "causal", False, True, None, True, True, True, 0.0, False, ((0, False),)),
        C(24, 64, 64, "mqa", "none", True, True, 1, False, False, True, 0.5, False, ((0, False),)),
        # attention_chunk (FA3 draws it for causal / local): the decode kernel, then the prefill
        C(3, 128, 64, "gqa", "causal", True, True, 4, True, True, False, 0.5, False, ((3, False),), chunk=20),
        C(4, 96, 64, "mha", "local", False, True, None, False, False, True, 0.0, False, ((0, False),), chunk=37),
        C(40, 96, 64, "gqa", "causal", True, False, None, False, True, False, 0.0, False, ((0, False),), chunk=16),
        # fp16 (FA3's kvcache grid is bf16 and fp8; one case keeps the other 16-bit type honest)
        C(2, 64, 128, "gqa", "causal", True, True, 4, True, True, True, 0.5, True, ((3, False),), torch.float16),
        # fp8: the decode kernel (dense, paged, split, varlen, rotary, chunk) and the prefill
        C(1, 64, 128, "mqa", "causal", True, True, 1, False, False, False, 1.0, False, ((0, False),), F8),
        C(3, 48, 64, "gqa", "local", True, False, 4, True, True, False, 0.5, True, ((3, False),), F8),
        C(6, 48, 64, "mha", "none", True, False, None, True, True, True, 0.0, False, ((1, True),), F8),
        C(3, 128, 64, "gqa", "causal", False, True, 128, False, True, True, 0.0, False, ((3, False),), F8,
          chunk=20),
        C(40, 96, 64, "gqa", "causal", True, True, None, False, True, False, 1.0, True, ((0, False),), F8),
        C(24, 64, 64, "mqa", "none", True, True, 4, True, False, True, 0.5, False, ((0, False),), F8),
    ]


def _gpu_cases():
    grid = _fa3_grid()
    if os.environ.get("TRIFLASH_FA3_KVCACHE_GRID") == "full":
        return grid
    return random.Random(0).sample(grid, 256)


CASES = _gpu_cases() if ON_GPU else _cpu_grid()
BATCH, NHEADS = (5, 6) if ON_GPU else (3, 4)


def _rotary_ref(x, cos, sin, positions, interleaved):
    """The rotate-half form of rotary (FlashAttention's reference), fp32, rounded once.
    x (batch, seqlen, heads, d); positions (batch, seqlen) inside the tables."""
    rot = 2 * cos.shape[1]
    c, s = cos.float()[positions], sin.float()[positions]  # (batch, seqlen, rot / 2)
    if interleaved:
        c, s = c.repeat_interleave(2, dim=-1), s.repeat_interleave(2, dim=-1)
    else:
        c, s = torch.cat((c, c), dim=-1), torch.cat((s, s), dim=-1)
    xr = x[..., :rot].float()
    if interleaved:
        half = torch.stack((-xr[..., 1::2], xr[..., 0::2]), dim=-1).flatten(-2)
    else:
        half = torch.cat((-xr[..., rot // 2:], xr[..., :rot // 2]), dim=-1)
    rotated = xr * c[:, :, None] + half * s[:, :, None]
    return torch.cat((rotated.to(x.dtype), x[..., rot:]), dim=-1)


def _prefix_lengths(n, batch, gen):
    """FA3's ``generate_random_padding_mask(mode="random")``: a prefix of max(1, n - 20) .. n."""
    return torch.randint(max(1, n - 20), n + 1, (batch,), generator=gen, device=DEVICE).tolist()


def _pack(x, lengths):
    return torch.cat([x[b, :n] for b, n in enumerate(lengths)])


def _cu(lengths):
    return torch.tensor([0] + list(itertools.accumulate(lengths)), **I32)


@pytest.mark.parametrize("case", CASES, ids=Case.id)
def test_flash_attn_kvcache(case):
    c = case
    gen = torch.Generator(device=DEVICE).manual_seed(zlib.crc32(c.id().encode()))
    sq, sk, d, dtype = c.seqlen_q, c.seqlen_k, c.d, c.dtype
    causal, local = MASKS[c.mask]
    batch, nheads = BATCH, NHEADS
    batch_cache = 2 * batch if c.has_batch_idx else batch
    nheads_k = HEADS[c.mha](nheads)
    dv = d  # FA3: dv = d for d = 128 (its only other dv values come with d <= 64 or 128 < d <= 192)
    rotary_dim = int(c.rotary_fraction * d) // 16 * 16

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=DEVICE).to(dtype)

    q = randn(batch, sq, nheads, d)
    q_lens = _prefix_lengths(sq, batch, gen) if c.varlen_q else [sq] * batch
    # FA3's form: a 2-element integer tensor (on the host), each side in [0, seqlen_k)
    window = torch.randint(0, sk, (2,), generator=gen, device=DEVICE).cpu() if local else (-1, -1)
    window_ref = tuple(int(w) for w in window)
    seqlen_new = sq if c.seqlen_new_eq_seqlen_q else int(torch.randint(1, sq + 1, (1,), generator=gen, device=DEVICE))
    if c.new_kv:
        k_new, v_new = randn(batch, seqlen_new, nheads_k, d), randn(batch, seqlen_new, nheads_k, dv)
        new_lens = _prefix_lengths(seqlen_new, batch, gen) if c.varlen_q else [seqlen_new] * batch
    else:
        k_new = v_new = None
        new_lens = [0] * batch

    # the caches: dense rows, or 3x the blocks the sequences need, in a random order
    if c.page_size is None:
        k_cache, v_cache = randn(batch_cache, sk, nheads_k, d), randn(batch_cache, sk, nheads_k, dv)
        page_table, table_rows = None, 0
    else:
        pages = math.ceil(sk / c.page_size)
        num_blocks = pages * batch_cache * 3
        k_cache = randn(num_blocks, c.page_size, nheads_k, d)
        v_cache = randn(num_blocks, c.page_size, nheads_k, dv)
        page_table = torch.randperm(num_blocks, generator=gen, device=DEVICE).to(torch.int32).view(batch_cache, -1)
        table_rows = page_table.shape[1] * c.page_size
    # room for the new tokens (for the rotated queries under causal/local rotary)
    room = (sq if (causal or local) and rotary_dim > 0 else seqlen_new) if c.new_kv else 0
    cache_seqlens = torch.randint(0 if c.new_kv else 1, sk - room + 1, (batch,), generator=gen,
                                  device=DEVICE).to(torch.int32)
    seqlens = cache_seqlens.tolist()
    leftpad = None
    if c.has_leftpad:
        leftpad = torch.tensor([int(torch.randint(0, s, (1,), generator=gen, device=DEVICE)) if s > 0 else 0
                                for s in seqlens], **I32)
    batch_idx = None
    if c.has_batch_idx:
        batch_idx = torch.randperm(batch_cache, generator=gen, device=DEVICE)[:batch].to(torch.int32)
    rows = batch_idx.long() if batch_idx is not None else torch.arange(batch, device=DEVICE)

    def logical(cache):
        """Each sequence's first seqlen_k cache rows, in order (through its page-table row)."""
        if page_table is None:
            return cache[rows]
        return cache[page_table[rows].long()].flatten(1, 2)[:, :sk]

    # rotary: the tables cover every cache row (paged: every block's rows, as FA3 sizes them)
    cos = sin = None
    q_ro, k_ro = q, k_new
    if rotary_dim > 0:
        angle = torch.rand(sk if c.page_size is None else num_blocks * c.page_size, rotary_dim // 2,
                           generator=gen, device=DEVICE) * 2 * math.pi
        cos, sin = torch.cos(angle).to(dtype), torch.sin(angle).to(dtype)
        steps = torch.arange(sq, device=DEVICE)[None]
        q_pos = cache_seqlens.long()[:, None] + (steps if causal or local else 0 * steps)
        q_ro = _rotary_ref(q, cos, sin, q_pos, c.rotary_interleaved)
        k_pos = cache_seqlens.long()[:, None] + torch.arange(seqlen_new, device=DEVICE)[None]
        k_ro = _rotary_ref(k_new, cos, sin, k_pos, c.rotary_interleaved)

    # the reference caches, and where the new tokens land in the physical ones
    k_ref, v_ref = logical(k_cache).clone(), logical(v_cache).clone()
    where_b, where_r, k_rows, v_rows = [], [], [], []
    for b in range(batch):
        s, n = seqlens[b], new_lens[b]
        if n == 0:
            continue
        k_ref[b, s:s + n], v_ref[b, s:s + n] = k_ro[b, :n], v_new[b, :n]
        r = torch.arange(s, s + n, device=DEVICE)
        if page_table is None:
            where_b.append(rows[b].expand(n))
            where_r.append(r)
        else:
            where_b.append(page_table[rows[b]].long()[r // c.page_size])
            where_r.append(r % c.page_size)
        k_rows.append(k_ro[b, :n])
        v_rows.append(v_new[b, :n])
    where = (torch.cat(where_b), torch.cat(where_r)) if where_b else None

    # the fp32 reference and the same computation in the input dtype, sequence by sequence
    # over keys leftpad .. cache_seqlens + new - 1, flattened in the kernel's output order
    kw = dict(causal=causal, window_size=window_ref, attention_chunk=c.chunk)
    low = (lambda t: t.bfloat16()) if dtype == F8 else (lambda t: t)  # (fp8: on its values in bf16, the output's dtype)
    refs, lse_refs, lowps = [], [], []
    for b in range(batch):
        start, end, n = (int(leftpad[b]) if leftpad is not None else 0), seqlens[b] + new_lens[b], q_lens[b]
        qb, kb, vb = q_ro[b:b + 1, :n], k_ref[b:b + 1, start:end], v_ref[b:b + 1, start:end]
        ref, lse_ref = attention_ref(low(qb), low(kb), low(vb), **kw)
        lowp, _ = attention_ref(low(qb), low(kb), low(vb), upcast=False, **kw)
        refs.append(ref[0].flatten())
        lse_refs.append(lse_ref[0].flatten())
        lowps.append(lowp[0].flatten())
    ref, lse_ref, lowp = torch.cat(refs), torch.cat(lse_refs), torch.cat(lowps)

    # the call's inputs, in FA3's forms
    cu_seqlens_q = _cu(q_lens) if c.varlen_q else None
    max_seqlen_q = max(q_lens) if c.varlen_q else None
    q_in = _pack(q, q_lens) if c.varlen_q else q
    cu_seqlens_k_new = None
    k_in, v_in = k_new, v_new
    if c.new_kv and c.varlen_q:
        cu_seqlens_k_new = _cu(new_lens)
        k_in, v_in = _pack(k_new, new_lens), _pack(v_new, new_lens)
    k_saved, v_saved = k_cache.clone(), v_cache.clone()
    if where is not None:
        k_rows, v_rows = torch.cat(k_rows), torch.cat(v_rows)
        k_old, v_old = k_saved[where], v_saved[where]

    for num_splits, precompute in c.runs:
        metadata = None
        if precompute:
            metadata = triflash.get_scheduler_metadata(
                batch, max_seqlen_q if c.varlen_q else sq, sk if page_table is None else table_rows,
                nheads, nheads_k, d, cache_seqlens, q.dtype, headdim_v=dv, cu_seqlens_q=cu_seqlens_q,
                cu_seqlens_k_new=cu_seqlens_k_new, cache_leftpad=leftpad, max_seqlen_k_new=seqlen_new,
                page_size=c.page_size, causal=causal, window_size=window, attention_chunk=c.chunk,
                num_splits=num_splits)
        for _ in range(2 if precompute else 1):  # FA3 reuses the metadata
            out, lse, *rest = triflash.flash_attn_with_kvcache(
                q_in, k_cache, v_cache, k_in, v_in, rotary_cos=cos, rotary_sin=sin,
                cache_seqlens=cache_seqlens, cache_batch_idx=batch_idx, cache_leftpad=leftpad,
                page_table=page_table, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k_new=cu_seqlens_k_new,
                max_seqlen_q=max_seqlen_q, rotary_seqlens=cache_seqlens, causal=causal, window_size=window,
                rotary_interleaved=c.rotary_interleaved, scheduler_metadata=metadata, num_splits=num_splits,
                attention_chunk=c.chunk, return_softmax_lse=True)
            # the caches: the new (rotated) tokens in place, every other row untouched;
            # the old rows put back, so that the next call starts from the same caches
            if where is not None:
                assert torch.equal(v_cache[where], v_rows), "v_cache: the new values, in place"
                if rotary_dim == 0:
                    assert torch.equal(k_cache[where], k_rows), "k_cache: the new keys, in place"
                else:  # FA3's check of the rotated keys (fp8: its 0.1)
                    tol = 1e-1 if dtype == F8 else 1e-3
                    assert torch.allclose(k_cache[where].float(), k_rows.float(), rtol=tol, atol=tol), \
                        f"k_cache: the rotated new keys, max error {max_err(k_cache[where], k_rows)}"
                k_cache[where], v_cache[where] = k_old, v_old
            assert torch.equal(k_cache, k_saved) and torch.equal(v_cache, v_saved), \
                "rows other than the new tokens' are untouched"

            total_q = sum(q_lens)
            if c.varlen_q:
                assert out.shape == (total_q, nheads, dv) and lse.shape == (nheads, total_q)
                outs = [out[s:e] for s, e in itertools.pairwise([0] + list(itertools.accumulate(q_lens)))]
                lses = [lse[:, s:e] for s, e in itertools.pairwise([0] + list(itertools.accumulate(q_lens)))]
            else:
                assert out.shape == (batch, sq, nheads, dv) and lse.shape == (batch, nheads, sq)
                outs, lses = list(out), list(lse)
            assert out.dtype == (torch.bfloat16 if dtype == F8 else dtype) and lse.dtype == torch.float32
            out_flat = torch.cat([o.flatten() for o in outs])
            lse_flat = torch.cat([x.flatten() for x in lses])
            where_split = f"num_splits={num_splits}, metadata={precompute}"
            try:
                assert_forward_matches(out_flat, lse_flat, ref, lse_ref, lowp)
                # FA3's second rule: the mean error within 1.5x the input dtype's
                err_mean = (out_flat.float() - ref.float()).abs().mean().item()
                lowp_mean = (lowp.float() - ref.float()).abs().mean().item()
                assert err_mean <= 1.5 * lowp_mean + 1e-6, f"mean error {err_mean} > 1.5 x {lowp_mean}"
            except AssertionError as e:
                raise AssertionError(f"{where_split}: {e}") from None
