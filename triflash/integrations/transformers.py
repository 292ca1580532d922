"""triflash as an attention implementation of Hugging Face transformers (>= 4.56).

    import torch
    from transformers import AutoModelForCausalLM
    from triflash.integrations.transformers import register

    name = register()                     # "trifa3"; registers the attention and mask functions
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation=name)
    # or, on a model already built: model.set_attn_implementation(name)

What it serves, with transformers' own FlashAttention path (integrations/flash_attention.py,
modeling_flash_attention_utils.py) as the convention: dense batches; padded batches (a 2-D
padding mask, left or right padding: unpadded to flash_attn_varlen_func; causal attention
re-padded with zeros at padding queries, non-causal attention, cross-attention included, with
every query seeing every valid key, as eager); packed sequences (``cu_seq_lens_q/k`` and
``max_length_q/k`` as DataCollatorWithFlattening(return_flash_attn_kwargs=True) gives them,
or, without an attention mask, ``position_ids`` that restart inside a row, in a batch of any
size: each row's documents apart, as the sdpa and eager masks read them when no mask and no
cache is given; a batch of one packs also beside an all-ones mask or a cache, as
transformers' FlashAttention path does); causal and non-causal (``module.is_causal`` or the
``is_causal`` argument) attention; ``sliding_window=w`` as ``window_size=(w - 1, w - 1)``:
w keys up to and including the query's own when causal, ``w - 1`` on each side when not
(ModernBERT passes its half window + 1); ``softcap``; GQA/MQA natively (no repeat_kv);
generate() with dynamic, sliding-window and static caches (causal attention is
bottom-right aligned, so a query block sees the whole cache before it); attention sinks
(``s_aux``, gpt-oss: FA4's ``learnable_sink``, trained through their gradient).

What it refuses, with an error naming the argument: a sliding window over padding that lies
between a sequence's tokens (the window would count tokens, not positions), attention
dropout (``dropout`` > 0: set ``attention_dropout=0.0`` in the config, or ``model.eval()``),
additive position biases (``position_bias``), 4-D or custom masks (``or_mask_function`` /
``and_mask_function``, a 4-D ``attention_mask``), chunked attention longer than its chunk,
paged caches (``block_table``), fp32 tensors outside autocast (triflash computes in fp16 and
bf16), and a registered name that transformers would route elsewhere (see ``register``).
Like transformers' FlashAttention path, a ``block_sequence_ids`` overlay is not seen here.

transformers is imported by ``register`` only; ``import triflash`` does not import it.
"""
import os

import torch
import torch.nn.functional as F

DEFAULT_NAME = "trifa3"
_HALF = (torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------- registration

def _check_name(name):
    """transformers reads meaning into some names (modeling_utils.py
    _check_and_adjust_attn_implementation / get_correct_attn_implementation,
    utils/generic.py is_flash_attention_requested, integrations/hub_kernels.py is_kernel)."""
    if not isinstance(name, str) or not name or name != name.strip():
        raise ValueError(f"register(name={name!r}): expected a non-empty string without surrounding spaces")
    if "flash" in name:
        raise ValueError(
            f"register(name={name!r}): transformers treats every attn_implementation containing 'flash' as its own "
            "FlashAttention path (utils/generic.py is_flash_attention_requested): it would try to load a flash-attn "
            "package or hub kernel named after it instead of calling triflash. Pick a name without 'flash', "
            f"e.g. the default {DEFAULT_NAME!r}.")
    for part, why in (("sdpa", "its SDPA checks (and fallback to eager)"), ("flex_attention", "its flex-attention checks"),
                      ("|", "its 'paged|' prefixes"), ("/", "a hub kernel repository (owner/name) to download"),
                      (":", "a hub kernel reference")):
        if part in name:
            raise ValueError(f"register(name={name!r}): a name containing {part!r} triggers {why} in transformers; "
                             f"pick another, e.g. {DEFAULT_NAME!r}")
    if name == "eager":
        raise ValueError("register(name='eager'): 'eager' is transformers' reference implementation; pick another name")


def register(name=DEFAULT_NAME):
    """Register triflash with transformers' ``AttentionInterface`` and ``AttentionMaskInterface``
    under ``name`` and return it, for ``attn_implementation=name`` (from_pretrained,
    from_config) or ``model.set_attn_implementation(name)``. Idempotent.

    ``name`` must not contain ``"flash"`` (so not "triflash"): transformers routes any such
    name to its own FlashAttention loader. ``"sdpa"``, ``"flex_attention"``, ``"|"``, ``"/"``,
    ``":"`` and ``"eager"`` are refused for the same reason."""
    _check_name(name)
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as e:  # transformers missing, or older than the mask interface (4.53)
        raise ImportError("triflash.integrations.transformers needs transformers>=4.56 "
                          "(pip install 'triflash[transformers]')") from e
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, attention_mask)
    return name


