"""triflash as torch's flash-attention kernel behind ``F.scaled_dot_product_attention``.

    import triflash                      # registers "triflash"; activates nothing
    from torch.nn.attention import activate_flash_attention_impl, restore_flash_attention_impl
    activate_flash_attention_impl("triflash")
    ...  # SDPA's flash backend (and varlen_attn) now run triflash's kernels on sm90
    restore_flash_attention_impl()       # torch's own flash kernel again

On sm90 torch >= 2.9 with a recent cuDNN tries cuDNN before flash, so activation also moves
flash just ahead of cuDNN in SDPA's priority order (``_prefer_flash``; restoring puts torch's
order back): a plain call goes to triflash, one with an attention mask still to cuDNN.

How torch's registry works (torch/nn/attention/_registry.py, torch >= 2.10; read at 2.11
and 2.14): ``register_flash_attention_impl(name, register_fn=fn)`` only records ``fn``;
``activate_flash_attention_impl(name)`` first restores (removes the active impl's handle),
then calls ``fn()``, which registers Python kernels for the CUDA dispatch key of aten's
flash ops through a ``torch.library.Library("aten", "IMPL", "CUDA")``, and keeps the handle
it returns; ``restore_flash_attention_impl()`` calls ``handle.remove()``, which destroys that
Library so that torch's builtin CUDA kernels are found again. torch's own FA4 module
(torch/nn/attention/_fa4.py) is the model: it overrides the ops below with the same
argument conventions, but raises on a case it does not serve. Here such a case goes to
the kernel that was registered before (``torch.library.get_kernel`` taken at activation,
called with the dispatcher's keyset), so activating triflash never makes a call fail that
torch's kernel would have run.

The ops (schemas: ``torch.ops.aten.<op>.default._schema``; identical at 2.11 and 2.14 except
where noted):

* ``_scaled_dot_product_flash_attention(query, key, value, dropout_p=0., is_causal=False,
  return_debug_mask=False, *, scale=None) -> (output, logsumexp, cum_seq_q, cum_seq_k,
  max_q, max_k, rng_state, unused, debug_attn_mask)``: what SDPA's flash backend calls, with
  (batch, heads, seqlen, dim) tensors, the head dim already padded to a multiple of 8 (and
  ``scale`` the unpadded one's), k/v with fewer heads under ``enable_gqa`` (flash takes GQA
  natively), never ``is_causal`` with seqlen_q != seqlen_k (torch's dispatcher refuses that
  to flash, whose causal mask is bottom-right aligned; ``CausalBias`` lower-right calls this
  op directly with ``is_causal=True`` for exactly that alignment). Returns output shaped and
  strided like query (the meta kernel's ``empty_like(query)``), logsumexp fp32 (batch, heads,
  seqlen_q), cum_seq_q/k undefined (None), max_q/max_k the seqlens, rng_state uint64 (2,),
  unused uint64 (), debug_attn_mask empty (0,) of query's dtype.
* ``_scaled_dot_product_flash_attention_backward(grad_out, query, key, value, out,
  logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, philox_seed,
  philox_offset, *, scale=None) -> (grad_query, grad_key, grad_value)``: autograd's formula
  for the above, handed its saved outputs; gradients strided like the inputs.
* ``_flash_attention_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k,
  dropout_p, is_causal, return_debug_mask, *, scale=None, window_size_left=None,
  window_size_right=None, seqused_k=None, alibi_slopes=None[, block_table=None,
  num_splits=None]) -> (output, softmax_logsumexp, rng_state, unused, debug_attn_mask)``:
  (batch, seqlen, heads, dim) tensors, or varlen (total, heads, dim) with int32 cum_seq_q/k
  (logsumexp (heads, total_q)); used by nested tensors, ``torch.nn.attention.varlen`` and
  by torch's own SDPA kernel underneath. ``block_table`` / ``num_splits``: torch >= 2.13.
* ``_flash_attention_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q,
  cum_seq_k, max_q, max_k, dropout_p, is_causal, rng_state, unused, *, scale=None,
  window_size_left=None, window_size_right=None) -> (dq, dk, dv)``.
* ``_flash_attention_forward_no_dropout_inplace(out!, query, ... as _flash_attention_forward
  without the output) -> softmax_logsumexp`` (torch >= 2.13, varlen_attn's ``out=``).

An op whose schema does not have the positional arguments above (another torch version)
is left to torch. Keyword arguments this module does not know are served only when None.

Served: fp16/bf16, equal head dims, multiple of 8 in 8..256, kv heads dividing q heads,
dropout_p == 0, no debug mask / alibi / block_table, a contiguous last dim, seqlen_k > 0,
CUDA tensors on an sm90 GPU (elsewhere triflash's portable kernels are not faster than
torch's FlashAttention-2). Windows as in FlashAttention-2 (torch's kernel): None or
negative is unbounded, a side >= seqlen_k is unbounded, ``is_causal`` sets the right side to
0; masks are bottom-right aligned, as in triflash. ``num_splits`` is a hint, ignored.
``torch.are_deterministic_algorithms_enabled()`` selects the deterministic backward.
"""
import inspect

