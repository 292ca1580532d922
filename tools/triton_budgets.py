"""The sm_90a compile checks' spill budgets that depend on the Triton release, in one place.

Each release of the support matrix (``triflash.versions.MATRIX``) allocates registers its own
way. The budgets written beside each check hold under triton 3.6, the release the H200 numbers
were measured on:

* ``"portable"``: the portable and backward Triton kernels, ``tools/sm90_report.py``
  (``SPILL_BUDGET`` by job id, ``SPILL_RULES`` by variant and head dim); here job id ->
  (bytes, reason);
* ``"hopper"``: the Gluon kernels, ``tests/test_hopper_compile.py`` (its ``HOPPER_*_SPILL_BUDGET``
  tables); here table name -> {(feature, head dim): bytes};
* ``"decode"``: the decode kernel, ``tests/test_decode.py`` (16 B a form); here form -> bytes.

Where another release spills more, ``BY_TRITON[release][check]`` holds its budget, measured
under it, which replaces the 3.6 one. For a new release: run ``pytest tests -m sm90`` under
it; for each launch over budget, the budget is the next multiple of 32 B at least 16 B above
what it spilled, with the measured bytes beside it.
"""
from typing import Dict

from triflash.versions import triton_release

CHECKS = ("portable", "hopper", "decode")

_TRITON37 = ("triton 3.7's register allocation spills a little more here than 3.6's (measured by "
             "the report under triton 3.7.1); not run on the H200 under 3.7")
_TRITON38 = ("triton 3.8's register allocation spills more here than 3.6's (measured by the "
             "report under triton 3.8.0); the H200 GPU suite and benchmark ran under 3.8 too")
_TRITON39 = ("triton 3.9's register allocation spills more here than 3.6's and 3.8's (measured by "
             "the report under triton 3.9.0); the GPU suite and the 8k cases ran under 3.9 on an H100")

