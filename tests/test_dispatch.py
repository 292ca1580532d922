"""Which tier serves which case on sm90 (``dispatch.hopper_fwd_supports`` /
``hopper_bwd_supports`` with target="sm90", on CPU tensors: the decision reads only shapes,
strides and the optional tensors' presence), and how the Hopper kernels compute the padded
head dims 96 / 192 (``hopper.common.PADDED_HEAD_DIMS``: boxes of the tile's width over the
tensor's own head dim), forward and backward."""
import pytest
import torch

from triflash import dispatch

fwd = pytest.importorskip("triflash.kernels.hopper.fwd")
from tools import kernel_arg  # noqa: E402


def _qkv(d, s=64, varlen=False):
    shape = (s, 4, d) if varlen else (2, s, 4, d)
    return [torch.empty(shape, dtype=torch.bfloat16) for _ in range(3)]


@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
def test_hopper_head_dims(d):
    """The Hopper forward and backward serve every tuned head dim: dense batches, varlen
    batches, seqused (the forward also on a dense batch: the KV cache)."""
    q, k, v = _qkv(d)
    used = torch.zeros(2, dtype=torch.int32)
    cu = torch.tensor([0, 30, 64], dtype=torch.int32)
    qv, kv, vv = _qkv(d, varlen=True)
    for why in (dispatch.hopper_fwd_supports(q, k, v, None, None, None, target="sm90"),
                dispatch.hopper_bwd_supports(q, k, v, None, None, None, target="sm90"),
                dispatch.hopper_fwd_supports(q, k, v, None, None, used, target="sm90"),
                dispatch.hopper_fwd_supports(qv, kv, vv, cu, None, None, target="sm90"),
                dispatch.hopper_bwd_supports(qv, kv, vv, cu, None, None, target="sm90"),
                dispatch.hopper_bwd_supports(qv, kv, vv, cu, None, used, target="sm90")):
        assert why == "", why


@pytest.mark.parametrize("d", [8, 40, 72, 80, 136, 200])
def test_other_head_dims_take_the_portable_tier(d):
    q, k, v = _qkv(d)
    assert "head dims" in dispatch.hopper_fwd_supports(q, k, v, None, None, None, target="sm90")
    assert "head dims" in dispatch.hopper_bwd_supports(q, k, v, None, None, None, target="sm90")


@pytest.mark.parametrize("d,width", [(96, 128), (192, 256), (128, 128)])
def test_padded_head_dims_take_boxes_of_the_tile_width(d, width):
    from triflash.kernels import configs
    from triflash.kernels.hopper.common import descriptor
    from triflash.kernels.problem import AttnParams
    q, k, v = _qkv(d, s=300)
    out, lse = torch.empty_like(q), torch.empty(2, 4, 300)
    p = AttnParams(d ** -0.5, -1, 0, 0.0, 300, 300)
    _, args = fwd.kernel_args(q, k, v, out, lse, p, configs.SM90_HOPPER_FWD[width], num_sms=8)
    descs = args[:4]  # q, k, v, o
    assert [x.block_shape[-1] for x in descs] == [width] * 4
    assert [x.shape[-1] for x in descs] == [d] * 4  # the tensor's head dim: TMA fills / clips
    assert [x.base for x in descs] == [q, k, v, out]
    # a varlen batch's masked O stores stop there
    assert kernel_arg(fwd.hopper_fwd_kernel, args, "META").HEAD_DIM == d
    if d == width:  # an unpadded head dim: the same descriptors as before the padding
        assert descs[0].layout is descriptor(q, 64).layout
    cu = torch.tensor([0, 300, 600], dtype=torch.int32)
    _, args = fwd.kernel_args(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), out.flatten(0, 1),
                              torch.empty(4, 600), p, configs.SM90_HOPPER_FWD[width], cu, cu)
    assert [x.block_shape[-1] for x in args[:4]] == [width] * 4
    assert kernel_arg(fwd.hopper_fwd_kernel, args, "META").HEAD_DIM == d


