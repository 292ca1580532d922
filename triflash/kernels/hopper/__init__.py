"""Hopper tier (Gluon): FlashAttention forward/backward for sm_90a written in Triton's Gluon
dialect (wgmma, TMA, mbarrier, warp specialization: a TMA loader warp and consumer
warpgroups). ``triflash/dispatch.py`` routes sm90 calls here where ``hopper_fwd_supports`` /
``hopper_bwd_supports`` accept the case (head dims 64, 96, 128, 192, 256 with headdim ==
headdim_v, dense or varlen batches); everything else runs the portable Triton tier.

* ``fwd.py``: the forward kernel and its host side (``fwd``); tiles in
  ``configs.SM90_HOPPER_FWD``.
* ``fwd_loader.py``: the forward's TMA loader warp and the walk of tiles (and split-tail
  pieces) it shares with the consumers.
* ``split_combine.py``: merges the pieces of a forward whose last round of tiles was cut
  along the keys (``split_keys``).
* ``bwd.py``: the dK/dV kernel at head dims 64 / 96 / 128 (dQ inside it by TMA reduce-add
  where the tile says ``atomic_dq``), the statistics kernel and the backward's host side
  (``bwd``); tiles in ``configs.SM90_HOPPER_BWD``.
* ``bwd256.py``: the dK/dV kernel at head dims 192 / 256 (head-dim axis split over the two
  consumer warpgroups).
* ``bwd_loader.py``: the TMA loader warp both dK/dV kernels share (K / V once, then the
  Q / dO / lse / Delta rings).
* ``bwd_dq.py``: the separate dQ kernel (no atomics, bitwise reproducible).
* ``common.py``: what the kernels share (layouts, TMA descriptors, schedules, launches
  without Triton's per-call binding, launch plans; 96 / 192 computed as 128 / 256).

The sm_90a compile check of every dispatched tile without a GPU (``tools/compile_check.py``)
and a minimal kernel of the building blocks compiled the same way (``tools/smoke.py``) live
beside the package in the repository's ``tools/``, not installed.

How the kernels work and why: docs/hopper.md.
"""
