"""The Hopper (Gluon) tier on an sm90 GPU, pinned with ``force_backend("hopper")`` so that a
case the dispatch meant for it cannot silently fall back to the portable kernels: forward
and backward (head dim 64/128/256, and 96/192 computed as 128/256) against the fp32 reference under FA3's
tolerance, every mask, GQA/MQA, odd sequence lengths, packed QKV views, bitwise
reproducibility; and the cases it does not serve fall back under "auto" and are refused
under "hopper". Skipped without an sm90 GPU (CI has none: tests/test_hopper_compile.py
compiles these kernels there instead).
"""
import pytest
import torch

import triflash
from triflash import dispatch
from triflash.kernels import configs as _configs
from triflash.testing import assert_forward_matches, attention_ref, fa_tolerance, max_err

from test_flash_attn import check_attention

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
    reason="needs an sm90 (Hopper) GPU")

MASKS = {
    "none": (False, (-1, -1), 0.0),
    "causal": (True, (-1, -1), 0.0),
    "window": (False, (93, 17), 0.0),
    "causal-window-softcap": (True, (200, -1), 20.0),
}
# A packed varlen batch (lengths of q, of k): sequences of length 0 and 1, blocks past a
# sequence's end, tiles straddling two sequences; and seqused for it (test_hopper_varlen)
VARLEN_LENS = ([0, 1, 700, 129, 1000, 64, 333], [5, 1, 900, 63, 1000, 0, 129])
VARLEN_USED = ([0, 1, 650, 129, 1, 64, 200], [5, 0, 900, 10, 999, 0, 129])
# (seqlen_q, seqlen_k, heads, kv heads): odd lengths, sq != sk both ways, MHA / GQA / MQA
SHAPES = [(1, 1, 4, 4), (113, 203, 8, 2), (1000, 1000, 6, 1), (2048, 1537, 4, 4), (777, 2048, 8, 4)]


# Head dim 256 (its own dK/dV kernel, hopper/bwd256.py): bf16 over the whole grid, fp16 on
# the plain and the fullest mask (the dtype only changes the wgmma instruction).
GRID = [(dt, d, m) for dt in ("bf16", "fp16") for d in (64, 128, 256) for m in MASKS
        if not (dt == "fp16" and d == 256 and m in ("causal", "window"))]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype,d,mask", GRID, ids=lambda x: str(x))
def test_hopper_fwd_bwd(dtype, d, mask, shape):
    dtype = DTYPES[dtype]
    sq, sk, h, hk = shape
    causal, window, softcap = MASKS[mask]
    with triflash.force_backend("hopper"):
        check_attention(2, sq, sk, h, hk, d, dtype, causal, window, softcap)


