"""Dispatch: which kernel serves which case. Read top to bottom.

    target   = "interpret"  CPU tensors under TRITON_INTERPRET=1 (how CI tests kernel logic)
               "sm90"       Hopper (H100/H200)
               "default"    any other CUDA GPU Triton supports
    backend  = "portable"   triflash/kernels/{fwd,bwd}.py, Triton, every target
               "hopper"     triflash/kernels/hopper/, Gluon, sm90 only

    head dims on the Hopper tier: 64, 128, 256 as they are; 96 and 192 computed as 128 and
                 256 (hopper.common.PADDED_HEAD_DIMS: TMA boxes of the tile's width over
                 the tensor's head dim)
    forward:  sm90 and hopper_fwd_supports(...) -> Gluon forward, tile configs.SM90_HOPPER_FWD
                 (dense or varlen batches, headdim == headdim_v in hopper.fwd.HEAD_DIMS
                 = {64, 96, 128, 192, 256}; TMA-aligned strides, seqlen_k > 0);
                 persistent CTAs with two Q slots
                 on dense batches where the tile says so (hopper.fwd.walk: without
                 causal / window mask at 64 / 128, tile after tile; under one, on the
                 host's longest-first schedule at every head dim);
                 without a mask at 96-256 (tile.split_keys) a part-empty last round of
                 tiles cut into equal shares of key blocks, one per SM, the pieces
                 merged after (hopper.fwd.split_keys, hopper/split_combine.py)
              otherwise                         -> portable forward, configs.fwd_config(target, d, dv)
                 (also FA3's forward-only extras: attention_chunk, qv, headdim_v > 256,
                 fp8 inputs)
              KV cache (run_fwd_cache): a decoding step (query tokens x GQA group <= 64
                 rows, decodes()) -> kernels/decode.py on every target (packed GQA, split
                 keys; attention_chunk too); longer queries with cache_batch_idx /
                 cache_leftpad / page table, varlen q, or qv -> portable forward; over a
                 plain dense cache -> as above
    backward: sm90 and hopper_bwd_supports(...) -> Gluon dK/dV kernel (hopper/bwd.py, or
                 hopper/bwd256.py at head dims 192 / 256), tile configs.SM90_HOPPER_BWD
                 (dense or varlen batches, headdim == headdim_v in hopper.bwd.HEAD_DIMS
                 = {64, 96, 128, 192, 256}, TMA-aligned strides); dQ:
                 deterministic=False, dense, tile.atomic_dq (64, 96, 128) -> inside the dK/dV
                     kernel, added by TMA reduce-add (order of adds not fixed)
                 otherwise -> the Gluon dQ kernel (hopper/bwd_dq.py), no atomics:
                     bitwise reproducible (at 192 / 256 deterministic=False takes it too;
                     there a dense batch's tile reads 64 keys per step with V in one slot
                     of its own, tile.dq_split_v, a varlen batch's 32)
              otherwise -> portable backward, tile from configs.bwd_config(target, d, dv);
              deterministic=True  -> dK/dV kernel + separate dQ kernel (no atomics)
              deterministic=False -> dK/dV kernel with fp32 atomic dQ, unless the tile
                                     says atomic_dq=False (then as deterministic=True)

``force_backend("portable")`` (or TRIFLASH_BACKEND=portable) pins every call to the portable
tier (the benchmark's ``triflash-portable``); ``force_backend("hopper")`` makes a case the
Hopper tier cannot serve an error instead of a silent fallback (tests use it).

On a Triton release the Hopper tier was not validated on (``versions.VALIDATED_TRITON``),
"auto" warns once and runs the portable tier; ``force_backend("hopper")`` runs Gluon anyway.
"""
import contextlib
import os

import torch

from . import versions
from .kernels import configs, decode, portable, problem
from .kernels.fwd import flash_fwd_kernel

try:  # Gluon ships with triton >= 3.5; the portable tier does not need it
    from .kernels.hopper import bwd as hopper_bwd
    from .kernels.hopper import fwd as hopper_fwd
    from .kernels.hopper.common import kernel_head_dim, tma_compatible
except ImportError:  # pragma: no cover
    hopper_fwd = hopper_bwd = None

BACKENDS = ("auto", "portable", "hopper")
_forced_backend = None


