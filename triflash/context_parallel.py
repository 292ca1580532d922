"""Context parallelism: attention over a sequence sharded across the ranks of a
``torch.distributed`` group, with ring-flash-attn's public API and sharding conventions
(zhuzilin/ring-flash-attention), so that ``from triflash.context_parallel import
ring_flash_attn_func`` replaces ``from ring_flash_attn import ring_flash_attn_func``.

Shardings (``world`` ranks, each holding local q, k, v of shape (batch, seqlen_local, heads,
dim), every rank the same shape):

* ring: rank r holds tokens [r * L, (r + 1) * L) of the global sequence.
* zigzag: the global sequence is cut into 2 * world chunks of L / 2 tokens; rank r holds
  chunks r and 2 * world - 1 - r (concatenated), which balances causal work across ranks.
* llama3 (varlen): packed sequences (total, heads, dim), rank r holds tokens
  [r * total / world, (r + 1) * total / world); ``llama3_flash_attn_prepare_cu_seqlens``
  gives the local cu_seqlens and the slice of the gathered keys the local queries need.

Ring / zigzag forward: ``world`` steps. At step s the rank holds the K/V shard of rank
(r - s) mod world; it starts sending that shard to rank r + 1 and receiving the next from
rank r - 1 (``batch_isend_irecv``), computes the partial attention of (part of) its queries
against (part of) the visiting block with triflash's forward kernel, giving (out_s, lse_s),
waits for the transfer, and merges: lse = logaddexp(lse, lse_s), out = out * exp(lse_old -
lse) + out_s * exp(lse_s - lse), in fp32 (rows no key has reached yet stay out 0, lse -inf;
``merge.merge_partials``, the merge ``flash_attn_combine`` runs).
Causal ring: step 0 is the causal diagonal block, blocks of earlier ranks are full, blocks of
later ranks are skipped. Causal zigzag: step 0 causal over the two local chunks; an earlier
rank's block: all local queries against its first chunk; a later rank's block: the second
local query chunk against both its chunks (every computed block is a full rectangle of
L * L / 2 pairs, so the ranks are balanced).

Ring / zigzag backward: the ring again. Each step runs triflash's backward kernel on the same
block pairs with the *global* (merged) out and lse: the softmax of a block with the global
lse is the block's slice of the global softmax, so the per-block dq/dk/dv add up to the exact
gradient. dq accumulates locally (fp32); dk/dv accumulators (fp32) travel around the ring
with their K/V block, each rank adding its contribution, and return to their owner after
``world`` hops.

Costs per rank (global length N = world * L, h query heads, hk KV heads, dim d):
forward compute N * L pairs (about half under causal), communication (world - 1) K/V
shards (2 * L * hk * d elements each); backward twice the forward's compute plus the
(world - 1) K/V shards and ``world`` fp32 dK/dV shards. Memory O(L): the fp32 out / dq /
dk / dv accumulators and two K/V (and dK/dV) shards in flight; nothing O(N^2).

llama3 varlen: per group of ``heads_k_stride`` KV heads, all-gather the K/V heads (the next
group's gather overlapping this group's kernel), run one varlen forward of the local queries
against the slice of keys they need; backward re-gathers, runs the varlen backward and
reduce-scatters dK/dV (fp32). Communication: all K/V (forward), all K/V plus dK/dV (backward);
memory O(N * heads_k_stride * d) for the gathered group.

Not supported (a ValueError / NotImplementedError naming the argument): dropout_p > 0,
alibi_slopes, window_size other than (-1, -1). zigzag also accepts causal=False (then it is
the plain ring: without a mask the token order does not matter); ring-flash-attn asserts.
"""
import torch
import torch.distributed as dist

from . import ops
from . import validation as V
from .merge import merge_partials

__all__ = ["ring_flash_attn_func", "ring_flash_attn_kvpacked_func", "ring_flash_attn_qkvpacked_func",
           "zigzag_ring_flash_attn_func", "zigzag_ring_flash_attn_kvpacked_func",
           "zigzag_ring_flash_attn_qkvpacked_func", "llama3_flash_attn_prepare_cu_seqlens",
           "llama3_flash_attn_varlen_func", "llama3_flash_attn_varlen_kvpacked_func",
           "llama3_flash_attn_varlen_qkvpacked_func"]

_ALL = slice(None)


