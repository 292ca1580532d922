"""Rotary position embedding for ``flash_attn_with_kvcache`` (FlashAttention's semantics), in
torch: the first ``rotary_dim = 2 * cos.shape[1]`` channels of each head are rotated, the
rest pass through; token i of sequence b sits at position ``offsets[b] + i``.

* ``interleaved=False`` (GPT-NeoX): channel pairs (j, j + rotary_dim / 2);
* ``interleaved=True`` (GPT-J): channel pairs (2j, 2j + 1).

Computed in fp32 and rounded to the input's dtype. Positions past the cos/sin tables leave
the token unrotated (cos 1, sin 0), as FlashAttention's rotary kernel does. Runs on device
tensors without a host sync, and under torch.compile.
"""
import torch


def apply_rotary(x, cos, sin, offsets, interleaved: bool, same_position: bool = False):
    """x (batch, seqlen, heads, dim) rotated at positions offsets[b] + i (int32/64 (batch,));
    ``same_position``: every token of sequence b at offsets[b] (FlashAttention's rotation of
    q when attention is neither causal nor local)."""
    batch, seqlen = x.shape[0], x.shape[1]
    rot = 2 * cos.shape[-1]
    steps = torch.zeros(seqlen, dtype=torch.long, device=x.device) if same_position else \
        torch.arange(seqlen, device=x.device)
    pos = offsets.to(torch.long)[:, None] + steps[None, :]                    # (batch, seqlen)
    inside = (pos >= 0) & (pos < cos.shape[0])
    idx = pos.clamp(0, max(cos.shape[0] - 1, 0))
    c = torch.where(inside[..., None], cos.float()[idx], 1.0)[:, :, None, :]  # (b, s, 1, rot/2)
    s = torch.where(inside[..., None], sin.float()[idx], 0.0)[:, :, None, :]
    xr = x[..., :rot].float()
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        out = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., :rot // 2], xr[..., rot // 2:]
        out = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    if batch * seqlen == 0:
        return x.clone()
    return torch.cat((out.to(x.dtype), x[..., rot:]), dim=-1)
