"""Host side of the portable Triton tier: allocate outputs, compute launch grids, launch.

Every function takes already-validated tensors (see ``triflash.validation``) in one of two
layouts and views both the same way, as (batch, seqlen, heads, dim) with explicit strides:

* dense:  q (batch, seqlen_q, nheads, d), lse (batch, nheads, seqlen_q)
* varlen: q (total_q, nheads, d) seen as batch stride 0 plus per-sequence starts from
  ``cu_seqlens``; lse (nheads, total_q)
"""
from dataclasses import dataclass
from typing import Optional

import torch
import triton

from .bwd import bwd_dkdv_kernel, bwd_dq_kernel, bwd_preprocess_kernel
from .common import LOG2E, ceil_div, launch_sections
from .configs import BwdConfig, FwdConfig
from .fwd import flash_fwd_kernel


# Tests set this: outputs the kernels must write in full start as NaN instead of garbage.
POISON = False


def alloc_output(shape, dtype, device):
    if POISON:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def alloc_fwd_outputs(q, v, varlen, out=None):
    """(out, lse) of a forward, FA3's shapes. Varlen: tokens no sequence covers (cu_seqlens
    gaps, padding, past seqused) read as empty rows (0, lse -inf), so they start that way.
    A given ``out`` (any strides with a contiguous last dim, e.g. a (batch, seqlen, heads,
    dim) view of SDPA's (batch, heads, seqlen, dim) buffer) is used instead of a new one."""
    out_shape = q.shape[:-1] + (v.shape[-1],)
    lse_shape = (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])
    if varlen:
        if out is None:
            out = torch.zeros(out_shape, dtype=q.dtype, device=q.device)
        else:
            out.zero_()
        return out, torch.full(lse_shape, float("-inf"), dtype=torch.float32, device=q.device)
    if out is None:
        out = alloc_output(out_shape, q.dtype, q.device)
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

    @property
    def masked(self) -> bool:
        """A causal or sliding-window mask: query blocks visit different numbers of key blocks."""
        return self.window_left >= 0 or self.window_right >= 0

    def score_constants(self):
        """(qk_scale, softcap_log2) as ``common.scores`` expects them."""
        if self.softcap > 0.0:
            return self.softmax_scale / self.softcap, self.softcap * LOG2E
        return self.softmax_scale * LOG2E, 0.0


def _bshd_strides(x: torch.Tensor, varlen: bool):
    """(batch, token, head) strides; the head-dim stride is 1 by validation."""
    if varlen:
        return 0, x.stride(0), x.stride(1)
    return x.stride(0), x.stride(1), x.stride(2)


def _lse_strides(lse: torch.Tensor, varlen: bool):
    if varlen:  # (nheads, total_q)
        return 0, lse.stride(0), lse.stride(1)
    return lse.stride(0), lse.stride(1), lse.stride(2)


def _seq_args(q, k, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, p: AttnParams):
    varlen = cu_seqlens_q is not None
    dummy = q  # never dereferenced when the matching constexpr flag is off
    batch = cu_seqlens_q.shape[0] - 1 if varlen else q.shape[0]
    total_q = q.shape[0] if varlen else q.shape[1]
    # keys packed like the queries, or (cu_seqlens_k None: a KV cache under packed queries) dense
    total_k = k.shape[0] if cu_seqlens_k is not None else k.shape[1]
    return dict(
        varlen=varlen, batch=batch,
        ptrs=(cu_seqlens_q if varlen else dummy, cu_seqlens_k if cu_seqlens_k is not None else dummy,
              seqused_q if seqused_q is not None else dummy,
              seqused_k if seqused_k is not None else dummy),
        sizes=(p.max_seqlen_q, p.max_seqlen_k, total_q, total_k),
        flags=dict(IS_VARLEN=varlen, HAS_SEQUSED_Q=seqused_q is not None,
                   HAS_SEQUSED_K=seqused_k is not None),
    )


