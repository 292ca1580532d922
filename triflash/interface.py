"""Public API with FlashAttention-3's names, arguments, layouts and return values, so that
``import triflash as flash_attn_interface`` works.

Semantics shared by every function:

* causal is bottom-right aligned: query i sees key j iff j <= i + seqlen_k - seqlen_q;
* window_size=(left, right), -1 unbounded: query i sees key j iff
  i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right; causal sets right=0;
* softcap > 0: scores become softcap * tanh(scores / softcap) before the softmax;
* GQA/MQA: query head h uses KV head h // (nheads // nheads_kv);
* a query row that sees no key gets output 0 and lse -inf; its gradients are 0;
* return_attn_probs=True returns (out, lse) with lse the natural-log log-sum-exp (fp32) of
  the scaled (soft-capped) scores, shape (batch, nheads, seqlen_q), or (nheads, total_q)
  for varlen.

Scalar arguments take the forms FA3's Python interface and C++ binding take, with FA3's
meaning (tests/test_fa3_call_forms.py):

* window_size: a tuple or list of two ints, each may be a NumPy int or a one-element
  integer tensor, or a 2-element integer tensor (FA3's tests draw it with torch.randint);
  any negative side is unbounded, as -1;
* causal, deterministic, rotary_interleaved: a bool, or what FA3's binding reads as one by
  truth value: None (False), a Python or NumPy integer or bool, a one-element tensor;
* softmax_scale (None: 1 / sqrt(headdim)) and softcap: a Python or NumPy number or a
  one-element tensor; softcap <= 0 disables soft-capping (FA3: "anything > 0 activates");
* max_seqlen_q / max_seqlen_k, cache_seqlens (or an int32 (batch,) tensor), num_heads_q: a
  Python or NumPy int or a one-element integer tensor (a CUDA tensor's value is read: a sync).

Bools in an int or float slot are refused (``softmax_scale=True`` is a misplaced ``causal``),
as are FA4's None windows; refusals raise "name=value is not supported: what is allowed".
"""
import torch

from . import dispatch, ops
from . import validation as V
from .kernels.decode import plan as decode_plan
from .merge import fold_sink, merge_partials
from .rotary import apply_rotary, token_positions


def _scale_dim(q, qv):
    """The head dim of the default softmax scale: q's, plus qv's when given (as FA3)."""
    return q.shape[-1] + (qv.shape[-1] if qv is not None else 0)


# Dense calls whose arguments passed validation, by signature -> (ints, floats) for the ops.
# Validation reads only what the signature holds (shapes, strides, dtypes, devices and the
# scalar arguments with their types), so a repeat skips it: ~6 us of Python per call on a
# fast host, twice that on the H200's, which a 1k-token forward pays as wall time under
# do_bench (`benchmarks/NOTES.md` at fb45c0d). Only plain tensors with a contiguous last dim, bool flags,
# a tuple window of two ints, a Python float/int/None scale and float/int softcap and
# default FA3 extras take this path; anything else (FA3's other forms: a list or tensor
# window, numpy or tensor scalars, integer flags) is validated every time, as is every call
# while torch.compile traces.
_VALIDATED = {}


_PLAIN_SCALE = (type(None), float, int)
_PLAIN_SOFTCAP = (float, int)


