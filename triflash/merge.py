"""The log-sum-exp merge of attention computed over disjoint sets of keys, shared by
``flash_attn_combine`` (FA3's merge of split results, interface.py) and the context-parallel
ring's merge of each step's block into its running result (context_parallel.py).

A part i is (out_i, lse_i): attention normalized over the part's own keys, and the
natural-log log-sum-exp of the part's scaled scores. Over the union of the keys,
lse = logsumexp_i lse_i and out = sum_i exp(lse_i - lse) out_i. A row with no key in a part
has out_i 0 and lse_i -inf (weight 0); a row with no key in any part gets out 0 and
lse -inf, without the NaN of exp(-inf - -inf).

Only torch: interface.py and context_parallel.py both import this module.
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