# ----------------------------------------------------------------------------- mask function

def attention_mask(batch_size, q_length=None, kv_length=None, q_offset=0, kv_offset=0, mask_function=None,
                   attention_mask=None, cache_position=None, use_vmap=False, local_size=None, config=None,
                   device=None, **kwargs):
    """The mask function for ``AttentionMaskInterface``: a 2-D boolean key mask (batch,
    keys), True where a key takes part, or None when every key does (the dense path).

    As transformers' ``flash_attention_mask`` (masking_utils.py), the pattern itself (causal,
    sliding window, packed sequences) is left to the attention function, which knows it from
    its arguments; this only carries padding. Beyond that mask it also cuts the keys that do
    not exist yet: a static cache hands the attention all ``max_cache_len`` rows, and
    generate() drops an all-ones attention_mask for every implementation whose name lacks
    "flash" (generation/utils.py), so the mask is the only place that knows how many rows
    hold tokens. transformers 4.x passes ``cache_position`` instead of q_length / q_offset.
    """
    if use_vmap:
        raise NotImplementedError(
            "triflash: custom or_mask_function / and_mask_function masks are not supported (triflash serves "
            "causal, sliding-window, padding and packed-sequence masks only); use attn_implementation='sdpa'")
    if q_length is None:
        if cache_position is None:
            raise TypeError("triflash mask function: expected q_length/q_offset (transformers 5) or cache_position (4.x)")
        q_length, q_offset = cache_position.shape[0], cache_position[0]
        device = cache_position.device if device is None else device
    chunk = getattr(config, "attention_chunk_size", None) if config is not None else None
    if chunk is not None and local_size == chunk and kv_length + kv_offset > chunk:
        raise NotImplementedError(
            f"triflash: chunked attention (attention_chunk_size={chunk}) over {kv_length + kv_offset} keys is not "
            "supported; use attn_implementation='sdpa'")
    # Keys kv_offset + j with j >= live do not hold a token yet (a static cache's empty rows).
    live = int(q_offset + q_length - kv_offset)
    if live < kv_length and not _sees_future(mask_function, q_offset + q_length - 1, q_offset + q_length, device):
        n = live
    else:  # all kv_length keys exist (or cross-attention: the keys are another sequence)
        n = kv_length
    if attention_mask is None:
        if n == kv_length:
            return None
        return torch.ones(batch_size, n, dtype=torch.bool, device=device)
    attention_mask = attention_mask.bool()
    if kv_offset > 0 and attention_mask.shape[-1] == n:
        # this function's own output handed back (generate() builds a static cache's masks once and
        # the model builds them again from that 2-D mask): already the keys kv_offset .., not
        # absolute positions, which would reach at least kv_offset + n here
        return None if bool(attention_mask.all()) and n == kv_length else attention_mask
    # The 2-D mask indexes absolute positions, keys are kv_offset .. kv_offset + kv_length - 1 (as sdpa_mask).
    short = kv_offset + kv_length - attention_mask.shape[-1]
    if short > 0:
        attention_mask = F.pad(attention_mask, (0, short), value=False)
    attention_mask = attention_mask[:, kv_offset:kv_offset + n]
    if n == kv_length and bool(attention_mask.all()):
        return None
    return attention_mask