import torch
from torch.nn.attention import SDPBackend

from .. import dispatch, ops
from ..kernels import problem

NAME = "triflash"
# why the backend is not registered with torch ("" once it is); set by register()
unavailable_reason = "triflash.integrations.sdpa.register() has not run"
# (op, reason) of the latest call handed to the previous kernel, for debugging
last_fallback = None

# The dispatch key the kernels are registered for: CUDA. Tests set "CPU" to run the whole
# activate / call / restore cycle through the dispatcher under Triton's interpreter.
_DISPATCH_KEY = "CUDA"
_active = None  # the _Handle of the active registration, if any

_HALF = (torch.float16, torch.bfloat16)


def available() -> bool:
    """Whether "triflash" is registered with torch's flash-attention registry."""
    return not unavailable_reason


def register() -> bool:
    """Register "triflash" with torch's registry (without activating it). Returns
    ``available()``; on a torch without the registry does nothing and sets
    ``unavailable_reason``."""
    global unavailable_reason
    reason = _registry_missing()
    if not reason:
        try:
            torch.nn.attention.register_flash_attention_impl(NAME, register_fn=activate_kernels)
        except Exception as e:  # pragma: no cover (a registry that changed its signature)
            reason = f"torch.nn.attention.register_flash_attention_impl failed: {e!r}"
    unavailable_reason = reason
    return not reason


def _registry_missing() -> str:
    attention = getattr(torch.nn, "attention", None)
    for name in ("register_flash_attention_impl", "activate_flash_attention_impl",
                 "restore_flash_attention_impl"):
        if not hasattr(attention, name):
            return (f"torch {torch.__version__} has no torch.nn.attention.{name} (the flash-attention "
                    "registry came with torch 2.10)")
    if "with_keyset" not in inspect.signature(torch.library.Library.impl).parameters:
        return f"torch {torch.__version__}'s torch.library.Library.impl has no with_keyset"
    return ""


# ---- registration (what activate_flash_attention_impl calls) -----------------------------

# op -> (method name, positional argument names the method expects, number of returns)
_FWD_ARGS = ("query", "key", "value", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p",
             "is_causal", "return_debug_mask")
_OPS = {
    "_scaled_dot_product_flash_attention": (
        "sdpa_forward", ("query", "key", "value", "dropout_p", "is_causal", "return_debug_mask"), 9),
    "_scaled_dot_product_flash_attention_backward": (
        "sdpa_backward", ("grad_out", "query", "key", "value", "out", "logsumexp", "cum_seq_q",
                          "cum_seq_k", "max_q", "max_k", "dropout_p", "is_causal", "philox_seed",
                          "philox_offset"), 3),
    "_flash_attention_forward": ("flash_forward", _FWD_ARGS, 5),
    "_flash_attention_backward": (
        "flash_backward", ("grad_out", "query", "key", "value", "out", "logsumexp", "cum_seq_q",
                           "cum_seq_k", "max_q", "max_k", "dropout_p", "is_causal", "rng_state",
                           "unused"), 3),
    "_flash_attention_forward_no_dropout_inplace": (
        "flash_forward_inplace", ("out",) + _FWD_ARGS, 1),
}