def _dense_signature(q, k, v, softmax_scale, causal, window_size, softcap, deterministic):
    """The key of ``_VALIDATED`` for these arguments, or None (validate every time)."""
    if not (q.__class__ is torch.Tensor and k.__class__ is torch.Tensor and v.__class__ is torch.Tensor
            and causal.__class__ is bool and deterministic.__class__ is bool
            and window_size.__class__ is tuple and len(window_size) == 2
            and window_size[0].__class__ is int and window_size[1].__class__ is int
            and softmax_scale.__class__ in _PLAIN_SCALE and softcap.__class__ in _PLAIN_SOFTCAP):
        return None
    qs, ks, vs = q.stride(), k.stride(), v.stride()
    if qs[-1] != 1 or ks[-1] != 1 or vs[-1] != 1:
        return None
    return (q.shape, qs, k.shape, ks, v.shape, vs, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device,
            softmax_scale.__class__, softmax_scale, softcap.__class__, softcap, causal, window_size,
            deterministic)


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None,
                    k_descale=None, v_descale=None, window_size=(-1, -1), attention_chunk=0,
                    softcap=0.0, num_splits=1, pack_gqa=None, deterministic=False, sm_margin=0,
                    return_attn_probs=False, *, learnable_sink=None):
    """Attention over dense batches: softmax(q k^T * softmax_scale) v per head.

    q: (batch, seqlen_q, nheads, headdim); k: (batch, seqlen_k, nheads_kv, headdim);
    v: (batch, seqlen_k, nheads_kv, headdim_v). fp16 or bf16, head dims 1 to 256 (FA3 takes
    multiples of 8), CUDA tensors (or CPU tensors under Triton's interpreter: TRITON_INTERPRET=1 set
    before ``import triflash``; slow, for tests). GQA / MQA: query head h uses KV head
    h // (nheads // nheads_kv).

    softmax_scale: default headdim ** -0.5. causal: bottom-right aligned, query i sees key j
    iff j <= i + seqlen_k - seqlen_q (as FA2 / FA3). window_size=(left, right), -1 unbounded:
    query i sees keys i + seqlen_k - seqlen_q - left .. i + seqlen_k - seqlen_q + right
    (causal sets right = 0). softcap > 0: scores become softcap * tanh(scores / softcap)
    before the softmax. A query row that sees no key gets output 0 and lse -inf.
    deterministic: True makes the backward bitwise reproducible (no atomic adds of dQ).
    learnable_sink (FA4's; gpt-oss's attention sinks, transformers' ``s_aux``): None, or a
    (nheads,) fp16 / bf16 / fp32 tensor of logits, one more softmax column per query head
    with no value (natural-log units, not scaled by softmax_scale): it enlarges each row's
    normalizer and lse, so out shrinks; a row that sees no key gets out 0 and lse = its
    sink. Differentiable (its gradient in its dtype).

    Returns out (batch, seqlen_q, nheads, headdim_v), and with return_attn_probs also lse
    (batch, nheads, seqlen_q), the fp32 natural-log log-sum-exp of the scaled scores.
    Differentiable in q, k, v. Scalars in any of FA3's forms (module docstring).
    ``num_splits``, ``pack_gqa`` and ``sm_margin`` are FA3 performance hints, accepted and
    ignored. fp8 (FA3's float8_e4m3fn q, k, v; forward only, bf16 output): scores
    q k^T x q_descale x k_descale x softmax_scale, output P v x v_descale, the descales
    float32 (batch, nheads_kv) tensors or None (1); for fp16 / bf16 inputs the descales are
    ignored, as FA3 ignores them. FA3's forward-only extras: ``attention_chunk`` > 0 (each query sees only the
    keys of its position's chunk of that many keys, intersected with causal / window), ``qv``
    (batch, seqlen_q, nheads, headdim_v): scores q k^T + qv v^T (the default scale then
    (headdim + headdim_v) ** -0.5); headdim_v up to 512. Their backward raises
    NotImplementedError, as FA3's does.
    """
    key = None
    chunk = 0
    if (qv is None and q_descale is None and k_descale is None and v_descale is None
            and attention_chunk.__class__ is int and attention_chunk == 0 and not torch.compiler.is_compiling()):
        key = _dense_signature(q, k, v, softmax_scale, causal, window_size, softcap, deterministic)
    scalars = _VALIDATED.get(key) if key is not None else None
    if scalars is None:
        causal = V.as_flag("causal", causal)
        deterministic = V.as_flag("deterministic", deterministic)
        V.check_qkv(q, k, v, varlen=False, fp8=True)
        q, k, v = (V.last_dim_contiguous(x) for x in (q, k, v))
        qv, chunk = V.check_extras(qv, attention_chunk, q, v)
        softmax_scale, softcap = V.check_scalars(softmax_scale, softcap, _scale_dim(q, qv))
        left, right = V.normalize_window(window_size, causal)
        scalars = ops.pack_scalars(q.shape[1], k.shape[1], softmax_scale, left, right, softcap, deterministic)
        if key is not None:
            if len(_VALIDATED) >= 256:
                _VALIDATED.clear()
            _VALIDATED[key] = scalars
    descale = None
    if q.dtype == V.FP8:
        descale = V.check_descales(q, v, qv, (q_descale, k_descale, v_descale), q.shape[0], k.shape[-2])
    sink = V.check_sink(learnable_sink, q.shape[2], q)
    if qv is not None or chunk > 0 or descale is not None:
        out, lse = ops.attention_extras(q, k, v, qv, None, None, None, None, *scalars, chunk, descale)
        if sink is not None:  # (forward only, as the extras)
            out, lse = fold_sink(out, lse, sink)
    elif sink is not None:
        out, lse = ops.attention_sink(q, k, v, sink, None, None, None, None, *scalars)
    else:
        out, lse = ops.attention(q, k, v, None, None, None, None, *scalars)
    return (out, lse) if return_attn_probs else out


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           seqused_q=None, seqused_k=None, softmax_scale=None, causal=False,
                           qv=None, q_descale=None, k_descale=None, v_descale=None,
                           window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1,
                           pack_gqa=None, deterministic=False, sm_margin=0,
                           return_attn_probs=False, *, learnable_sink=None):
    """Attention over a packed batch of variable-length sequences.

    q: (total_q, nheads, headdim); k, v: (total_k, nheads_kv, headdim[_v]); cu_seqlens_q/k:
    int32 (batch + 1,) prefix sums of the lengths; max_seqlen_q/k: the longest sequence (a
    Python or NumPy int, or a one-element integer tensor, as FA3 takes); seqused_q/k:
    optional int32 (batch,) counts of tokens that take part in each sequence. As in FA3,
    either side may instead be a dense batch: cu_seqlens_q=None with q (batch, seqlen_q,
    nheads, headdim) (max_seqlen_q then unused), cu_seqlens_k=None with k, v (batch,
    seqlen_k, nheads_kv, headdim[_v]); seqused_q/k still apply, counted from each batch
    row's start. Every feature of ``flash_attn_func`` applies per sequence. Forward-only
    calls with cu_seqlens_k=None whose query tokens times the GQA group fit the decode
    kernel's tile (a serving engine's decoding step: packed queries, seqused_k over a dense
    batch of caches) run that kernel, splitting keys as ``num_splits`` says (FA3's default 1:
    no split; 0: the heuristic). Returns out
    (total_q, nheads, headdim_v) (a dense q: (batch, seqlen_q, nheads, headdim_v)), and lse
    (nheads, total_q) (a dense q: (batch, nheads, seqlen_q)) if return_attn_probs.
    ``qv`` (q's layout, headdim_v wide), ``attention_chunk`` and fp8 inputs with their
    descales ((batch, nheads_kv), batch the sequences): FA3's forward-only extras, per
    sequence, and ``learnable_sink``, as in ``flash_attn_func``.
    """
    causal = V.as_flag("causal", causal)
    deterministic = V.as_flag("deterministic", deterministic)
    V._check_tensor("q", q, 4 if cu_seqlens_q is None else 3, fp8=True)
    V._check_tensor("v", v, 4 if cu_seqlens_k is None else 3, fp8=True)
    qv, chunk = V.check_extras(qv, attention_chunk, q, v)
    dense_q = dense_kv = None
    if cu_seqlens_q is None:  # FA3: q is then a dense batch (batch, seqlen_q, ...)
        dense_q = q.shape[:2]
        q, cu_seqlens_q, max_seqlen_q = _as_packed(q)
        if qv is not None:
            qv = qv.reshape(qv.shape[0] * qv.shape[1], *qv.shape[2:])
    else:
        max_seqlen_q = V.as_max_seqlen("max_seqlen_q", max_seqlen_q)
    if cu_seqlens_k is None:  # likewise k and v
        V._check_tensor("k", k, 4, fp8=True)
        V._check_tensor("v", v, 4, fp8=True)
        V._check_cu_seqlens("cu_seqlens_q", cu_seqlens_q)
        batch = cu_seqlens_q.shape[0] - 1
        for name, t in (("k", k), ("v", v)):
            if t.shape[0] != batch:
                V._fail(f"{name}.shape[0]", t.shape[0], f"with cu_seqlens_k=None {name} is a dense batch: "
                        f"expected the batch size {batch}")
        if k.shape[1] != v.shape[1]:
            V._fail("seqlen_k", (k.shape[1], v.shape[1]), "k and v must share seqlen_k")
        dense_kv = (k, v)
        k, cu_seqlens_k, max_seqlen_k = _as_packed(k)
        v = v.reshape(v.shape[0] * v.shape[1], *v.shape[2:])
    else:
        max_seqlen_k = V.as_max_seqlen("max_seqlen_k", max_seqlen_k)
    V.check_qkv(q, k, v, varlen=True, fp8=True)
    V.check_varlen(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k)
    descale = V.check_descales(q, v, qv, (q_descale, k_descale, v_descale), cu_seqlens_q.shape[0] - 1, k.shape[-2])
    q, k, v = (V.last_dim_contiguous(x) for x in (q, k, v))
    softmax_scale, softcap = V.check_scalars(softmax_scale, softcap, _scale_dim(q, qv))
    left, right = V.normalize_window(window_size, causal)
    scalars = ops.pack_scalars(max_seqlen_q, max_seqlen_k, softmax_scale, left, right, softcap, deterministic)
    sink = V.check_sink(learnable_sink, q.shape[-2], q)
    if (dense_kv is not None and dense_q is None and seqused_q is None and qv is None and not _needs_grad(q, k, v)
            and dispatch.decodes(max_seqlen_q, q.shape[-2], k.shape[-2], cu_seqlens_q.shape[0] - 1)):
        # a decoding step over a dense batch of caches (a serving engine's call: packed
        # queries, seqused_k): the decode kernel, as flash_attn_with_kvcache runs it
        num_splits = V.as_int("num_splits", num_splits, "expected an int, 0 for a heuristic")
        k_cache, v_cache = (V.last_dim_contiguous(x) for x in dense_kv)
        out, lse = ops.attention_kvcache(q, k_cache, v_cache, cu_seqlens_q, seqused_k, None, None, None,
                                         scalars[0] + [max(num_splits, 0)], scalars[1], chunk=chunk,
                                         descale=descale)
        if sink is not None:  # (forward only)
            out, lse = fold_sink(out, lse, sink)
    elif qv is not None or chunk > 0 or descale is not None:
        out, lse = ops.attention_extras(q, k, v, qv, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, *scalars,
                                        chunk, descale)
        if sink is not None:  # (forward only, as the extras)
            out, lse = fold_sink(out, lse, sink)
    elif sink is not None:
        out, lse = ops.attention_sink(q, k, v, sink, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, *scalars)
    else:
        out, lse = ops.attention(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, *scalars)
    if dense_q is not None:
        out = out.reshape(*dense_q, *out.shape[1:])
        if return_attn_probs:
            lse = lse.reshape(lse.shape[0], *dense_q).transpose(0, 1).contiguous()
    return (out, lse) if return_attn_probs else out