@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
def test_forward_rescales_early_where_its_tile_says(d):
    """RESCALE_EARLY of the forward launch (``hopper.fwd.rescale_early``): at 64 / 128 for every
    launch (``rescale_early``), at 256 without a causal / window mask and without softcap
    (``rescale_early_unmasked``: measured faster there, slower under a mask)."""
    from triflash.kernels import configs
    from triflash.kernels.hopper.common import kernel_head_dim
    from triflash.kernels.problem import AttnParams
    cfg = configs.SM90_HOPPER_FWD[kernel_head_dim(d)]
    q, k, v = _qkv(d, s=300)
    out, lse = torch.empty_like(q), torch.empty(2, 4, 300)
    cases = {"plain": (-1, -1, 0.0), "causal": (-1, 0, 0.0), "window": (64, 32, 0.0), "softcap": (-1, -1, 30.0)}
    for name, (left, right, softcap) in cases.items():
        p = AttnParams(d ** -0.5, left, right, softcap, 300, 300)
        _, args = fwd.kernel_args(q, k, v, out, lse, p, cfg, num_sms=8)
        expected = kernel_head_dim(d) in (64, 128) or (kernel_head_dim(d) == 256 and name == "plain")
        assert kernel_arg(fwd.hopper_fwd_kernel, args, "META").RESCALE_EARLY == expected, name


@pytest.mark.parametrize("d,width", [(96, 128), (192, 256), (128, 128), (256, 256)])
def test_padded_head_dims_backward_boxes(d, width):
    """The backward's kernels at a padded head dim take boxes of the tile's width over the
    tensors' own head dim (loads zero-fill, TMA stores clip): the dK/dV kernel (bwd.py's, or
    bwd256.py's two 128-column halves, whose register stores mask the columns past
    ``HEAD_DIM``), its in-kernel dQ reduce-add (half-width boxes) and the dQ kernel."""
    import triflash.kernels.hopper.bwd as B
    from triflash.kernels import configs
    from triflash.kernels.hopper import bwd256, bwd_dq
    from triflash.kernels.hopper.common import Problem
    from triflash.kernels.problem import AttnParams
    q, k, v = _qkv(d, s=300)
    do, dq, dk, dv = (torch.empty_like(x) for x in (q, q, k, v))
    p = AttnParams(d ** -0.5, -1, 0, 0.0, 300, 300)
    pb = Problem(q, k, p)
    stat = delta = torch.empty(2, 4, 320)
    cfg = configs.SM90_HOPPER_BWD[width]
    if width == 256:
        _, args = bwd256.kernel_args(pb, q, k, v, do, dk, dv, stat, delta, p, cfg)
        assert [x.block_shape[-1] for x in args[:4]] == [128] * 4
        # HEAD_DIM: WG1 stores columns [128, d) only
        assert kernel_arg(bwd256.hopper_bwd256_kernel, args, "META").HEAD_DIM == d
    else:
        args = B._kernel_args(pb, q, k, v, do, dk, dv, stat, delta, torch.empty(q.shape), p, cfg, True)
        descs = args[:6]  # q, k, v, dout, dk, dv
        assert [x.block_shape[-1] for x in descs] == [width] * 6
        assert [x.shape[-1] for x in descs] == [d] * 6
        dq_accum = kernel_arg(B.hopper_bwd_kernel, args, "dq_desc")
        assert (dq_accum.block_shape[-1], dq_accum.shape[-1]) == (width // 2, d)
        # HEAD_DIM: a varlen batch's masked dK / dV stores stop there
        assert kernel_arg(B.hopper_bwd_kernel, args, "META").HEAD_DIM == d
    _, args = bwd_dq.kernel_args(pb, q, k, v, do, dq, stat, delta, p, cfg.dq_block_n)
    assert [x.block_shape[-1] for x in args[:5]] == [width] * 5  # q, k, v, dout, dq
    assert [x.shape[-1] for x in args[:5]] == [d] * 5
    # HEAD_DIM: a varlen batch's masked dQ stores stop there
    assert kernel_arg(bwd_dq.hopper_dq_kernel, args, "META").HEAD_DIM == d


def test_tail_pieces():
    """Pieces per key tile of the backward's last partial wave (hopper.bwd.tail_pieces)."""
    from triflash.kernels.hopper.bwd import tail_pieces
    assert tail_pieces(4096, 132) == 4  # 4 tiles left over: quarters, one round
    assert tail_pieces(144, 132) == 4
    assert tail_pieces(132 + 33, 132) == 4
    assert tail_pieces(132 + 34, 132) == 1
    assert tail_pieces(2048, 132) == 1  # 68 left over: measured slower split (3 pieces)
    assert tail_pieces(100, 132) == 1   # a single partial wave
    assert tail_pieces(660, 132) == 1   # whole waves
