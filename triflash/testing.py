"""Reference attention for tests and the benchmark's correctness column.

``attention_ref`` computes the same function as the kernels, in fp32 on upcast inputs
(``upcast=True``) or in the input dtype (``upcast=False``, the "same computation in low
precision" that FlashAttention's tolerance rule compares against). It materializes the
score matrix one head chunk at a time, so it is for checking, not for speed.
"""
import torch


def visible_mask(seqlen_q, seqlen_k, window_left, window_right, device, attention_chunk=0):
    """(seqlen_q, seqlen_k) bool: query i sees key j (bottom-right aligned); with
    ``attention_chunk`` C, only the keys of the chunk of C keys holding i's position."""
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    shift = seqlen_k - seqlen_q
    mask = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if window_right >= 0:
        mask &= j <= i + shift + window_right
    if window_left >= 0:
        mask &= j >= i + shift - window_left
    if attention_chunk > 0:
        mask &= torch.div(i + shift, attention_chunk, rounding_mode="floor") == j // attention_chunk
    return mask


def attention_ref(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                  upcast=True, head_chunk=None, attention_chunk=0, qv=None, learnable_sink=None):
    """Dense reference. q (b, sq, h, d); k, v (b, sk, hk, d[v]). Returns (out, lse) with
    out in q's dtype and lse (b, h, sq) fp32. Differentiable (autograd) in both modes.
    FlashAttention-3's extras: ``attention_chunk`` (``visible_mask``) and ``qv`` (b, sq, h,
    dv): scores q k^T + qv v^T, default scale (d + dv) ** -0.5. FA4's ``learnable_sink`` (h,):
    one more softmax column per head with that logit (unscaled) and no value."""
    dtype_og = q.dtype
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
        qv = qv.float() if qv is not None else None
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = softmax_scale if softmax_scale is not None else (d + (qv.shape[-1] if qv is not None else 0)) ** -0.5
    left, right = window_size
    if causal:
        right = 0
    group = h // hk
    mask = visible_mask(sq, sk, left, right, q.device, attention_chunk)
    head_chunk = head_chunk or h
    outs, lses = [], []
    for h0 in range(0, h, head_chunk):
        hs = slice(h0, min(h, h0 + head_chunk))
        kv_idx = torch.arange(hs.start, hs.stop, device=q.device) // group
        kc, vc = k[:, :, kv_idx], v[:, :, kv_idx]
        s = torch.einsum("bqhd,bkhd->bhqk", q[:, :, hs], kc)
        if qv is not None:
            s = s + torch.einsum("bqhd,bkhd->bhqk", qv[:, :, hs], vc)
        s = (s.float() * scale) if upcast else s * scale
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        s = s.float().masked_fill(~mask, float("-inf"))
        lse = torch.logsumexp(s, dim=-1)
        if learnable_sink is not None:
            lse = torch.logaddexp(lse, learnable_sink[hs].float()[None, :, None].expand_as(lse))
        p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
        p = p.masked_fill(~mask, 0.0)
        o = torch.einsum("bhqk,bkhd->bqhd", p.to(vc.dtype), vc)
        outs.append(o)
        lses.append(lse)
    out = torch.cat(outs, dim=2).to(dtype_og)
    return out, torch.cat(lses, dim=1)


def attention_varlen_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q=None, seqused_k=None,
                         **kwargs):
    """Varlen reference, one sequence at a time through ``attention_ref``. Tokens outside
    every used sequence get output 0 and lse -inf. Returns (out, lse (h, total_q))."""
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    h = q.shape[1]
    out = torch.zeros(q.shape[:-1] + (v.shape[-1],), dtype=q.dtype, device=q.device)
    lse = torch.full((h, q.shape[0]), float("-inf"), device=q.device)
    out_parts, lse_parts, rows = [], [], []
    for b in range(len(cq) - 1):
        lq, lk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        if seqused_q is not None:
            lq = min(lq, int(seqused_q[b]))
        if seqused_k is not None:
            lk = min(lk, int(seqused_k[b]))
        if lq == 0:
            continue
        o, l = attention_ref(q[None, cq[b]:cq[b] + lq], k[None, ck[b]:ck[b] + lk],
                             v[None, ck[b]:ck[b] + lk], **kwargs)
        out_parts.append(o[0])
        lse_parts.append(l[0])
        rows.append(torch.arange(cq[b], cq[b] + lq, device=q.device))
    if rows:
        idx = torch.cat(rows)
        # index_put keeps this differentiable for the gradient reference
        out = out.index_put((idx,), torch.cat(out_parts))
        lse = lse.index_copy(1, idx, torch.cat(lse_parts, dim=1))
    return out, lse


def reversed_pages(k_cache, v_cache, page):
    """A dense cache (batch, seqlen, heads, dim) as a paged one holding the same rows: blocks
    (batch * seqlen / page, page, heads, dim) in reverse order, and the (batch, pages) int32
    page table that finds them. Returns (k_blocks, v_blocks, page_table)."""
    b, n = k_cache.shape[:2]
    pages = n // page
    blocks = [c.reshape(b * pages, page, *c.shape[2:]).flip(0).contiguous() for c in (k_cache, v_cache)]
    table = (b * pages - 1 - torch.arange(b * pages, device=k_cache.device)).to(torch.int32).reshape(b, pages)
    return blocks[0], blocks[1], table


