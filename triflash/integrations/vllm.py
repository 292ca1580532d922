"""triflash behind vLLM's FlashAttention backend.

vLLM's FlashAttention backend (``vllm/v1/attention/backends/flash_attn.py``) does not call
FlashAttention-3's Python interface: it calls vLLM's own build, ``vllm.vllm_flash_attn``,
whose ``flash_attn_varlen_func`` reads a paged KV cache through ``block_table`` with
``seqused_k``, writes into ``out``, takes gpt-oss's sinks as ``s_aux`` and orders its first
arguments differently (``max_seqlen_q`` before ``cu_seqlens_q``). This module is that API on
triflash (``flash_attn_varlen_func``, ``get_scheduler_metadata``,
``is_fa_version_supported``, ``fa_version_unsupported_reason``), and ``install`` points vLLM
at it::

    TRIFLASH_VLLM=1 vllm serve MODEL     # every vLLM process: the plugin below

    from triflash.integrations import vllm as triflash_vllm
    triflash_vllm.install()              # or in one process, before it builds the engine

``plugin`` is triflash's ``vllm.general_plugins`` entry point (pyproject.toml), which vLLM
loads in each of its processes wherever triflash is installed; it installs only when
``TRIFLASH_VLLM=1`` (otherwise it only imports triflash, which registers its SDPA backend
without activating it). vLLM is imported by ``install`` only.

What runs: a call with ``seqused_k`` (a KV cache, paged through ``block_table`` or dense
(batch, seqlen_k, ...)) is ``triflash.flash_attn_with_kvcache`` with ``cu_seqlens_q`` (decode
steps, chunked prefill, speculative tokens: the decode kernel where the queries are few);
one with ``cu_seqlens_k`` (keys packed like the queries: vLLM's encoder attention) is
``triflash.flash_attn_varlen_func``. Causal attention is bottom-right aligned per sequence,
``window_size`` None means no window, the default scale is q's head dim ** -0.5 (vLLM's, also
with ``q_v``), and fp8 queries and caches take their descales as in FA3. Refused, naming the
argument: ALiBi (vLLM picks FA2 for it; FA3 has none either), ``dropout_p`` > 0, decode
context parallelism (``cp_world_size`` > 1) and FA versions other than 2 and 3.
"""
import importlib
import os
import sys

import torch

from .. import interface
from ..validation import _fail, describe

DEFAULT_FA_VERSION = 2  # (vLLM's default argument; vLLM asks for 3 on Hopper)
ENV = "TRIFLASH_VLLM"

_NAMES = ("flash_attn_varlen_func", "get_scheduler_metadata", "is_fa_version_supported",
          "fa_version_unsupported_reason")
_MODULES = ("vllm.vllm_flash_attn", "vllm.vllm_flash_attn.flash_attn_interface")
_replaced = []  # (module, attribute, original) for uninstall


def fa_version_unsupported_reason(fa_version, device=None):
    """None where triflash serves vLLM's ``fa_version`` on ``device`` (2 or 3, a Hopper GPU),
    else why not."""
    if fa_version not in (2, 3):
        return f"triflash serves FlashAttention versions 2 and 3 of vLLM's API, not {fa_version}"
    if not torch.cuda.is_available():
        return "triflash serves vLLM on CUDA GPUs and none is available"
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        return f"triflash serves vLLM on Hopper (sm90) GPUs; this one is sm{major}{minor}"
    return None


def is_fa_version_supported(fa_version, device=None):
    return fa_version_unsupported_reason(fa_version, device) is None


def get_scheduler_metadata(batch_size, max_seqlen_q, max_seqlen_k, num_heads_q, num_heads_kv, headdim,
                           cache_seqlens, qkv_dtype=torch.bfloat16, headdim_v=None, cu_seqlens_q=None,
                           cu_seqlens_k_new=None, cache_leftpad=None, page_size=None, max_seqlen_k_new=0,
                           causal=False, window_size=(-1, -1), has_softcap=False, num_splits=0, pack_gqa=None,
                           sm_margin=0):
    """vLLM's arguments (FA3's without ``attention_chunk``): ``triflash.get_scheduler_metadata``."""
    return interface.get_scheduler_metadata(
        batch_size, max_seqlen_q, max_seqlen_k, num_heads_q, num_heads_kv, headdim, cache_seqlens,
        qkv_dtype=qkv_dtype, headdim_v=headdim_v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k_new=cu_seqlens_k_new,
        cache_leftpad=cache_leftpad, page_size=page_size, max_seqlen_k_new=max_seqlen_k_new, causal=causal,
        window_size=window_size, has_softcap=has_softcap, num_splits=num_splits, pack_gqa=pack_gqa,
        sm_margin=sm_margin)