def _check(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic, varlen):
    """(softmax_scale, causal, deterministic) after refusing what is not implemented."""
    if dropout_p != 0:
        V._fail("dropout_p", dropout_p, "triflash has no attention dropout; pass 0.0", NotImplementedError)
    if alibi_slopes is not None:
        V._fail("alibi_slopes", "a tensor", "triflash has no ALiBi; pass None", NotImplementedError)
    if V.normalize_window(window_size, False) != (-1, -1):
        V._fail("window_size", tuple(window_size), "context-parallel attention has no local window; "
                "pass (-1, -1)", NotImplementedError)
    causal = V.as_flag("causal", causal)
    deterministic = V.as_flag("deterministic", deterministic)
    V.check_qkv(q, k, v, varlen=varlen)
    softmax_scale, _ = V.check_scalars(softmax_scale, 0.0, q.shape[-1])
    return softmax_scale, causal, deterministic


_DTYPES = (torch.float16, torch.bfloat16)


def _check_ranks_agree(group, q, k, v, causal, scale):
    """With the host checks (the CPU, or set_check_inputs(True)): every rank of ``group``
    passes the same dtype, shapes, causal and scale, or every rank raises (a few numbers per
    rank all-gathered, with the collective the ring already uses). Unchecked, a mismatch
    reads another dtype's bytes or aborts inside the collective library."""
    world = _rank_world(group)[1]
    if not V._host_checks(q) or world == 1:
        return
    dims = [list(x.shape) + [-1] * (4 - x.dim()) for x in (q, k, v)]
    mine = torch.tensor([_DTYPES.index(q.dtype), *dims[0], *dims[1], *dims[2], float(causal), scale],
                        dtype=torch.float64, device=q.device)
    every = torch.empty(world * mine.numel(), dtype=torch.float64, device=q.device)
    dist.all_gather_into_tensor(every, mine, group=group)
    every = every.view(world, -1).cpu()
    if not bool((every == every[0]).all()):
        readable = [f"{_DTYPES[int(r[0])]} q{tuple(int(x) for x in r[1:5] if x >= 0)} "
                    f"k{tuple(int(x) for x in r[5:9] if x >= 0)} v{tuple(int(x) for x in r[9:13] if x >= 0)} "
                    f"causal={bool(r[13])} scale={float(r[14]):.6g}" for r in every]
        V._fail("q, k, v across ranks", readable, "every rank must pass the same dtype, q, k and v shapes, causal "
                "and softmax_scale")