def _schema_matches(op_name: str) -> bool:
    """Whether the running torch has ``aten::op_name`` with the positional arguments (and
    number of returns) the method was written for."""
    packet = getattr(torch.ops.aten, op_name, None)
    if packet is None or "default" not in packet.overloads():
        return False
    schema = packet.default._schema
    positional = tuple(a.name for a in schema.arguments if not a.kwarg_only)
    _, expected, nreturns = _OPS[op_name]
    return positional == expected and len(schema.returns) == nreturns


def _previous_kernel(op_name: str, dispatch_key: str):
    """The kernel registered now for (op, key), to serve what triflash does not; None if
    there is none (or this torch cannot hand it out)."""
    get_kernel = getattr(torch.library, "get_kernel", None)
    if get_kernel is None:
        return None
    try:
        return get_kernel(getattr(torch.ops.aten, op_name).default, dispatch_key)
    except Exception:  # no kernel for this key
        return None


class _Handle:
    """What ``activate_flash_attention_impl`` keeps; ``remove()`` (restore) destroys the
    Library, so torch's kernels serve again, and puts back SDPA's priority order if
    activation changed it (``_prefer_flash``) and nothing changed it since."""

    def __init__(self, library, kernels, ops_registered, dispatch_key, priority=None):
        self.library = library
        self.kernels = kernels
        self.ops = ops_registered          # the aten ops overridden
        self.dispatch_key = dispatch_key
        self.priority = priority           # (order before, order set) from _prefer_flash

    def remove(self) -> None:
        global _active
        if self.library is not None:
            self.library._destroy()
            self.library = None
        if self.priority is not None:
            before, set_here = self.priority
            if list(torch._C._get_sdp_priority_order()) == set_here:
                torch._C._set_sdp_priority_order(before)
            self.priority = None
        if _active is self:
            _active = None


def _flash_first(order):
    """SDPA's backend priority ``order`` (ints of ``SDPBackend``) with flash moved just ahead
    of cuDNN; None where flash is ahead already."""
    flash, cudnn = int(SDPBackend.FLASH_ATTENTION), int(SDPBackend.CUDNN_ATTENTION)
    order = list(order)
    if flash not in order or cudnn not in order or order.index(flash) < order.index(cudnn):
        return None
    order.remove(flash)
    order.insert(order.index(cudnn), flash)
    return order


def _prefer_flash(dispatch_key):
    """On sm90 with a recent cuDNN, torch >= 2.9 tries cuDNN before flash
    (``check_prefer_cudnn_attention`` in aten's ``sdp_utils.cpp``), so a call cuDNN serves
    never reaches the flash backend, triflash. Move flash just ahead of cuDNN in SDPA's
    priority order; what flash does not take (an attention mask, ...) still goes to cuDNN.
    Returns (order before, order set), or None where nothing changed."""
    get_order = getattr(torch._C, "_get_sdp_priority_order", None)
    set_order = getattr(torch._C, "_set_sdp_priority_order", None)
    if dispatch_key != "CUDA" or get_order is None or set_order is None or not torch.cuda.is_available():
        return None
    device = torch.device("cuda", torch.cuda.current_device())
    if dispatch.target_of(device) != "sm90":
        return None
    # torch installs its default order once, at the first choice of a backend on a GPU; that
    # choice is made here, or a later call would replace the order set below
    x = torch.zeros(1, 1, 1, 8, device=device, dtype=torch.bfloat16)
    try:
        torch._fused_sdp_choice(x, x, x)
    except RuntimeError:  # every backend switched off by the user: the order does not matter now
        pass
    before = list(get_order())
    order = _flash_first(before)
    if order is None:
        return None
    set_order(order)
    return before, order


