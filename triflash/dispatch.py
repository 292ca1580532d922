"""Dispatch: which kernel serves which case. Read top to bottom.

    target   = "interpret"  CPU tensors under TRITON_INTERPRET=1 (how CI tests kernel logic)
               "sm90"       Hopper (H100/H200)
               "default"    any other CUDA GPU Triton supports
    backend  = "portable"   triflash/kernels/{fwd,bwd}.py, Triton, every target

    forward:  portable forward, tile from configs.fwd_config(target, d, dv)
    backward: portable backward, tile from configs.bwd_config(target, d, dv);
              deterministic=True  -> dK/dV kernel + separate dQ kernel (no atomics)
              deterministic=False -> dK/dV kernel with fp32 atomic dQ, unless the tile
                                     says atomic_dq=False (then as deterministic=True)

A Hopper tier (Gluon) slots in here as another backend; until it exists every target uses
the portable kernels, and ``force_backend("portable")`` (or TRIFLASH_BACKEND=portable) is
what the benchmark uses to show the portable tier on its own.
"""
import contextlib
import os

import torch

from .kernels import configs, portable
from .kernels.fwd import flash_fwd_kernel

BACKENDS = ("auto", "portable")
_forced_backend = None


def interpreting() -> bool:
    """True when the kernels were built by Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return type(flash_fwd_kernel).__name__ == "InterpretedFunction"


def target_of(device: torch.device) -> str:
    if device.type == "cpu":
        return "interpret"
    major, _ = torch.cuda.get_device_capability(device)
    return "sm90" if major == 9 else "default"


def backend() -> str:
    chosen = _forced_backend or os.environ.get("TRIFLASH_BACKEND", "auto")
    if chosen not in BACKENDS:
        raise ValueError(f"TRIFLASH_BACKEND={chosen!r} is not one of {BACKENDS}")
    return chosen


@contextlib.contextmanager
def force_backend(name: str):
    """Run the enclosed calls on one backend ("auto" or "portable")."""
    global _forced_backend
    if name not in BACKENDS:
        raise ValueError(f"backend={name!r} is not one of {BACKENDS}")
    previous, _forced_backend = _forced_backend, name
    try:
        yield
    finally:
        _forced_backend = previous


def run_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, params):
    target = target_of(q.device)
    cfg = configs.fwd_config(target, q.shape[-1], v.shape[-1])
    return portable.fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, params,
                        cfg, upcast=target == "interpret")


def run_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
            params, deterministic, dq=None, dk=None, dv=None):
    """(dq, dk, dv); given dq/dk/dv (any strides, e.g. views of one packed dqkv) are written."""
    target = target_of(q.device)
    cfg = configs.bwd_config(target, q.shape[-1], v.shape[-1])
    use_atomics = cfg.atomic_dq and not deterministic
    return portable.bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q,
                        seqused_k, params, cfg, not use_atomics, upcast=target == "interpret",
                        dq=dq, dk=dk, dv=dv)