def flash_attn_varlen_func(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k=None, seqused_k=None,
                           q_v=None, dropout_p=0.0, softmax_scale=None, causal=False, window_size=None, softcap=0.0,
                           alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None,
                           return_softmax_lse=False, out=None, scheduler_metadata=None, q_descale=None,
                           k_descale=None, v_descale=None, num_splits=0, output_scale=None,
                           fa_version=DEFAULT_FA_VERSION, s_aux=None, cp_world_size=1, cp_rank=0, cp_tot_seqused_k=None,
                           mask_mod=None, aux_tensors=None, aux_tensor_leading_dims=None, dynamic_causal=None):
    """``vllm.vllm_flash_attn.flash_attn_varlen_func`` (module docstring). q: (total_q,
    nheads, headdim) with int32 ``cu_seqlens_q`` (batch + 1,). With ``seqused_k`` (batch,)
    int32: k, v a KV cache, blocks (num_blocks, block_size, nheads_kv, headdim[_v]) read
    through ``block_table`` (batch, blocks per sequence) int32, or without one (batch,
    seqlen_k, nheads_kv, headdim[_v]). With ``cu_seqlens_k``: k, v (total_k, nheads_kv,
    headdim[_v]). Returns out (total_q, nheads, headdim_v), written into ``out`` when given
    (and returned), and with ``return_softmax_lse`` (out, lse (nheads, total_q) fp32).
    ``deterministic`` and ``return_attn_probs`` change nothing (the forward is deterministic;
    vLLM's FA3 path ignores both); ``scheduler_metadata`` and ``num_splits`` as in
    ``triflash.flash_attn_with_kvcache``. The FA4-only arguments of newer vLLM releases
    (``output_scale``, ``mask_mod``, ``aux_tensors``, ``aux_tensor_leading_dims``,
    ``dynamic_causal``) are accepted as None and refused otherwise."""
    if (cu_seqlens_k is None) == (seqused_k is None):
        _fail("cu_seqlens_k", describe(cu_seqlens_k),
              f"give exactly one of cu_seqlens_k (keys packed like q) and seqused_k (a KV cache); seqused_k="
              f"{describe(seqused_k)}")
    if block_table is not None and seqused_k is None:
        _fail("block_table", describe(block_table), "a block table needs seqused_k, the tokens each sequence holds")
    if fa_version not in (2, 3):
        _fail("fa_version", fa_version, "expected 2 or 3 (triflash serves both)")
    if alibi_slopes is not None:
        _fail("alibi_slopes", describe(alibi_slopes), "ALiBi is not supported (FA3 has none either)",
              NotImplementedError)
    if dropout_p != 0.0:
        _fail("dropout_p", dropout_p, "expected 0.0: triflash's forward has no dropout")
    for name, value in (("output_scale", output_scale), ("mask_mod", mask_mod), ("aux_tensors", aux_tensors),
                        ("aux_tensor_leading_dims", aux_tensor_leading_dims), ("dynamic_causal", dynamic_causal)):
        if value is not None:
            _fail(name, describe(value), "expected None: vLLM passes it to FlashAttention-4 only", NotImplementedError)
    if cp_world_size != 1:
        _fail("cp_world_size", cp_world_size, "expected 1: decode context parallelism is not supported",
              NotImplementedError)
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    common = dict(softmax_scale=softmax_scale, causal=causal, qv=q_v, q_descale=q_descale, k_descale=k_descale,
                  v_descale=v_descale, window_size=(-1, -1) if window_size is None else window_size,
                  softcap=softcap, num_splits=num_splits, learnable_sink=s_aux)
    if out is not None:
        expected = tuple(q.shape[:-1]) + (v.shape[-1],)
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != expected:
            _fail("out", describe(out), f"expected a tensor of shape (total_q, nheads, headdim_v) = {expected}")
    if seqused_k is not None:
        result, lse, *_ = interface.flash_attn_with_kvcache(
            q, k, v, cache_seqlens=seqused_k, page_table=block_table, cu_seqlens_q=cu_seqlens_q,
            max_seqlen_q=max_seqlen_q, scheduler_metadata=scheduler_metadata, return_softmax_lse=True, **common)
    else:
        result, lse = interface.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                       max_seqlen_k, return_attn_probs=True, **common)
    if out is not None:
        if out.dtype != result.dtype or out.device != result.device:
            _fail("out", describe(out), f"expected {result.dtype} on {result.device}, the output's dtype and device")
        result = out.copy_(result)
    return (result, lse) if return_softmax_lse else result


def install():
    """Point vLLM's FlashAttention names at this module's: the attributes of
    ``vllm.vllm_flash_attn`` (and its ``flash_attn_interface``), so that modules importing
    them later get triflash's, and those that bound vLLM's already (``from vllm.vllm_flash_attn
    import flash_attn_varlen_func``). Idempotent; returns the names changed ("module.attr").
    ``uninstall`` puts vLLM's back. Raises ImportError without vLLM."""
    try:
        importlib.import_module(_MODULES[0])
    except ImportError as e:
        raise ImportError(f"triflash.integrations.vllm.install: vLLM's {_MODULES[0]} cannot be imported ({e})") from e
    ours = {name: globals()[name] for name in _NAMES}
    originals = []  # (vLLM's object, our name)
    changed = []
    for module_name in _MODULES:
        module = sys.modules.get(module_name)
        if module is None:
            try:
                module = importlib.import_module(module_name)
            except ImportError:
                continue
        for name in _NAMES:
            old = getattr(module, name, None)
            if old is ours[name]:
                continue
            if old is not None:
                originals.append((old, name))
            _replaced.append((module, name, old))
            setattr(module, name, ours[name])
            changed.append(f"{module_name}.{name}")
    for module_name, module in list(sys.modules.items()):
        if module is None or not module_name.startswith("vllm.") or module_name in _MODULES:
            continue
        for attr, value in list(vars(module).items()):
            name = next((name for old, name in originals if value is old), None)
            if name is not None:
                _replaced.append((module, attr, value))
                setattr(module, attr, ours[name])
                changed.append(f"{module_name}.{attr}")
    return changed


def uninstall():
    """Undo ``install``: vLLM's own names again."""
    while _replaced:
        module, attr, old = _replaced.pop()
        if old is None:
            delattr(module, attr)
        else:
            setattr(module, attr, old)


def plugin():
    """vLLM's ``vllm.general_plugins`` entry point: ``install`` when ``TRIFLASH_VLLM=1``."""
    if os.environ.get(ENV, "0") not in ("", "0"):
        install()
