"""Bad input raises an exception naming the argument, the value and what is allowed."""
import pytest
import torch

import triflash

from conftest import DEVICE


def qkv(b=1, sq=8, sk=8, h=2, hk=2, d=16, dv=None, dtype=torch.float16, device=DEVICE):
    dv = d if dv is None else dv
    return (torch.randn(b, sq, h, d, device=device).to(dtype), torch.randn(b, sk, hk, d, device=device).to(dtype),
            torch.randn(b, sk, hk, dv, device=device).to(dtype))


def expect(exc, *fragments):
    return pytest.raises(exc, match=".*".join(fragments))


def test_float64_rejected():
    q, k, v = qkv()
    with expect(TypeError, "q.dtype", "float64", "float16 or torch.bfloat16"):
        triflash.flash_attn_func(q.double(), k, v)


def test_mixed_dtypes_rejected():
    q, k, v = qkv()
    with expect(TypeError, "dtypes", "share one dtype"):
        triflash.flash_attn_func(q, k.bfloat16(), v)


def test_wrong_rank():
    q, k, v = qkv()
    with expect(ValueError, r"q.dim\(\)=3", "expected 4 dims"):
        triflash.flash_attn_func(q[0], k, v)


@pytest.mark.parametrize("d", [264, 0])
def test_bad_headdim(d):
    q, k, v = qkv(d=max(d, 1) if d else 16)
    if d == 0:
        q, k, v = q[..., :0], k[..., :0], v[..., :0]
    with expect(ValueError, "head dim", str(d), "expected 1 to 256"):
        triflash.flash_attn_func(q, k, v)


def test_mismatched_shapes():
    q, k, v = qkv()
    with expect(ValueError, "k head dim", "must equal"):
        triflash.flash_attn_func(q, k[..., :8], v)
    with expect(ValueError, "seqlen_k"):
        triflash.flash_attn_func(q, k, v[:, :4])
    with expect(ValueError, "batch sizes"):
        triflash.flash_attn_func(q, k.expand(2, -1, -1, -1), v)


def test_gqa_heads_must_divide():
    q, k, v = qkv(h=3, hk=2)
    with expect(ValueError, "nheads_kv=2", "divide nheads=3"):
        triflash.flash_attn_func(q, k, v)


@pytest.mark.parametrize("window", [(1,), "ab", (1.5, 2), None, (None, None)])
def test_bad_window(window):
    q, k, v = qkv()
    with pytest.raises(ValueError, match="window_size"):
        triflash.flash_attn_func(q, k, v, window_size=window)


def test_bad_scalars():
    q, k, v = qkv()
    with expect(ValueError, "softcap=nan", "finite"):
        triflash.flash_attn_func(q, k, v, softcap=float("nan"))
    with expect(ValueError, "softmax_scale=nan"):
        triflash.flash_attn_func(q, k, v, softmax_scale=float("nan"))
    with expect(TypeError, "causal=1.5", "bool"):
        triflash.flash_attn_func(q, k, v, causal=1.5)


def test_bad_fa3_extras():
    q, k, v = qkv()
    with expect(ValueError, "attention_chunk=-4", ">= 0"):
        triflash.flash_attn_func(q, k, v, attention_chunk=-4)
    with expect(ValueError, "attention_chunk=1.5"):
        triflash.flash_attn_func(q, k, v, attention_chunk=1.5)
    with expect(ValueError, "qv.shape", "v's head dim"):
        triflash.flash_attn_func(q, k, v, qv=q[:, :-1])
    with expect(TypeError, "qv.dtype"):
        triflash.flash_attn_func(q, k, v, qv=q.float())
    with expect(TypeError, "qv=list"):
        triflash.flash_attn_func(q, k, v, qv=[1])


def test_cpu_tensors_without_interpreter_explained(monkeypatch):
    from triflash import dispatch
    monkeypatch.setattr(dispatch, "interpreting", lambda: False)
    q, k, v = qkv(device="cpu")
    with expect(ValueError, "q.device=cpu", "TRITON_INTERPRET=1"):
        triflash.flash_attn_func(q, k, v)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs two devices: cpu and cuda")