BY_TRITON: Dict[str, Dict[str, dict]] = {
    # Triton 3.7 (torch 2.12 / 2.13): the portable forward and the Gluon backward under the
    # causal mask hold a few more words than under 3.6 (measured under 3.7.1, bf16 and fp16,
    # dense and varlen); the Hopper tier has not run on the H200 under 3.7.
    "3.7": {
        "portable": {
            "fwd-d72-bf16-all": (12288, f"{_TRITON37}: 12272 B"),
            "fwd+paged-d72-bf16-kvcache-varlen": (6432, f"{_TRITON37}: 6404 B"),
            "fwd-d96-bf16-causal": (96, f"{_TRITON37}: 72 B"),
            "fwd+paged-d96-bf16-kvcache": (96, f"{_TRITON37}: 80 B"),
            "fwd+paged-d96-bf16-kvcache-varlen": (128, f"{_TRITON37}: 88 B"),
            "fwd-d128-bf16-causal": (96, f"{_TRITON37}: 72 B"),
            "fwd-d192-bf16-all": (256, f"{_TRITON37}: 212 B"),
            "fwd+paged-d192-bf16-kvcache": (64, f"{_TRITON37}: 32 B"),
            "fwd+paged-d192-bf16-kvcache-varlen": (128, f"{_TRITON37}: 88 B"),
            "fwd-d256-bf16-all": (256, f"{_TRITON37}: 216 B"),
        },
        "hopper": {
            "HOPPER_BWD_SPILL_BUDGET": {("causal", 256): 96},  # 76 B
            "HOPPER_BWD_ATOMIC_SPILL_BUDGET": {("causal", 128): 32},  # 8 B
        },
        # the dense form at head dim 256: 32 B (16 B under 3.6); not timed
        "decode": {"d256-dense": 64},
    },
    # Triton 3.8: the Gluon forward at 64 with three consumers and the varlen forward at 128
    # hold sequence bookkeeping in spilled words; the H200 GPU suite and benchmark ran under
    # 3.8 (benchmarks/results/*-triton3.8*).
    "3.8": {
        "portable": {
            "bwd_dq-d64-bf16-all": (1152, f"{_TRITON38}: 1140 B"),
            "bwd_dq-d72-bf16-all": (4224, f"{_TRITON38}: 4192 B"),
            "fwd-d64-bf16-all": (1216, f"{_TRITON38}: 1192 B when every block's Q / O rows were 64-bit"),
            "fwd+paged-d64-bf16-kvcache-varlen": (384, f"{_TRITON38}: 332 B when every block's Q / O rows "
                                                       f"were 64-bit"),
            "fwd-d128-bf16-plain": (96, f"{_TRITON38}: 72 B"),
            "fwd-d128-fp16-plain": (96, f"{_TRITON38}: 80 B"),
            "fwd-d192-bf16-all": (256, f"{_TRITON38}: 216 B"),
            "fwd-d256-bf16-all": (256, f"{_TRITON38}: 228 B"),
            "fwd+paged-d192-bf16-kvcache": (64, f"{_TRITON38}: 32 B"),
            "fwd+paged-d192-bf16-kvcache-varlen": (128, f"{_TRITON38}: 104 B"),
        },
        "hopper": {
            "HOPPER_FWD_3WG_SPILL_BUDGET": {("causal", 64): 288, ("window-softcap", 64): 448},  # 272, 416 B
            "HOPPER_FWD_3WG_VARLEN_SPILL_BUDGET": {("plain", 64): 832},  # 800 B
            "HOPPER_FWD_VARLEN_SPILL_BUDGET": {("plain", 128): 1024},  # 968 B (976 B at 96)
            # dK/dV under the causal mask at 256: 68 B dense, 44 B varlen
            "HOPPER_BWD_SPILL_BUDGET": {("causal", 256): 128},
            "HOPPER_BWD_ATOMIC_SPILL_BUDGET": {("causal", 128): 32},  # 8 B
        },
    },
    # Triton 3.9 (ptxas 13.4 for sm_90 with --regAllocOptLevel=2, and its dummy moves before
    # each wgmma reading A from registers): every Gluon kernel spills more than under 3.8.
    # Measured under 3.9.0 (bf16 and fp16, the largest of dense / varlen / KV-cache form in
    # each Gluon table). The 8k cases under 3.9 ran at 0.955-1.082x their 3.6 speed on an H100
    # (benchmarks/results/bench-8k-64338f2-triton3.9-vs-3.6-h100.txt).
    "3.9": {
        "portable": {
            "fwd-d64-bf16-all": (1696, f"{_TRITON39}: 1656 B"),
            "fwd+paged-d64-bf16-kvcache": (608, f"{_TRITON39}: 572 B"),
            "fwd+paged-d64-bf16-kvcache-varlen": (608, f"{_TRITON39}: 580 B"),
            "fwd-d96-bf16-plain": (256, f"{_TRITON39}: 220 B"),
            "fwd-d96-bf16-causal": (256, f"{_TRITON39}: 224 B"),
            "fwd-d96-bf16-all": (416, f"{_TRITON39}: 388 B"),
            "fwd-d128-bf16-plain": (224, f"{_TRITON39}: 180 B"),
            "fwd-d128-fp16-plain": (224, f"{_TRITON39}: 180 B"),
            "fwd-d128-bf16-causal": (256, f"{_TRITON39}: 224 B"),
            "fwd-d128-bf16-all": (416, f"{_TRITON39}: 388 B"),
            "fwd-d192-bf16-causal": (352, f"{_TRITON39}: 312 B"),
            "fwd-d192-bf16-all": (960, f"{_TRITON39}: 920 B"),
            "fwd-d256-bf16-causal": (352, f"{_TRITON39}: 328 B"),
            "fwd-d256-bf16-all": (960, f"{_TRITON39}: 920 B"),
            "bwd_dq-d192-bf16-all": (128, f"{_TRITON39}: 104 B"),
            "bwd_dq-d256-bf16-all": (128, f"{_TRITON39}: 104 B"),
            "fwd+paged-d192-bf16-kvcache": (64, f"{_TRITON39}: 40 B"),
            "fwd+paged-d192-bf16-kvcache-varlen": (64, f"{_TRITON39}: 48 B"),
        },
        "hopper": {
            "HOPPER_FWD_SPILL_BUDGET": {("causal", 128): 64, ("window-softcap", 128): 256,  # 20, 228 B
                                        ("plain", 256): 416, ("window-softcap", 256): 448},  # 372, 424 B
            "HOPPER_FWD_3WG_SPILL_BUDGET": {("plain", 64): 640, ("causal", 64): 800,  # 616, 756 B
                                            ("window-softcap", 64): 992},  # 948 B
            "HOPPER_FWD_RESCALE_EARLY_SPILL_BUDGET": {("plain", 64): 640},  # 604 B
            "HOPPER_FWD_3WG_VARLEN_SPILL_BUDGET": {("plain", 64): 2368, ("causal", 64): 1216,  # 2340, 1200 B
                                                   ("window-softcap", 64): 1376},  # 1348 B
            "HOPPER_FWD_VARLEN_SPILL_BUDGET": {("plain", 128): 960, ("causal", 128): 704,  # 920, 664 B
                                               ("window-softcap", 128): 640,  # 596 B
                                               ("plain", 256): 672, ("causal", 256): 544,  # 656, 500 B
                                               ("causal", 192): 544, ("window-softcap", 256): 832},  # 500, 812 B
            "HOPPER_BWD_SPILL_BUDGET": {("plain", 256): 96, ("causal", 256): 224,  # 80, 192 B
                                        ("window-softcap", 256): 256},  # 228 B
            "HOPPER_BWD_ATOMIC_SPILL_BUDGET": {("window-softcap", 64): 224,  # 204 B
                                               ("causal", 128): 96, ("window-softcap", 128): 96},  # 68, 76 B
            "HOPPER_BWD_SPLIT_SPILL_BUDGET": {("plain", 64): 352},  # 320 B
            "HOPPER_DQ_SPILL_BUDGET": {("plain", 256): 32, ("causal", 256): 128},  # 16, 92 B
        },
        # the fp8 paged form at pages of 64: 24 B (none under 3.6 and 3.8); not timed
        "decode": {"d128-paged64-fp8": 32},
    },
}


def for_release(check: str, release: str = None) -> dict:
    """The budgets of ``check`` (one of CHECKS) that Triton ``release`` (default: the running
    one) replaces; {} where it spills no more than 3.6."""
    if check not in CHECKS:
        raise ValueError(f"check={check!r} is not one of {CHECKS}")
    return BY_TRITON.get(release or triton_release(), {}).get(check, {})