@pytest.mark.parametrize("shape", SHAPES[1:4], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("d,mask", [(d, m) for d in (64, 128) for m in MASKS], ids=lambda x: str(x))
def test_hopper_bwd_deterministic_path(d, mask, shape):
    """At 64 / 128 deterministic=True takes the other dQ path (the separate dQ kernel instead
    of the in-kernel TMA reduce-add, hopper/bwd.py): held to the same tolerance."""
    sq, sk, h, hk = shape
    causal, window, softcap = MASKS[mask]
    with triflash.force_backend("hopper"):
        check_attention(2, sq, sk, h, hk, d, torch.bfloat16, causal, window, softcap, deterministic=True)


def _check_hopper_forward(q, k, v, mask):
    """The Hopper forward's O and lse under ``mask`` against the fp32 reference (FA3's rule)."""
    causal, window, softcap = MASKS[mask]
    with triflash.force_backend("hopper"):
        out, lse = triflash.flash_attn_func(q, k, v, causal=causal, window_size=window,
                                            softcap=softcap, return_attn_probs=True)
    kw = dict(causal=causal, window_size=window, softcap=softcap)
    ref, lse_ref = attention_ref(q, k, v, **kw)
    pt, _ = attention_ref(q, k, v, upcast=False, **kw)
    assert_forward_matches(out, lse, ref, lse_ref, pt, softcap)


@pytest.mark.parametrize("mask", list(MASKS))
def test_hopper_fwd_256(mask):
    q, k, v = (torch.randn(2, s, h, 256, device="cuda", dtype=torch.bfloat16)
               for s, h in ((1031, 8), (2047, 2), (2047, 2)))
    _check_hopper_forward(q, k, v, mask)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("d", [96, 192])
@pytest.mark.parametrize("mask", list(MASKS))
def test_hopper_fwd_padded_head_dims(mask, d, shape):
    """Head dims 96 and 192: the forward computed as 128 / 256 (TMA boxes of the tile's width,
    zero-filled past the head dim on load, clipped on store), O and lse against the fp32
    reference. q / k / v are slices of wider rows, so a load that did not stop at the head
    dim would read the next columns' random values; out is poisoned (NaN) and contiguous,
    so a store that did not stop would overwrite the next head's first columns."""
    sq, sk, h, hk = shape
    g = torch.Generator(device="cuda").manual_seed(d + sq)

    def rnd(s, heads):  # a (2, s, heads, d) view into (2, s, heads, d + 32): strided rows
        x = torch.randn(2, s, heads, d + 32, device="cuda", dtype=torch.bfloat16, generator=g)
        return x[..., :d]
    _check_hopper_forward(rnd(sq, h), rnd(sk, hk), rnd(sk, hk), mask)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("d,deterministic", [(96, False), (96, True), (192, False)])
def test_hopper_bwd_padded_head_dims(mask, d, deterministic, shape):
    """Head dims 96 and 192, forward and backward on the Hopper tier (dK/dV by bwd.py's kernel
    at 96, bwd256.py's at 192; dQ in the dK/dV kernel at 96 unless deterministic, else the dQ
    kernel, which 192 always takes) against the fp32 reference."""
    sq, sk, h, hk = shape
    causal, window, softcap = MASKS[mask]
    with triflash.force_backend("hopper"):
        check_attention(2, sq, sk, h, hk, d, torch.bfloat16, causal, window, softcap,
                        deterministic=deterministic, seed=d + sq)


@pytest.mark.parametrize("d", [96, 192])
def test_hopper_bwd_padded_head_dims_strided(d):
    """q / k / v / dout as views into wider rows (NaN past the head dim) and dq / dk / dv
    written into views of wider, NaN-poisoned rows (flash_attn_qkvpacked_func's dqkv): a load
    past the head dim would bring NaN in, a store past it would leave the poison's
    neighbours changed."""
    g = torch.Generator(device="cuda").manual_seed(d)
    qkv = torch.full((2, 700, 3, 4, d + 32), float("nan"), device="cuda", dtype=torch.bfloat16)
    qkv[..., :d] = torch.randn(2, 700, 3, 4, d, device="cuda", dtype=torch.bfloat16, generator=g)
    qkv_view = qkv[..., :d].detach().requires_grad_()
    out, dout, dqkv, dref, dpt = _check_qkvpacked_causal(qkv_view)
    assert torch.isfinite(out).all() and torch.isfinite(dqkv).all()
    q, k, v = qkv_view.unbind(2)
    # the backward's own kernels writing into strided views of poisoned wider rows
    from triflash.kernels.problem import AttnParams
    grads = torch.full((2, 700, 3, 4, d + 32), float("nan"), device="cuda", dtype=torch.bfloat16)
    dq, dk, dv = grads[..., :d].unbind(2)
    lse = triflash.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)[1]
    p = AttnParams(d ** -0.5, -1, 0, 0.0, 700, 700)
    with triflash.force_backend("hopper"):
        dispatch.run_bwd(dout, q.detach(), k.detach(), v.detach(), out.detach(), lse, None, None, None, None,
                         p, False, dq=dq, dk=dk, dv=dv)
    assert torch.isnan(grads[..., d:]).all(), "a store ran past the head dim"
    got = torch.stack((dq, dk, dv), 2)
    assert max_err(got, dref) <= fa_tolerance(dref, dpt)


def _two_sequences(d, shape, seed):
    """(q, k, v, cu_q, cu_k, generator): fresh bf16 inputs of batch 2, ``shape`` = (sq, sk,
    heads, kv heads), from a CUDA generator seeded with ``seed`` (returned for more draws),
    and the cu_seqlens that pack the batch's two sequences as a varlen batch."""
    sq, sk, h, hk = shape
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(2, n, heads, d, device="cuda", dtype=torch.bfloat16, generator=g)
               for n, heads in ((sq, h), (sk, hk), (sk, hk)))
    cu_q = torch.tensor([0, sq, 2 * sq], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, sk, 2 * sk], dtype=torch.int32, device="cuda")
    return q, k, v, cu_q, cu_k, g