def test_different_devices():
    q, k, v = qkv()
    with expect(ValueError, "device", "one device"):
        triflash.flash_attn_func(q, k.cpu(), v)


def _varlen_inputs():
    q = torch.randn(10, 2, 16, device=DEVICE).half()
    cu = torch.tensor([0, 4, 10], dtype=torch.int32, device=DEVICE)
    return q, q.clone(), q.clone(), cu


def test_varlen_cu_seqlens_checked():
    q, k, v, cu = _varlen_inputs()
    with expect(ValueError, "cu_seqlens_q", "int32"):
        triflash.flash_attn_varlen_func(q, k, v, cu.long(), cu, 6, 6)
    triflash.set_check_inputs(True)
    try:
        bad = torch.tensor([0, 7, 4], dtype=torch.int32, device=DEVICE)
        with expect(ValueError, "cu_seqlens_k", r"c\[0\] <= c\[1\]"):
            triflash.flash_attn_varlen_func(q, k, v, cu, bad, 6, 7)
        too_long = torch.tensor([0, 4, 12], dtype=torch.int32, device=DEVICE)
        with expect(ValueError, "cu_seqlens_q", "10"):
            triflash.flash_attn_varlen_func(q, k, v, too_long, cu, 8, 6)
        with expect(ValueError, "max_seqlen_q", "longest sequence, 6"):
            triflash.flash_attn_varlen_func(q, k, v, cu, cu, 5, 6)
    finally:
        triflash.set_check_inputs(False)


def test_varlen_seqused_shape():
    q, k, v, cu = _varlen_inputs()
    with expect(ValueError, "seqused_k", r"shape \(2,\)"):
        triflash.flash_attn_varlen_func(q, k, v, cu, cu, 6, 6,
                                        seqused_k=torch.zeros(3, dtype=torch.int32, device=DEVICE))


def test_seqused_beyond_its_sequence_checked():
    """seqused counts more tokens than cu_seqlens gives the sequence: FA3 would read the next
    sequence's; with the host checks it is an error naming the argument."""
    q, k, v, cu = _varlen_inputs()
    triflash.set_check_inputs(True)
    try:
        for name in ("seqused_k", "seqused_q"):
            with expect(ValueError, name, r"\[4, 6\]"):
                triflash.flash_attn_varlen_func(q, k, v, cu, cu, 6, 6,
                                                **{name: torch.tensor([5, 6], dtype=torch.int32, device=DEVICE)})
        triflash.flash_attn_varlen_func(q, k, v, cu, cu, 6, 6, seqused_k=torch.tensor([4, 0], dtype=torch.int32,
                                                                                     device=DEVICE))
    finally:
        triflash.set_check_inputs(False)


def test_rotary_tables_cover_the_positions():
    """Tables shorter than the positions rotated (cache_seqlens + the new tokens): an error with
    the host checks (FA3 reads past them); exactly long enough passes."""
    q = torch.randn(2, 3, 2, 16, device=DEVICE).half()
    kc, vc = torch.randn(2, 12, 2, 16, device=DEVICE).half(), torch.randn(2, 12, 2, 16, device=DEVICE).half()
    kn, vn = torch.randn(2, 3, 2, 16, device=DEVICE).half(), torch.randn(2, 3, 2, 16, device=DEVICE).half()
    lens = torch.tensor([2, 7], dtype=torch.int32, device=DEVICE)
    triflash.set_check_inputs(True)
    try:
        for n, ok in ((9, False), (10, True)):
            cos = torch.ones(n, 4, device=DEVICE).half()
            call = (lambda: triflash.flash_attn_with_kvcache(q, kc.clone(), vc.clone(), kn, vn, rotary_cos=cos,
                                                             rotary_sin=cos, cache_seqlens=lens, causal=True))
            if ok:
                call()
            else:
                with expect(ValueError, r"rotary_cos.shape\[0\]=9", "10 positions"):
                    call()
    finally:
        triflash.set_check_inputs(False)


