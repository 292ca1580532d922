"""Hopper tier (Gluon): FlashAttention forward/backward for sm_90a written in Triton's Gluon
dialect (wgmma, TMA, mbarrier, warp specialization).

UNDER CONSTRUCTION. Nothing here is dispatched yet: ``triflash.dispatch`` never routes to
this package. What exists so far is ``smoke.py``, a minimal kernel that exercises the
building blocks (TMA load into NVMMA-swizzled shared memory completing on an mbarrier, one
``warpgroup_mma``) and a CPU-only sm_90a compile of it; the plan is ``docs/hopper-tier.md``.
"""