def _sees_future(mask_function, q_idx, kv_idx, device):
    """Whether the mask pattern lets query q_idx see key kv_idx > q_idx (bidirectional: True;
    causal, sliding, chunked: False). None (no pattern given) counts as causal."""
    if mask_function is None:
        return False
    t = lambda x: torch.as_tensor(x, device=device).reshape(1, 1, 1, 1)  # noqa: E731
    return bool(mask_function(t(0), t(0), t(q_idx), t(kv_idx)).all())


# ----------------------------------------------------------------------------- attention function

_warned = set()


def _warn_once(msg):
    if msg not in _warned:
        _warned.add(msg)
        import warnings
        warnings.warn(msg, stacklevel=3)


def _compute_dtype(query, module):
    """fp16/bf16 as is; fp32 under autocast -> the autocast dtype; fp32 with half-precision
    Linear weights (PEFT's fp32 norms) -> their dtype, as transformers' get_target_dtype."""
    if query.dtype in _HALF:
        return query.dtype
    target = None
    if query.dtype == torch.float32:
        device_type = query.device.type
        if torch.is_autocast_enabled(device_type):
            target = torch.get_autocast_dtype(device_type)
        elif module is not None:
            linear = next((m for m in module.modules() if isinstance(m, torch.nn.Linear)), None)
            target = linear.weight.dtype if linear is not None else None
    if target not in _HALF:
        raise TypeError(
            f"triflash: query dtype {query.dtype}: triflash computes attention in float16 or bfloat16; load the model "
            "with dtype=torch.bfloat16 (or float16), or run it under torch.autocast")
    return target