def _rank_world(group):
    """(rank, world size); a process without an initialized default group is a world of one."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


class _Ring:
    """Sends to rank r + 1 and receives from rank r - 1 of ``group``."""

    def __init__(self, group):
        self.group = group
        self.rank, self.world = _rank_world(group)
        self.send_to, self.recv_from = (self.rank + 1) % self.world, (self.rank - 1) % self.world
        if group is not None:  # P2POp takes global ranks
            self.send_to = dist.get_global_rank(group, self.send_to)
            self.recv_from = dist.get_global_rank(group, self.recv_from)

    def exchange(self, tensors, tag):
        """Start sending ``tensors`` on and receiving their successors; (buffers, requests).
        Tags tell the K/V stream (0, 1) from the dK/dV stream (2, 3) where the backend uses
        them (gloo; NCCL orders by issue)."""
        bufs = [torch.empty_like(t) for t in tensors]
        p2p = [dist.P2POp(dist.isend, t, self.send_to, self.group, tag + i) for i, t in enumerate(tensors)]
        p2p += [dist.P2POp(dist.irecv, b, self.recv_from, self.group, tag + i) for i, b in enumerate(bufs)]
        return bufs, dist.batch_isend_irecv(p2p)


def _wait(reqs):
    for req in reqs:
        req.wait()


def _scalars(seqlen_q, seqlen_k, scale, causal, deterministic):
    return ops.pack_scalars(seqlen_q, seqlen_k, scale, -1, 0 if causal else -1, 0.0, deterministic)


def _block_plan(zigzag, causal, rank, step, half):
    """(query slice, key slice, causal) of the block computed at ``step``, or None (skipped)."""
    if not causal:
        return _ALL, _ALL, False
    if step == 0:
        return _ALL, _ALL, True
    if step <= rank:  # the visiting block comes from an earlier rank
        return (_ALL, slice(0, half), False) if zigzag else (_ALL, _ALL, False)
    return (slice(half, None), _ALL, False) if zigzag else None


def _merge(out, lse, block_out, block_lse):
    """In place, fp32: (out, lse) <- the log-sum-exp merge (``merge.merge_partials``, as
    ``flash_attn_combine``) of (out, lse) and the block's. out (b, s, h, d), lse (b, h, s); a
    row -inf on both sides stays out 0, lse -inf."""
    merged, new_lse = merge_partials(torch.stack([out.transpose(1, 2), block_out.transpose(1, 2).float()]),
                                     torch.stack([lse, block_lse]))
    out.copy_(merged.transpose(1, 2))
    lse.copy_(new_lse)


def _ring_forward(ring, q, k, v, scale, causal, deterministic, zigzag):
    b, s, h, _ = q.shape
    out = torch.zeros((b, s, h, v.shape[-1]), dtype=torch.float32, device=q.device)
    lse = torch.full((b, h, s), float("-inf"), dtype=torch.float32, device=q.device)
    for step in range(ring.world):
        last = step + 1 == ring.world
        if not last:
            (next_k, next_v), reqs = ring.exchange([k, v], 0)
        plan = _block_plan(zigzag, causal, ring.rank, step, s // 2)
        if plan is not None:
            qs, ks, c = plan
            qb, kb, vb = q[:, qs], k[:, ks], v[:, ks]
            block_out, block_lse = ops._fwd_impl(qb, kb, vb, None, None, None, None,
                                                 *_scalars(qb.shape[1], kb.shape[1], scale, c, deterministic))
            _merge(out[:, qs], lse[:, :, qs], block_out, block_lse)
        if not last:
            _wait(reqs)
            k, v = next_k, next_v
    return out.to(q.dtype), lse


def _ring_backward(ring, dout, q, k, v, out, lse, scale, causal, deterministic, zigzag):
    s = q.shape[1]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = dv = dkv_reqs = None
    for step in range(ring.world):
        last = step + 1 == ring.world
        if not last:
            (next_k, next_v), kv_reqs = ring.exchange([k, v], 0)
        plan = _block_plan(zigzag, causal, ring.rank, step, s // 2)
        if plan is not None:
            qs, ks, c = plan
            qb, kb, vb = q[:, qs], k[:, ks], v[:, ks]
            lse_b = lse if qs is _ALL else lse[:, :, qs].contiguous()
            bdq, bdk, bdv = ops._bwd_impl(dout[:, qs], qb, kb, vb, out[:, qs], lse_b, None, None, None, None,
                                          *_scalars(qb.shape[1], kb.shape[1], scale, c, deterministic))
            dq[:, qs] += bdq
        if step == 0:  # the accumulators of this rank's own K/V start here
            dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
            dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        else:  # those of the visiting K/V arrive from rank r - 1 (sent at the previous step)
            _wait(dkv_reqs)
            dk, dv = next_dk, next_dv
        if plan is not None:
            dk[:, ks] += bdk
            dv[:, ks] += bdv
        if ring.world > 1:
            (next_dk, next_dv), dkv_reqs = ring.exchange([dk, dv], 2)
        if not last:
            _wait(kv_reqs)
            k, v = next_k, next_v
    if ring.world > 1:  # after ``world`` hops each accumulator is back with its owner
        _wait(dkv_reqs)
        dk, dv = next_dk, next_dv
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, causal, deterministic, zigzag, group):
        ring = _Ring(group)
        k, v = k.contiguous(), v.contiguous()  # sent as they are
        out, lse = _ring_forward(ring, q, k, v, scale, causal, deterministic, zigzag)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (scale, causal, deterministic, zigzag, group)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        scale, causal, deterministic, zigzag, group = ctx.args
        dq, dk, dv = _ring_backward(_Ring(group), dout, *ctx.saved_tensors, scale, causal, deterministic, zigzag)
        return dq, dk, dv, None, None, None, None, None


def _ring_call(zigzag, q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
               deterministic, return_attn_probs, group):
    scale, causal, deterministic = _check(q, k, v, dropout_p, softmax_scale, causal, window_size,
                                          alibi_slopes, deterministic, varlen=False)
    if k.shape[1] != q.shape[1]:
        V._fail("k.shape[1]", k.shape[1], f"each rank's k/v shard must have q's local length {q.shape[1]}")
    _check_ranks_agree(group, q, k, v, causal, scale)
    if zigzag and causal and q.shape[1] % 2:
        V._fail("q.shape[1]", q.shape[1], "zigzag needs an even local length (two chunks per rank; "
                "the global length divisible by 2 * world size)")
    out, lse = _RingAttention.apply(q, k, v, scale, causal, deterministic, zigzag and causal, group)
    return (out, lse, None) if return_attn_probs else out


def ring_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                         alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None):
    """Attention of the local queries over the whole sequence, sharded contiguously: rank r
    holds tokens [r * L, (r + 1) * L). q (batch, L, nheads, d); k, v (batch, L, nheads_kv, d)
    (GQA: nheads_kv divides nheads). Returns out (batch, L, nheads, d), or with
    return_attn_probs (out, lse (batch, nheads, L) fp32, None) as ring-flash-attn.
    Differentiable in q, k, v; every rank of ``group`` must call it with the same shapes."""
    return _ring_call(False, q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                      deterministic, return_attn_probs, group)


def zigzag_ring_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                                window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                                return_attn_probs=False, group=None):
    """As ``ring_flash_attn_func`` with the zigzag sharding: the global sequence cut into
    2 * world chunks, rank r holding chunks r and 2 * world - 1 - r (in that order)."""
    return _ring_call(True, q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                      deterministic, return_attn_probs, group)


def ring_flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                                  window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                                  return_attn_probs=False, group=None):
    """kv (batch, L, 2, nheads_kv, d)."""
    return ring_flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size,
                                alibi_slopes, deterministic, return_attn_probs, group)


def ring_flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                                   window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                                   return_attn_probs=False, group=None):
    """qkv (batch, L, 3, nheads, d)."""
    return ring_flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal,
                                window_size, alibi_slopes, deterministic, return_attn_probs, group)


def zigzag_ring_flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                                         window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                                         return_attn_probs=False, group=None):
    return zigzag_ring_flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal,
                                       window_size, alibi_slopes, deterministic, return_attn_probs, group)


def zigzag_ring_flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                                          window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                                          return_attn_probs=False, group=None):
    return zigzag_ring_flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale,
                                       causal, window_size, alibi_slopes, deterministic, return_attn_probs,
                                       group)


# ---- llama3: all-gather K/V per head group, one varlen call -------------------------------

def llama3_flash_attn_prepare_cu_seqlens(cu_seqlens, causal, rank, world_size):
    """From the global ``cu_seqlens`` (every sequence across the group; total divisible by
    world_size): (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, local_k_slice) for
    rank ``rank``, whose queries are tokens [rank * L, (rank + 1) * L). local_k_slice is the
    slice of the all-gathered keys those queries need: from the start of the first sequence
    they touch to their end (causal) or to the end of their last sequence (not causal)."""
    cu = [int(x) for x in cu_seqlens.tolist()]
    total = cu[-1]
    if total % world_size:
        V._fail("cu_seqlens[-1]", total, f"the total length must be divisible by world_size={world_size}")
    length = total // world_size
    lo, hi = rank * length, (rank + 1) * length
    left = max(i for i in range(len(cu)) if cu[i] <= lo)  # the sequence holding token lo starts at cu[left]
    right = min(i for i in range(len(cu)) if cu[i] >= hi)  # ... token hi - 1 ends at cu[right]
    bounds = cu[left:right + 1]
    q_bounds = [0] + [c - lo for c in bounds[1:-1]] + [length]
    k_start, k_end = bounds[0], (hi if causal else bounds[-1])
    k_bounds = [c - k_start for c in bounds[:-1]] + [k_end - k_start]
    as_tensor = lambda b: torch.tensor(b, dtype=torch.int32, device=cu_seqlens.device)  # noqa: E731
    max_q = max(b - a for a, b in zip(q_bounds, q_bounds[1:]))
    max_k = max(b - a for a, b in zip(k_bounds, k_bounds[1:]))
    return as_tensor(q_bounds), as_tensor(k_bounds), max_q, max_k, slice(k_start, k_end)


def _gather_heads(k, v, heads, group, world):
    """Start all-gathering the KV heads ``heads`` of every rank's k and v: (buffers, handles)."""
    if world == 1:
        return (k[:, heads], v[:, heads]), []
    bufs, handles = [], []
    for t in (k, v):
        part = t[:, heads].contiguous()
        buf = part.new_empty((world * part.shape[0],) + part.shape[1:])
        handles.append(dist.all_gather_into_tensor(buf, part, group=group, async_op=True))
        bufs.append(buf)
    return bufs, handles


