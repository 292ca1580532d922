"""The log-sum-exp merge of attention computed over disjoint sets of keys, shared by
``flash_attn_combine`` (FA3's merge of split results, interface.py) and the context-parallel
ring's merge of each step's block into its running result (context_parallel.py).

A part i is (out_i, lse_i): attention normalized over the part's own keys, and the
natural-log log-sum-exp of the part's scaled scores. Over the union of the keys,
lse = logsumexp_i lse_i and out = sum_i exp(lse_i - lse) out_i. A row with no key in a part
has out_i 0 and lse_i -inf (weight 0); a row with no key in any part gets out 0 and
lse -inf, without the NaN of exp(-inf - -inf).

A learnable attention sink (gpt-oss; FA4's ``learnable_sink``, transformers' ``s_aux``) is the
same merge with a part of one key whose logit is the head's sink and whose value is zero:
``fold_sink`` applies it to a forward's (out, lse), ``sink_grad`` is the sink's gradient.

Only torch: interface.py, ops.py and context_parallel.py import this module.
"""
import torch


def merge_partials(out_parts, lse_parts):
    """(out, lse) of the parts stacked along dim 0: out_parts (n, ..., headdim), lse_parts
    (n, ...) (out_parts' shape without headdim). Returns out (..., headdim) fp32 (weights
    applied elementwise in fp32: no matmul, so no TF32 whatever torch's matmul precision)
    and lse (...) fp32. The parts are added one at a time: no temporary of all of them (FA3's
    combine tests merge 133 parts of 5 x 1024 x 16 x 256 fp32, 11 GB)."""
    lse = torch.logsumexp(lse_parts, dim=0)
    weights = torch.exp(lse_parts - lse)  # NaN where every part is -inf (lse -inf too)
    weights = torch.where(torch.isfinite(weights), weights, 0.0).unsqueeze(-1)
    out = weights[0] * out_parts[0].float()
    for i in range(1, out_parts.shape[0]):
        out += weights[i] * out_parts[i].float()
    return out, lse


def _by_rows(x, varlen):
    """A per-row tensor in lse's layout ((batch, heads, seqlen), or (heads, total) for varlen)
    in out's ((batch, seqlen, heads), (total, heads))."""
    return x.transpose(0, 1) if varlen else x.transpose(1, 2)


def _sink_rows(sink, lse):
    """The sink logits (heads,) as fp32, broadcast against ``lse``'s layout."""
    sink = sink.float()
    return sink[:, None] if lse.dim() == 2 else sink[None, :, None]


def fold_sink(out, lse, sink):
    """(out, lse) of attention over the keys and a sink: one more softmax column per query
    head with logit ``sink[head]`` (natural-log units, not multiplied by softmax_scale) and
    no value, so lse' = logaddexp(lse, sink) and out' = out exp(lse - lse'). ``out``:
    (batch, seqlen_q, heads, dim) or varlen (total, heads, dim); ``lse``: (batch, heads,
    seqlen_q) or (heads, total), fp32. A row that sees no key keeps out 0 and gets lse' =
    sink (FA4's convention). Returns out' in out's dtype, lse' fp32."""
    lse_s = torch.logaddexp(lse, _sink_rows(sink, lse))
    factor = torch.exp(lse - lse_s)  # NaN only where lse and the sink are both -inf (out is 0)
    factor = torch.where(torch.isnan(factor), 0.0, factor)
    out_s = (out.float() * _by_rows(factor, lse.dim() == 2).unsqueeze(-1)).to(out.dtype)
    return out_s, lse_s


def sink_grad(dout, out_s, lse_s, sink):
    """d loss / d sink of attention with a sink, given the gradient ``dout`` of its output and
    its (out', lse') as ``fold_sink`` returned them: the sink column's probability
    exp(sink - lse') times its dS = -Delta, summed over every row of each head,
    dsink[h] = -sum exp(sink - lse') Delta, with Delta = rowsum(dout * out') taken from the
    returned output, as the kernels' dq / dk / dv take theirs. fp32, returned in sink's
    dtype."""
    varlen = lse_s.dim() == 2
    weight = torch.exp(_sink_rows(sink, lse_s) - lse_s)
    weight = torch.where(torch.isnan(weight), 0.0, weight)  # sink and lse' both -inf: no weight
    delta = torch.einsum("...d,...d->...", dout.float(), out_s.float())
    rows = tuple(range(delta.dim() - 1))  # every axis but the heads
    return -(_by_rows(weight, varlen) * delta).sum(dim=rows).to(sink.dtype)