def _fwd_dense_and_varlen(d, mask, shape, seed):
    """(q, k, v, run): fresh bf16 inputs (``_two_sequences``) and run() -> (out, lse, out
    varlen, lse varlen) of the Hopper forward under ``mask``, the batch dense and as a varlen
    batch of its two sequences (varlen lse is (heads, 2 * sq))."""
    sq, sk = shape[:2]
    causal, window, softcap = MASKS[mask]
    q, k, v, cu_q, cu_k, _ = _two_sequences(d, shape, seed)
    kw = dict(causal=causal, window_size=window, softcap=softcap, return_attn_probs=True)

    def run():
        with triflash.force_backend("hopper"):
            dense = triflash.flash_attn_func(q, k, v, **kw)
            varlen = triflash.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1),
                                                     cu_q, cu_k, sq, sk, **kw)
            return (*dense, *varlen)
    return q, k, v, run


# Forward options that move operands, not arithmetic (HopperFwdConfig), each against the
# dispatched tile: ``q_regs`` (Q in registers for every S wgmma; dispatched at 128, here
# off), and flipped from the dispatched value: ``tree_max`` (each row's max
# of S by a tree: max is exact, so the same maxima) and, at 256, ``persistent_unmasked``
# (unmasked tiles walked by one persistent CTA per SM, one Q slot).
FWD_SAME_BITS = [(96, dict(q_regs=False)), (128, dict(q_regs=False))] + [
    (d, {o: _configs.flipped(_configs.SM90_HOPPER_FWD[d], o)}) for o in ("tree_max",) for d in (64, 128, 256)] + [
    (256, {"persistent_unmasked": _configs.flipped(_configs.SM90_HOPPER_FWD[256], "persistent_unmasked")})]


