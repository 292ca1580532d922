"""Rotary position embedding for ``flash_attn_with_kvcache`` (FlashAttention's semantics), in
torch: the first ``rotary_dim = 2 * cos.shape[1]`` channels of each head are rotated, the
rest pass through; each token is rotated at its own position.

* ``interleaved=False`` (GPT-NeoX): channel pairs (j, j + rotary_dim / 2);
* ``interleaved=True`` (GPT-J): channel pairs (2j, 2j + 1).

Computed in fp32 and rounded to the input's dtype. Positions past the cos/sin tables leave
the token unrotated (cos 1, sin 0), never a fault; the host checks refuse such calls
(``validation.check_rotary_positions``). Runs on device tensors without a host sync, and
under torch.compile.
"""
import torch


def apply_rotary(x, cos, sin, positions, interleaved: bool):
    """x (..., heads, dim) rotated at ``positions`` (integers shaped ``x.shape[:-2]``)."""
    rot = 2 * cos.shape[-1]
    if x.numel() == 0 or rot == 0 or cos.shape[0] == 0:
        return x.clone()
    pos = positions.to(torch.long)
    inside = (pos >= 0) & (pos < cos.shape[0])
    idx = pos.clamp(0, cos.shape[0] - 1)
    c = torch.where(inside[..., None], cos.float()[idx], 1.0).unsqueeze(-2)  # (..., 1, rot/2)
    s = torch.where(inside[..., None], sin.float()[idx], 0.0).unsqueeze(-2)
    xr = x[..., :rot].float()
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        out = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., :rot // 2], xr[..., rot // 2:]
        out = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    return torch.cat((out.to(x.dtype), x[..., rot:]), dim=-1)


def token_positions(offsets, seqlen, same_position=False, cu_seqlens=None, total=None):
    """Each token's position: ``offsets[b] + i`` for token i of sequence b (``same_position``:
    ``offsets[b]`` for every token, FlashAttention's rotation of q when attention is neither
    causal nor local). Dense: (batch, seqlen); packed (``cu_seqlens``, ``total`` tokens):
    (total,)."""
    offsets = offsets.to(torch.long)
    if cu_seqlens is None:
        steps = torch.arange(seqlen, device=offsets.device)
        return offsets[:, None] + (0 if same_position else steps[None, :])
    t = torch.arange(total, device=offsets.device)
    starts = cu_seqlens.to(torch.long)
    # sequence of token t: (starts <= t) counted, minus 1 (starts[0] = 0). On the whole
    # tensor: torch 2.11's inductor fails to lower searchsorted over a slice (SliceView).
    b = (torch.searchsorted(starts, t, right=True) - 1).clamp(0, max(offsets.shape[0] - 1, 0))
    return offsets[b] + (0 if same_position else t - starts[b])
