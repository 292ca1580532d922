"""vLLM's FlashAttention API on triflash (``triflash.integrations.vllm``), called the way
vLLM's FlashAttention backend calls ``vllm.vllm_flash_attn``: the KV cache one tensor
(2, num_blocks, block_size, nheads_kv, headdim) unbound into K and V, blocks in a random
order behind a block table wider than needed, ragged ``seqused_k``, queries of decode steps,
chunked prefills and speculative tokens packed by ``cu_seqlens_q``, the output written into
a slice of a longer buffer; its cascade attention (a shared prefix through one table row,
the suffixes through the table's later columns, each with its lse); its encoder attention
(``cu_seqlens_k``). Against the fp32 reference under FlashAttention-3's tolerance rule."""
import importlib
import inspect
import math
import sys
import textwrap

import pytest
import torch

import triflash
from triflash.integrations import vllm as tv
from triflash.testing import assert_forward_matches, attention_ref, attention_varlen_ref

from conftest import DEVICE

ON_GPU = DEVICE == "cuda"

# vllm_flash_attn.flash_attn_varlen_func's parameters and defaults, in its order (its newest form, with
# FlashAttention-4's arguments; older vLLM releases pass a subset, by keyword)
VLLM_VARLEN = [("q", None), ("k", None), ("v", None), ("max_seqlen_q", None), ("cu_seqlens_q", None),
               ("max_seqlen_k", None), ("cu_seqlens_k", None), ("seqused_k", None), ("q_v", None),
               ("dropout_p", 0.0), ("softmax_scale", None), ("causal", False), ("window_size", None),
               ("softcap", 0.0), ("alibi_slopes", None), ("deterministic", False), ("return_attn_probs", False),
               ("block_table", None), ("return_softmax_lse", False), ("out", None), ("scheduler_metadata", None),
               ("q_descale", None), ("k_descale", None), ("v_descale", None), ("num_splits", 0),
               ("output_scale", None), ("fa_version", 2), ("s_aux", None), ("cp_world_size", 1), ("cp_rank", 0),
               ("cp_tot_seqused_k", None), ("mask_mod", None), ("aux_tensors", None),
               ("aux_tensor_leading_dims", None), ("dynamic_causal", None)]
VLLM_SCHEDULER = ["batch_size", "max_seqlen_q", "max_seqlen_k", "num_heads_q", "num_heads_kv", "headdim",
                  "cache_seqlens", "qkv_dtype", "headdim_v", "cu_seqlens_q", "cu_seqlens_k_new", "cache_leftpad",
                  "page_size", "max_seqlen_k_new", "causal", "window_size", "has_softcap", "num_splits", "pack_gqa",
                  "sm_margin"]


def test_signatures_are_vllms():
    params = inspect.signature(tv.flash_attn_varlen_func).parameters
    assert [(n, None if p.default is inspect.Parameter.empty else p.default) for n, p in params.items()] == VLLM_VARLEN
    assert list(inspect.signature(tv.get_scheduler_metadata).parameters) == VLLM_SCHEDULER


