"""torch.library registration, in one place.

``triflash::fwd`` and ``triflash::bwd`` are custom ops with fake (meta) implementations, so
``torch.compile(fullgraph=True)`` traces through them without graph breaks, and the forward
carries its autograd formula (``register_autograd``), so eager autograd and AOTAutograd
both see the same backward. Dense and varlen share the ops: varlen is "cu_seqlens given".

``triflash::fwd_qkvpacked`` / ``bwd_qkvpacked`` take one packed qkv and return one packed
dqkv: the backward kernels write dq, dk and dv straight into views of it, so the gradient
of a packed input costs no concatenation.

``attention`` / ``attention_qkvpacked`` are what the public API calls: under torch.compile
they are the custom ops; in eager mode an ``autograd.Function`` makes the same two dispatch
calls without torch.library's per-call Python work (~100-200 us per forward + backward on
the CPU side, which short sequences pay as wall time).
"""
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from . import dispatch
from .kernels import kvcache
from .kernels.problem import AttnParams, CacheAddressing, alloc_output
from .merge import fold_sink, sink_grad


# Scalar arguments travel as two lists: torch's custom-op autograd path re-reads the op schema
# for every argument on every call (torch._library.utils.fill_defaults), a cost quadratic in
# the argument count: 99 us per forward call with 14 separate arguments (CPU, torch 2.13).
#   ints   = [max_seqlen_q, max_seqlen_k, window_left, window_right, deterministic]
#   floats = [softmax_scale, softcap]
def pack_scalars(max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right,
                 softcap, deterministic):
    """(ints, floats) as the ops take them. The seqlens may be SymInts (torch.compile with
    dynamic shapes): passed through, never int()-ed, so no shape gets specialized."""
    return ([max_seqlen_q, max_seqlen_k, int(window_left), int(window_right),
             int(deterministic)], [float(softmax_scale), float(softcap)])


def _params(ints, floats, chunk=0) -> AttnParams:
    max_seqlen_q, max_seqlen_k, window_left, window_right = ints[:4]
    return AttnParams(softmax_scale=floats[0], window_left=window_left,
                      window_right=window_right, softcap=floats[1],
                      max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, chunk=chunk)


@torch.library.custom_op("triflash::fwd", mutates_args=())
def fwd(q: Tensor, k: Tensor, v: Tensor,
        cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor],
        seqused_q: Optional[Tensor], seqused_k: Optional[Tensor],
        ints: List[int], floats: List[float]) -> Tuple[Tensor, Tensor]:
    """(out, lse). ``ints``/``floats`` from ``pack_scalars``; deterministic only travels to
    the backward."""
    return _fwd_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, ints, floats)


def _fwd_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, ints, floats, out=None):
    """The forward both entry points run (the custom op and the eager ``_Attention``); the
    SDPA backend (integrations/sdpa.py) also calls it, with its own ``out``."""
    return dispatch.run_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                            _params(ints, floats), out=out)


def _bwd_impl(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
              ints, floats, dq=None, dk=None, dv=None):
    """The backward both entry points run (and the SDPA backend, with its own dq/dk/dv)."""
    if dout.stride(-1) != 1:  # autograd may hand us expanded (stride-0) gradients
        dout = dout.contiguous()
    return dispatch.run_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q,
                            seqused_k, _params(ints, floats), bool(ints[4]), dq=dq, dk=dk, dv=dv)


@fwd.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, ints, floats):
    out = q.new_empty(q.shape[:-1] + (v.shape[-1],))
    if cu_seqlens_q is not None:
        lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    else:
        lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
    return out, lse