def activate_kernels(dispatch_key=None) -> _Handle:
    """The register_fn given to torch's registry: override the flash ops (those whose
    schema matches) for ``dispatch_key`` (default CUDA), each falling back to the kernel
    registered before it."""
    global _active
    key = dispatch_key or _DISPATCH_KEY
    if _active is not None:  # never take our own kernels for the previous ones
        _active.remove()
    names = [name for name in _OPS if _schema_matches(name)]
    kernels = Kernels({name: _previous_kernel(name, key) for name in names}, key)
    library = torch.library.Library("aten", "IMPL", key)  # noqa: TOR901
    extra = {"allow_override": True} if "allow_override" in inspect.signature(library.impl).parameters else {}
    try:
        for name in names:
            library.impl(name, getattr(kernels, _OPS[name][0]), key, with_keyset=True, **extra)
    except Exception:
        library._destroy()
        raise
    _active = _Handle(library, kernels, tuple(names), key, _prefer_flash(key))
    return _active


# ---- what triflash serves ----------------------------------------------------------------

_DEVICE_REASONS = {}


def _device_reason(device) -> str:
    if device.type == "cuda":
        reason = _DEVICE_REASONS.get(device)  # (asked on every call)
        if reason is None:
            reason = _DEVICE_REASONS[device] = "" if dispatch.target_of(device) == "sm90" else (
                f"{torch.cuda.get_device_name(device)} is not sm90 (triflash's portable kernels "
                "are not faster than torch's FlashAttention-2 there)")
        return reason
    if device.type == "cpu" and dispatch.interpreting():
        return ""  # Triton's interpreter (tests)
    return f"device {device}"


def _inputs_reason(q, k, v, varlen: bool) -> str:
    """'' when triflash serves attention over q, k, v in flash layout ((batch, seqlen,
    heads, dim), or (total, heads, dim) for varlen), else why not."""
    if q.dtype not in _HALF:
        return f"dtype {q.dtype} (triflash: fp16, bf16)"
    if k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtypes {q.dtype}, {k.dtype}, {v.dtype}"
    ndim = 3 if varlen else 4
    if q.dim() != ndim or k.dim() != ndim or v.dim() != ndim:
        return f"{q.dim()}-dim tensors (expected {ndim})"
    d = q.shape[-1]
    if d % 8 or not 8 <= d <= 256 or k.shape[-1] != d or v.shape[-1] != d:
        return f"head dims {d}, {k.shape[-1]}, {v.shape[-1]} (triflash: equal, a multiple of 8 in 8..256)"
    hq, hk = q.shape[-2], k.shape[-2]
    if v.shape[-2] != hk or hk == 0 or hq % hk:
        return f"heads {hq}, {hk}, {v.shape[-2]}"
    if k.shape[:-2] != v.shape[:-2] or (not varlen and k.shape[0] != q.shape[0]):
        return f"shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
    if k.shape[-3] == 0 or q.numel() == 0:
        return "an empty problem (seqlen_k, batch or heads 0)"
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        return "a head dim stride other than 1"
    if not (q.device == k.device == v.device):
        return "tensors on several devices"
    return _device_reason(q.device)


def _varlen_reason(q, cum_seq_q, cum_seq_k, seqused_k) -> str:
    if cum_seq_q is None and cum_seq_k is None:
        return "" if seqused_k is None else "seqused_k on a dense batch"
    if cum_seq_q is None or cum_seq_k is None:
        return "only one of cum_seq_q, cum_seq_k"
    batch1 = cum_seq_q.shape[0] if cum_seq_q.dim() == 1 else -1
    for t in (cum_seq_q, cum_seq_k) + ((seqused_k,) if seqused_k is not None else ()):
        if t.dtype != torch.int32 or t.dim() != 1 or not t.is_contiguous() or t.device != q.device:
            return "cum_seq / seqused_k not contiguous int32 vectors on q's device"
    if cum_seq_k.shape[0] != batch1 or batch1 < 1 or (seqused_k is not None and seqused_k.shape[0] != batch1 - 1):
        return "cum_seq_q, cum_seq_k, seqused_k lengths"
    return ""