class _Llama3Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, stride, k_slice, scale, causal, deterministic, group):
        world = _rank_world(group)[1]
        nheads_k, group_q = k.shape[1], q.shape[1] // k.shape[1]
        ints, floats = _scalars(max_q, max_k, scale, causal, deterministic)
        outs, lses = [], []
        pending = _gather_heads(k, v, slice(0, stride), group, world)
        for i in range(0, nheads_k, stride):
            (kf, vf), handles = pending
            _wait(handles)
            if i + stride < nheads_k:  # the next head group's gather overlaps this group's kernel
                pending = _gather_heads(k, v, slice(i + stride, i + 2 * stride), group, world)
            qb = q[:, i * group_q:(i + stride) * group_q]
            o, lse = ops._fwd_impl(qb, kf[k_slice], vf[k_slice], cu_q, cu_k, None, None, ints, floats)
            outs.append(o)
            lses.append(lse)
        out, lse = torch.cat(outs, dim=1), torch.cat(lses, dim=0)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
        ctx.args = (stride, k_slice, ints, floats, group, world)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
        stride, k_slice, ints, floats, group, world = ctx.args
        nheads_k, group_q = k.shape[1], q.shape[1] // k.shape[1]
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        pending = _gather_heads(k, v, slice(0, stride), group, world)
        for i in range(0, nheads_k, stride):
            (kf, vf), handles = pending
            _wait(handles)
            if i + stride < nheads_k:
                pending = _gather_heads(k, v, slice(i + stride, i + 2 * stride), group, world)
            hq = slice(i * group_q, (i + stride) * group_q)
            bdq, bdk, bdv = ops._bwd_impl(dout[:, hq], q[:, hq], kf[k_slice], vf[k_slice], out[:, hq],
                                          lse[hq].contiguous(), cu_q, cu_k, None, None, ints, floats)
            dq[:, hq] = bdq
            for grad, block in ((dk, bdk), (dv, bdv)):
                if world == 1:
                    grad[:, i:i + stride] = block
                    continue
                full = torch.zeros((kf.shape[0],) + block.shape[1:], dtype=torch.float32, device=k.device)
                full[k_slice] = block
                mine = full.new_empty((k.shape[0],) + block.shape[1:])
                dist.reduce_scatter_tensor(mine, full, group=group)  # fp32 sum over the ranks
                grad[:, i:i + stride] = mine
        return (dq, dk, dv) + (None,) * 10