def _needs_grad(*tensors):
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _as_packed(x):
    """A dense batch (batch, seqlen, heads, dim) as FA3's varlen kernels read it when its
    cu_seqlens is None: (batch * seqlen, heads, dim), cu_seqlens 0, seqlen, 2 * seqlen, ...
    and max_seqlen seqlen."""
    batch, seqlen = x.shape[:2]
    cu = torch.arange(batch + 1, dtype=torch.int32, device=x.device) * seqlen
    return x.reshape(batch * seqlen, *x.shape[2:]), cu, seqlen


def flash_attn_qkvpacked_func(qkv, softmax_scale=None, causal=False, q_descale=None,
                              k_descale=None, v_descale=None, window_size=(-1, -1),
                              attention_chunk=0, softcap=0.0, deterministic=False,
                              num_heads_q=None, sm_margin=0, return_attn_probs=False):
    """Attention over a packed qkv: (batch, seqlen, 3, nheads, headdim), or
    (batch, seqlen, nheads_q + 2 * nheads_kv, headdim) with ``num_heads_q`` (GQA).

    The kernels read q, k and v as strided views of qkv, and the backward writes dq, dk
    and dv into views of one dqkv (no concatenation)."""
    causal = V.as_flag("causal", causal)
    deterministic = V.as_flag("deterministic", deterministic)
    if not isinstance(qkv, torch.Tensor):
        V._fail("qkv", type(qkv).__name__, "expected a torch.Tensor", TypeError)
    if qkv.dim() == 5:
        if qkv.shape[2] != 3:
            V._fail("qkv.shape[2]", qkv.shape[2], "expected 3 for (batch, seqlen, 3, nheads, headdim)")
        num_heads_q = 0  # the ops' marker for the 5-dim layout
    elif qkv.dim() == 4:
        if num_heads_q is None:
            V._fail("num_heads_q", None, "required with a 4-dim qkv (batch, seqlen, nheads_q + 2 * nheads_kv, headdim)")
        num_heads_q = V.as_int("num_heads_q", num_heads_q, "expected an int, the query heads of a 4-dim qkv")
        nheads_kv2 = qkv.shape[2] - num_heads_q
        if num_heads_q <= 0 or nheads_kv2 <= 0 or nheads_kv2 % 2 != 0:
            V._fail("num_heads_q", num_heads_q, f"qkv has {qkv.shape[2]} heads; need nheads_q + 2 * nheads_kv with nheads_kv >= 1")
    else:
        V._fail("qkv.dim()", qkv.dim(), "expected 5 dims (batch, seqlen, 3, nheads, headdim) or 4 with num_heads_q")
    qkv = V.last_dim_contiguous(qkv)
    q, k, v = ops.split_qkv(qkv, num_heads_q)
    V.check_qkv(q, k, v, varlen=False, fp8=True)
    _, chunk = V.check_extras(None, attention_chunk, q, v)
    descale = V.check_descales(q, v, None, (q_descale, k_descale, v_descale), q.shape[0], k.shape[-2])
    softmax_scale, softcap = V.check_scalars(softmax_scale, softcap, q.shape[-1])
    left, right = V.normalize_window(window_size, causal)
    if chunk > 0 or descale is not None:  # (FA3's forward-only extras: the views, as flash_attn_func takes them)
        ints, floats = ops.pack_scalars(q.shape[1], k.shape[1], softmax_scale, left, right, softcap, deterministic)
        out, lse = ops.attention_extras(q, k, v, None, None, None, None, None, ints, floats, chunk, descale)
        return (out, lse) if return_attn_probs else out
    out, lse = ops.attention_qkvpacked(qkv, [num_heads_q, left, right, int(deterministic)],
                                       [float(softmax_scale), float(softcap)])
    return (out, lse) if return_attn_probs else out


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None,
                            rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                            cache_leftpad=None, page_table=None, cu_seqlens_q=None,
                            cu_seqlens_k_new=None, max_seqlen_q=None, rotary_seqlens=None,
                            q_descale=None, k_descale=None, v_descale=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), attention_chunk=0, softcap=0.0,
                            rotary_interleaved=True, scheduler_metadata=None, num_splits=0,
                            pack_gqa=None, sm_margin=0, return_softmax_lse=False, *, learnable_sink=None):
    """Attention of q against a KV cache, for decoding (forward only, no autograd).

    q: (batch, seqlen_q, nheads, headdim), or (total_q, nheads, headdim) with int32
    ``cu_seqlens_q`` (batch + 1,) and ``max_seqlen_q`` (an int, NumPy int or one-element
    integer tensor; ignored without cu_seqlens_q, as in FA3). k_cache, v_cache:
    (batch_cache, seqlen_cache, nheads_kv, headdim[_v]), or with ``page_table`` (batch,
    pages per sequence, int32) blocks (num_blocks, page_size, nheads_kv, headdim[_v]):
    sequence b's logical row r is row r % page_size of block page_table[b, r // page_size].
    ``cache_batch_idx`` (batch,) int32: the cache batch of each sequence, or with a page
    table the page-table row of each (the table then has any number of rows; sequence b
    reads page_table[cache_batch_idx[b]], as in FA3). ``cache_seqlens``: an int (or NumPy
    int) or int32 (batch,) tensor, the tokens already in each sequence's cache (None: the
    whole cache). With new k, v (batch, seqlen_new, nheads_kv, headdim[_v]) they are first
    written into the caches in place at rows cache_seqlens .. cache_seqlens + seqlen_new - 1.
    Each sequence then attends to its keys cache_leftpad .. cache_seqlens + seqlen_new - 1
    (``cache_leftpad`` (batch,), default 0), causal bottom-right aligned to them. With
    ``rotary_cos`` / ``rotary_sin`` (seqlen_ro, rotary_dim / 2) the new keys are rotated at
    positions ``rotary_seqlens`` (default cache_seqlens) + i before they are written, and q
    at the same positions if causal or local, else every query at position cache_seqlens
    (``rotary_interleaved``: GPT-J pairs, else GPT-NeoX halves); without the tables
    ``rotary_seqlens`` is ignored, as in FA3. Other scalars in any of FA3's forms (module
    docstring). Returns out (batch, seqlen_q, nheads, headdim_v) (varlen: (total_q, ...)),
    and with return_softmax_lse (out, lse, out_accum, lse_accum) as FA3 returns them: lse
    (batch, nheads, seqlen_q) (varlen: (nheads, total_q)), the split accumulators empty.

    A decoding step (query tokens x the GQA group <= 64 rows per KV head) runs the decode
    kernel over every cache form: the query heads of a KV head packed into one tile, the
    cache length split across CTAs when the batch leaves SMs idle (``num_splits``: 0 picks,
    n > 0 asks for n shares), pieces merged by log-sum-exp. Longer queries (prefill) over a
    plain dense cache run the dense forward (the Hopper tier on sm90), over the other forms
    the portable kernels. ``cu_seqlens_k_new`` (batch + 1,) int32: new k, v packed
    (total_new, nheads_kv, headdim[_v]), sequence b's new tokens rows cu_seqlens_k_new[b] ..
    cu_seqlens_k_new[b + 1] - 1 (FA3's varlen append; without new k, v it is ignored, as in
    FA3). ``attention_chunk`` and ``qv`` (q's layout, headdim_v wide; MLA's absorbed decode
    with headdim 64 / headdim_v 512), fp8 inputs (q, the caches and new keys; the
    descales (batch, nheads_kv)) and ``learnable_sink`` as in ``flash_attn_func``; ``scheduler_metadata`` (the plan, which
    the call recomputes from the shapes), ``pack_gqa`` and ``sm_margin`` are accepted and
    change nothing. Index values (cache_seqlens, cache_batch_idx, cache_leftpad,
    page_table, cu_seqlens_q) are checked on the host on the CPU or with
    ``triflash.set_check_inputs(True)``; otherwise the kernels clamp them (no fault) and new
    tokens past a sequence's cache are not written.
    """
    causal = V.as_flag("causal", causal)
    rotary_interleaved = V.as_flag("rotary_interleaved", rotary_interleaved)
    varlen_q = cu_seqlens_q is not None
    if k is None:  # (FA3 reads cu_seqlens_k_new only with new keys)
        cu_seqlens_k_new = None
    if varlen_q:  # (FA3 reads max_seqlen_q only with cu_seqlens_q)
        max_seqlen_q = V.as_max_seqlen("max_seqlen_q", max_seqlen_q)
    starts, used, capacity = V.check_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx,
                                             cache_leftpad, page_table, cu_seqlens_q, max_seqlen_q,
                                             cu_seqlens_k_new)
    batch = cu_seqlens_q.shape[0] - 1 if varlen_q else q.shape[0]
    rotary = V.check_rotary(rotary_cos, rotary_sin, rotary_seqlens, q, k, batch)
    qv, chunk = V.check_extras(qv, attention_chunk, q, v_cache)
    descale = V.check_descales(q, v_cache, qv, (q_descale, k_descale, v_descale), batch, k_cache.shape[-2])
    softmax_scale, softcap = V.check_scalars(softmax_scale, softcap, _scale_dim(q, qv))
    left, right = V.normalize_window(window_size, causal)
    sink = V.check_sink(learnable_sink, q.shape[-2], q)
    with torch.no_grad():
        if page_table is not None and cache_batch_idx is not None:
            # FA3: sequence b reads page_table[cache_batch_idx[b]]; the kernels take the rows
            # gathered (clamped like every unchecked index: no fault)
            page_table = page_table.index_select(0, cache_batch_idx.clamp(0, page_table.shape[0] - 1))
            cache_batch_idx = None
        if rotary:
            offsets = rotary_seqlens if rotary_seqlens is not None else starts
            same = left < 0 and right < 0
            V.check_rotary_positions(rotary_cos, offsets, q, k, cu_seqlens_q, cu_seqlens_k_new, not same)
            q = apply_rotary(q, rotary_cos, rotary_sin,
                             token_positions(offsets, q.shape[-3], same, cu_seqlens_q, q.shape[0]),
                             rotary_interleaved)
            k = apply_rotary(k, rotary_cos, rotary_sin,
                             token_positions(offsets, k.shape[1], False, cu_seqlens_k_new, k.shape[0]),
                             rotary_interleaved)
        if k is not None:
            used = ops.append_kv(V.last_dim_contiguous(k), V.last_dim_contiguous(v), k_cache, v_cache,
                                 starts, cache_batch_idx, page_table, cu_seqlens_k_new)
        q = V.last_dim_contiguous(q)
        max_q = max_seqlen_q if varlen_q else q.shape[1]
        ints, floats = ops.pack_scalars(max_q, capacity, softmax_scale, left, right, softcap, False)
        if (varlen_q or cache_batch_idx is not None or cache_leftpad is not None or page_table is not None
                or dispatch.decodes(max_q, q.shape[-2], k_cache.shape[-2], batch)):
            num_splits = V.as_int("num_splits", num_splits, "expected an int, 0 for a heuristic")
            out, lse = ops.attention_kvcache(q, k_cache, v_cache, cu_seqlens_q, used, cache_batch_idx,
                                             cache_leftpad, page_table, ints + [max(num_splits, 0)], floats,
                                             qv=qv, chunk=chunk, descale=descale)
        elif qv is not None or chunk > 0 or descale is not None:  # prefill over a plain dense cache, FA3's extras
            out, lse = ops.attention_extras(q, k_cache, v_cache, qv, None, None, None, used, ints, floats, chunk,
                                            descale)
        else:  # prefill over a plain dense cache: the dense kernels (the Hopper tier on sm90)
            out, lse = ops.attention(q, k_cache, v_cache, None, None, None, used, ints, floats)
        if sink is not None:
            out, lse = fold_sink(out, lse, sink)
    if not return_softmax_lse:
        return out
    empty = out.new_empty(0, dtype=torch.float32)  # FA3's split accumulators (empty unless it splits)
    return out, lse, empty, empty