def max_err(a, b):
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0


def fa_tolerance(ref, ref_lowp, rtol=2.0):
    """FlashAttention-3's rule: kernel error <= rtol x (low-precision reference error) + atol,
    with atol two rounding errors at the scale 0.3 (FA3's ``ref + 0.3 - 0.3`` term), and at
    least 1e-5: fp32 accumulation noise where the exact answer is 0 (e.g. dq when every
    query sees a single key), which the low-precision reference may happen to hit exactly."""
    atol = max(2 * max_err(ref + 0.3 - 0.3, ref), 1e-5) if ref.numel() else 0.0
    return rtol * max_err(ref_lowp, ref) + atol


def assert_forward_matches(out, lse, out_ref, lse_ref, out_lowp, softcap=0.0):
    """FlashAttention-3's forward checks: out within ``fa_tolerance`` of the fp32 reference
    (rtol 3 with softcap), no NaN, lse -inf exactly on rows that see no key and close to the
    reference elsewhere."""
    rtol = 2.0 if softcap == 0.0 else 3.0
    assert not out.isnan().any(), "output has NaN (unwritten or invalid)"
    err, tol = max_err(out, out_ref), fa_tolerance(out_ref, out_lowp, rtol)
    assert err <= tol, f"out: max error {err} > tolerance {tol}"
    seen = torch.isfinite(lse_ref)
    assert torch.equal(torch.isneginf(lse), ~seen), "lse is -inf exactly where a row sees no key"
    if seen.any():
        scale = max(1.0, lse_ref[seen].abs().max().item())
        assert max_err(lse[seen], lse_ref[seen]) <= 1e-3 * scale


def assert_grads_match(grads, grads_ref, grads_lowp, softcap=0.0):
    """FlashAttention-3's gradient checks on (dq, dk, dv): no NaN, each error within
    ``fa_tolerance`` of the low-precision reference's (rtol 3 and +3e-4 with softcap)."""
    rtol = 2.0 if softcap == 0.0 else 3.0
    assert len(grads) == len(grads_ref) == len(grads_lowp)
    for name, g, g_ref, g_lowp in zip(("dq", "dk", "dv"), grads, grads_ref, grads_lowp):
        assert not g.isnan().any(), f"{name} has NaN"
        err = max_err(g, g_ref)
        tol = fa_tolerance(g_ref, g_lowp, rtol) + (0.0 if softcap == 0.0 else 3e-4)
        assert err <= tol, f"{name}: max error {err} > tolerance {tol}"


def assert_matches_reference(out, lse, out_ref, lse_ref, out_lowp, inputs, dout, softcap=0.0):
    """FlashAttention-3's checks on one call: ``assert_forward_matches``, then dq/dk/dv for
    ``dout`` against the fp32 reference's gradients (``assert_grads_match``). Returns the
    kernel's gradients."""
    assert_forward_matches(out, lse, out_ref, lse_ref, out_lowp, softcap)
    grads = torch.autograd.grad(out, inputs, dout)
    grads_ref = torch.autograd.grad(out_ref, inputs, dout)
    grads_lowp = torch.autograd.grad(out_lowp, inputs, dout)
    assert_grads_match(grads, grads_ref, grads_lowp, softcap)
    return grads


def flops(batch, nheads, seqlen_q, seqlen_k, headdim, headdim_v=None, causal=False,
          window_size=(-1, -1), mode="fwd"):
    """FlashAttention benchmark convention: 2 matmuls forward, 2.5x that backward; the
    number of (query, key) pairs actually visited under causal/window."""
    headdim_v = headdim if headdim_v is None else headdim_v
    left, right = window_size
    if causal:
        right = 0
    if left < 0 and right < 0:
        pairs = seqlen_q * seqlen_k
    elif causal and left < 0 and seqlen_q == seqlen_k:
        pairs = seqlen_q * seqlen_k / 2  # FA's convention for causal
    else:
        pairs = int(visible_mask(seqlen_q, seqlen_k, left, right, "cpu").sum()) \
            if seqlen_q * seqlen_k <= 1 << 26 else _pairs_closed_form(seqlen_q, seqlen_k, left, right)
    f = 2.0 * batch * nheads * pairs * (headdim + headdim_v)
    return {"fwd": f, "bwd": 2.5 * f, "fwd_bwd": 3.5 * f}[mode]


def _pairs_closed_form(sq, sk, left, right):
    total = 0
    shift = sk - sq
    for i in range(sq):
        lo = 0 if left < 0 else max(0, i + shift - left)
        hi = sk - 1 if right < 0 else min(sk - 1, i + shift + right)
        total += max(0, hi - lo + 1)
    return total


__all__ = ["attention_ref", "attention_varlen_ref", "visible_mask", "fa_tolerance", "max_err",
           "assert_matches_reference", "flops"]