@pytest.mark.parametrize("shape", [(113, 203, 8, 2), (777, 2048, 8, 4), (1, 1, 4, 4), (1000, 1000, 6, 1)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("d,option", FWD_SAME_BITS, ids=lambda x: str(x))
@pytest.mark.option
def test_hopper_fwd_operand_options_same_bits(d, option, mask, shape, monkeypatch):
    """Where Q is read from (registers or shared memory), in which order a row's max is taken
    and how CTAs walk the tiles change neither the products nor the order of the sums: out and lse keep the dispatched tile's
    bits. Dense
    tiles of every walk (one CTA per tile, persistent, scheduled under masks) and a varlen
    batch."""
    import dataclasses
    from triflash.kernels import configs
    from triflash.kernels.hopper.common import kernel_head_dim
    w = kernel_head_dim(d)
    _, _, _, run = _fwd_dense_and_varlen(d, mask, shape, d + shape[0])
    dispatched = run()
    monkeypatch.setitem(configs.SM90_HOPPER_FWD, w, dataclasses.replace(configs.SM90_HOPPER_FWD[w], **option))
    for name, a, b in zip(("out", "lse", "out varlen", "lse varlen"), dispatched, run()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("shape", [(777, 2048, 8, 4), (2048, 1537, 4, 4), (1000, 1000, 16, 4)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.option
def test_hopper_fwd_own_blocks_same_bits(mask, shape, monkeypatch):
    """``own_blocks`` (each consumer warpgroup computes only the key blocks its own 64 rows
    see, masked only where they need it; dispatched at head dim 64) leaves
    out blocks whose every probability is exactly 0 and masks that keep every score: out
    and lse keep the bits of the tile-wide range. With softcap an unmasked block's
    ``softcap * tanh - max`` contracts into one FMA where a masked one rounds twice, so
    there the two agree to an ulp of the output instead. The shapes skip leading blocks
    (causal diagonal), trailing ones (left window), whole consumers (sq > sk bottom-right:
    rows that see no key; rows past the sequence), and walk several tiles per persistent
    CTA (1000 x 16 heads); dense and varlen."""
    import dataclasses
    from triflash.kernels import configs
    softcap = MASKS[mask][2]
    _, _, _, run = _fwd_dense_and_varlen(64, mask, shape, shape[0])
    cfg = configs.SM90_HOPPER_FWD[64]
    assert cfg.own_blocks
    dispatched = run()
    monkeypatch.setitem(configs.SM90_HOPPER_FWD, 64, dataclasses.replace(cfg, own_blocks=False))
    for name, a, b in zip(("out", "lse", "out varlen", "lse varlen"), dispatched, run()):
        if softcap:
            tol = dict(rtol=2 ** -7, atol=2 ** -9) if "out" in name else dict(rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(a, b, **tol, msg=name)
        else:
            assert torch.equal(a, b), name


# Forward options (HopperFwdConfig), (name, value): ``rescale_early`` (O rescaled by the
# previous block's factor before P V is issued; dispatched at 64 / 128, at 256 without a
# mask: here at every tile and mask), and ``split_keys`` 2.
FWD_OPTIONS = [(("rescale_early", True), d) for d in (64, 128, 192, 256)] + [
    (("split_keys", 2), d) for d in (64, 128, 192, 256)]
# (split_keys 2: without a mask, tiles of the last round cut into pieces of key blocks and
# merged, hopper.split_combine, at every shape here but 1 x 1 (one key block per tile))


@pytest.mark.parametrize("shape", [(113, 203, 8, 2), (777, 2048, 8, 4), (1000, 1000, 16, 4), (1, 1, 4, 4)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("option,d", FWD_OPTIONS, ids=lambda x: str(x))
@pytest.mark.option
def test_hopper_fwd_option(option, d, mask, shape, monkeypatch):
    """A forward option (``FWD_OPTIONS``) on, against the fp32 reference: dense (one CTA per
    tile and persistent walks, the 64 tile's skipped blocks) and varlen."""
    import dataclasses
    from triflash.kernels import configs
    from triflash.kernels.hopper.common import kernel_head_dim
    w = kernel_head_dim(d)
    name, value = option
    monkeypatch.setitem(configs.SM90_HOPPER_FWD, w, dataclasses.replace(configs.SM90_HOPPER_FWD[w], **{name: value}))
    sq, sk, h, hk = shape
    causal, window, softcap = MASKS[mask]
    q, k, v, run = _fwd_dense_and_varlen(d, mask, shape, d + sq)
    out, lse, out_varlen, lse_varlen = run()
    kw = dict(causal=causal, window_size=window, softcap=softcap)
    ref, lse_ref = attention_ref(q, k, v, **kw)
    pt, _ = attention_ref(q, k, v, upcast=False, **kw)
    assert_forward_matches(out, lse, ref, lse_ref, pt, softcap)
    assert_forward_matches(out_varlen.view(2, sq, h, d), lse_varlen.view(h, 2, sq).transpose(0, 1), ref, lse_ref,
                           pt, softcap)


@pytest.mark.parametrize("b,sq,sk,h,hk", [(1, 500, 8192, 8, 2), (1, 8192, 3000, 3, 1)], ids=lambda x: str(x))
@pytest.mark.parametrize("d", [96, 128, 192, 256])
def test_hopper_fwd_split_keys_dispatched(d, b, sq, sk, h, hk):
    """The dispatched tiles cut these launches' last round into pieces (``fwd.split_keys``:
    few tiles over long keys; a part-empty last round of many): the forward and its lse
    against the fp32 reference."""
    from triflash.kernels import configs, problem
    from triflash.kernels.hopper import fwd as H
    from triflash.kernels.hopper.common import kernel_head_dim
    g = torch.Generator(device="cuda").manual_seed(d + sq)
    q, k, v = (torch.randn(b, n, x, d, device="cuda", dtype=torch.bfloat16, generator=g)
               for n, x in ((sq, h), (sk, hk), (sk, hk)))
    params = problem.AttnParams(d ** -0.5, -1, -1, 0.0, sq, sk)
    assert H.split_keys(q, k, params, configs.SM90_HOPPER_FWD[kernel_head_dim(d)]) is not None
    with triflash.force_backend("hopper"):
        out, lse = triflash.flash_attn_func(q, k, v, return_attn_probs=True)
    ref, lse_ref = attention_ref(q, k, v)
    pt, _ = attention_ref(q, k, v, upcast=False)
    assert_forward_matches(out, lse, ref, lse_ref, pt, 0.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b,sq,sk,h,hk,softcap", [(2, 777, 1501, 8, 2, 30.0), (1, 2000, 333, 67, 67, 0.0),
                                                   (3, 129, 4096, 12, 1, 0.0)], ids=lambda x: str(x))
@pytest.mark.parametrize("d", [64, 96, 128, 256])
@pytest.mark.option
def test_hopper_fwd_split_keys(d, b, sq, sk, h, hk, softcap, dtype, monkeypatch):
    """``split_keys`` = 2 (the last round's tiles cut into pieces of key blocks, merged by
    ``hopper.split_combine``) without a mask, softcap too, fp16 too, sq != sk, GQA / MQA,
    more tiles than CTAs (whole tiles, then pieces), against the fp32 reference; the
    allocator's memory filled with NaN first (every row must be written, by the kernel or
    the merge)."""
    import dataclasses
    from triflash.kernels import configs
    from triflash.kernels.hopper.common import kernel_head_dim
    w = kernel_head_dim(d)
    cfg = dataclasses.replace(configs.SM90_HOPPER_FWD[w], split_keys=2)
    monkeypatch.setitem(configs.SM90_HOPPER_FWD, w, cfg)
    g = torch.Generator(device="cuda").manual_seed(d * sq + sk)
    q, k, v = (torch.randn(b, n, x, d, device="cuda", dtype=dtype, generator=g)
               for n, x in ((sq, h), (sk, hk), (sk, hk)))
    torch.full((4 * b * sq * h * d,), float("nan"), device="cuda", dtype=dtype)  # (freed: out's memory, likely)
    with triflash.force_backend("hopper"):
        out, lse = triflash.flash_attn_func(q, k, v, softcap=softcap, return_attn_probs=True)
    ref, lse_ref = attention_ref(q, k, v, softcap=softcap)
    pt, _ = attention_ref(q, k, v, upcast=False, softcap=softcap)
    assert_forward_matches(out, lse, ref, lse_ref, pt, softcap)


@pytest.mark.parametrize("sk", [1000, 4096])
@pytest.mark.parametrize("mask", ["none", "causal", "causal-window-softcap"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("when", ["late", "early"])
@pytest.mark.option
def test_hopper_fwd_rescale_threshold_rising_max(when, d, mask, sk, monkeypatch):
    """``hopper.fwd.RESCALE_THRESHOLD`` (a row's stale max kept below a rise of 8, O's
    rescale skipped per warp), with O rescaled after P V (``rescale_early`` off, dispatched at
    256 under masks) or before P V is issued, at every tile: scores whose row maxima rise
    by far more than the threshold from block to block (queries scaled up, every key's norm
    drawn between 0.05 and 4), so rows both keep a stale max and replace it, in blocks
    visited in every order; against the fp32 reference."""
    import dataclasses
    from triflash.kernels import configs
    causal, window, softcap = MASKS[mask]
    g = torch.Generator(device="cuda").manual_seed(d + sk)
    q = 3 * torch.randn(2, 1000, 4, d, device="cuda", dtype=torch.bfloat16, generator=g)
    norms = 0.05 + 3.95 * torch.rand(2, sk, 1, 1, device="cuda", generator=g)
    k = (torch.randn(2, sk, 2, d, device="cuda", generator=g) * norms).to(torch.bfloat16)
    v = torch.randn(2, sk, 2, d, device="cuda", dtype=torch.bfloat16, generator=g)
    monkeypatch.setitem(configs.SM90_HOPPER_FWD, d, dataclasses.replace(
        configs.SM90_HOPPER_FWD[d], rescale_early=when == "early", rescale_early_unmasked=False))
    kw = dict(causal=causal, window_size=window, softcap=softcap)
    with triflash.force_backend("hopper"):
        out, lse, *_ = triflash.flash_attn_func(q, k, v, return_attn_probs=True, **kw)
    ref, lse_ref = attention_ref(q, k, v, **kw)
    pt, _ = attention_ref(q, k, v, upcast=False, **kw)
    assert_forward_matches(out, lse, ref, lse_ref, pt, softcap)


@pytest.mark.parametrize("shape", [(113, 203, 8, 2), (777, 2048, 8, 4), (1000, 1000, 6, 1), (1, 1, 4, 4)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("d", [64, 128])
def test_hopper_bwd_dq_one_block_later(d, mask, shape):
    """The in-kernel dQ (head dims 64 / 128, deterministic=False) adds each query block's dQ
    one block later (four dS^T slots, a zero block first, the last block's after the loop),
    against the fp32 reference: GQA / MQA groups (the block before a head's first is the
    last of the head before; the turns run on across a group's heads), key tiles no query
    block visits (777 x 2048, left window), an odd count of blocks, a single block."""
    sq, sk, h, hk = shape
    causal, window, softcap = MASKS[mask]
    with triflash.force_backend("hopper"):
        check_attention(2, sq, sk, h, hk, d, torch.bfloat16, causal, window, softcap)


@pytest.mark.parametrize("shape", [(113, 203, 8, 2), (777, 2048, 8, 4), (1000, 1000, 6, 1), (1, 1, 4, 4)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("d", [256, 192])
@pytest.mark.option
def test_hopper_bwd_dq_split_v(d, mask, shape, monkeypatch):
    """``dq_split_v`` flipped from its dispatched value (the dQ kernel of a dense batch with
    64-key K / V tiles, V in one slot of its own freed before K's, or 32-key tiles sharing
    the slots), against the fp32 reference: GQA / MQA groups, key blocks a query block does
    not visit, odd lengths past the tile, a single key."""
    import dataclasses
    from triflash.kernels import configs
    cfg = configs.SM90_HOPPER_BWD[256]
    monkeypatch.setitem(configs.SM90_HOPPER_BWD, 256,
                        dataclasses.replace(cfg, dq_split_v=0 if cfg.dq_split_v else 64))
    sq, sk, h, hk = shape
    causal, window, softcap = MASKS[mask]
    with triflash.force_backend("hopper"):
        check_attention(2, sq, sk, h, hk, d, torch.bfloat16, causal, window, softcap)


@pytest.mark.parametrize("shape", [(113, 203, 8, 2), (777, 2048, 8, 4), (1, 1, 4, 4)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("d,reg_a", [(64, 1), (64, 2), (192, 1), (256, 1)])  # (256 with 2 spills: measured, dropped)
@pytest.mark.option
def test_hopper_bwd_reg_a_same_bits(d, reg_a, mask, shape, monkeypatch):
    """The dK/dV kernels' ``reg_a`` (K / V tiles as the S^T / dP^T wgmmas' A operand from
    registers instead of shared memory; dispatched at 256 with 1, at 64 with 2) changes
    where the operand is read, not the products: the gradients' bits equal the tile's
    without it (deterministic=True: the dQ kernel, no atomics). 777 x 2048 with a left
    window of 200 leaves key tiles that no query block visits; with softcap the option is
    not applied."""
    import dataclasses
    from triflash.kernels import configs
    sq, sk, h, hk = shape
    causal, window, softcap = MASKS[mask]
    g = torch.Generator(device="cuda").manual_seed(d + sk + reg_a)
    q = torch.randn(2, sq, h, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    k, v = (torch.randn(2, sk, hk, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
            for _ in range(2))
    dout = torch.randn(2, sq, h, d, device="cuda", dtype=torch.bfloat16, generator=g)

    def run():
        with triflash.force_backend("hopper"):
            out = triflash.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap,
                                           deterministic=True)
            return torch.autograd.grad(out, (q, k, v), dout)
    tile = 256 if d == 192 else d
    cfg = configs.SM90_HOPPER_BWD[tile]
    monkeypatch.setitem(configs.SM90_HOPPER_BWD, tile, dataclasses.replace(cfg, reg_a=0))
    plain = run()
    monkeypatch.setitem(configs.SM90_HOPPER_BWD, tile, dataclasses.replace(cfg, reg_a=reg_a))
    for name, a, b in zip(("dq", "dk", "dv"), plain, run()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("shape", [(113, 203, 8, 2), (777, 2048, 8, 4), (1, 1, 4, 4)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("d", [96, 128])  # the 128 tile's (dispatched there, not at 64)
@pytest.mark.option
def test_hopper_bwd_fresh_tiles_same_bits(d, mask, shape, monkeypatch):
    """``fresh_tiles`` (the K / V tiles' wgmma descriptors built every step instead of held in
    registers) moves where addresses are computed, not the products: the gradients' bits
    equal those without it (deterministic=True: no atomics), with and without softcap."""
    import dataclasses
    from triflash.kernels import configs
    sq, sk, h, hk = shape
    causal, window, softcap = MASKS[mask]
    g = torch.Generator(device="cuda").manual_seed(d + sk)
    q = torch.randn(2, sq, h, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    k, v = (torch.randn(2, sk, hk, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
            for _ in range(2))
    dout = torch.randn(2, sq, h, d, device="cuda", dtype=torch.bfloat16, generator=g)

    def run(fresh):
        tile = 128 if d == 96 else d
        monkeypatch.setitem(configs.SM90_HOPPER_BWD, tile,
                            dataclasses.replace(configs.SM90_HOPPER_BWD[tile], fresh_tiles=fresh))
        with triflash.force_backend("hopper"):
            out = triflash.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap,
                                           deterministic=True)
            return torch.autograd.grad(out, (q, k, v), dout)
    for name, a, b in zip(("dq", "dk", "dv"), run(False), run(True)):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("d,pieces", [(64, 2), (96, 3), (128, 3), (128, 4)])
@pytest.mark.parametrize("softcap", [0.0, 20.0])
@pytest.mark.option
def test_hopper_bwd_tail_split(d, pieces, softcap, shape, monkeypatch):
    """The last-wave split forced (``hopper.bwd.tail_pieces`` answering ``pieces``): every
    key tile of the dK/dV kernel runs as ``pieces`` CTAs over
    parts of its query blocks (fewer blocks than pieces leave pieces empty: 1 x 1), each
    adding fp32 dK / dV into the split tiles' buffer that ``_split_fixup_kernel`` writes out
    (rows past seqlen_k, columns past a padded head dim not written); held to FA3's
    tolerance against the fp32 reference. No mask: the split serves only unmasked tiles."""
    from triflash.kernels.hopper import bwd as hbwd
    sq, sk, h, hk = shape
    monkeypatch.setattr(hbwd, "tail_pieces", lambda n_tiles, n_sm: pieces)
    with triflash.force_backend("hopper"):
        check_attention(2, sq, sk, h, hk, d, torch.bfloat16, False, (-1, -1), softcap)


@pytest.mark.parametrize("d", [64, 128])
def test_hopper_bwd_tail_split_auto(d):
    """The dispatched tiles split the last wave where ``tail_pieces`` says so: a shape with a
    few key tiles more than the GPU has SMs, (GQA, seqlen not a multiple of the tile) against
    the reference; the same shape under a causal mask does not split and is checked too."""
    from triflash.kernels.hopper import bwd as hbwd
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    hk = 8
    tiles = sms // hk + 1  # key tiles per KV head: a few more tiles than SMs in all
    sk = tiles * 128 - 37
    assert hbwd.tail_pieces(tiles * hk, sms) > 1
    with triflash.force_backend("hopper"):
        check_attention(1, 700, sk, 2 * hk, hk, d, torch.bfloat16, False, (-1, -1), 0.0)
        check_attention(1, 700, sk, 2 * hk, hk, d, torch.bfloat16, True, (-1, -1), 0.0)


@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
def test_hopper_bwd_reproducible(d):
    """deterministic=True is bitwise reproducible at every head dim; so is deterministic=False
    where the tile adds dQ without atomics (256). (At 64 / 128 deterministic=False adds dQ
    by TMA reduce-add, whose order of adds may vary: its accuracy is tested like every
    other gradient.)"""
    from triflash.kernels import configs
    from triflash.kernels.hopper.common import kernel_head_dim
    for det in (True,) if configs.SM90_HOPPER_BWD[kernel_head_dim(d)].atomic_dq else (False, True):
        with triflash.force_backend("hopper"):
            g1 = check_attention(2, 1500, 1500, 8, 2, d, torch.bfloat16, True, (-1, -1), 0.0,
                                 deterministic=det, seed=5)
            g2 = check_attention(2, 1500, 1500, 8, 2, d, torch.bfloat16, True, (-1, -1), 0.0,
                                 deterministic=det, seed=5)
        for a, b in zip(g1, g2):
            assert torch.equal(a, b)


def _check_qkvpacked_causal(qkv):
    """Causal ``flash_attn_qkvpacked_func`` on the Hopper tier and its dqkv (written by the
    backward into views of one buffer) against the fp32 reference under FA3's rule; returns
    (out, dout, dqkv, dqkv_ref, dqkv of the same computation in the input dtype)."""
    with triflash.force_backend("hopper"):
        out = triflash.flash_attn_qkvpacked_func(qkv, causal=True)
        dout = torch.randn_like(out)
        (dqkv,) = torch.autograd.grad(out, qkv, dout)
    q, k, v = qkv.unbind(2)
    ref, _ = attention_ref(q, k, v, causal=True)
    pt, _ = attention_ref(q, k, v, causal=True, upcast=False)
    (dref,) = torch.autograd.grad(ref, qkv, dout)
    (dpt,) = torch.autograd.grad(pt, qkv, dout)
    assert max_err(dqkv, dref) <= fa_tolerance(dref, dpt)
    return out, dout, dqkv, dref, dpt


def test_hopper_qkvpacked_writes_views():
    g = torch.Generator().manual_seed(9)
    qkv = torch.randn(2, 300, 3, 4, 128, generator=g).to("cuda", torch.bfloat16).requires_grad_()
    _check_qkvpacked_causal(qkv)


def test_unserved_cases_fall_back_or_are_refused():
    q = torch.randn(1, 64, 2, 80, device="cuda", dtype=torch.float16)
    assert dispatch.hopper_bwd_supports(q, q, q, None, None, None) != ""
    assert dispatch.hopper_fwd_supports(q, q, q, None, None, None) != ""
    triflash.flash_attn_func(q, q, q)  # auto: the portable tier serves it
    with triflash.force_backend("hopper"), pytest.raises(NotImplementedError, match="head dims"):
        triflash.flash_attn_func(q, q, q)
    # head dim 96: the Hopper tier (computed as 128), dense and varlen
    q96 = torch.randn(64, 2, 96, device="cuda", dtype=torch.float16)
    cu = torch.tensor([0, 30, 64], device="cuda", dtype=torch.int32)
    assert dispatch.hopper_fwd_supports(q96[None], q96[None], q96[None], None, None, None) == ""
    assert dispatch.hopper_bwd_supports(q96[None], q96[None], q96[None], None, None, None) == ""
    assert dispatch.hopper_fwd_supports(q96, q96, q96, cu, None, None) == ""
    assert dispatch.hopper_bwd_supports(q96, q96, q96, cu, None, None) == ""
    q64 = torch.randn(1, 64, 2, 64, device="cuda", dtype=torch.float16)
    assert dispatch.hopper_bwd_supports(q64, q64, q64, None, None, None) == ""


@pytest.mark.parametrize("seqused", [False, True])
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
def test_hopper_varlen(d, mask, seqused):
    """The Gluon forward and backward on packed varlen batches: sequences of length 0 and 1,
    query and key blocks past a sequence's end, tiles straddling two sequences, GQA, seqused
    and padding rows; per sequence against the fp32 reference, gradients included. At 96 /
    192 (computed as 128 / 256) the masked stores of O, dQ, dK and dV stop at the head dim:
    a store past it would land in the next head's first columns."""
    from test_varlen import check_varlen
    causal, window, softcap = MASKS[mask]
    lens_q, lens_k = VARLEN_LENS
    used = VARLEN_USED if seqused else None
    with triflash.force_backend("hopper"):
        check_varlen(lens_q, lens_k, 8, 2, d, torch.bfloat16, causal, window, softcap,
                     seqused=used, seed=d, pad=9, deterministic=seqused)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("mask", ["none", "causal", "causal-window-softcap"])
def test_hopper_launch_plans_run(d, mask, monkeypatch):
    """Repeat calls of one signature launch through their plans (``hopper.common
    .planned_launch``, past Triton's launcher wrapper where it can: ``LaunchPlan.direct``),
    which the rest of this suite checks only as argument lists (TRIFLASH_VERIFY_LAUNCHES=1
    builds every list). Here the plans run: three calls with fresh inputs (the descriptors'
    maps refilled), forward and backward each against the fp32 reference, and the forward's
    plan took the direct path."""
    from triflash.kernels.hopper import common as hc
    monkeypatch.setattr(hc, "VERIFY_LAUNCHES", False)
    monkeypatch.setattr(hc, "_PLANS", {})
    causal, window, softcap = MASKS[mask]
    for seed in range(3):
        with triflash.force_backend("hopper"):
            check_attention(2, 1000, 1000, 8, 2, d, torch.bfloat16, causal, window, softcap, seed=seed)
    # past Triton's launcher wrapper on triton 3.6 (hopper.common._direct_launcher reads its
    # closure); later releases build their launcher differently: plans call compiled.run
    from triflash.versions import triton_release
    assert any(plan.direct is not None for plan in hc._PLANS.values()) == (triton_release() == "3.6")