def _ints(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def _cu(lens):
    return _ints([0] + torch.tensor(lens).cumsum(0).tolist())


def _paged(seq_lens, block_size, hk, d, dtype, g):
    """vLLM's cache: one (2, num_blocks, block_size, hk, d) tensor, each sequence's blocks at
    random places (unused blocks hold noise), a block table with a spare column (zeros past a
    sequence's blocks, as vLLM pads it). Returns (kv, table, k_packed, v_packed): the
    sequences' keys and values packed (total_k, hk, d) for the reference."""
    per = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(per) + 3
    kv = torch.randn(2, num_blocks, block_size, hk, d, generator=g).to(DEVICE, dtype)
    order = torch.randperm(num_blocks, generator=g)
    table = torch.zeros(len(seq_lens), max(per) + 1, dtype=torch.int32)
    ks, vs, used = [], [], 0
    for b, (n, blocks) in enumerate(zip(seq_lens, per)):
        ids = order[used:used + blocks]
        used += blocks
        table[b, :blocks] = ids
        ks.append(kv[0][ids.to(DEVICE)].reshape(-1, hk, d)[:n])
        vs.append(kv[1][ids.to(DEVICE)].reshape(-1, hk, d)[:n])
    return kv, table.to(DEVICE), torch.cat(ks), torch.cat(vs)


def _check(out, lse, q, k_packed, v_packed, query_lens, seq_lens, **kw):
    args = (q, k_packed, v_packed, _cu(query_lens), _cu(seq_lens))
    out_ref, lse_ref = attention_varlen_ref(*args, **kw)
    out_lowp, _ = attention_varlen_ref(*args, upcast=False, **kw)
    assert_forward_matches(out, lse, out_ref, lse_ref, out_lowp, kw.get("softcap", 0.0))


# (query_lens, seq_lens): decode steps; decode beside chunked prefills and speculative tokens
BATCHES = {
    "decode": ([1, 1, 1, 1], [37, 1, 64, 130]),
    "mixed": ([1, 5, 19, 3], [50, 5, 83, 20]),
}
if ON_GPU:
    BATCHES["decode-long"] = ([1] * 6, [4097, 1, 8191, 300, 2048, 5000])
    BATCHES["mixed-long"] = ([1, 300, 4, 1], [3000, 300, 1027, 9000])
FEATURES = {  # (causal, window_size, softcap, sinks)
    "causal": (True, None, 0.0, False),
    "causal-sinks": (True, None, 0.0, True),
    "window-softcap": (True, [15, 0], 30.0, False),  # vLLM's sliding window: (w - 1, 0)
}


def _backend_call(query_lens, seq_lens, block_size, causal, window, softcap, sinks, dtype, seed, h=8, hk=2, d=64):
    """The call of vLLM's backend (its keywords and values), with the lse asked for as its
    cascade attention asks. Returns (its result, the output buffer, q, the packed keys and
    values, the reference's keywords)."""
    g = torch.Generator().manual_seed(seed)
    kv, table, k_packed, v_packed = _paged(seq_lens, block_size, hk, d, dtype, g)
    key_cache, value_cache = kv.unbind(0)
    total_q = sum(query_lens)
    q = torch.randn(total_q, h, d, generator=g).to(DEVICE, dtype)
    output = torch.full((total_q + 5, h, d), float("nan"), device=DEVICE, dtype=dtype)  # vLLM pads its buffer
    s_aux = (3 * torch.randn(h, generator=g)).to(DEVICE, torch.float32) if sinks else None
    scale = 0.11
    descale = torch.full((1,), 2.0, device=DEVICE).expand(len(seq_lens), hk)  # ignored for 16-bit inputs, as in FA3
    result = tv.flash_attn_varlen_func(
        q=q, k=key_cache, v=value_cache, out=output[:total_q], cu_seqlens_q=_cu(query_lens),
        max_seqlen_q=max(query_lens), seqused_k=_ints(seq_lens), max_seqlen_k=max(seq_lens), softmax_scale=scale,
        causal=causal, alibi_slopes=None, window_size=window, block_table=table, softcap=softcap,
        scheduler_metadata=None, fa_version=3, q_descale=descale, k_descale=descale, v_descale=descale,
        num_splits=0, s_aux=s_aux, return_softmax_lse=True)
    ref_kw = dict(softmax_scale=scale, causal=causal, window_size=tuple(window or (-1, -1)), softcap=softcap,
                  learnable_sink=s_aux)
    return result, output, q, k_packed, v_packed, ref_kw


@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("batch", BATCHES)
def test_backend_call(batch, feature):
    query_lens, seq_lens = BATCHES[batch]
    causal, window, softcap, sinks = FEATURES[feature]
    (out, lse), output, q, k_packed, v_packed, ref_kw = _backend_call(
        query_lens, seq_lens, 16, causal, window, softcap, sinks, torch.bfloat16, seed=len(batch) + len(feature))
    total_q = sum(query_lens)
    assert out.data_ptr() == output.data_ptr() and out.shape == (total_q, 8, 64)  # written into out
    assert output[total_q:].isnan().all()  # the buffer's padding rows untouched
    assert lse.shape == (8, total_q) and lse.dtype == torch.float32
    _check(out, lse, q, k_packed, v_packed, query_lens, seq_lens, **ref_kw)


@pytest.mark.parametrize("block_size,dtype", [(1, torch.bfloat16), (16, torch.float16)])
def test_backend_call_other_forms(block_size, dtype):
    """Pages of one token, fp16; and the same keys as a dense (batch, seqlen_k, hk, d) cache
    read through ``seqused_k`` without a block table (noise past each sequence's length)."""
    query_lens, seq_lens = BATCHES["mixed"]
    (out, lse), _, q, k_packed, v_packed, ref_kw = _backend_call(query_lens, seq_lens, block_size, True, None, 0.0,
                                                                 True, dtype, seed=block_size)
    _check(out, lse, q, k_packed, v_packed, query_lens, seq_lens, **ref_kw)

    batch, longest = len(seq_lens), max(seq_lens)
    g = torch.Generator().manual_seed(block_size + 1)
    k = torch.randn(batch, longest + 3, *k_packed.shape[1:], generator=g).to(DEVICE, dtype)
    v = torch.randn(batch, longest + 3, *v_packed.shape[1:], generator=g).to(DEVICE, dtype)
    for b, (start, n) in enumerate(zip(_cu(seq_lens).tolist(), seq_lens)):
        k[b, :n], v[b, :n] = k_packed[start:start + n], v_packed[start:start + n]
    out, lse = tv.flash_attn_varlen_func(q, k, v, max(query_lens), _cu(query_lens), longest, None, _ints(seq_lens),
                                         softmax_scale=ref_kw["softmax_scale"], causal=True,
                                         s_aux=ref_kw["learnable_sink"], return_softmax_lse=True, fa_version=3)
    _check(out, lse, q, k_packed, v_packed, query_lens, seq_lens, **ref_kw)


def test_backend_call_fp8():
    """vLLM's fp8 KV cache: the cache viewed as float8_e4m3fn, q quantized with its scale, the
    descales per-tensor scalars expanded to (batch, nheads_kv); bf16 output."""
    f8 = torch.float8_e4m3fn
    query_lens, seq_lens = BATCHES["mixed"]
    g = torch.Generator().manual_seed(8)
    kv, table, k_packed, v_packed = _paged(seq_lens, 16, 2, 64, torch.float32, g)
    kv8 = kv.to(f8)
    q8 = torch.randn(sum(query_lens), 8, 64, generator=g).to(DEVICE, f8)
    shape = (len(seq_lens), 2)
    q_scale, k_scale, v_scale = (torch.full((1,), x, device=DEVICE) for x in (0.5, 1.5, 0.75))
    out, lse = tv.flash_attn_varlen_func(
        q=q8, k=kv8[0], v=kv8[1], cu_seqlens_q=_cu(query_lens), max_seqlen_q=max(query_lens),
        seqused_k=_ints(seq_lens), max_seqlen_k=max(seq_lens), causal=True, block_table=table, fa_version=3,
        q_descale=q_scale.expand(shape), k_descale=k_scale.expand(shape), v_descale=v_scale.expand(shape),
        return_softmax_lse=True)
    assert out.dtype == torch.bfloat16
    qf, kf, vf = q8.float() * 0.5, k_packed.to(f8).float() * 1.5, v_packed.to(f8).float() * 0.75
    args = (_cu(query_lens), _cu(seq_lens))
    out_ref, lse_ref = attention_varlen_ref(qf, kf, vf, *args, causal=True, softmax_scale=64 ** -0.5)
    out_lowp, _ = attention_varlen_ref(qf.bfloat16(), kf.bfloat16(), vf.bfloat16(), *args, causal=True,
                                       softmax_scale=64 ** -0.5, upcast=False)
    assert_forward_matches(out, lse, out_ref, lse_ref, out_lowp)


def test_cascade_attention():
    """vLLM's cascade attention: every sequence's first blocks are one shared prefix, read
    once for all queries (non-causal) through the table's first row, then each sequence's
    suffix (causal) through the table's later columns (a column slice of it), each with its
    lse for vLLM's merge."""
    g = torch.Generator().manual_seed(7)
    block_size, h, hk, d, dtype = 16, 8, 2, 64, torch.bfloat16
    query_lens, suffix_lens, common_blocks = [1, 6, 1, 3], [9, 6, 30, 17], 3
    prefix = common_blocks * block_size
    seq_lens = [prefix + n for n in suffix_lens]
    kv, table, k_packed, v_packed = _paged(seq_lens, block_size, hk, d, dtype, g)
    table[:, :common_blocks] = table[0, :common_blocks]  # the shared prefix's blocks
    key_cache, value_cache = kv.unbind(0)
    k_prefix, v_prefix = (c[table[0, :common_blocks].long()].reshape(-1, hk, d) for c in (key_cache, value_cache))
    total_q = sum(query_lens)
    q = torch.randn(total_q, h, d, generator=g).to(DEVICE, dtype)
    scale = d ** -0.5

    out, lse = tv.flash_attn_varlen_func(
        q=q, k=key_cache, v=value_cache, cu_seqlens_q=_ints([0, total_q]), seqused_k=_ints([prefix]),
        max_seqlen_q=total_q, max_seqlen_k=prefix, softmax_scale=scale, causal=False, window_size=[-1, -1],
        block_table=table[:1], softcap=0.0, return_softmax_lse=True, fa_version=3)
    assert lse.shape == (h, total_q) and lse.dtype == torch.float32
    out_ref, lse_ref = attention_ref(q[None], k_prefix[None], v_prefix[None], softmax_scale=scale)
    out_lowp, _ = attention_ref(q[None], k_prefix[None], v_prefix[None], softmax_scale=scale, upcast=False)
    assert_forward_matches(out[None], lse[None], out_ref, lse_ref, out_lowp)

    suffix_table = table[:, common_blocks:]
    assert not suffix_table.is_contiguous()
    out, lse = tv.flash_attn_varlen_func(
        q=q, k=key_cache, v=value_cache, cu_seqlens_q=_cu(query_lens), seqused_k=_ints(suffix_lens),
        max_seqlen_q=max(query_lens), max_seqlen_k=max(suffix_lens), softmax_scale=scale, causal=True,
        window_size=[-1, -1], block_table=suffix_table, softcap=0.0, return_softmax_lse=True, fa_version=3)
    k_suffix = torch.cat([k_packed[s + prefix:s + n] for s, n in zip(_cu(seq_lens).tolist(), seq_lens)])
    v_suffix = torch.cat([v_packed[s + prefix:s + n] for s, n in zip(_cu(seq_lens).tolist(), seq_lens)])
    _check(out, lse, q, k_suffix, v_suffix, query_lens, suffix_lens, softmax_scale=scale, causal=True)


def test_encoder_call():
    """vLLM's encoder attention: keys packed like the queries (``cu_seqlens_k``), bidirectional,
    a sliding window of w - 1 on each side, written into ``out``."""
    g = torch.Generator().manual_seed(3)
    lens, h, d, dtype = [17, 1, 40], 4, 64, torch.bfloat16
    total = sum(lens)
    q, k, v = (torch.randn(total, h, d, generator=g).to(DEVICE, dtype) for _ in range(3))
    out = torch.full((total, h, d), float("nan"), device=DEVICE, dtype=dtype)
    cu = _cu(lens)
    result = tv.flash_attn_varlen_func(q=q, k=k, v=v, out=out, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=40,
                                       max_seqlen_k=40, softmax_scale=None, causal=False, alibi_slopes=None,
                                       window_size=(7, 7), softcap=0.0, fa_version=3)
    assert result is out
    _, lse = triflash.flash_attn_varlen_func(q, k, v, cu, cu, 40, 40, window_size=(7, 7), return_attn_probs=True)
    _check(out, lse, q, k, v, lens, lens, window_size=(7, 7))


def test_default_scale_is_vllms_with_q_v():
    """vLLM's wrapper scales by q's head dim alone, also with ``q_v`` (FA3's own adds q_v's)."""
    g = torch.Generator().manual_seed(5)
    lens, h, d, dv = [5, 9], 2, 64, 128
    total = sum(lens)
    q = torch.randn(total, h, d, generator=g).to(DEVICE, torch.bfloat16)
    q_v = torch.randn(total, h, dv, generator=g).to(DEVICE, torch.bfloat16)
    k = torch.randn(2, 16, h, d, generator=g).to(DEVICE, torch.bfloat16)
    v = torch.randn(2, 16, h, dv, generator=g).to(DEVICE, torch.bfloat16)
    common = dict(q_v=q_v, max_seqlen_q=9, cu_seqlens_q=_cu(lens), max_seqlen_k=16, seqused_k=_ints([11, 16]),
                  causal=True)
    assert torch.equal(tv.flash_attn_varlen_func(q, k, v, **common),
                       tv.flash_attn_varlen_func(q, k, v, softmax_scale=d ** -0.5, **common))


BAD = {  # keyword overrides of a good call -> (exception, the argument the message names)
    "both-key-forms": (dict(cu_seqlens_k="cu"), ValueError, "cu_seqlens_k"),
    "no-key-form": (dict(seqused_k=None), ValueError, "cu_seqlens_k"),
    "table-without-seqused": (dict(seqused_k=None, cu_seqlens_k="cu"), ValueError, "block_table"),
    "fa4": (dict(fa_version=4), ValueError, "fa_version"),
    "alibi": (dict(alibi_slopes="slopes"), NotImplementedError, "alibi_slopes"),
    "dropout": (dict(dropout_p=0.1), ValueError, "dropout_p"),
    "dcp": (dict(cp_world_size=2), NotImplementedError, "cp_world_size"),
    "fa4-output-scale": (dict(output_scale="slopes"), NotImplementedError, "output_scale"),
    "fa4-mask-mod": (dict(mask_mod=len), NotImplementedError, "mask_mod"),
    "out-shape": (dict(out="wide"), ValueError, "out"),
    "out-dtype": (dict(out="fp16"), ValueError, "out"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_calls_name_the_argument(case):
    overrides, exc, name = BAD[case]
    g = torch.Generator().manual_seed(1)
    kv, table, _, _ = _paged([20, 3], 16, 2, 64, torch.bfloat16, g)
    q = torch.randn(4, 4, 64, generator=g).to(DEVICE, torch.bfloat16)
    values = {"cu": _cu([2, 2]), "slopes": torch.ones(4, device=DEVICE),
              "wide": torch.empty(4, 4, 128, device=DEVICE, dtype=torch.bfloat16),
              "fp16": torch.empty(4, 4, 64, device=DEVICE, dtype=torch.float16)}
    kw = dict(q=q, k=kv[0], v=kv[1], cu_seqlens_q=_cu([2, 2]), max_seqlen_q=2, seqused_k=_ints([20, 3]),
              max_seqlen_k=20, block_table=table, causal=True, fa_version=3)
    kw.update({key: values.get(val, val) if isinstance(val, str) else val for key, val in overrides.items()})
    with pytest.raises(exc, match=name):
        tv.flash_attn_varlen_func(**kw)


def test_scheduler_metadata_as_vllm_passes_it():
    g = torch.Generator().manual_seed(2)
    query_lens, seq_lens = BATCHES["decode"]
    kv, table, _, _ = _paged(seq_lens, 16, 2, 64, torch.bfloat16, g)
    q = torch.randn(4, 8, 64, generator=g).to(DEVICE, torch.bfloat16)
    meta = tv.get_scheduler_metadata(batch_size=4, max_seqlen_q=1, max_seqlen_k=max(seq_lens), num_heads_q=8,
                                     num_heads_kv=2, headdim=64, cache_seqlens=_ints(seq_lens),
                                     qkv_dtype=torch.bfloat16, page_size=16, cu_seqlens_q=_cu(query_lens),
                                     causal=True, window_size=(-1, -1), num_splits=0)
    assert meta.dtype == torch.int32 and meta.device == q.device
    kw = dict(q=q, k=kv[0], v=kv[1], cu_seqlens_q=_cu(query_lens), max_seqlen_q=1, seqused_k=_ints(seq_lens),
              max_seqlen_k=max(seq_lens), block_table=table, causal=True, fa_version=3)
    assert torch.equal(tv.flash_attn_varlen_func(scheduler_metadata=meta, **kw), tv.flash_attn_varlen_func(**kw))


@pytest.mark.parametrize("capability,version,served", [((9, 0), 3, True), ((9, 0), 2, True), ((9, 0), 4, False),
                                                       ((8, 0), 3, False), ((10, 0), 2, False)])
def test_fa_versions_served(monkeypatch, capability, version, served):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert tv.is_fa_version_supported(version) == served
    reason = tv.fa_version_unsupported_reason(version)
    assert (reason is None) == served
    if not served:
        assert str(version) in reason or f"sm{capability[0]}{capability[1]}" in reason


def test_no_gpu_is_not_served(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not tv.is_fa_version_supported(3)
    assert "CUDA" in tv.fa_version_unsupported_reason(3)


FAKE_VLLM = {  # a stand-in for vLLM's modules: how they import the FlashAttention names
    "vllm/__init__.py": "",
    "vllm/vllm_flash_attn/__init__.py": """
        from .flash_attn_interface import flash_attn_varlen_func, get_scheduler_metadata
    """,
    "vllm/vllm_flash_attn/flash_attn_interface.py": """
        def flash_attn_varlen_func(*args, **kwargs): raise RuntimeError("vLLM's own")
        def get_scheduler_metadata(*args, **kwargs): raise RuntimeError("vLLM's own")
        def is_fa_version_supported(fa_version, device=None): return False
        def fa_version_unsupported_reason(fa_version, device=None): return "not built"
    """,
    "vllm/attention/__init__.py": "",
    "vllm/attention/utils/__init__.py": "",
    "vllm/attention/utils/fa_utils.py": """
        from vllm.vllm_flash_attn import flash_attn_varlen_func, get_scheduler_metadata
    """,
    "vllm/v1/__init__.py": "",
    "vllm/v1/backend.py": """
        from vllm.attention.utils.fa_utils import flash_attn_varlen_func, get_scheduler_metadata
    """,
}


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    for path, text in FAKE_VLLM.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    tv.uninstall()
    for name in [name for name in sys.modules if name == "vllm" or name.startswith("vllm.")]:
        del sys.modules[name]


def test_install_points_vllm_at_triflash(fake_vllm):
    fa_utils = importlib.import_module("vllm.attention.utils.fa_utils")  # bound vLLM's names already
    interface = importlib.import_module("vllm.vllm_flash_attn.flash_attn_interface")
    own = interface.flash_attn_varlen_func
    changed = tv.install()
    assert "vllm.attention.utils.fa_utils.flash_attn_varlen_func" in changed
    assert fa_utils.flash_attn_varlen_func is tv.flash_attn_varlen_func
    assert fa_utils.get_scheduler_metadata is tv.get_scheduler_metadata
    assert interface.is_fa_version_supported is tv.is_fa_version_supported
    backend = importlib.import_module("vllm.v1.backend")  # imported after install
    assert backend.flash_attn_varlen_func is tv.flash_attn_varlen_func
    assert tv.install() == []  # idempotent
    tv.uninstall()
    assert fa_utils.flash_attn_varlen_func is own and interface.flash_attn_varlen_func is own
    assert interface.fa_version_unsupported_reason(3) == "not built"


def test_install_without_vllm_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # (import vllm raises ImportError)
    with pytest.raises(ImportError, match="vllm.vllm_flash_attn"):
        tv.install()


@pytest.mark.parametrize("env,installs", [(None, False), ("0", False), ("1", True)])
def test_plugin_installs_only_when_asked(monkeypatch, env, installs):
    calls = []
    monkeypatch.setattr(tv, "install", lambda: calls.append(1))
    if env is None:
        monkeypatch.delenv(tv.ENV, raising=False)
    else:
        monkeypatch.setenv(tv.ENV, env)
    tv.plugin()
    assert calls == ([1] if installs else [])


def test_plugin_is_declared_for_vllm():
    import pathlib
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((pathlib.Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    target = project["entry-points"]["vllm.general_plugins"]["triflash"]
    module, _, name = target.partition(":")
    assert getattr(importlib.import_module(module), name) is tv.plugin


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_decode_step_replays_from_a_cuda_graph():
    """vLLM captures its decode steps in CUDA graphs: the call, ``out`` included, replays on
    fresh inputs copied into the captured tensors to exactly what an eager call returns."""
    query_lens, seq_lens = [1] * 6, [4097, 1, 8191, 300, 2048, 5000]
    g = torch.Generator().manual_seed(11)
    kv, table, _, _ = _paged(seq_lens, 16, 8, 128, torch.bfloat16, g)
    q = torch.randn(6, 32, 128, generator=g).to(DEVICE, torch.bfloat16)
    out = torch.empty_like(q)
    kw = dict(k=kv[0], v=kv[1], cu_seqlens_q=_cu(query_lens), max_seqlen_q=1, seqused_k=_ints(seq_lens),
              max_seqlen_k=max(seq_lens), block_table=table, causal=True, fa_version=3)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        tv.flash_attn_varlen_func(q=q, out=out, **kw)  # warm-up: compiles every kernel the capture launches
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tv.flash_attn_varlen_func(q=q, out=out, **kw)
    for seed in range(2):
        fresh = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, q.dtype)
        q.copy_(fresh)
        kv.mul_(-1)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, tv.flash_attn_varlen_func(q=fresh, **kw))
