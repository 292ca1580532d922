"""triflash: FlashAttention for NVIDIA Hopper written in Python (Triton), with
FlashAttention-3's API. ``import triflash as flash_attn_interface`` works.

Layout: interface.py (public API) -> validation.py -> ops.py (torch.library) ->
dispatch.py (which kernel serves which case) -> kernels/ (portable Triton tier).
"""
from .dispatch import force_backend
from .interface import (_flash_attn_backward, _flash_attn_forward, flash_attn_func,
                        flash_attn_qkvpacked_func, flash_attn_varlen_func, flash_attn_combine,
                        flash_attn_with_kvcache, get_scheduler_metadata)
from .validation import set_check_inputs


def _register_sdpa_backend():
    """Offer triflash to torch's SDPA (``torch.nn.attention.activate_flash_attention_impl(
    "triflash")``); activates nothing, and never makes ``import triflash`` fail
    (``triflash.integrations.sdpa.available()`` / ``unavailable_reason`` say why not)."""
    try:
        from .integrations import sdpa
        sdpa.register()
    except Exception:  # pragma: no cover
        pass


_register_sdpa_backend()


def _register_fa3_ops():
    """FlashAttention-3's ``torch.ops.flash_attn_3`` operators, served by triflash where FA3
    is not installed (``triflash.integrations.fa3_ops``); never makes ``import triflash`` fail."""
    try:
        from .integrations import fa3_ops
        fa3_ops.register()
    except Exception:  # pragma: no cover
        pass


_register_fa3_ops()

__version__ = "0.1.0"
__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_qkvpacked_func",
           "flash_attn_with_kvcache", "flash_attn_combine", "get_scheduler_metadata", "force_backend", "set_check_inputs",
           "_flash_attn_forward", "_flash_attn_backward"]  # (FA3's low-level pair, which callers import by name)
