"""Integrations of triflash into other libraries' extension points; each imports its library
only when used.

``sdpa``: a backend for ``torch.nn.functional.scaled_dot_product_attention`` through torch's
flash-attention registry (torch >= 2.10), registered by ``import triflash``, never activated
by it: ``torch.nn.attention.activate_flash_attention_impl("triflash")``.

``transformers``: ``register()`` adds an attention implementation to Hugging Face
transformers (``AttentionInterface`` and ``AttentionMaskInterface``) and returns its name.

``vllm``: vLLM's FlashAttention API (``vllm.vllm_flash_attn``) on triflash; ``install()``, or
``TRIFLASH_VLLM=1`` through triflash's vLLM plugin, points vLLM's FlashAttention backend at it.
"""
