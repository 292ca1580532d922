"""Hopper (Gluon) tier, no GPU needed: the forward and the backward's dK/dV and dQ kernels
(every dispatchable tile), and the smoke kernel ``tools/smoke.py``
(TMA loads of a Q and a K tile into NVMMA-swizzled shared memory on an mbarrier, one
``warpgroup_mma`` S = Q K^T) compiles for sm_90a, its PTX has wgmma and TMA instructions,
and its shared memory fits the per-block opt-in limit of H100/H200.

Gluon has no interpreter and the suite runs with TRITON_INTERPRET=1, so the compile runs in
a subprocess without it (``smoke.compile_sm90_subprocess``). Skipped when Triton's NVIDIA
backend or ptxas is unavailable.
"""
import pytest
import torch

from tools import sm90_report as R
from tools import triton_budgets

pytestmark = pytest.mark.sm90

CASES = [
    dict(block_m=64, block_n=64, headdim=128, dtype="bf16"),
    dict(block_m=128, block_n=128, headdim=128, dtype="fp16"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "{dtype}-m{block_m}-n{block_n}-d{headdim}".format(**c))
def test_smoke_kernel_compiles_for_sm90a(case):
    problem = R.toolchain_problem()
    if problem:
        pytest.skip(f"sm_90a toolchain unavailable: {problem}")
    try:
        from tools import smoke
    except ImportError as e:  # Triton without Gluon's Hopper pieces
        pytest.skip(f"Gluon (Hopper) unavailable: {e!r}")
    r = smoke.compile_sm90_subprocess(**case)
    assert r["has_wgmma"], f"no wgmma.mma_async in the PTX: {r}"
    assert r["has_tma"], f"no cp.async.bulk.tensor in the PTX: {r}"
    assert r["has_mbarrier"], f"no mbarrier wait in the PTX: {r}"
    assert r["num_warps"] == 4
    # Q and K tiles plus one 8-byte mbarrier; nothing else is staged through shared memory.
    el = 2
    tiles = (case["block_m"] + case["block_n"]) * case["headdim"] * el
    assert tiles <= r["shared"] <= R.MAX_SHARED_SM90, r


def _compiled(part):
    """``compile_check.run_subprocess(part)``; skipped without ptxas or Gluon's Hopper pieces."""
    problem = R.toolchain_problem()
    if problem:
        pytest.skip(f"sm_90a toolchain unavailable: {problem}")
    try:
        from tools import compile_check
    except ImportError as e:
        pytest.skip(f"Gluon (Hopper) unavailable: {e!r}")
    return compile_check.run_subprocess(part)


def _check_row(r, spill_budget=0):
    """What every Gluon kernel must show: shared memory within the opt-in limit, spills
    within the budget, the register hand-off (setmaxnreg) from the loader warp to the
    consumers, wgmma and TMA in the PTX, the consumer warpgroups (2, or 3) + the loader's
    (padded) warpgroup."""
    assert r["shared"] <= R.MAX_SHARED_SM90, r
    assert r["spill_bytes"] <= spill_budget, r
    # ptxas serializing the wgmmas (C7512, e.g. for want of registers) costs more than any
    # spill and shows in no spill count
    assert not r["wgmma_serialized"], r
    assert r["setmaxnreg"] and r["has_wgmma"] and r["has_tma"], r
    assert r["num_warps"] == 4 * (r.get("num_consumers", 2) + 1), r


# (feature, head dim) -> spill bytes allowed, with the reason. Plain and causal: none.
HOPPER_FWD_SPILL_BUDGET = {
    # sliding-window bounds + the softcap's tanh temporaries on top of the 240 registers the
    # 128-key S tile and the O accumulator use; a few words spilled on the rare path only.
    ("window-softcap", 128): 128,
    # at 256 P's pairwise 16-bit conversion (hopper.common.to_16bit) keeps more values live:
    # 172 B measured dense (bf16 and fp16), 140 B in the KV-cache form,
    # against 8 / 32 B one at a time (its speed with window + softcap is not measured yet)
    ("window-softcap", 256): 192,
    # head dim 128 holds Q in registers (``q_regs``, dispatched): the persistent two-Q-slot
    # walk of the plain tile keeps more addresses live next to it (372 B measured, bf16 and
    # fp16; causal and window + softcap 0 B), and ran as fast as Q from shared memory
    # (configs.HopperFwdConfig.q_regs); with per-thread partial row sums 404 B;
    # with the turns on named barriers 484 B, two spill stores and loads per key block in two
    # of its loops, and 0.4% faster non-causal in five rounds than on mbarriers
    # (`benchmarks/results/probes/probe-rounds-named1.json` at fb45c0d); the
    # plain rows compile the split tail's walk (split_keys: 0 B; its walk without pieces is
    # the option row, 484 B)
    ("plain", 128): 512,
    # the split tail's walk at 256 (split_keys): its table's entry and piece kept
    # across the loop, 128 B, two spill loads per key block in two of its loops
    # (scripts/sass_loops.py fwd 256 plain)
    ("plain", 256): 192,
    # the 256 tile with per-thread partial row sums and the rescale threshold (O rescaled late, the per-warp
    # vote before the branch that skips O's rescale) under the causal mask: 88 B dense, 84 B in
    # the KV-cache form (bf16 and fp16); window + softcap 144 B (budget above)
    ("causal", 256): 128,
}

# (feature, head dim) -> spill bytes allowed in the backward's dK/dV kernel, with the reason.
HOPPER_BWD_SPILL_BUDGET = {
    # At 128 none: the K / V tiles' descriptors are built in each step (fresh_tiles); before,
    # window + softcap held 180 B beside the 64 x 128 fp32 dK and dV accumulators.
    # Window bounds + the softcap's tanh and its derivative at 256 (hopper/bwd256.py), plus
    # the swizzled addressing of the fp32 dP^T exchange tile that this path keeps: 24 B
    # measured (bf16 and fp16).
    ("window-softcap", 256): 64,
}

# The same with the in-kernel dQ (atomic_dq), each block's dQ one block later: at 128 its
# 64 x 64 fp32 dQ accumulator and the descriptor / coordinates of the reduce next to dK and
# dV. With the K / V descriptors built in each step (fresh_tiles) nothing spills (bf16 and
# fp16; with the dQ in its own block window + softcap spilled 60 B); with the descriptors
# held across the loop 104 / 96 / 636 B (the wgmma descriptors, two registers each, hoisted
# out of the query-block loop). At 64 plain and causal spill nothing, window + softcap 44 B
# (bf16 and fp16; the four dS^T slots' indices next to the window bounds and the tanh terms).
HOPPER_BWD_ATOMIC_SPILL_BUDGET = {("window-softcap", 64): 64}
# The same kernels splitting the last wave (``hopper.bwd.tail_pieces``, 4 pieces; plain
# only): 32 B at 64 measured (52 B at 128 before fresh_tiles, none since), the piece's range
# and slot computed at entry (the 64 kernel with 4 pieces ran 1.4% and 6% faster than
# without the split in interleaved rounds, `benchmarks/results/probes/bwd-probe-rounds-d64-
# split-*.json` at fb45c0d).
HOPPER_BWD_SPLIT_SPILL_BUDGET = {("plain", 64): 32}
# The forward with O rescaled before P V is issued (rescale_early, dispatched at 64 / 128, and at 256
# without a mask: 256 spills nothing there), bf16: at
# 64 the unmasked persistent walk (two Q slots) spills 200 B (6 loads and stores per key
# block in one of its loops); measured with those spills, +0.7% / +1.5% in five rounds.
# At 256 under the causal mask (not dispatched there: O is rescaled late under masks) 148 B.
HOPPER_FWD_RESCALE_EARLY_SPILL_BUDGET = {("plain", 64): 256, ("causal", 256): 160}
# 128 plain, the persistent walk without the split tail's pieces (split_keys off): 496 B
# (428 B under triton 3.8); 128 causal with tree_max (off there) 28 B (3.8: 0 B). The other
# option rows keep the dispatched tiles' budgets (causal at 256: 0 B under 3.6 and 3.8).
HOPPER_FWD_OPTION_SPILL_BUDGET = {("plain", 128): 512, ("causal", 128): 32}
# (feature, head dim) -> spill bytes allowed in the Gluon dQ kernel: at 256 the 64 x 256 fp32
# dQ accumulator leaves little room for the window bounds and tanh temporaries. With 64-key
# tiles (dq_split_v, dense: bf16 / fp16 causal 52 B, window + softcap 8 B, none in
# the key-block loops' SASS) and 32-key ones (varlen, budget below).
HOPPER_DQ_SPILL_BUDGET = {("window-softcap", 256): 32, ("causal", 256): 64}


# Varlen variants (dispatched): the tile's sequence starts and lengths stay
# live through the loop and the masked-store epilogue (hopper/common.py ``_store_rows``)
# needs 64-bit addresses, on top of the dense kernel's registers. Measured (bf16) at
# bcff93c: forward 44-360 B, dK/dV as dense (248 / 64 B with window + softcap), dQ at 256
# 8-52 B. The varlen forward at that size of spill ran at 0.96x-0.97x of the dense one on
# the seed case (`benchmarks/results/h200-bcff93c.json.gz` at fb45c0d).
HOPPER_FWD_VARLEN_SPILL_BUDGET = {
    # with Q in registers (q_regs): plain 232 B, causal 96 B, window + softcap 8 B
    ("plain", 128): 256,
    ("causal", 128): 128,
    ("window-softcap", 128): 192,
    # 256 (and 192 on its tile): 160 / 168 B; with the turns on named barriers
    # 212 / 220 B (GPU tests passed; the varlen seed forward ran 0.946x the dense
    # one in c0c4f9a's benchmark, 0.953x in 5ae1b49's); with O's rescale decided per warp
    # (the early rescale's branch over 128 values of O) 392 B, at 256
    # and 192: the varlen seed forward 661.9 (3afe79e's run, 212 B) -> 675.7 (119238b's, 392 B),
    # 2x8192x8x256 665.4 -> 680.9
    ("plain", 256): 448,
    # 396 B measured with the pairwise 16-bit conversions (360 B one at a time)
    ("window-softcap", 256): 448,
    # head dim 192 (the 256 tile) on a varlen batch: the column mask of the masked O stores
    # (common._store_rows) on top of the 256 kernel's sequence bookkeeping: 156 B measured
    # (bf16), against 128 B at 256; with the 256 tile's partial row sums and rescale threshold
    # under the causal mask 216 B at 256 and at 192
    ("causal", 256): 256,
    ("causal", 192): 256,
}
HOPPER_DQ_VARLEN_SPILL_BUDGET = {("plain", 256): 64, ("causal", 256): 64, ("window-softcap", 256): 64}

# Three consumer warpgroups (head dim 64, dispatched since 49d2a7c): 160 registers per
# consumer thread (3 x 128 x 160 + the loader's 128 x 24 fill the 64K register file) hold the
# 64 x 128 S tile, P and the 64 x 64 O accumulator with a little spilled: plain 648 B, and it
# still ran 13-15% faster than two consumers (configs.SM90_HOPPER_FWD); causal 32 B since the
# sectioned launch order (common.launch_order) added its divisions. Varlen keeps the
# sequence's starts and lengths live on top: causal 404 B; window + softcap (bounds and tanh
# temporaries as well) 1960 B, a rare combination whose speed is not measured.
# Causal on persistent CTAs (two Q slots, the schedule's walk): 336 B
# (bf16 and fp16, 7c818c1), and 1.6-3.1% faster than one CTA per tile
# (configs.SM90_HOPPER_FWD); window + softcap there spills nothing.
# With each consumer keeping its own key-block range (own_blocks, dispatched at 64) none of
# them spills (bf16 and fp16; dense, varlen, the KV-cache form): the sizes
# above (plain 648 B, causal 32 / 336 B, varlen causal 404 B) were measured without it.
# With O rescaled before P V is issued (rescale_early, dispatched at 64) the
# unmasked persistent walk (two Q slots) spills 200 B and the KV-cache form's causal 8 B
# (bf16); measured with those spills, +0.7% / +1.5% non-causal / causal in five interleaved
# rounds (configs.HopperFwdConfig.rescale_early).
# With tree_max, the per-thread partial row sums and the round robin of turns (dispatched): plain
# and causal nothing, window + softcap 52 B.
HOPPER_FWD_3WG_SPILL_BUDGET = {("plain", 64): 256, ("causal", 64): 32, ("window-softcap", 64): 64}
HOPPER_FWD_3WG_VARLEN_SPILL_BUDGET = {}

# Where the running Triton release spills more than these (3.6's) budgets, its own, measured
# under it, replace them (tools/triton_budgets.py).
for _name, _overlay in triton_budgets.for_release("hopper").items():
    globals()[_name] = {**globals()[_name], **_overlay}


def test_budgets_by_triton_name_known_tables():
    for release in triton_budgets.BY_TRITON:
        for name, entries in triton_budgets.for_release("hopper", release).items():
            assert name.endswith("_SPILL_BUDGET") and isinstance(globals()[name], dict), name
            assert all(isinstance(b, int) and b > 0 for b in entries.values()), name


def test_hopper_forward_compiles_for_sm90a():
    """Every tile of configs.SM90_HOPPER_FWD, fp16 and bf16, plain / causal / window+softcap,
    dense, (bf16) varlen and (bf16) the KV-cache form; head dim 64 with three consumer
    warpgroups; the padded head dims (96, 192) in bf16, each form, held to the budgets of the
    tile they run unless a budget names them."""
    from triflash.kernels import configs
    from triflash.kernels.hopper.common import PADDED_HEAD_DIMS, kernel_head_dim
    rows = _compiled("fwd")
    assert {r["headdim"] for r in rows} == set(configs.SM90_HOPPER_FWD) | set(PADDED_HEAD_DIMS)
    every = set(configs.SM90_HOPPER_FWD) | set(PADDED_HEAD_DIMS)
    assert {r["headdim"] for r in rows if r.get("varlen")} == every
    assert any(r.get("num_consumers") == 3 for r in rows)
    # flash_attn_with_kvcache's form (dense, seqused_k) is held to the dense budgets
    assert {r["headdim"] for r in rows if r.get("kvcache")} == every
    # persistent CTAs (with the tile's Q slots) exactly where the dispatch asks for them
    # (fwd.walk): dense batches, unmasked at the head dims whose tile says persistent_unmasked,
    # causal / window on the host's schedule at every head dim, also over a KV cache (dense q,
    # seqused_k alone); never varlen
    # (a padded head dim, 96 or 192, runs the tile of the width it is computed at)
    tiles = configs.SM90_HOPPER_FWD
    rows = [dict(r, headdim=kernel_head_dim(r["headdim"]), real=r["headdim"]) for r in rows]
    assert {(r["real"], r["feature"]) for r in rows if r.get("kvcache") and r["scheduled"]} == {
        (d, f) for d in every for f in ("causal", "window-softcap")}
    assert {(r["headdim"], r["feature"], bool(r.get("varlen")))
            for r in rows if r["q_slots"] == 2} == (
        {(d, "plain", False) for d, c in tiles.items() if c.persistent_unmasked and c.q_slots == 2}
        | {(d, f, False) for d, c in tiles.items() if c.q_slots == 2 for f in ("causal", "window-softcap")})
    # (and without a mask the walk of the split tail's table where it says split_keys)
    assert {(r["headdim"], r["feature"]) for r in rows if r["pieces"]} == {
        (d, "plain") for d, c in tiles.items() if c.split_keys}
    assert {(r["headdim"], r["feature"]) for r in rows if r["scheduled"]} == {
        (d, f) for d in tiles for f in ("causal", "window-softcap")} | {
        (d, "plain") for d, c in tiles.items() if c.split_keys}
    assert not any(r["scheduled"] and r.get("varlen") for r in rows)
    for r in rows:
        # P to 16 bits two at a time (hopper.common.to_16bit): no one-at-a-time conversion left
        assert r["scalar_cvt"] == 0, r
        if r.get("num_consumers") == 3:
            budget = HOPPER_FWD_3WG_VARLEN_SPILL_BUDGET if r.get("varlen") else HOPPER_FWD_3WG_SPILL_BUDGET
        else:
            budget = HOPPER_FWD_VARLEN_SPILL_BUDGET if r.get("varlen") else HOPPER_FWD_SPILL_BUDGET
        _check_row(r, budget.get((r["feature"], r["real"]), budget.get((r["feature"], r["headdim"]), 0)))


def test_hopper_backward_compiles_for_sm90a():
    """The dK/dV kernel of every tile of configs.SM90_HOPPER_BWD (hopper/bwd256.py's at head
    dim 256), fp16 and bf16, plain / causal / window+softcap, dense and (bf16) varlen, as
    dispatched: no per-thread atomics; where the tile has ``atomic_dq`` (deterministic=False,
    dense) also the variant that adds dQ by TMA reduce-add, with the tile's ring depth, and
    its kernel splitting the last wave (``hopper.bwd.tail_pieces``, plain); the
    padded head dims (96, 192: dense and varlen, bf16) with the tile of the width they are
    computed at, held to that width's budgets."""
    from triflash.kernels import configs
    from triflash.kernels.hopper.common import PADDED_HEAD_DIMS, kernel_head_dim
    rows = _compiled("bwd")
    assert {r["headdim"] for r in rows} == set(configs.SM90_HOPPER_BWD) | set(PADDED_HEAD_DIMS)
    assert {r["kernel"] for r in rows if r["headdim"] == 192} == {"hopper_bwd256"}
    assert {r["headdim"] for r in rows if r.get("varlen")} == set(configs.SM90_HOPPER_BWD) | set(PADDED_HEAD_DIMS)
    rows = [dict(r, headdim=kernel_head_dim(r["headdim"])) for r in rows]
    assert {r["dtype"] for r in rows} == {"bf16", "fp16"}
    assert {r["kernel"] for r in rows if r["headdim"] == 256} == {"hopper_bwd256"}
    assert {r["headdim"] for r in rows if r.get("varlen")} == set(configs.SM90_HOPPER_BWD)
    assert {r["headdim"] for r in rows if r["atomic_dq"]} == {
        d for d, c in configs.SM90_HOPPER_BWD.items() if c.atomic_dq}
    assert {(r["headdim"], r["dtype"]) for r in rows if r.get("tail_split")} == {
        (d, dt) for d, c in configs.SM90_HOPPER_BWD.items() if c.atomic_dq
        for dt in ("bf16", "fp16")}
    for r in rows:
        c = configs.SM90_HOPPER_BWD[r["headdim"]]
        if r["atomic_dq"]:
            assert r["stages"] == c.atomic_stages and not r.get("varlen"), r
            assert r["tma_reduce"] > 0, r
            budget = HOPPER_BWD_SPLIT_SPILL_BUDGET if r.get("tail_split") else HOPPER_BWD_ATOMIC_SPILL_BUDGET
            _check_row(r, budget.get((r["feature"], r["headdim"]), 0))
        else:
            assert r["tma_reduce"] == 0, r
            _check_row(r, HOPPER_BWD_SPILL_BUDGET.get((r["feature"], r["headdim"]), 0))
        assert r["atomics"] == 0, r


def test_hopper_dq_compiles_for_sm90a():
    """The Gluon dQ kernel (hopper/bwd_dq.py) at every head dim whose tile uses it, with that
    tile's key block and ring depth, fp16 and bf16, plain / causal / window+softcap, dense
    and (bf16) varlen; the padded head dims (96, 192: dense and varlen, bf16) with the tile of
    the width they are computed at."""
    from triflash.kernels import configs
    from triflash.kernels.hopper import bwd_dq
    from triflash.kernels.hopper.common import PADDED_HEAD_DIMS, kernel_head_dim
    rows = _compiled("dq")
    served = set(configs.SM90_HOPPER_BWD)
    assert {r["headdim"] for r in rows} == served | {d for d, w in PADDED_HEAD_DIMS.items() if w in served}
    assert {r["headdim"] for r in rows if r.get("varlen")} == {r["headdim"] for r in rows}
    rows = [dict(r, headdim=kernel_head_dim(r["headdim"])) for r in rows]
    for r in rows:
        c = configs.SM90_HOPPER_BWD[r["headdim"]]
        block_n, v_stages = bwd_dq.tile(c, r.get("varlen", False))  # what bwd.bwd launches
        assert (r["block_n"], r["stages"], r.get("v_stages", 0)) == (block_n, bwd_dq.STAGES, v_stages), r
        if c.dq_split_v and not r.get("varlen"):  # dense: dq_split_v keys, V in a slot of its own
            assert (block_n, v_stages) == (c.dq_split_v, 1), r
        budget = HOPPER_DQ_VARLEN_SPILL_BUDGET if r.get("varlen") else HOPPER_DQ_SPILL_BUDGET
        _check_row(r, budget.get((r["feature"], r["headdim"]), 0))
        assert r["atomics"] == 0, r


def test_tile_variants_compile_for_sm90a():
    """Tile options the dispatch does not use compile within the dispatched tiles' budgets:
    the head-dim-256 dK/dV kernel with K / V
    read from shared memory (``reg_a`` 0; the dispatched kernel's is 1). (The head-dim-64 dK/dV
    kernel's ``reg_a`` 2 and the head-dim-128 forward's ``q_regs`` are dispatched: the tests
    above compile them in every form.) The head-dim-256 dQ kernel of a dense batch with
    32-key tiles (``dq_split_v`` off); the forward with each row's max of S by a tree
    (``tree_max``), and at 256 the persistent walk of unmasked
    tiles (``persistent_unmasked``, one Q slot), at 128 / 256 the walk without the split tail
    (``split_keys``): each flipped from its dispatched value (``configs.flipped``)."""
    from triflash.kernels import configs
    rows = _compiled("variants")
    from tools import compile_check
    assert {r["feature"] for r in rows if r.get("reg_a") == 0} == {"plain", "causal"}
    assert {(r["headdim"], r["feature"]) for r in rows if r.get("rescale_early")} == {
        (d, f) for d in (64, 128, 256) for f in ("plain", "causal")}
    assert {(r["headdim"], r["feature"], r["option"]) for r in rows if r.get("option")} == {
        (256, f, "dq_split_v=0") for f in ("plain", "causal")} | {
        (d, f, f"{o}={configs.flipped(configs.SM90_HOPPER_FWD[d], o)}")
        for d, o in compile_check.FWD_FLIPPED for f in ("plain", "causal")}
    for r in rows:
        if r["kernel"] == "hopper_fwd":
            budget = HOPPER_FWD_3WG_SPILL_BUDGET if r.get("num_consumers") == 3 else HOPPER_FWD_SPILL_BUDGET
            if r.get("rescale_early"):
                budget = {**budget, **HOPPER_FWD_RESCALE_EARLY_SPILL_BUDGET}
            if r.get("option", "").startswith(("split_keys", "tree_max")):
                budget = {**budget, **HOPPER_FWD_OPTION_SPILL_BUDGET}
        elif r["kernel"] == "hopper_dq":
            budget = HOPPER_DQ_VARLEN_SPILL_BUDGET if r.get("varlen") else HOPPER_DQ_SPILL_BUDGET
        else:
            budget = HOPPER_BWD_SPILL_BUDGET
        _check_row(r, budget.get((r["feature"], r["headdim"]), 0))


def test_forward_refuses_a_key_block_that_is_no_power_of_two():
    """``HopperFwdConfig.block_n`` must be a power of two (Gluon's tiles and TMA boxes; FA3 /
    FA4's 80-key tile at 256 was built as two wgmmas per product, ran 7-14% slower and was
    removed: docs/performance.md): any other size is refused with its value named."""
    import dataclasses
    from triflash.kernels import configs
    from tools import compile_check
    from triflash.kernels.hopper import fwd
    q, k, v, p, cu, used = compile_check._problem(256, "bf16", "plain")
    for n in (48, 80, 144, 192):
        cfg = dataclasses.replace(configs.SM90_HOPPER_FWD[256], block_n=n)
        with pytest.raises(ValueError, match=f"block_n={n}"):
            fwd.kernel_args(q, k, v, torch.empty_like(q), compile_check._lse(q, cu), p, cfg)