def get_scheduler_metadata(batch_size, max_seqlen_q, max_seqlen_k, num_heads_q, num_heads_kv,
                           headdim, cache_seqlens, qkv_dtype=None, headdim_v=None,
                           cu_seqlens_q=None, cu_seqlens_k_new=None, cache_leftpad=None,
                           page_size=None, max_seqlen_k_new=0, causal=False, window_size=(-1, -1),
                           attention_chunk=0, has_softcap=False, num_splits=0, pack_gqa=None,
                           sm_margin=0):
    """FA3's precomputed decoding schedule: how many shares ``flash_attn_with_kvcache``
    splits each tile's keys into for these shapes, as a one-element int32 tensor on
    cache_seqlens' device (serving engines store it beside their CUDA graphs and pass it
    back as ``scheduler_metadata``). The plan is a function of the shapes alone, so the
    call computes the same one itself; ``num_splits`` > 0 is honoured as there."""
    device = cache_seqlens.device if isinstance(cache_seqlens, torch.Tensor) else torch.device("cuda")
    headdim_v = headdim if headdim_v is None else headdim_v
    max_seqlen_q = int(max_seqlen_q)
    splits = 1
    if dispatch.decodes(max_seqlen_q, num_heads_q, num_heads_kv, batch_size):
        splits = decode_plan(dispatch.target_of(device), device, int(batch_size), max_seqlen_q,
                             int(max_seqlen_k), int(num_heads_q), int(num_heads_kv), int(headdim),
                             int(headdim_v), int(page_size or 0), max(int(num_splits), 0)).splits
    return torch.tensor([splits], dtype=torch.int32, device=device)