@torch.library.custom_op("triflash::bwd", mutates_args=())
def bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
        cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor],
        seqused_q: Optional[Tensor], seqused_k: Optional[Tensor],
        ints: List[int], floats: List[float]) -> Tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv)."""
    return _bwd_impl(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                     ints, floats)


@bwd.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, ints, floats):
    # contiguous, as the real op allocates them (empty_like would keep a permuted q's strides)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, ints, floats = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
    ctx.scalars = (ints, floats)
    # lse is returned for inspection (as in FlashAttention), not differentiable: a loss
    # through it alone raises, and no gradient flows through it, compiled or eager
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k = ctx.saved_tensors
    dq, dk, dv = bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                     *ctx.scalars)
    return dq, dk, dv, None, None, None, None, None, None


fwd.register_autograd(_backward, setup_context=_setup_context)


def split_qkv(qkv: Tensor, num_heads_q: int):
    """Views q, k, v of a packed qkv: (b, s, 3, h, d), or (b, s, hq + 2 * hk, d) with
    ``num_heads_q`` = hq (then num_heads_q > 0; for the 5-dim layout pass 0)."""
    if qkv.dim() == 5:
        return qkv.unbind(dim=2)
    nheads_kv = (qkv.shape[2] - num_heads_q) // 2
    return qkv.split([num_heads_q, nheads_kv, nheads_kv], dim=2)


# Packed ops: ints = [num_heads_q (0: the 5-dim layout), window_left, window_right,
# deterministic], floats = [softmax_scale, softcap].
def _packed_params(q, k, ints, floats) -> AttnParams:
    return _params([q.shape[1], k.shape[1], ints[1], ints[2]], floats)


def _fwd_qkvpacked_impl(qkv, ints, floats):
    q, k, v = split_qkv(qkv, ints[0])
    return dispatch.run_fwd(q, k, v, None, None, None, None, _packed_params(q, k, ints, floats))


def _bwd_qkvpacked_impl(dout, qkv, out, lse, ints, floats):
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    q, k, v = split_qkv(qkv, ints[0])
    dqkv = alloc_output(qkv.shape, qkv.dtype, qkv.device)
    dq, dk, dv = split_qkv(dqkv, ints[0])
    dispatch.run_bwd(dout, q, k, v, out, lse, None, None, None, None,
                     _packed_params(q, k, ints, floats), bool(ints[3]), dq=dq, dk=dk, dv=dv)
    return dqkv


@torch.library.custom_op("triflash::fwd_qkvpacked", mutates_args=())
def fwd_qkvpacked(qkv: Tensor, ints: List[int], floats: List[float]) -> Tuple[Tensor, Tensor]:
    return _fwd_qkvpacked_impl(qkv, ints, floats)


@fwd_qkvpacked.register_fake
def _(qkv, ints, floats):
    q, _, _ = split_qkv(qkv, ints[0])
    return q.new_empty(q.shape), q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)


@torch.library.custom_op("triflash::bwd_qkvpacked", mutates_args=())
def bwd_qkvpacked(dout: Tensor, qkv: Tensor, out: Tensor, lse: Tensor,
                  ints: List[int], floats: List[float]) -> Tensor:
    """dqkv, shaped like qkv (contiguous); the kernels write into its q/k/v views."""
    return _bwd_qkvpacked_impl(dout, qkv, out, lse, ints, floats)


@bwd_qkvpacked.register_fake
def _(dout, qkv, out, lse, ints, floats):
    return qkv.new_empty(qkv.shape)


def _setup_context_qkvpacked(ctx, inputs, output):
    qkv, ints, floats = inputs
    out, lse = output
    ctx.save_for_backward(qkv, out, lse)
    ctx.scalars = (ints, floats)
    ctx.mark_non_differentiable(lse)  # (as _setup_context)


def _backward_qkvpacked(ctx, dout, dlse):
    qkv, out, lse = ctx.saved_tensors
    return bwd_qkvpacked(dout, qkv, out, lse, *ctx.scalars), None, None


fwd_qkvpacked.register_autograd(_backward_qkvpacked, setup_context=_setup_context_qkvpacked)


# ---- eager fast path ----------------------------------------------------------------------

# The twins define ``forward(ctx, ...)`` rather than ``setup_context``: with setup_context,
# ``autograd.Function.apply`` binds the arguments through ``inspect.signature`` on every call,
# about a fifth of the forward's host time at 1k tokens on the H200
# (benchmarks/results/probes/host-profile-*-b1b8827.txt).

class _Attention(torch.autograd.Function):
    """Eager twin of ``fwd`` + its registered autograd: the same forward, context and backward
    implementation, without the torch.library dispatch."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, ints, floats):
        inputs = (q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, ints, floats)
        output = _fwd_impl(*inputs)
        _setup_context(ctx, inputs, output)
        # lse's gradient is never read: without this autograd fills a zero (batch, heads,
        # seqlen_q) tensor for it on every backward (a kernel launch and an allocation)
        ctx.set_materialize_grads(False)
        return output

    @staticmethod
    def backward(ctx, dout, dlse):
        if dout is None:  # (not materialized: out took no part in what is differentiated)
            return (None,) * 9
        saved = ctx.saved_tensors
        dq, dk, dv = _bwd_impl(dout, *saved, *ctx.scalars)
        if torch.is_grad_enabled():  # create_graph=True
            dq, dk, dv = _FirstOrderOnly.apply(3, dq, dk, dv, *saved[:3], dout)
        return dq, dk, dv, None, None, None, None, None, None


