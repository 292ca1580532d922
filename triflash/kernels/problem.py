"""The host's view of an attention problem, shared by every tier's launch code: the
scalars (``AttnParams``), where a KV cache keeps each sequence's keys (``CacheAddressing``),
the outputs with FlashAttention-3's shapes (``alloc_fwd_outputs``), and the (batch, token,
head) strides every kernel reads tensors by. Two layouts, viewed the same way as (batch,
seqlen, heads, dim) with explicit strides:

* dense:  q (batch, seqlen_q, nheads, d), lse (batch, nheads, seqlen_q)
* varlen: q (total_q, nheads, d) seen as batch stride 0 plus per-sequence starts from
  ``cu_seqlens``; lse (nheads, total_q)
"""
from dataclasses import dataclass
from typing import Optional

import torch

from .common import LOG2E


# Tests set this: outputs the kernels must write in full start as NaN instead of garbage.
POISON = False


def alloc_output(shape, dtype, device):
    if POISON:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def out_dtype(dtype):
    """The output dtype of inputs of ``dtype``: theirs, bf16 for fp8 (FA3's rule)."""
    return torch.bfloat16 if dtype == torch.float8_e4m3fn else dtype


def alloc_fwd_outputs(q, v, varlen, out=None):
    """(out, lse) of a forward, FA3's shapes. Varlen: tokens no sequence covers (cu_seqlens
    gaps, padding, past seqused) read as empty rows (0, lse -inf), so they start that way.
    A given ``out`` (any strides with a contiguous last dim, e.g. a (batch, seqlen, heads,
    dim) view of SDPA's (batch, heads, seqlen, dim) buffer) is used instead of a new one.
    fp8 inputs give a bf16 output (``out_dtype``), as FA3's."""
    out_shape = q.shape[:-1] + (v.shape[-1],)
    dtype = out_dtype(q.dtype)
    lse_shape = (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])
    if varlen:
        if out is None:
            out = torch.zeros(out_shape, dtype=dtype, device=q.device)
        else:
            out.zero_()
        return out, torch.full(lse_shape, float("-inf"), dtype=torch.float32, device=q.device)
    if out is None:
        out = alloc_output(out_shape, dtype, q.device)
    elif POISON:
        out.fill_(float("nan"))
    return out, alloc_output(lse_shape, torch.float32, q.device)


@dataclass(frozen=True)
class AttnParams:
    """Everything about the attention problem that is not a tensor."""
    softmax_scale: float
    window_left: int     # -1: unbounded
    window_right: int    # -1: unbounded; causal is 0
    softcap: float       # 0: off
    max_seqlen_q: int
    max_seqlen_k: int
    chunk: int = 0       # FA3's attention_chunk (forward only): 0 off, else keys per chunk

    @property
    def masked(self) -> bool:
        """A causal or sliding-window mask: query blocks visit different numbers of key blocks."""
        return self.window_left >= 0 or self.window_right >= 0

    def score_constants(self):
        """(qk_scale, softcap_log2) as ``common.scores`` expects them."""
        if self.softcap > 0.0:
            return self.softmax_scale / self.softcap, self.softcap * LOG2E
        return self.softmax_scale * LOG2E, 0.0


def bshd_strides(x: torch.Tensor, varlen: bool):
    """(batch, token, head) strides; the head-dim stride is 1 by validation."""
    if varlen:
        return 0, x.stride(0), x.stride(1)
    return x.stride(0), x.stride(1), x.stride(2)


def lse_strides(lse: torch.Tensor, varlen: bool):
    if varlen:  # (nheads, total_q)
        return 0, lse.stride(0), lse.stride(1)
    return lse.stride(0), lse.stride(1), lse.stride(2)


@dataclass(frozen=True)
class CacheAddressing:
    """Where a KV cache keeps each sequence's keys (``flash_attn_with_kvcache``):
    ``batch_idx[b]`` the cache batch of sequence b (None: b); ``start[b]`` its first key
    (cache_leftpad; None: 0); ``page_table`` (batch, pages): the cache block of each page
    (None: not paged; paged caches are (num_blocks, page_size, heads, dim)). Key rows are
    counted in the sequence's logical order in every case."""
    batch_idx: Optional[torch.Tensor] = None
    start: Optional[torch.Tensor] = None
    page_table: Optional[torch.Tensor] = None

    def kernel_args(self, k, dummy):
        """The forward kernel's (KV_BATCH, K_START, PAGE_TABLE, stride_ptb, page_size,
        num_kv_blocks) and its flags."""
        pt = self.page_table
        args = (self.batch_idx if self.batch_idx is not None else dummy,
                self.start if self.start is not None else dummy,
                pt if pt is not None else dummy, pt.stride(0) if pt is not None else 0,
                k.shape[1] if pt is not None else 1, k.shape[0])
        return args, dict(HAS_KV_BATCH=self.batch_idx is not None, HAS_K_START=self.start is not None,
                          PAGED=pt is not None)