def _flash_attn_forward(q, k, v, k_new=None, v_new=None, qv=None, out_=None, cu_seqlens_q=None,
                        cu_seqlens_k=None, cu_seqlens_k_new=None, seqused_q=None, seqused_k=None,
                        max_seqlen_q=None, max_seqlen_k=None, page_table=None, kv_batch_idx=None,
                        leftpad_k=None, rotary_cos=None, rotary_sin=None, seqlens_rotary=None,
                        q_descale=None, k_descale=None, v_descale=None, softmax_scale=None,
                        causal=False, window_size_left=-1, window_size_right=-1, attention_chunk=0,
                        softcap=0.0, rotary_interleaved=True, scheduler_metadata=None, num_splits=1,
                        pack_gqa=None, sm_margin=0):
    """FA3's one forward entry point (``flash_attn_interface._flash_attn_forward``, which its
    three public forwards call), its arguments in its order: (out, softmax_lse, out_accum,
    softmax_lse_accum), the split accumulators empty. With new keys, a page table,
    ``kv_batch_idx``, ``leftpad_k`` or rotary tables k and v are a KV cache
    (``flash_attn_with_kvcache``, ``seqused_k`` its cache_seqlens); else with cu_seqlens or
    seqused counts ``flash_attn_varlen_func``; else ``flash_attn_func``. Differentiable in
    q, k, v where those are. ``out_``: the output is written there too."""
    window = (window_size_left, window_size_right)
    common = dict(softmax_scale=softmax_scale, causal=causal, qv=qv, q_descale=q_descale, k_descale=k_descale,
                  v_descale=v_descale, window_size=window, attention_chunk=attention_chunk, softcap=softcap,
                  num_splits=num_splits, pack_gqa=pack_gqa, sm_margin=sm_margin)
    if (k_new is not None or page_table is not None or kv_batch_idx is not None or leftpad_k is not None
            or rotary_cos is not None):
        if cu_seqlens_k is not None or seqused_q is not None:
            V._fail("cu_seqlens_k" if cu_seqlens_k is not None else "seqused_q", "a tensor",
                    "a KV cache (new keys, page_table, kv_batch_idx, leftpad_k or rotary tables) takes "
                    "seqused_k as its lengths, not cu_seqlens_k / seqused_q")
        out, lse, *_ = flash_attn_with_kvcache(
            q, k, v, k_new, v_new, rotary_cos=rotary_cos, rotary_sin=rotary_sin, cache_seqlens=seqused_k,
            cache_batch_idx=kv_batch_idx, cache_leftpad=leftpad_k, page_table=page_table,
            cu_seqlens_q=cu_seqlens_q, cu_seqlens_k_new=cu_seqlens_k_new, max_seqlen_q=max_seqlen_q,
            rotary_seqlens=seqlens_rotary, rotary_interleaved=rotary_interleaved,
            scheduler_metadata=scheduler_metadata, return_softmax_lse=True, **common)
    elif (cu_seqlens_q is not None or cu_seqlens_k is not None or seqused_q is not None
          or seqused_k is not None):
        out, lse = flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                          seqused_q, seqused_k, return_attn_probs=True, **common)
    else:
        out, lse = flash_attn_func(q, k, v, return_attn_probs=True, **common)
    if out_ is not None:
        out = out_.copy_(out)  # (recorded by autograd: the gradient flows through out_)
    empty = out.new_empty(0, dtype=torch.float32)
    return out, lse, empty, empty