class _AttentionQKVPacked(torch.autograd.Function):
    """Eager twin of ``fwd_qkvpacked`` + its registered autograd."""

    @staticmethod
    def forward(ctx, qkv, ints, floats):
        output = _fwd_qkvpacked_impl(qkv, ints, floats)
        _setup_context_qkvpacked(ctx, (qkv, ints, floats), output)
        ctx.set_materialize_grads(False)  # (as _Attention)
        return output

    @staticmethod
    def backward(ctx, dout, dlse):
        if dout is None:
            return None, None, None
        dqkv = _bwd_qkvpacked_impl(dout, *ctx.saved_tensors, *ctx.scalars)
        if torch.is_grad_enabled():  # create_graph=True
            dqkv, = _FirstOrderOnly.apply(1, dqkv, ctx.saved_tensors[0], dout)
        return dqkv, None, None


class _FirstOrderOnly(torch.autograd.Function):
    """``apply(n, *grads, *inputs)``: the n gradients a backward computed with create_graph,
    joined to the inputs they depend on, so that differentiating them raises (the kernels'
    backward has no derivative of its own) instead of leaving out the second-order term."""

    @staticmethod
    def forward(ctx, n, *tensors):
        return tuple(t.view_as(t) for t in tensors[:n])

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError("triflash: attention has no second derivative (its backward is not differentiable); "
                           "double backward / gradient penalties through it are not supported")


def attention(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, ints, floats):
    """(out, lse) with autograd: the custom op under torch.compile, else the eager twin."""
    if torch.compiler.is_compiling():
        return fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, ints, floats)
    return _Attention.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, ints, floats)


class _AttentionSink(torch.autograd.Function):
    """Attention with a learnable sink per query head (``merge.fold_sink``): the forward's
    (out, lse) with the sink folded in, and the kernels' backward run on that out and lse
    (its probabilities are then the sink's softmax: the sink column has no value, so Delta
    and dS of every key are unchanged) plus the sink's own gradient (``merge.sink_grad``,
    from the same out and lse).
    Under torch.compile the forward and backward go through the custom ops."""

    @staticmethod
    def forward(ctx, q, k, v, sink, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, ints, floats):
        inputs = (q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, ints, floats)
        out, lse = fwd(*inputs) if torch.compiler.is_compiling() else _fwd_impl(*inputs)
        # the kernels' out / lse are kept (the same memory as the folded ones); the backward
        # folds them again, bit for bit
        ctx.save_for_backward(q, k, v, out, lse, sink, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
        ctx.scalars = (ints, floats)
        out_s, lse_s = fold_sink(out, lse, sink)
        ctx.mark_non_differentiable(lse_s)  # (as _setup_context)
        ctx.set_materialize_grads(False)
        return out_s, lse_s

    @staticmethod
    def backward(ctx, dout, dlse):
        if dout is None:
            return (None,) * 10
        q, k, v, out, lse, sink, *seqs = ctx.saved_tensors
        if dout.stride(-1) != 1:
            dout = dout.contiguous()
        out_s, lse_s = fold_sink(out, lse, sink)
        args = (dout, q, k, v, out_s, lse_s, *seqs, *ctx.scalars)
        dq, dk, dv = bwd(*args) if torch.compiler.is_compiling() else _bwd_impl(*args)
        dsink = sink_grad(dout, out_s, lse_s, sink) if ctx.needs_input_grad[3] else None
        if torch.is_grad_enabled():  # create_graph=True
            dq, dk, dv = _FirstOrderOnly.apply(3, dq, dk, dv, q, k, v, dout)
            if dsink is not None:
                dsink, = _FirstOrderOnly.apply(1, dsink, sink, q, k, v, dout)
        return dq, dk, dv, dsink, None, None, None, None, None, None


def attention_sink(q, k, v, sink, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, ints, floats):
    """(out, lse) of attention with a learnable sink (``_AttentionSink``), differentiable in
    q, k, v and the sink."""
    return _AttentionSink.apply(q, k, v, sink, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, ints, floats)


class _AttentionExtras(torch.autograd.Function):
    """FlashAttention-3's forward-only extras (``attention_chunk`` > 0, ``qv``, fp8 inputs
    with their ``descale``): the forward, and a backward that raises, as FA3's asserts."""

    @staticmethod
    def forward(ctx, q, k, v, qv, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, ints, floats, chunk,
                descale):
        out, lse = dispatch.run_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                                    _params(ints, floats, chunk), qv=qv, descale=descale)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        raise NotImplementedError("triflash: attention with attention_chunk > 0, qv or fp8 inputs is "
                                  "forward-only (FlashAttention-3's backward does not take them either)")


