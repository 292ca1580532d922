"""torch.library registration, in one place.

``triflash::fwd`` and ``triflash::bwd`` are custom ops with fake (meta) implementations, so
``torch.compile(fullgraph=True)`` traces through them without graph breaks, and the forward
carries its autograd formula (``register_autograd``), so eager autograd and AOTAutograd
both see the same backward. Dense and varlen share the ops: varlen is "cu_seqlens given".

``triflash::fwd_qkvpacked`` / ``bwd_qkvpacked`` take one packed qkv and return one packed
dqkv: the backward kernels write dq, dk and dv straight into views of it, so the gradient
of a packed input costs no concatenation.
"""
from typing import Optional, Tuple

import torch
from torch import Tensor

from . import dispatch
from .kernels.portable import AttnParams, alloc_output


def _params(max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right, softcap):
    return AttnParams(softmax_scale=softmax_scale, window_left=window_left,
                      window_right=window_right, softcap=softcap,
                      max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)


@torch.library.custom_op("triflash::fwd", mutates_args=())
def fwd(q: Tensor, k: Tensor, v: Tensor,
        cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor],
        seqused_q: Optional[Tensor], seqused_k: Optional[Tensor],
        max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float,
        window_left: int, window_right: int, softcap: float,
        deterministic: bool) -> Tuple[Tensor, Tensor]:
    """(out, lse). ``deterministic`` is only carried to the backward."""
    p = _params(max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right, softcap)
    return dispatch.run_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, p)


@fwd.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k,
      softmax_scale, window_left, window_right, softcap, deterministic):
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
        max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float,
        window_left: int, window_right: int, softcap: float,
        deterministic: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv)."""
    if dout.stride(-1) != 1:  # autograd may hand us expanded (stride-0) gradients
        dout = dout.contiguous()
    p = _params(max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right, softcap)
    return dispatch.run_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q,
                            seqused_k, p, deterministic)


@bwd.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
      max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right, softcap,
      deterministic):
    # contiguous, as the real op allocates them (empty_like would keep a permuted q's strides)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    (q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k,
     softmax_scale, window_left, window_right, softcap, deterministic) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
    ctx.scalars = (max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right,
                   softcap, deterministic)


def _backward(ctx, dout, dlse):
    # lse is returned for inspection; its gradient is not propagated (as in FlashAttention).
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k = ctx.saved_tensors
    dq, dk, dv = bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                     *ctx.scalars)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None, None, None


fwd.register_autograd(_backward, setup_context=_setup_context)


def split_qkv(qkv: Tensor, num_heads_q: int):
    """Views q, k, v of a packed qkv: (b, s, 3, h, d), or (b, s, hq + 2 * hk, d) with
    ``num_heads_q`` = hq (then num_heads_q > 0; for the 5-dim layout pass 0)."""
    if qkv.dim() == 5:
        return qkv.unbind(dim=2)
    nheads_kv = (qkv.shape[2] - num_heads_q) // 2
    return qkv.split([num_heads_q, nheads_kv, nheads_kv], dim=2)


@torch.library.custom_op("triflash::fwd_qkvpacked", mutates_args=())
def fwd_qkvpacked(qkv: Tensor, num_heads_q: int, softmax_scale: float, window_left: int,
                  window_right: int, softcap: float, deterministic: bool) -> Tuple[Tensor, Tensor]:
    q, k, v = split_qkv(qkv, num_heads_q)
    p = _params(q.shape[1], k.shape[1], softmax_scale, window_left, window_right, softcap)
    return dispatch.run_fwd(q, k, v, None, None, None, None, p)


@fwd_qkvpacked.register_fake
def _(qkv, num_heads_q, softmax_scale, window_left, window_right, softcap, deterministic):
    q, _, _ = split_qkv(qkv, num_heads_q)
    return q.new_empty(q.shape), q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)


@torch.library.custom_op("triflash::bwd_qkvpacked", mutates_args=())
def bwd_qkvpacked(dout: Tensor, qkv: Tensor, out: Tensor, lse: Tensor, num_heads_q: int,
                  softmax_scale: float, window_left: int, window_right: int, softcap: float,
                  deterministic: bool) -> Tensor:
    """dqkv, shaped like qkv (contiguous); the kernels write into its q/k/v views."""
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    q, k, v = split_qkv(qkv, num_heads_q)
    dqkv = alloc_output(qkv.shape, qkv.dtype, qkv.device)
    dq, dk, dv = split_qkv(dqkv, num_heads_q)
    p = _params(q.shape[1], k.shape[1], softmax_scale, window_left, window_right, softcap)
    dispatch.run_bwd(dout, q, k, v, out, lse, None, None, None, None, p, deterministic,
                     dq=dq, dk=dk, dv=dv)
    return dqkv


@bwd_qkvpacked.register_fake
def _(dout, qkv, out, lse, num_heads_q, softmax_scale, window_left, window_right, softcap,
      deterministic):
    return qkv.new_empty(qkv.shape)


def _setup_context_qkvpacked(ctx, inputs, output):
    qkv, *scalars = inputs
    out, lse = output
    ctx.save_for_backward(qkv, out, lse)
    ctx.scalars = scalars


def _backward_qkvpacked(ctx, dout, dlse):
    qkv, out, lse = ctx.saved_tensors
    return (bwd_qkvpacked(dout, qkv, out, lse, *ctx.scalars),) + (None,) * 6


fwd_qkvpacked.register_autograd(_backward_qkvpacked, setup_context=_setup_context_qkvpacked)