def _flash_attn_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q=None, cu_seqlens_k=None,
                         sequed_q=None, sequed_k=None, max_seqlen_q=None, max_seqlen_k=None, dq=None,
                         dk=None, dv=None, softmax_scale=None, is_causal=False, window_size_left=-1,
                         window_size_right=-1, softcap=0.0, deterministic=False, sm_margin=0):
    """FA3's backward entry point (``flash_attn_interface._flash_attn_backward``), its
    arguments in its order (``sequed_q`` / ``sequed_k`` spelled as FA3 spells them): the
    gradients of the forward that returned ``out`` and ``softmax_lse`` are written into dq,
    dk and dv (allocated when None; any strides); returns softmax_d, the rows' sum of
    dout * out in fp32, (batch, nheads, seqlen_q) dense, (nheads, total_q) varlen (FA3 pads
    its last dim to its tile). Dense (batch, seqlen, nheads, headdim) tensors without
    cu_seqlens, or packed (total, nheads, headdim) ones with both."""
    is_causal = V.as_flag("is_causal", is_causal)
    deterministic = V.as_flag("deterministic", deterministic)
    varlen = cu_seqlens_q is not None
    if (cu_seqlens_k is not None) != varlen:
        name = "cu_seqlens_k" if varlen else "cu_seqlens_q"
        V._fail(name, None, "the backward takes cu_seqlens_q and cu_seqlens_k together (packed q, k, v) "
                "or neither (dense batches)")
    V.check_qkv(q, k, v, varlen=varlen)
    if varlen:
        max_seqlen_q = V.as_max_seqlen("max_seqlen_q", max_seqlen_q)
        max_seqlen_k = V.as_max_seqlen("max_seqlen_k", max_seqlen_k)
        V.check_varlen(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, sequed_q, sequed_k)
    else:
        if sequed_q is not None or sequed_k is not None:
            V._fail("sequed_q" if sequed_q is not None else "sequed_k", "a tensor",
                    "seqused counts come with cu_seqlens_q / cu_seqlens_k (packed tensors)")
        max_seqlen_q, max_seqlen_k = q.shape[1], k.shape[1]
    for name, t, like in (("dout", dout, out), ("out", out, None)):
        if like is not None and tuple(t.shape) != tuple(like.shape):
            V._fail(f"{name}.shape", tuple(t.shape), f"expected out's shape {tuple(like.shape)}")
    expected_lse = (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])
    if tuple(softmax_lse.shape) != expected_lse or softmax_lse.dtype != torch.float32:
        V._fail("softmax_lse", f"{tuple(softmax_lse.shape)} {softmax_lse.dtype}",
                f"expected the forward's fp32 lse {expected_lse}")
    softmax_scale, softcap = V.check_scalars(softmax_scale, softcap, q.shape[-1])
    left, right = V.normalize_window((window_size_left, window_size_right), is_causal)
    ints, floats = ops.pack_scalars(max_seqlen_q, max_seqlen_k, softmax_scale, left, right, softcap, deterministic)
    q, k, v, out = (V.last_dim_contiguous(x) for x in (q, k, v, out))
    with torch.no_grad():
        if torch.compiler.is_compiling():  # the custom op (its own outputs), copied into dq, dk, dv
            grads = ops.bwd(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, sequed_q, sequed_k,
                            ints, floats)
            for given, grad in zip((dq, dk, dv), grads):
                if given is not None:
                    given.copy_(grad)
        else:
            grads = ops._bwd_impl(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, sequed_q, sequed_k,
                                  ints, floats, dq=dq, dk=dk, dv=dv)
            for given, grad in zip((dq, dk, dv), grads):
                if given is not None and given.data_ptr() != grad.data_ptr():
                    given.copy_(grad)
        d = (dout.float() * out.float()).sum(-1)  # (batch, seqlen, heads) or (total, heads)
        return d.transpose(0, 1).contiguous() if varlen else d.transpose(1, 2).contiguous()