def attention_extras(q, k, v, qv, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, ints, floats, chunk,
                     descale=None):
    """(out, lse) of a forward with FA3's forward-only extras (``_AttentionExtras``);
    ``descale``: fp8 inputs' (q, k, v) descales (``validation.check_descales``)."""
    return _AttentionExtras.apply(q, k, v, qv, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, ints,
                                  floats, chunk, descale)


def attention_qkvpacked(qkv, ints, floats):
    if torch.compiler.is_compiling():
        return fwd_qkvpacked(qkv, ints, floats)
    return _AttentionQKVPacked.apply(qkv, ints, floats)


# ---- KV cache (flash_attn_with_kvcache) --------------------------------------------------

@torch.library.custom_op("triflash::append_kv", mutates_args={"k_cache", "v_cache"})
def append_kv(k_new: Tensor, v_new: Tensor, k_cache: Tensor, v_cache: Tensor, starts: Tensor,
              batch_idx: Optional[Tensor] = None, page_table: Optional[Tensor] = None,
              cu_seqlens_new: Optional[Tensor] = None) -> Tensor:
    """Write the new keys and values into the caches in place at each sequence's logical rows
    ``starts[b]`` onwards (one launch; ``kvcache.append_kv``): an op, so that torch.compile
    sees the mutation instead of tracing into Triton. ``cu_seqlens_new``: packed new tokens.
    Returns each sequence's key count after the append, starts + its new tokens."""
    return kvcache.append_kv(k_new, v_new, k_cache, v_cache, starts, batch_idx, page_table, cu_seqlens_new)


@append_kv.register_fake
def _(k_new, v_new, k_cache, v_cache, starts, batch_idx=None, page_table=None, cu_seqlens_new=None):
    return torch.empty_like(starts)


@torch.library.custom_op("triflash::fwd_kvcache", mutates_args=())
def fwd_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, cu_seqlens_q: Optional[Tensor],
                seqused_k: Optional[Tensor], batch_idx: Optional[Tensor], k_start: Optional[Tensor],
                page_table: Optional[Tensor], ints: List[int], floats: List[float]) -> Tuple[Tensor, Tensor]:
    """(out, lse) of q, dense or packed (``cu_seqlens_q``, ints[0] the longest sequence), over
    a KV cache addressed through ``cache_batch_idx`` (batch_idx), ``cache_leftpad``
    (k_start) or a page table (``problem.CacheAddressing``), or neither (a dense cache).
    ``ints``: ``pack_scalars``'s, then num_splits. Forward only."""
    return _fwd_kvcache_impl(q, k_cache, v_cache, cu_seqlens_q, seqused_k, batch_idx, k_start,
                             page_table, ints, floats)


def _fwd_kvcache_impl(q, k_cache, v_cache, cu_seqlens_q, seqused_k, batch_idx, k_start, page_table,
                      ints, floats, qv=None, chunk=0, descale=None):
    """(``qv``, ``chunk`` and fp8 inputs' ``descale``, FA3's forward-only extras, are passed
    only by direct calls.)"""
    cache = CacheAddressing(batch_idx=batch_idx, start=k_start, page_table=page_table)
    num_splits = ints[5] if len(ints) > 5 else 0  # (FA3's num_splits: 0 picks)
    return dispatch.run_fwd_cache(q, k_cache, v_cache, cu_seqlens_q, seqused_k, cache,
                                  _params(ints, floats, chunk), num_splits, qv=qv, descale=descale)


def attention_kvcache(q, k_cache, v_cache, cu_seqlens_q, seqused_k, batch_idx, k_start, page_table,
                      ints, floats, qv=None, chunk=0, descale=None):
    """``fwd_kvcache``: the custom op under torch.compile, else its implementation called
    directly (a decoding step is short enough for the op's per-call Python work to show).
    FA3's extras ``qv`` / ``chunk`` / fp8 ``descale`` run the implementation directly."""
    if qv is not None or chunk > 0 or descale is not None:
        return _fwd_kvcache_impl(q, k_cache, v_cache, cu_seqlens_q, seqused_k, batch_idx, k_start,
                                 page_table, ints, floats, qv, chunk, descale)
    if torch.compiler.is_compiling():
        return fwd_kvcache(q, k_cache, v_cache, cu_seqlens_q, seqused_k, batch_idx, k_start,
                           page_table, ints, floats)
    return _fwd_kvcache_impl(q, k_cache, v_cache, cu_seqlens_q, seqused_k, batch_idx, k_start,
                             page_table, ints, floats)


@fwd_kvcache.register_fake
def _(q, k_cache, v_cache, cu_seqlens_q, seqused_k, batch_idx, k_start, page_table, ints, floats):
    out = q.new_empty(q.shape[:-1] + (v_cache.shape[-1],))
    if cu_seqlens_q is not None:
        return out, q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    return out, q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
