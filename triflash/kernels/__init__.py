"""Kernels. Portable Triton tier: ``fwd.py``, ``bwd.py`` (host side in ``portable.py``);
shared concepts in ``common.py``; tile tables in ``configs.py``."""
