"""Which tier serves which case on sm90 (``dispatch.hopper_fwd_supports`` /
``hopper_bwd_supports`` with target="sm90", on CPU tensors: the decision reads only shapes,
strides and the optional tensors' presence), and how the Hopper forward computes the padded
head dims 96 / 192 (``hopper.fwd.kernel_args``: boxes of the tile's width over the tensor's
own head dim). The padded head dims are not dispatched yet (``hopper.fwd.HEAD_DIMS``); the
``serve_padded`` fixture adds them, as dispatching them will."""
import pytest
import torch

from triflash import dispatch

fwd = pytest.importorskip("triflash.kernels.hopper.fwd")


def _qkv(d, s=64, varlen=False):
    shape = (s, 4, d) if varlen else (2, s, 4, d)
    return [torch.empty(shape, dtype=torch.bfloat16) for _ in range(3)]


@pytest.fixture
def serve_padded(monkeypatch):
    monkeypatch.setattr(fwd, "HEAD_DIMS", tuple(sorted(fwd.HEAD_DIMS + tuple(fwd.PADDED_HEAD_DIMS))))


@pytest.mark.parametrize("d", sorted(fwd.PADDED_HEAD_DIMS))
def test_padded_head_dims_not_dispatched_yet(d):
    q, k, v = _qkv(d)
    assert "head dims" in dispatch.hopper_fwd_supports(q, k, v, None, None, None, target="sm90")


@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
def test_hopper_forward_head_dims(d, serve_padded):
    q, k, v = _qkv(d)
    assert dispatch.hopper_fwd_supports(q, k, v, None, None, None, target="sm90") == ""
    used = torch.zeros(2, dtype=torch.int32)
    cu = torch.tensor([0, 30, 64], dtype=torch.int32)
    qv, kv, vv = _qkv(d, varlen=True)
    padded = d in fwd.PADDED_HEAD_DIMS
    for why in (dispatch.hopper_fwd_supports(q, k, v, None, None, used, target="sm90"),
                dispatch.hopper_fwd_supports(qv, kv, vv, cu, None, None, target="sm90")):
        assert (why != "") == padded and (not padded or "dense batches only" in why), why
    # the backward: the Hopper tier at 64 / 128 / 256 only
    assert (dispatch.hopper_bwd_supports(q, k, v, None, None, None, target="sm90") == "") == (not padded)


@pytest.mark.parametrize("d", [8, 40, 72, 80, 136, 200])
def test_other_head_dims_take_the_portable_forward(d):
    q, k, v = _qkv(d)
    assert "head dims" in dispatch.hopper_fwd_supports(q, k, v, None, None, None, target="sm90")


@pytest.mark.parametrize("d,width", [(96, 128), (192, 256), (128, 128)])
def test_padded_head_dims_take_boxes_of_the_tile_width(d, width):
    from triflash.kernels import configs
    from triflash.kernels.hopper.common import descriptor
    from triflash.kernels.portable import AttnParams
    q, k, v = _qkv(d, s=300)
    out, lse = torch.empty_like(q), torch.empty(2, 4, 300)
    p = AttnParams(d ** -0.5, -1, 0, 0.0, 300, 300)
    _, args = fwd.kernel_args(q, k, v, out, lse, p, configs.SM90_HOPPER_FWD[width], num_sms=8)
    descs = args[:4]  # q, k, v, o
    assert [x.block_shape[-1] for x in descs] == [width] * 4
    assert [x.shape[-1] for x in descs] == [d] * 4  # the tensor's head dim: TMA fills / clips
    assert [x.base for x in descs] == [q, k, v, out]
    if d == width:  # an unpadded head dim: the same descriptors as before the padding
        assert descs[0].layout is descriptor(q, 64).layout
    cu = torch.tensor([0, 300, 600], dtype=torch.int32)
    if d != width:
        with pytest.raises(AssertionError, match="dense batches only"):
            fwd.kernel_args(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), out.flatten(0, 1),
                            torch.empty(4, 600), p, configs.SM90_HOPPER_FWD[width], cu, cu)