def test_malformed_cu_seqlens_never_read_out_of_bounds():
    """With checks off, cu_seqlens past the tensor are clamped inside the kernel."""
    q, k, v, _ = _varlen_inputs()
    huge = torch.tensor([0, 4, 1 << 30], dtype=torch.int32, device=DEVICE)
    out = triflash.flash_attn_varlen_func(q, k, v, huge, huge, 6, 6) if DEVICE == "cuda" else None
    if out is not None:
        torch.cuda.synchronize()
        assert not out.isnan().any()


def test_qkvpacked_layout_checked():
    qkv = torch.randn(1, 8, 4, 2, 16, device=DEVICE).half()
    with expect(ValueError, r"qkv.shape\[2\]=4", "expected 3"):
        triflash.flash_attn_qkvpacked_func(qkv)
    with expect(ValueError, "num_heads_q=None", "required"):
        triflash.flash_attn_qkvpacked_func(qkv[:, :, 0])
    with expect(ValueError, "num_heads_q=3", "nheads_kv >= 1"):
        triflash.flash_attn_qkvpacked_func(qkv.flatten(2, 3)[:, :, :6], num_heads_q=3)


def test_a_validated_signature_still_refuses_what_validation_refuses():
    """A repeat of a dense call that passed validation skips it (``interface._VALIDATED``,
    keyed by shapes, strides, dtypes, devices and the scalars with their types): the same
    tensors with an argument validation refuses still raise, and a cached call computes
    what an uncached one does."""
    from triflash import interface
    interface._VALIDATED.clear()
    q, k, v = qkv(sq=5, sk=7)
    first = triflash.flash_attn_func(q, k, v, causal=True, window_size=(1, -1))
    assert len(interface._VALIDATED) == 1
    again = triflash.flash_attn_func(q, k, v, causal=True, window_size=(1, -1))
    assert len(interface._VALIDATED) == 1 and torch.equal(first, again)
    with expect(TypeError, "causal=1.0", "expected a bool"):
        triflash.flash_attn_func(q, k, v, causal=1.0, window_size=(1, -1))
    with expect(ValueError, "window_size\\[0\\]=True", "expected an int"):  # (True, -1) == (1, -1)
        triflash.flash_attn_func(q, k, v, causal=True, window_size=(True, -1))
    with expect(ValueError, "softmax_scale=True"):
        triflash.flash_attn_func(q, k, v, causal=True, window_size=(1, -1), softmax_scale=True)
    with expect(ValueError, "softcap=False"):  # False == 0.0, the cached softcap
        triflash.flash_attn_func(q, k, v, causal=True, window_size=(1, -1), softcap=False)
    with expect(ValueError, "attention_chunk=True"):  # (a bool in an int slot)
        triflash.flash_attn_func(q, k, v, causal=True, window_size=(1, -1), attention_chunk=True)
    with expect(ValueError, "seqlen_k"):
        triflash.flash_attn_func(q, k, v[:, :6], causal=True, window_size=(1, -1))
    with expect(TypeError, "dtypes"):
        triflash.flash_attn_func(q, k, v.bfloat16(), causal=True, window_size=(1, -1))
    # a list window is validated every call (not hashable: no signature) and means the same,
    # as does FA3's causal=1 (an int flag: validated every call)
    assert torch.equal(triflash.flash_attn_func(q, k, v, causal=True, window_size=[1, -1]), first)
    assert torch.equal(triflash.flash_attn_func(q, k, v, causal=1, window_size=(1, -1)), first)
    # a non-contiguous last dim is copied, as before, and not cached
    qt = q.transpose(-1, -2).contiguous().transpose(-1, -2)
    assert torch.equal(triflash.flash_attn_func(qt, k, v, causal=True, window_size=(1, -1)), first)
    assert len(interface._VALIDATED) == 1