def _extra_reason(extra) -> str:
    """Keyword arguments beyond those of torch 2.11's schemas: block_table (paged KV) is not
    served; num_splits is a performance hint; anything else is served only when None."""
    for name, value in extra.items():
        if name == "num_splits":
            continue
        if value is not None:
            return f"{name}" if name == "block_table" else f"argument {name}={value!r}"
    return ""


def _window(left, right, is_causal, seqlen_k):
    """FlashAttention-2's normalization (torch's mha_fwd / mha_bwd): None or negative is
    unbounded, a side >= seqlen_k is unbounded, causal sets right to 0."""
    left = -1 if left is None or left < 0 or left >= seqlen_k else int(left)
    right = -1 if right is None or right < 0 or right >= seqlen_k else int(right)
    if is_causal:
        right = 0
    return left, right


def _empty_like(x):
    """``torch.empty_like`` (the meta kernels' strides); NaN under the tests' poison mode."""
    y = torch.empty_like(x)
    if problem.POISON:
        y.fill_(float("nan"))
    return y


def _aux(q):
    """rng_state, unused, debug_attn_mask as torch's kernel returns them without dropout."""
    return (torch.zeros((2,), dtype=torch.uint64, device=q.device),
            torch.zeros((), dtype=torch.uint64, device=q.device),
            torch.empty(0, dtype=q.dtype, device=q.device))


def _lse_reason(lse, expected_shape) -> str:
    if lse.dtype != torch.float32 or tuple(lse.shape) != tuple(expected_shape) or lse.stride(-1) != 1:
        return f"logsumexp {lse.dtype} {tuple(lse.shape)} (expected float32 {tuple(expected_shape)})"
    return ""


def _grad_reason(grad_out, out, q) -> str:
    for name, t in (("grad_out", grad_out), ("out", out)):
        if t.dtype != q.dtype or t.shape != q.shape or t.device != q.device:
            return f"{name} {t.dtype} {tuple(t.shape)}"
    if out.stride(-1) != 1:
        return "out's head dim stride other than 1"
    return ""