def _sections(q, k, v, s, p: AttnParams):
    return launch_sections(s["batch"], q.shape[-2], k, v, p.max_seqlen_k, p.window_left, p.window_right)


def _common_flags(q, v, p: AttnParams, upcast: bool):
    d, dv = q.shape[-1], v.shape[-1]
    return dict(
        HEADDIM=d, HEADDIM_V=dv,
        BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_DV=max(16, triton.next_power_of_2(dv)),
        HAS_LEFT=p.window_left >= 0, HAS_RIGHT=p.window_right >= 0, SOFTCAP=p.softcap > 0.0,
        UPCAST=upcast,
    )


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


def fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, p: AttnParams,
        cfg: FwdConfig, upcast: bool, cache: Optional[CacheAddressing] = None,
        out: Optional[torch.Tensor] = None):
    """Returns (out, lse) with FlashAttention-3's shapes. ``cache``: a KV cache's addressing
    (then ``p.max_seqlen_k`` is one sequence's cache capacity, and packed queries come with
    ``cu_seqlens_q`` and no ``cu_seqlens_k``). ``out``: written instead of a new tensor
    (``alloc_fwd_outputs``)."""
    s = _seq_args(q, k, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, p)
    cache_args, cache_flags = (cache or _NO_CACHE).kernel_args(k, q)
    varlen = s["varlen"]
    k_varlen = cu_seqlens_k is not None  # else dense keys, also under packed queries (DENSE_K)
    nheads, nheads_kv = q.shape[-2], k.shape[-2]
    out, lse = alloc_fwd_outputs(q, v, varlen, out)
    if s["batch"] == 0 or p.max_seqlen_q == 0 or nheads == 0:
        return out, lse
    qk_scale, softcap_log2 = p.score_constants()
    grid = (ceil_div(p.max_seqlen_q, cfg.block_m) * s["batch"] * nheads,)  # (common.launch_order)
    flash_fwd_kernel[grid](
        q, k, v, out, lse,
        *_bshd_strides(q, varlen), *_bshd_strides(k, k_varlen), *_bshd_strides(v, k_varlen),
        *_bshd_strides(out, varlen), *_lse_strides(lse, varlen),
        *s["ptrs"], nheads, nheads_kv, *s["sizes"],
        qk_scale, softcap_log2, p.window_left, p.window_right, _sections(q, k, v, s, p),
        *cache_args,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, **s["flags"], **_common_flags(q, v, p, upcast),
        **cache_flags, DENSE_K=varlen and not k_varlen, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out, lse


_NO_CACHE = CacheAddressing()


def launch_dq(q, k, v, dout, lse, delta, dq, s, p: AttnParams, cfg: BwdConfig, flags):
    """The separate dQ kernel (no atomics): one program per query block. ``s`` and ``flags``
    as ``_seq_args`` / ``_common_flags`` build them; ``delta`` has ``lse``'s shape and strides."""
    varlen = s["varlen"]
    nheads, nheads_kv = q.shape[-2], k.shape[-2]
    qk_scale, softcap_log2 = p.score_constants()
    bwd_dq_kernel[(ceil_div(p.max_seqlen_q, cfg.dq_block_m) * s["batch"] * nheads,)](
        q, k, v, dout, lse, delta, dq,
        *_bshd_strides(q, varlen), *_bshd_strides(k, varlen), *_bshd_strides(v, varlen),
        *_bshd_strides(dout, varlen), *_lse_strides(lse, varlen), *_bshd_strides(dq, varlen),
        *s["ptrs"], nheads, nheads_kv, *s["sizes"],
        qk_scale, p.softmax_scale, softcap_log2, p.window_left, p.window_right,
        _sections(q, k, v, s, p),
        BLOCK_M=cfg.dq_block_m, BLOCK_N=cfg.dq_block_n, **s["flags"], **flags,
        num_warps=cfg.dq_warps, num_stages=cfg.dq_stages,
    )


def bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
        p: AttnParams, cfg: BwdConfig, deterministic: bool, upcast: bool,
        dq: Optional[torch.Tensor] = None, dk: Optional[torch.Tensor] = None,
        dv: Optional[torch.Tensor] = None):
    """Returns (dq, dk, dv). ``deterministic`` selects the separate dQ kernel (no atomics);
    otherwise dQ is accumulated with fp32 atomics inside the dK/dV kernel."""
    s = _seq_args(q, k, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, p)
    varlen = s["varlen"]
    nheads, nheads_kv = q.shape[-2], k.shape[-2]
    dq = alloc_output(q.shape, q.dtype, q.device) if dq is None else dq
    dk = alloc_output(k.shape, k.dtype, k.device) if dk is None else dk
    dv = alloc_output(v.shape, v.dtype, v.device) if dv is None else dv
    if s["batch"] == 0 or nheads == 0 or p.max_seqlen_q == 0 or p.max_seqlen_k == 0:
        # no query sees any key: every gradient is zero
        dq.zero_(), dk.zero_(), dv.zero_()
        return dq, dk, dv
    # rows a varlen batch leaves uncovered (and keys no sequence owns) still get zeros
    if varlen:
        dq.zero_(), dk.zero_(), dv.zero_()
    qk_scale, softcap_log2 = p.score_constants()
    flags = _common_flags(q, v, p, upcast)
    lse_strides = _lse_strides(lse, varlen)

    delta = alloc_output(lse.shape, torch.float32, lse.device)
    pre_block = 64
    bwd_preprocess_kernel[(ceil_div(p.max_seqlen_q, pre_block) * s["batch"] * nheads,)](
        out, dout, delta, *_bshd_strides(out, varlen), *_bshd_strides(dout, varlen), *lse_strides,
        s["ptrs"][0], s["ptrs"][2], nheads, p.max_seqlen_q, s["sizes"][2],
        HEADDIM_V=flags["HEADDIM_V"], BLOCK_M=pre_block, BLOCK_DV=flags["BLOCK_DV"],
        IS_VARLEN=varlen, HAS_SEQUSED_Q=s["flags"]["HAS_SEQUSED_Q"],
    )

    atomic_dq = not deterministic
    dq_accum = torch.zeros(q.shape, dtype=torch.float32, device=q.device) if atomic_dq else dq
    # one launch computing dK and dV, or (split_dkdv) a dV pass and a dK(+dQ) pass
    passes = [(True, False), (False, True)] if cfg.split_dkdv else [(True, True)]
    for do_dk, do_dv in passes:
        bwd_dkdv_kernel[(ceil_div(p.max_seqlen_k, cfg.dkdv_block_n) * s["batch"] * nheads_kv,)](
            q, k, v, dout, lse, delta, dq_accum, dk, dv,
            *_bshd_strides(q, varlen), *_bshd_strides(k, varlen), *_bshd_strides(v, varlen),
            *_bshd_strides(dout, varlen), *lse_strides, *_bshd_strides(dq_accum, varlen),
            *_bshd_strides(dk, varlen), *_bshd_strides(dv, varlen),
            *s["ptrs"], nheads, nheads_kv, *s["sizes"],
            qk_scale, p.softmax_scale, softcap_log2, p.window_left, p.window_right,
            BLOCK_M=cfg.dkdv_block_m, BLOCK_N=cfg.dkdv_block_n, **s["flags"], **flags,
            ATOMIC_DQ=atomic_dq and do_dk, DO_DK=do_dk, DO_DV=do_dv,
            num_warps=cfg.dkdv_warps, num_stages=cfg.dkdv_stages,
        )
    if atomic_dq:
        dq.copy_(dq_accum)
    else:
        launch_dq(q, k, v, dout, lse, delta, dq, s, p, cfg, flags)
    return dq, dk, dv