def llama3_flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  heads_k_stride, local_k_slice, dropout_p=0.0, softmax_scale=None,
                                  causal=False, window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                                  return_attn_probs=False, group=None):
    """Varlen attention of this rank's tokens (total / world of the packed batch) over the
    keys they need, K/V all-gathered ``heads_k_stride`` KV heads at a time. q (L, nheads, d);
    k, v (L, nheads_kv, d); the cu_seqlens, max_seqlens and local_k_slice from
    ``llama3_flash_attn_prepare_cu_seqlens``. Returns out (L, nheads, d), or with
    return_attn_probs (out, lse (nheads, L) fp32, None)."""
    scale, causal, deterministic = _check(q, k, v, dropout_p, softmax_scale, causal, window_size,
                                          alibi_slopes, deterministic, varlen=True)
    stride = V.as_int("heads_k_stride", heads_k_stride, "expected an int dividing nheads_kv")
    if stride <= 0 or k.shape[1] % stride:
        V._fail("heads_k_stride", stride, f"expected a positive divisor of nheads_kv={k.shape[1]}")
    max_seqlen_q = V.as_max_seqlen("max_seqlen_q", max_seqlen_q)
    max_seqlen_k = V.as_max_seqlen("max_seqlen_k", max_seqlen_k)
    _check_ranks_agree(group, q, k, v, causal, scale)
    if V._host_checks(q):  # (as flash_attn_varlen_func's: on the CPU, or with set_check_inputs(True))
        keys = len(range(_rank_world(group)[1] * k.shape[0])[local_k_slice])  # the gathered keys it reads
        V._check_cu_seqlens_values("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q)
        V._check_cu_seqlens_values("cu_seqlens_k", cu_seqlens_k, keys, max_seqlen_k)
    out, lse = _Llama3Attention.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                      stride, local_k_slice, scale, causal, deterministic, group)
    return (out, lse, None) if return_attn_probs else out


def llama3_flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                           heads_k_stride, local_k_slice, dropout_p=0.0, softmax_scale=None,
                                           causal=False, window_size=(-1, -1), alibi_slopes=None,
                                           deterministic=False, return_attn_probs=False, group=None):
    """kv (L, 2, nheads_kv, d)."""
    return llama3_flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                         max_seqlen_k, heads_k_stride, local_k_slice, dropout_p, softmax_scale,
                                         causal, window_size, alibi_slopes, deterministic, return_attn_probs,
                                         group)


def llama3_flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                            heads_k_stride, local_k_slice, dropout_p=0.0, softmax_scale=None,
                                            causal=False, window_size=(-1, -1), alibi_slopes=None,
                                            deterministic=False, return_attn_probs=False, group=None):
    """qkv (L, 3, nheads, d)."""
    return llama3_flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens_q, cu_seqlens_k,
                                         max_seqlen_q, max_seqlen_k, heads_k_stride, local_k_slice, dropout_p,
                                         softmax_scale, causal, window_size, alibi_slopes, deterministic,
                                         return_attn_probs, group)