class Kernels:
    """The overriding kernels, one method per op (each takes the dispatcher's keyset first),
    and the previous kernels (``torch._C._SafeKernelFunction``, or anything with a
    ``call_boxed(keyset, *args, **kwargs)``) they hand what they do not serve to."""

    def __init__(self, fallbacks, dispatch_key="CUDA"):
        self.fallbacks = dict(fallbacks)
        self.dispatch_key = dispatch_key

    def _fallback(self, op_name, reason, keyset, *args, **kwargs):
        global last_fallback
        last_fallback = (op_name, reason)
        kernel = self.fallbacks.get(op_name)
        if kernel is None:
            raise NotImplementedError(
                f"triflash's SDPA backend does not serve this call of aten::{op_name} ({reason}), "
                f"and no other {self.dispatch_key} kernel was registered for it")
        return kernel.call_boxed(keyset, *args, **kwargs)

    # -- SDPA's ops: (batch, heads, seqlen, dim) -----------------------------------------

    def sdpa_forward(self, keyset, query, key, value, dropout_p=0.0, is_causal=False,
                     return_debug_mask=False, *, scale=None, **extra):
        q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)  # views
        reason = ("dropout_p > 0" if dropout_p != 0.0 else "return_debug_mask" if return_debug_mask
                  else _extra_reason(extra) or _inputs_reason(q, k, v, varlen=False))
        if reason:
            return self._fallback("_scaled_dot_product_flash_attention", reason, keyset, query, key,
                                  value, dropout_p, is_causal, return_debug_mask, scale=scale, **extra)
        seqlen_q, seqlen_k = q.shape[1], k.shape[1]
        out = _empty_like(query)  # strided like query, as the meta kernel says
        left, right = _window(None, None, is_causal, seqlen_k)
        _, lse = _run_fwd(q, k, v, None, None, None, seqlen_q, seqlen_k, scale, left, right,
                          out.transpose(1, 2))
        return (out, lse, None, None, seqlen_q, seqlen_k) + _aux(query)

    def sdpa_backward(self, keyset, grad_out, query, key, value, out, logsumexp, cum_seq_q,
                      cum_seq_k, max_q, max_k, dropout_p, is_causal, philox_seed, philox_offset,
                      *, scale=None, **extra):
        q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)  # views
        reason = ("dropout_p > 0" if dropout_p != 0.0 else _extra_reason(extra)
                  or _inputs_reason(q, k, v, varlen=False) or _grad_reason(grad_out, out, query)
                  or _lse_reason(logsumexp, query.shape[:3]))
        if reason:
            return self._fallback("_scaled_dot_product_flash_attention_backward", reason, keyset,
                                  grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k,
                                  max_q, max_k, dropout_p, is_causal, philox_seed, philox_offset,
                                  scale=scale, **extra)
        dq, dk, dv = _empty_like(query), _empty_like(key), _empty_like(value)  # strided like the inputs
        left, right = _window(None, None, is_causal, k.shape[1])
        _run_bwd(grad_out.transpose(1, 2), q, k, v, out.transpose(1, 2), logsumexp, None, None,
                 q.shape[1], k.shape[1], scale, left, right,
                 dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2))
        return dq, dk, dv

    # -- the flash ops: (batch, seqlen, heads, dim) or varlen (total, heads, dim) --------

    def _flash_forward_reason(self, query, key, value, cum_seq_q, cum_seq_k, dropout_p,
                              return_debug_mask, seqused_k, alibi_slopes, extra):
        if dropout_p != 0.0:
            return "dropout_p > 0"
        if return_debug_mask:
            return "return_debug_mask"
        if alibi_slopes is not None:
            return "alibi_slopes"
        return (_extra_reason(extra) or _varlen_reason(query, cum_seq_q, cum_seq_k, seqused_k)
                or _inputs_reason(query, key, value, varlen=cum_seq_q is not None))

    def _flash_forward_run(self, out, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k,
                           is_causal, scale, window_size_left, window_size_right, seqused_k):
        varlen = cum_seq_q is not None
        seqlen_q, seqlen_k = (max_q, max_k) if varlen else (query.shape[1], key.shape[1])
        left, right = _window(window_size_left, window_size_right, is_causal, seqlen_k)
        _, lse = _run_fwd(query, key, value, cum_seq_q, cum_seq_k, seqused_k, seqlen_q, seqlen_k,
                          scale, left, right, out)
        return lse

    def flash_forward(self, keyset, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k,
                      dropout_p, is_causal, return_debug_mask, *, scale=None, window_size_left=None,
                      window_size_right=None, seqused_k=None, alibi_slopes=None, **extra):
        reason = self._flash_forward_reason(query, key, value, cum_seq_q, cum_seq_k, dropout_p,
                                            return_debug_mask, seqused_k, alibi_slopes, extra)
        if reason:
            return self._fallback(
                "_flash_attention_forward", reason, keyset, query, key, value, cum_seq_q, cum_seq_k,
                max_q, max_k, dropout_p, is_causal, return_debug_mask, scale=scale,
                window_size_left=window_size_left, window_size_right=window_size_right,
                seqused_k=seqused_k, alibi_slopes=alibi_slopes, **extra)
        out = _empty_like(query)
        lse = self._flash_forward_run(out, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k,
                                      is_causal, scale, window_size_left, window_size_right, seqused_k)
        return (out, lse) + _aux(query)

    def flash_forward_inplace(self, keyset, out, query, key, value, cum_seq_q, cum_seq_k, max_q,
                              max_k, dropout_p, is_causal, return_debug_mask, *, scale=None,
                              window_size_left=None, window_size_right=None, seqused_k=None,
                              alibi_slopes=None, **extra):
        reason = self._flash_forward_reason(query, key, value, cum_seq_q, cum_seq_k, dropout_p,
                                            return_debug_mask, seqused_k, alibi_slopes, extra)
        if not reason and (out.dtype != query.dtype or out.shape != query.shape
                           or out.device != query.device or out.stride(-1) != 1):
            reason = f"out {out.dtype} {tuple(out.shape)} stride {out.stride()}"
        if reason:
            return self._fallback(
                "_flash_attention_forward_no_dropout_inplace", reason, keyset, out, query, key, value,
                cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask,
                scale=scale, window_size_left=window_size_left, window_size_right=window_size_right,
                seqused_k=seqused_k, alibi_slopes=alibi_slopes, **extra)
        return self._flash_forward_run(out, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k,
                                       is_causal, scale, window_size_left, window_size_right, seqused_k)

    def flash_backward(self, keyset, grad_out, query, key, value, out, logsumexp, cum_seq_q,
                       cum_seq_k, max_q, max_k, dropout_p, is_causal, rng_state, unused, *,
                       scale=None, window_size_left=None, window_size_right=None, **extra):
        varlen = cum_seq_q is not None
        reason = ("dropout_p > 0" if dropout_p != 0.0 else _extra_reason(extra)
                  or _varlen_reason(query, cum_seq_q, cum_seq_k, None)
                  or _inputs_reason(query, key, value, varlen) or _grad_reason(grad_out, out, query)
                  or _lse_reason(logsumexp, (query.shape[1], query.shape[0]) if varlen
                                 else (query.shape[0], query.shape[2], query.shape[1])))
        if reason:
            return self._fallback(
                "_flash_attention_backward", reason, keyset, grad_out, query, key, value, out,
                logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, rng_state, unused,
                scale=scale, window_size_left=window_size_left, window_size_right=window_size_right,
                **extra)
        seqlen_q, seqlen_k = (max_q, max_k) if varlen else (query.shape[1], key.shape[1])
        left, right = _window(window_size_left, window_size_right, is_causal, seqlen_k)
        dq, dk, dv = _empty_like(query), _empty_like(key), _empty_like(value)
        _run_bwd(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, seqlen_q,
                 seqlen_k, scale, left, right, dq, dk, dv)
        return dq, dk, dv


def _scalars(q, seqlen_q, seqlen_k, scale, left, right):
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return ops.pack_scalars(int(seqlen_q), int(seqlen_k), scale, left, right, 0.0,
                            torch.are_deterministic_algorithms_enabled())


def _run_fwd(q, k, v, cu_q, cu_k, seqused_k, seqlen_q, seqlen_k, scale, left, right, out):
    """triflash's forward (ops._fwd_impl) into ``out``: (out, lse)."""
    ints, floats = _scalars(q, seqlen_q, seqlen_k, scale, left, right)
    return ops._fwd_impl(q, k, v, cu_q, cu_k, None, seqused_k, ints, floats, out=out)


def _run_bwd(dout, q, k, v, out, lse, cu_q, cu_k, seqlen_q, seqlen_k, scale, left, right, dq, dk, dv):
    """triflash's backward (ops._bwd_impl) into dq, dk, dv; deterministic as torch says."""
    ints, floats = _scalars(q, seqlen_q, seqlen_k, scale, left, right)
    return ops._bwd_impl(dout, q, k, v, out, lse, cu_q, cu_k, None, None, ints, floats,
                         dq=dq, dk=dk, dv=dv)