def interpreting() -> bool:
    """True when the kernels were built by Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return type(flash_fwd_kernel).__name__ == "InterpretedFunction"


_TARGETS = {}


def target_of(device: torch.device) -> str:
    if device.type == "cpu":
        return "interpret"
    target = _TARGETS.get(device)  # (looked up once per device: every call asks)
    if target is None:
        major, _ = torch.cuda.get_device_capability(device)
        target = _TARGETS[device] = "sm90" if major == 9 else "default"
    return target


def backend() -> str:
    chosen = _forced_backend or os.environ.get("TRIFLASH_BACKEND", "auto")
    if chosen not in BACKENDS:
        raise ValueError(f"TRIFLASH_BACKEND={chosen!r} is not one of {BACKENDS}")
    return chosen


@contextlib.contextmanager
def force_backend(name: str):
    """Run the enclosed calls on one backend ("auto", "portable" or "hopper")."""
    global _forced_backend
    if name not in BACKENDS:
        raise ValueError(f"backend={name!r} is not one of {BACKENDS}")
    previous, _forced_backend = _forced_backend, name
    try:
        yield
    finally:
        _forced_backend = previous


# '' when the running Triton is one the Hopper tier was validated on, else why not
TRITON_UNTRUSTED = versions.hopper_untrusted_reason()


def _try_hopper(chosen: str, target: str) -> bool:
    """Whether this call tries the Hopper tier: an sm90 GPU, not pinned to the portable tier,
    and a validated Triton unless the Hopper tier is forced."""
    if chosen == "portable" or target != "sm90":
        return False
    if chosen == "auto" and TRITON_UNTRUSTED:
        versions.warn_untrusted_once(TRITON_UNTRUSTED)
        return False
    return True


GRID_YZ_MAX = 65535


def _hopper_supports(module, q, k, v, cu_seqlens_q, seqused_q, seqused_k, target) -> str:
    """'' when the Gluon kernels of ``module`` (hopper.fwd or hopper.bwd) serve this case,
    else why not."""
    if module is None:
        return "triton.experimental.gluon is not available"
    if (target or target_of(q.device)) != "sm90":
        return "not an sm90 GPU"
    if (cu_seqlens_q is not None or seqused_q is not None or seqused_k is not None) and not getattr(
            module, "VARLEN", False):
        return "varlen / seqused"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {q.dtype} (fp8: the portable forward)"
    d, dv = q.shape[-1], v.shape[-1]
    if d != dv or d not in module.HEAD_DIMS:
        return f"head dims ({d}, {dv}) (needs equal, one of {module.HEAD_DIMS})"
    if not tma_compatible(q, k, v):
        return "strides or base pointers not 16-byte aligned (TMA)"
    return ""


def hopper_fwd_supports(q, k, v, cu_seqlens_q, seqused_q, seqused_k, target=None) -> str:
    """'' when the Gluon forward serves this case, else why not."""
    why_not = _hopper_supports(hopper_fwd, q, k, v, cu_seqlens_q, seqused_q, seqused_k, target)
    keys = k.shape[0] if cu_seqlens_q is not None else k.shape[1]
    return why_not or ("seqlen_k == 0" if keys == 0 else "")


def hopper_bwd_supports(q, k, v, cu_seqlens_q, seqused_q, seqused_k, target=None) -> str:
    """'' when the Gluon backward serves this case, else why not."""
    why_not = _hopper_supports(hopper_bwd, q, k, v, cu_seqlens_q, seqused_q, seqused_k, target)
    if not why_not and cu_seqlens_q is None and (seqused_q is not None or seqused_k is not None):
        # only flash_attn_with_kvcache (forward only) makes seqused on a dense batch
        why_not = "seqused on a dense batch: not GPU-tested on this tier's backward"
    # its dK/dV grid is (key blocks, KV heads, batch): CUDA's y and z axes stop at 65535
    batch = cu_seqlens_q.shape[0] - 1 if cu_seqlens_q is not None else q.shape[0]
    if not why_not and max(batch, k.shape[-2]) > GRID_YZ_MAX:
        why_not = f"batch {batch} or KV heads {k.shape[-2]} above {GRID_YZ_MAX} (grid axes y, z)"
    return why_not


def run_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, params, out=None, qv=None,
            descale=None):
    """(out, lse); a given ``out`` (contiguous last dim, any other strides) is written instead
    of a new tensor (the SDPA backend's (batch, heads, seqlen, dim) outputs). ``qv``,
    ``params.chunk`` and fp8 inputs with their ``descale`` (q, k, v): FA3's forward-only
    extras, which the portable forward serves."""
    target = target_of(q.device)
    chosen = backend()
    if _try_hopper(chosen, target):
        why_not = hopper_fwd_supports(q, k, v, cu_seqlens_q, seqused_q, seqused_k, target)
        if not why_not and (qv is not None or params.chunk > 0):
            why_not = "qv" if qv is not None else "attention_chunk"
        if not why_not and out is not None and not tma_compatible(out):
            why_not = "out's strides or base pointer not 16-byte aligned (TMA)"
        if not why_not:
            cfg = configs.SM90_HOPPER_FWD[kernel_head_dim(q.shape[-1])]
            out, lse = problem.alloc_fwd_outputs(q, v, cu_seqlens_q is not None, out)
            if q.numel() == 0:
                return out, lse
            return hopper_fwd.fwd(q, k, v, out, lse, params, cfg, cu_seqlens_q, cu_seqlens_k,
                                  seqused_q, seqused_k)
        if chosen == "hopper":
            raise NotImplementedError(f"triflash: the Hopper forward does not serve this case: {why_not}")
    elif chosen == "hopper":
        raise NotImplementedError(f"triflash: the Hopper backend needs an sm90 GPU, got target {target!r}")
    cfg = configs.fwd_config(target, q.shape[-1], v.shape[-1], fp8=descale is not None)
    return portable.fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, params,
                        cfg, upcast=target == "interpret", out=out, qv=qv, descale=descale)


def decodes(max_seqlen_q, nheads, nheads_kv, batch) -> bool:
    """Whether a KV-cache call is a decoding step (kernels/decode.py): every query row of a
    KV head's query heads fits one tile, and the grid fits CUDA's y / z axes."""
    return decode.serves(max_seqlen_q, nheads, nheads_kv) and batch * nheads_kv <= GRID_YZ_MAX


def run_fwd_cache(q, k_cache, v_cache, cu_seqlens_q, seqused_k, cache, params, num_splits=0, qv=None,
                  descale=None):
    """The forward over a KV cache addressed through ``cache`` (``problem.CacheAddressing``:
    cache_batch_idx, cache_leftpad, a page table, or a dense cache) or under packed queries
    (cu_seqlens_q): a decoding step runs the decode kernel (packed GQA, split keys) on every
    target; longer queries the portable forward (the Hopper forward reads K/V in TMA boxes
    of contiguous rows of one batch). ``descale``: fp8 inputs' (q, k, v) descales."""
    target = target_of(q.device)
    batch = cu_seqlens_q.shape[0] - 1 if cu_seqlens_q is not None else q.shape[0]
    if qv is None and decodes(params.max_seqlen_q, q.shape[-2], k_cache.shape[-2], batch):
        return decode.fwd(q, k_cache, v_cache, cu_seqlens_q, seqused_k, cache, params, target, num_splits,
                          descale=descale)
    if backend() == "hopper":
        raise NotImplementedError("triflash: the Hopper forward does not serve a KV cache with "
                                  "cache_batch_idx, cache_leftpad, a page table, varlen q or qv")
    cfg = configs.fwd_config(target, q.shape[-1], v_cache.shape[-1], fp8=descale is not None)
    return portable.fwd(q, k_cache, v_cache, cu_seqlens_q, None, None, seqused_k, params, cfg,
                        upcast=target == "interpret", cache=cache, qv=qv, descale=descale)


def run_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
            params, deterministic, dq=None, dk=None, dv=None):
    """(dq, dk, dv); given dq/dk/dv (any strides, e.g. views of one packed dqkv) are written."""
    if v.shape[-1] > 256:
        raise NotImplementedError(f"triflash: headdim_v={v.shape[-1]} has a forward only (the backward takes "
                                  "headdim_v up to 256, as FlashAttention-3's)")
    target = target_of(q.device)
    chosen = backend()
    if _try_hopper(chosen, target):
        why_not = hopper_bwd_supports(q, k, v, cu_seqlens_q, seqused_q, seqused_k, target)
        if not why_not:
            return hopper_bwd.bwd(dout, q, k, v, out, lse, params, deterministic,
                                  configs.SM90_HOPPER_BWD[kernel_head_dim(q.shape[-1])], dq=dq, dk=dk, dv=dv,
                                  cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                  seqused_q=seqused_q, seqused_k=seqused_k)
        if chosen == "hopper":
            raise NotImplementedError(f"triflash: the Hopper backward does not serve this case: {why_not}")
    elif chosen == "hopper":
        raise NotImplementedError(f"triflash: the Hopper backend needs an sm90 GPU, got target {target!r}")
    cfg = configs.bwd_config(target, q.shape[-1], v.shape[-1])
    use_atomics = cfg.atomic_dq and not deterministic
    return portable.bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q,
                        seqused_k, params, cfg, not use_atomics, upcast=target == "interpret",
                        dq=dq, dk=dk, dv=dv)