def flash_attn_combine(out_partial, lse_partial, out=None, out_dtype=None, return_lse=True):
    """Merge attention computed over disjoint key splits (FA3's ``flash_attn_combine``).

    out_partial: (num_splits, ..., nheads, headdim) fp32, e.g. (num_splits, batch, seqlen,
    nheads, headdim); lse_partial: out_partial's shape without headdim, each split's
    natural-log log-sum-exp. Returns (out, lse): out = sum_i exp(lse_i - lse) out_i in
    ``out_dtype`` (default out_partial's), written into ``out`` when given; lse =
    logsumexp_i lse_i (fp32, -inf where every split saw nothing; out 0 there). A given
    ``out`` sets the dtype; with ``out_dtype`` too, the two must agree.
    ``return_lse=False`` (FA4's option) returns out alone."""
    for name, t in (("out_partial", out_partial), ("lse_partial", lse_partial)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
            V._fail(name, getattr(t, "dtype", type(t).__name__), "expected a float32 tensor", TypeError)
    if out_partial.dim() < 3 or tuple(lse_partial.shape) != tuple(out_partial.shape[:-1]):
        V._fail("lse_partial.shape", tuple(lse_partial.shape),
                f"expected out_partial's shape without its last dim, {tuple(out_partial.shape[:-1])}")
    V.check_device(out_partial, lse_partial, out)
    if out is not None and out_dtype is not None and out.dtype != out_dtype:
        V._fail("out.dtype", out.dtype, f"expected out_dtype, {out_dtype}", TypeError)
    dtype = out_dtype if out_dtype is not None else (out.dtype if out is not None else out_partial.dtype)
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        V._fail("out_dtype", dtype, "expected torch.float32, float16 or bfloat16")
    merged, lse = merge_partials(out_partial, lse_partial)
    if out is None:
        out = merged.to(dtype)
    else:
        if tuple(out.shape) != tuple(merged.shape):
            V._fail("out.shape", tuple(out.shape), f"expected {tuple(merged.shape)}")
        out.copy_(merged)
    return (out, lse) if return_lse else out