def _window(sliding_window):
    if sliding_window is None:
        return (-1, -1)
    w = int(sliding_window)
    if w != sliding_window or w < 1:
        raise ValueError(f"triflash: sliding_window={sliding_window!r}: expected an int >= 1 (keys in the window)")
    # transformers' flash path (modeling_flash_attention_utils.py _process_flash_attention_kwargs):
    # window w means w keys counting the query's own, so w - 1 to the left (and right, non-causal).
    return (w - 1, w - 1)


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                      softcap=None, is_causal=None, s_aux=None, **kwargs):
    """transformers' attention-function signature: query (batch, heads, seqlen_q, dim), key,
    value (batch, kv_heads, seqlen_k, dim[_v]); returns (out (batch, seqlen_q, heads, dim_v), None)."""
    import triflash

    if dropout:
        raise NotImplementedError(
            f"triflash: dropout={dropout}: attention dropout is not implemented; set the config's attention_dropout "
            "to 0.0 (or call model.eval())")
    if kwargs.get("position_bias") is not None:
        raise NotImplementedError("triflash: position_bias (additive attention biases) is not supported; "
                                  "use attn_implementation='sdpa'")
    if kwargs.get("block_table") is not None:
        raise NotImplementedError("triflash: block_table (paged KV caches, continuous batching) is not supported")
    if kwargs.get("output_attentions", False):
        _warn_once("triflash does not return attention weights (output_attentions=True); they are None")
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(f"triflash: expected query/key/value of 4 dims (batch, heads, seqlen, dim), got "
                         f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    causal = bool(causal)
    dtype = _compute_dtype(query, module)
    batch, _, seqlen_q, _ = query.shape
    # (batch, seqlen, heads, dim): transposed views, as FlashAttention reads them
    q, k, v = (x.transpose(1, 2).to(dtype) for x in (query, key, value))
    deterministic = kwargs.get("deterministic")
    if deterministic is None:
        deterministic = (os.environ.get("FLASH_ATTENTION_DETERMINISTIC", "0") == "1"
                         or torch.are_deterministic_algorithms_enabled())
    common = dict(softmax_scale=None if scaling is None else float(scaling), causal=causal,
                  window_size=_window(sliding_window), softcap=0.0 if softcap is None else float(softcap),
                  deterministic=bool(deterministic), learnable_sink=s_aux)
    if q.numel() == 0 or k.shape[1] == 0:
        return q.new_zeros(*q.shape[:3], v.shape[-1]), None

    if attention_mask is not None:
        out = _padded(q, k, v, attention_mask, common, triflash)
    elif kwargs.get("cu_seq_lens_q") is not None or kwargs.get("cu_seq_lens_k") is not None:
        out = _flattened(q, k, v, kwargs, common, triflash)
    elif (cu := _packed_cu_seqlens(kwargs.get("position_ids"), batch, seqlen_q)) is not None:
        if k.shape[1] != seqlen_q:
            raise ValueError(f"triflash: packed position_ids with {seqlen_q} queries but {k.shape[1]} keys (a cache): "
                             "packed sequences are for training and prefill without a cache")
        max_len = int(cu.diff().max())
        out = triflash.flash_attn_varlen_func(q.reshape(-1, *q.shape[2:]), k.reshape(-1, *k.shape[2:]),
                                              v.reshape(-1, *v.shape[2:]), cu, cu, max_len, max_len, **common)
        out = out.view(batch, seqlen_q, *out.shape[1:])
    else:
        out = triflash.flash_attn_func(q, k, v, **common)
    return out, None


def _flattened(q, k, v, kwargs, common, triflash):
    """DataCollatorWithFlattening(return_flash_attn_kwargs=True): the batch is one stream of
    documents with boundaries cu_seq_lens_q/k; max_length_q/k may be ints or 0-d tensors."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    cu_q = cu_k if cu_q is None else cu_q
    cu_k = cu_q if cu_k is None else cu_k
    cu_q, cu_k = (c.to(device=q.device, dtype=torch.int32).contiguous() for c in (cu_q, cu_k))
    max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
    max_q = int(cu_q.diff().max()) if max_q is None else int(max_q)
    max_k = int(cu_k.diff().max()) if max_k is None else int(max_k)
    batch, seqlen_q = q.shape[:2]
    out = triflash.flash_attn_varlen_func(q.reshape(-1, *q.shape[2:]), k.reshape(-1, *k.shape[2:]),
                                          v.reshape(-1, *v.shape[2:]), cu_q, cu_k, max_q, max_k, **common)
    return out.view(batch, seqlen_q, *out.shape[1:])


def _packed_cu_seqlens(position_ids, batch, seqlen_q):
    """cu_seqlens (int32) over the batch's flattened tokens when position_ids pack several
    sequences into a row, else None. A new sequence starts at every row and wherever the
    position does not follow the previous one by 1, the rule of the sdpa/eager masks
    (masking_utils.py find_packed_sequence_indices, per row; position_ids of one row apply to
    every row). transformers' FlashAttention path reads packing from a batch of one only."""
    if position_ids is None or seqlen_q == 1 or position_ids.dim() != 2 or position_ids.shape[-1] != seqlen_q \
            or position_ids.shape[0] not in (1, batch):
        return None
    pos = position_ids.expand(batch, seqlen_q)
    restart = pos.diff(dim=-1) != 1  # (batch, seqlen_q - 1): token j + 1 starts a sequence
    if not bool(restart.any()):
        return None
    starts = F.pad(restart, (1, 0), value=True).flatten().nonzero().flatten().to(torch.int32)
    end = torch.full((1,), batch * seqlen_q, dtype=torch.int32, device=pos.device)
    return torch.cat([starts, end])


def _window_sees_padding(mask, seqlen_q, left, right):
    """Whether a valid query's window (``left`` keys before its position, ``right`` after)
    holds a padding key that lies between two valid keys: unpadded, the window would count
    tokens there instead of positions. (Padding before the first or after the last valid key
    moves every token alike.)"""
    n = mask.shape[1]
    seen = mask.int().cumsum(-1)
    inner = ~mask & (seen > 0) & (seen < seen[:, -1:])
    before = F.pad(inner.int().cumsum(-1), (1, 0))  # before[:, j]: inner padding keys in [0, j)
    pos = torch.arange(n - seqlen_q, n, device=mask.device)
    lo = (pos - left).clamp(min=0)
    hi = (pos + right + 1).clamp(max=n)
    inside = before[:, hi] - before[:, lo]
    return bool(((inside > 0) & mask[:, n - seqlen_q:]).any())


def _padded(q, k, v, mask, common, triflash):
    """A 2-D key mask (batch, keys) from the mask function: unpad, flash_attn_varlen_func,
    re-pad (zeros at padding queries), as transformers' _upad_input / _pad_input."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(
            f"triflash: attention_mask of shape {shape}: triflash takes the 2-D padding mask its registered mask "
            "function builds (register()); a 4-D or custom mask needs attn_implementation='sdpa' or 'eager'")
    batch, seqlen_q = q.shape[:2]
    n = mask.shape[1]
    if mask.shape[0] != batch or k.shape[1] < n:
        raise ValueError(f"triflash: attention_mask of shape {tuple(mask.shape)} for {batch} sequences of "
                         f"{k.shape[1]} keys")
    if k.shape[1] > n:  # a static cache's rows past the last token
        k, v = k[:, :n], v[:, :n]
    mask = mask.to(device=q.device, dtype=torch.bool)
    lens_k = mask.sum(-1, dtype=torch.int32)
    cu_k = F.pad(lens_k.cumsum(0, dtype=torch.int32), (1, 0))
    idx_k = mask.flatten().nonzero().flatten()
    k_un = k.reshape(-1, *k.shape[2:]).index_select(0, idx_k)
    v_un = v.reshape(-1, *v.shape[2:]).index_select(0, idx_k)
    windowed = common["window_size"] != (-1, -1)
    if common["causal"] or (windowed and seqlen_q == n):
        # Self-attention: the queries are the last seqlen_q keys (a cache holds the ones before),
        # so the valid queries are the last of each sequence's valid keys and causal attention
        # aligned bottom-right per sequence is exact for left, right or inner padding; a window
        # counts the tokens left, which are the positions only while no padding lies between them.
        if seqlen_q > n:
            raise ValueError(f"triflash: {seqlen_q} queries but {n} keys in causal attention")
        left, right = common["window_size"]
        if windowed and _window_sees_padding(mask, seqlen_q, left, 0 if common["causal"] else right):
            raise NotImplementedError(
                "triflash: sliding_window over padding between a sequence's tokens (e.g. a right-padded prompt "
                "followed by generated tokens): the window would count tokens, not positions; pad on the left, "
                "or use attn_implementation='sdpa'")
        qmask = mask[:, n - seqlen_q:]
    else:
        # Without a causal mask or a window every query sees every valid key: cross-attention (the
        # keys are another sequence, whatever its length), or an encoder, whose padding queries
        # get what eager gives them.
        if windowed:
            raise NotImplementedError("triflash: sliding_window in non-causal attention with a padding mask and a "
                                      "different number of queries and keys is ambiguous")
        qmask = torch.ones(batch, seqlen_q, dtype=torch.bool, device=q.device)
    lens_q = qmask.sum(-1, dtype=torch.int32)
    cu_q = F.pad(lens_q.cumsum(0, dtype=torch.int32), (1, 0))
    idx_q = qmask.flatten().nonzero().flatten()
    q_un = q.reshape(-1, *q.shape[2:]).index_select(0, idx_q)
    out_un = triflash.flash_attn_varlen_func(q_un, k_un, v_un, cu_q, cu_k, int(lens_q.max()), int(lens_k.max()),
                                             **common)
    out = out_un.new_zeros(batch * seqlen_q, *out_un.shape[1:]).index_copy(0, idx_q, out_un)
    return out.view(batch, seqlen_q, *out.shape[1:])
