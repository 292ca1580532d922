"""Tile configurations: one table per target, the one obvious place for tile decisions.

Keys are head-dim buckets (the padded power-of-two head dim the kernel computes with).
Each sm90 entry says what chose it; numbers come from ``scripts/sweep.py`` on the H200
(results in ``benchmarks/results/``) and from interleaved timing rounds
(``scripts/hopper_probe.py``, ``scripts/hopper_bwd_probe.py``), and every entry must pass the
sm_90a compile check (``tests/test_sm90_resources.py``: shared memory <= 232448 bytes, no
spills).

Measurements: TFLOPS non-causal / causal on one H200, bf16, five interleaved rounds unless
said; "seed" is 1x8192x36x256, other cases batch x seqlen x heads (x head dim). A file
cited as ``probes/NAME at fb45c0d`` is ``benchmarks/results/probes/NAME`` at commit fb45c0d
(``git show fb45c0d:benchmarks/results/probes/NAME``). Options measured and not kept:
docs/performance.md, "Tried and not kept".
"""
import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class FwdConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class BwdConfig:
    # dK/dV kernel: one program per key block of BLOCK_N keys, streaming BLOCK_M queries
    dkdv_block_m: int
    dkdv_block_n: int
    dkdv_warps: int
    dkdv_stages: int
    # dQ kernel: one program per query block of BLOCK_M rows, streaming BLOCK_N keys
    dq_block_m: int
    dq_block_n: int
    dq_warps: int
    dq_stages: int
    # deterministic=False: True adds dQ with fp32 atomics inside the dK/dV kernel (5 matmuls);
    # False runs the separate dQ kernel (7 matmuls, no atomics, bitwise reproducible).
    atomic_dq: bool = True
    # True: dV and dK in two launches of the dK/dV kernel, one fp32 accumulator each
    # (S = K Q^T computed twice); lets head dim 256 use larger key blocks without spills.
    split_dkdv: bool = False


@dataclass(frozen=True)
class HopperFwdConfig:
    """Gluon sm90 forward (kernels/hopper/fwd.py): 2 consumer warpgroups x 64 query rows,
    one TMA loader warp; K/V rings of ``stages`` slots of ``block_n`` keys (a power of two:
    Gluon's tiles and TMA boxes. FA3 / FA4's 80-key tile at 256, built as 64 + 16 keys with
    two wgmmas per product, ran 7-14% slower and 144 at 128 11% slower:
    docs/performance.md)."""
    block_n: int
    stages: int
    num_consumers: int = 2
    # (Every tile: the consumers take turns issuing wgmmas, a round robin over three at 64,
    # on named barriers, ``hopper.fwd._take_turn``; without turns, or on mbarriers:
    # docs/performance.md.)
    # (Every tile: P to 16 bits two at a time, ``hopper.common.to_16bit``; one at a time:
    # docs/performance.md.)
    # (Not kept: ``exp2_emu``, one exponential in every 4 / 8 by a polynomial on the FMA
    # units instead of the MUFU, slower at every head dim: docs/performance.md.)
    # Q held in registers as the A operand of every S = Q K^T wgmma instead of read from
    # shared memory by each (2 of the 6 KB an m64n128k16 reads), the shared-memory arithmetic
    # that made ``HopperBwdConfig.reg_a`` pay in the backward. Measured (off -> on,
    # probes/fwd-rounds-q_regs-3c9fc25.json at fb45c0d): 128 2x8192x16 642.4 -> 643.0 /
    # 598.2 -> 613.6, 16x1024x16 565.5 -> 571.0 / 430.2 -> 429.3: dispatched at 128; 64
    # (three consumers) 514.2 -> 492.2 / 453.2 -> 452.6 and 256 (spills 1.2-2 KB) 685.6 ->
    # 359.1 / 652.0 -> 345.8: not there.
    q_regs: bool = False
    # (Not kept: ``q_reg_cols``, Q's first 128 columns in registers at 256 with S as two
    # chained wgmmas, and ``v_stages``, V's ring a slot deeper than K's: no gain beyond the
    # rounds' spread, docs/performance.md.)
    # Each consumer visits only the key blocks its own 64 rows see (``common.n_block_range``
    # of those rows) and masks only where they need it; the tile's other blocks it merely
    # waits for and releases (``hopper.fwd._own_blocks``). Under causal / window masks a
    # 192-row tile with 128-key blocks (head dim 64, three consumers) computes ~1.5 blocks
    # per tile that one of its consumers cannot see, and rows all past the sequence (the
    # last tile of 8192 rows) compute nothing; 64's kernels spill nothing with it. Measured
    # (off -> on at every head dim, probes/fwd-rounds-own_blocks-aac5c09+.json at fb45c0d):
    # 64 2x8192x32 499.8 -> 507.4 / 461.3 -> 483.1 (cuDNN 450.5 / 427.6): dispatched at 64.
    # 128 2x8192x16 630.3 -> 620.8 / 602.1 -> 599.6, seed 681.2 -> 677.1 / 647.8 -> 644.6
    # (a 128-row tile skips at most one 64-key block per consumer): not there.
    own_blocks: bool = False
    # (Not kept: ``tail_pieces``, the last, partial round of an unmasked launch's tiles split
    # into 2-4 pieces by the count of rounds alone: CTAs finish at staggered times, so that
    # round is not the idle block the count suggests; slower, docs/performance.md.)
    # O rescaled by the previous block's factor while the block's S = Q K^T wgmma runs, just
    # before O += P V is issued (FA3's order at head dims above 128), instead of after the P V
    # wgmma retires and before the next block's S is issued (where the 64 x 256 multiply at
    # 256 sits between this warpgroup's wgmmas). Measured (off -> on, beside cuDNN,
    # probes/probe-rounds-23cee87.json at fb45c0d): 64 2x8192x32 509.1 -> 512.5 / 478.6 ->
    # 485.6, 128 2x8192x16 627.5 -> 634.3 / 586.3 -> 603.2, 16x1024x16 549.9 -> 556.8 /
    # 411.2 -> 416.9; 256 seed 671.4 -> 674.1 / 650.2 -> 644.8. Dispatched at 64 and 128
    # (a second set of rounds: 515.1 -> 513.1 / 483.6 -> 488.1 at 64, 622.5 -> 634.7 /
    # 584.0 -> 606.2 at 128, probes/probe-rounds-ac47225.json at fb45c0d).
    rescale_early: bool = False
    # ``rescale_early`` where the launch has no causal / window mask and no softcap (dense or
    # varlen): at 256 it measured faster without a mask and slower with one (seed 671.4 ->
    # 674.1 / 650.2 -> 644.8, then 670.6 -> 681.2 / 638.5 -> 633.9,
    # probes/probe-rounds-{23cee87,ac47225}.json at fb45c0d). Dispatched at 256.
    rescale_early_unmasked: bool = False
    # (Every tile: a row's running max kept until a block raises it by more than
    # ``hopper.fwd.RESCALE_THRESHOLD`` = 8, and O's rescale skipped per warp where its rows'
    # alpha are all 1, ``hopper.fwd._rescale``; threshold 0, or every block multiplying O, or
    # the decision per warpgroup: docs/performance.md.)
    # Each row's max of S by a tree (``hopper.fwd._row_max``): a thread's columns halved
    # pairwise down to 8 before the quad's shuffles, instead of Triton's in-thread reduction,
    # one FMNMX chain through all of the thread's 32 (128 keys) or 16 columns of the row,
    # whose latency sits between S's wait and the first exponential (FA4 keeps 4 chains).
    # The same maxima, bit for bit. Alone (off -> on, probes/probe-rounds-95960bf.json at
    # fb45c0d): 64 510.6 -> 513.1 / 484.7 -> 492.0, 128 642.7 -> 638.6 / 602.5 -> 612.2,
    # seed 694.0 -> 692.1 / 667.7 -> 665.7; at 64 in SM90_HOPPER_FWD (with the per-thread
    # partial row sums and the round-robin turns).
    tree_max: bool = False
    # (Every tile: each row's running sum l kept as per-thread partial sums and added across
    # the quad once per tile, ``hopper.fwd._partial_sums``; every block's sum across the
    # quad: docs/performance.md.)
    # (Not kept, slower though the outputs were the same bits: ``thread_arrives``, every
    # consumer thread arriving on the K / V free and turn barriers (4 -> 2 BAR.SYNC per key
    # block), and ``pv_overlap``, a basic-block split that keeps the exponentials under the
    # in-flight P V wgmma: docs/performance.md.)
    # One CTA per SM walking the tiles where every tile has the same length (dense, no
    # causal / window mask), else one CTA per tile. (Every tile: under a causal / window mask
    # on a dense batch, persistent CTAs walking the host's longest-first schedule,
    # common.persistent_schedule; one CTA per tile there: docs/performance.md.)
    persistent_unmasked: bool = False
    # persistent only: Q tiles (each also the O staging of its tile) for this many tiles, so
    # the loader fetches the next tile's Q while this one runs (2: 2 x the Q shared memory)
    q_slots: int = 1
    # Without causal / window mask on a dense batch, the last round of tiles cut into equal
    # shares of key blocks when it would leave CTAs idle (stream-K's remainder split,
    # ``common.split_schedule``; the pieces merged by ``hopper.split_combine``): 1 where the
    # schedule's estimate says it saves time, 2 whenever that round is part empty (tests).
    split_keys: int = 0
    consumer_regs: int = 240   # setmaxnreg per consumer thread (FA3: 240; the loader's: common.LOADER_REGS)


@dataclass(frozen=True)
class HopperBwdConfig:
    """Gluon sm90 dK/dV kernel (kernels/hopper/bwd.py): 2 consumer warpgroups x 64 keys, one
    TMA loader warp (``hopper.bwd.NUM_CONSUMERS``, ``BLOCK_N`` keys per CTA); Q/dO rings of
    ``stages`` slots of 64 query rows."""
    stages: int
    # True (deterministic=False, dense batches): dQ inside the dK/dV kernel, each warpgroup's
    # fp32 column slice over the CTA's keys added in L2 by a TMA reduce-add (5 matmuls; the
    # order of the adds varies, so the bits may too), with Q/dO rings ``atomic_stages``
    # deep. deterministic=True, varlen, or False here: the separate dQ kernel (7 matmuls,
    # no atomics, bitwise reproducible).
    atomic_dq: bool = False
    atomic_stages: int = 2
    # dQ (where not inside the dK/dV kernel) by the Gluon dQ kernel (hopper/bwd_dq.py, every
    # tile; the Triton one: docs/performance.md) with ``dq_block_n``-key K/V tiles in
    # ``hopper.bwd_dq.STAGES``-deep rings.
    dq_block_n: int = 64
    # Dense batches (> 0): the dQ kernel's K / V tiles hold this many keys instead, K in
    # ``hopper.bwd_dq.STAGES`` slots and V in one slot of its own, freed once dP' has read it
    # (``hopper/bwd_dq.py`` V_STAGES = 1). At head dim 256 64-key tiles read 29% fewer
    # shared-memory bytes per multiply-add than 32-key ones (Q and dO, the wgmmas' A
    # operands, once per 64 keys: 160 KB per warpgroup and 64 keys against 2 x 112 KB), and
    # 2 K + 1 V slots fit (229680 B) where 2 K + 2 V do not (262448 B). Varlen batches keep
    # ``dq_block_n`` (their 64-key tiles: docs/performance.md).
    dq_split_v: int = 0
    # (Not kept: ``dq_own_blocks``, each dQ consumer computing only its own rows' key blocks,
    # never measured; the dQ kernel on a side stream beside the dK/dV kernel,
    # ``dq_stream``: docs/performance.md.)
    # (Not kept, each within noise at head dim 256: persistent dQ and dK/dV kernels on the
    # host's longest-first schedule, a longest-first order of the dK/dV CTAs across KV heads
    # (``ordered_keys``), each key tile's unmasked query blocks before its masked ones
    # (``full_first``): docs/performance.md.)
    # (Head dim 256, hopper/bwd256.py: dS^T computed by the dP^T warpgroup from P^T in 16
    # bits but with softcap, ``DS_WG1``; the fp32 dP^T exchange without softcap:
    # docs/performance.md.)
    # (Every tile: P^T and dS^T (dS in the dQ kernel) to 16 bits two at a time,
    # ``hopper.common.to_16bit``; one at a time: docs/performance.md.)
    # (Head dim 256, dense batches: dK / dV out through each warpgroup's K / V half tiles by
    # TMA stores, ``TMA_EPILOGUE``; register stores there: docs/performance.md.)
    # (Not kept: ``early_q``, K and V on two barriers and the first Q loaded before V so
    # that the S^T warpgroup starts without waiting for V: within the rounds' spread,
    # docs/performance.md.)
    # (Removed: ``timeline``, probe clock stamps per CTA at 256 and per step at 64 / 128,
    # scripts/bwd_timeline.py: docs/performance.md.)
    # The first ``reg_a`` (0, 1, 2) of each consumer warpgroup's two 64 x 128 A-operand tiles
    # held in registers instead of read from shared memory by every query block's wgmmas
    # (head dim 256: WG0's K halves for S^T, WG1's V halves for dP'^T; 64 / 128, hopper/bwd.py:
    # the warpgroup's K, then its V). At 256 per block the kernel moves ~296 KB through shared memory
    # (the S^T / dP'^T wgmmas at N = 64 read 4 KB per 32 cycles each), more than its four
    # matmuls' ~2050 cycles at 128 B per cycle; K and V in registers take 64 KB off that.
    # Measured at 9cefcf9 (probes/bwd-probe-rounds-d256-9cefcf9.json at fb45c0d): 1 (the
    # first halves, 32 KB per block) seed 439.2 -> 448.7 / 429.4 -> 430.7, 16x1024x8x256
    # 370.9 -> 368.1 / 292.6 -> 294.3; the kernel's own clock stamps put a query block at
    # 2579 cycles against 2720 (probes/bwd-timeline-{reg_a1-9cefcf9,e0f3479}.json at
    # fb45c0d). 2 spills 680 B and ran at 372.7 / 352.2. Not with softcap (spills).
    # Head dims 64 / 128 (dQ in the kernel, probes/bwd-probe-rounds-d{64,128}-3c9fc25.json
    # at fb45c0d), 0 -> 1 -> 2: 64 2x8192x32 (0 B spilled) 419.7 ->
    # 418.9 -> 424.8 / 400.3 -> 405.2 -> 415.7 (cuDNN 432.8 / 396.6): 2 dispatched at 64;
    # 128 2x8192x16 with 1 (824 / 1316 B spilled) 543.5 -> 405.6 / 506.3 -> 380.1: not there.
    reg_a: int = 0
    # (Not kept: ``stagger``, WG1's dP'^T issued after WG0's S^T so that the tensor cores
    # run it during WG0's exponentials: slower, docs/performance.md.)
    # (Every tile with the in-kernel dQ, no mask: the key tiles of the last, partial wave of
    # CTAs each run as ``hopper.bwd.tail_pieces`` CTAs over parts of their query blocks
    # where it says that pays, storing fp32 dK / dV that a small kernel sums and writes out;
    # never splitting: docs/performance.md.)
    # (Every tile with the in-kernel dQ (atomic_dq): each query block's dQ wgmmas issued one
    # block later, ``hopper.bwd._bwd_step``, so that the two warpgroups are not held in step at
    # every block; issued in their own block (the option ``dq_lag`` off) at 64 434.7 -> 450.6 /
    # 408.6 -> 435.5 and, since fresh_tiles, at 128 on an H100 543.4 -> 565.7 / 498.5 -> 512.5:
    # docs/performance.md.)
    # The K / V tiles of the dK/dV kernel's wgmmas (S^T, dP^T and dQ's K slices) indexed anew
    # every step through a zero the compiler cannot prove (``hopper.bwd._bwd_step``): the
    # tiles never change, so their wgmma descriptors are loop-invariant, and LLVM / ptxas
    # hoist them out of the query-block loop and hold them in registers (two per
    # descriptor, one per 16-column k-step: 24 descriptors at head dim 128). Built in the
    # step instead (three integer instructions each), they free those registers: sm_90a
    # spills of the in-kernel-dQ kernel at 128, triton 3.6 plain / causal / window + softcap
    # 104 / 96 / 636 B -> 0 / 0 / 60, 3.9 960 / 1596 / 1844 -> 0 / 128 / 104
    # (``tools.compile_check --bwd``). Dispatched at 128: on an H100, 536.6 -> 554.3 /
    # 501.2 -> 503.9 TFLOPS (deterministic 482.0 -> 508.3 / 459.4 -> 460.6); not at 64,
    # where it spilled nothing to begin with and measured 467.7 -> 450.3 / 450.5 -> 448.1
    # (benchmarks/results/h100-bwd-fresh-tiles-de1a088.json).
    fresh_tiles: bool = False
    # (Not kept: ``dq_alt``, the warpgroups taking turns at whole dQ row blocks: slower,
    # docs/performance.md.)
    # (Every tile with the in-kernel dQ: each query block's dQ wgmmas issued before its dK
    # wgmma, FA4's sm90 order, ``hopper.bwd._bwd_step``; dQ issued last: docs/performance.md.)
    # (Not kept: ``s_first``, S^T issued before dP^T so that P's exponentials run under dP^T
    # (FA4's sm90 order): slower at 128, within the spread at 64, docs/performance.md.)

    def reg_a_for(self, softcap: float) -> int:
        """``reg_a`` where it applies: not with softcap (its tanh temporaries next to the
        register-held tiles spill)."""
        return self.reg_a if softcap == 0.0 else 0


# The CPU interpreter: tiles small enough that test sequences of ~100-800 tokens span
# several blocks (edge masks, partial blocks and the unmasked middle all run), large enough
# that the interpreter's per-iteration cost stays bearable in CI; tl.dot needs >= 16.
INTERPRET_FWD = FwdConfig(block_m=32, block_n=32, num_warps=4, num_stages=1)
INTERPRET_BWD = BwdConfig(32, 32, 4, 1, 32, 32, 4, 1)

# Hopper (sm90) through the portable Triton path. Candidates screened on the CPU for spills
# (``python -m tools.sm90_report``), then timed by scripts/sweep.py on the H200
# (bf16, seqlen 8192 at 16k tokens; the seed case 1x8192x36 at head dim 256; every backward
# with the separate dQ kernel, as dispatched). TFLOPS full / causal, best first:
# benchmarks/results/sweep-h200-25aaea1.json.gz (scale folded into exp2, this forward):
#   fwd  64: 128x128 w4 s3 407/352;  fwd 128: 128x128 w8 s3 477/459 > 128x64 368/389
#   fwd 256: 128x64 w8 s2 509/436 > 128x32 s3 430/416 (FlashAttention-4's conditional
#            rescale measured slower at every head dim: 468/409 at 256, 334/264 at 64)
#   bwd 256 (split dK/dV 32x128 + dQ 128x32): dK/dV s3 + dQ s3 317/288 > s3 + s2 291/270 >
#            s2 + s2 250/243 > 16x128 s4 256/224
#   bwd 128 (dK/dV 64x128 + dQ 128x64): s3 + s3 365/335 > s2 + s3 354/334 > s2 + s2 332/307
# sweep-h200-4cf91bc.json.gz (the same kernels before the scale was folded into exp2):
#   bwd  64 (dK/dV 64x128 s3): dQ 64x128 w4 s3 315/294 ~ 128x64 w4 314/291 > 128x64 w8 287/270
#   bwd 128: dK/dV 128x128 127/69 and 64x64 w4 242/210 (far behind); dQ 64x128 257/249
#   bwd 256: dK/dV 64x128 and fwd 64x128 do not fit in shared memory
# sweep-h200-6ffbd25.json (older, measured while the GPU tests shared the card): atomic dQ
# inside the dK/dV kernel vs the separate dQ kernel; the H200 benchmark then confirmed the
# separate dQ kernel faster at 64/128 (h200-9f1c860.json.gz: 128 329.2 vs 313.0, causal 308.3
# vs 282.4), so atomic_dq=False everywhere on sm90. At 256 two fp32 BLOCK_N x 256
# accumulators cannot share 255 registers, so dK and dV run as two passes (split_dkdv).
SM90_FWD = {
    64: FwdConfig(128, 128, 4, 3),
    128: FwdConfig(128, 128, 8, 3),
    256: FwdConfig(128, 64, 8, 2),
    512: FwdConfig(64, 32, 8, 2),  # headdim_v 512 (FA3's MLA shape, forward only; not timed)
}
# fp8 inputs (their tiles converted to fp16 in registers), tiles picked by their sm_90a
# compile (tests/test_fp8.py), not timed against each other: at 64 the bf16 tile (128, 128, 4,
# 3) spills 240 B with the conversions (888 B under softcap), 8 warps none; at 256 the bf16
# tile (128, 64, 8, 2) spills 708 B (bf16: 136 B), (128, 32, 8, 2) none (24-32 B under triton 3.8;
# with one stage none, but unpipelined)
SM90_FP8_FWD = {
    64: FwdConfig(128, 128, 8, 3),
    256: FwdConfig(128, 32, 8, 2),
}
SM90_BWD = {
    64: BwdConfig(64, 128, 8, 3, 64, 128, 4, 3, atomic_dq=False),
    128: BwdConfig(64, 128, 8, 3, 128, 64, 8, 3, atomic_dq=False),
    256: BwdConfig(32, 128, 8, 3, 128, 32, 8, 3, atomic_dq=False, split_dkdv=True),
}

# Hopper tier forward (Gluon), by head dim (= headdim_v). Shared memory (bf16): Q 2 x 64 x D,
# K and V rings stages x block_n x D each; all fit under 232448 B and compile without spills
# (tests/test_hopper_compile.py). 256 uses 64-key blocks: S (64 x 128 fp32) next to the
# 64 x 256 O accumulator would not fit in 240 registers.
# Measured on the H200 (files: probes/NAME at fb45c0d, see the module's docstring):
#   tiles (hopper-fwd-tiles-509b418.json): 64: 128 keys x 2-3 stages 404/387 > 64 x 4 370/355;
#     128: 128 x 2 595/551 > 64 x 3-4 544/502; 256: 64 x 2 681/631 > 32 x 4 509/492
#     (64 x 3 does not fit in shared memory).
#   schedules (hopper-fwd-schedules-33a8e80.json, 8k tokens): the persistent loop (one Q
#     slot) did not pay at 8k and was erratic at 1k (the consumers' turns: docs/performance.md).
#   three consumer warpgroups at 64 (192-row tiles, 160 registers per consumer thread;
#     hopper-fwd64-speed_*-30c2e0d.json, 2x8192x32): 128 keys x 3 stages 476.9/427.4
#     against two consumers' 415.2/406.2 (cuDNN 465.5/439.7 in the same process); 64 keys x 4
#     447.1/402.8. Through the GPU probe's check at 49d2a7c (16 of 16 cases,
#     hopper-fwd64-check_3wg-49d2a7c.json) at 453.0/424.1 (cuDNN 450.5/424.9); dispatched.
#   persistent CTAs with two Q slots for unmasked dense batches (three interleaved rounds,
#     non-causal, probe-rounds-fwd-persistent-13394e9.json): 128 at 2x8192x16 609.3
#     -> 620.4 (one Q slot 614.3), 16x1024x16 498.5 -> 551.1, 1x16384x16 617.4 -> 619.9; 64
#     460.8 -> 470.6 (hopper-fwd-check-persistent-qslots2-8c638d0.json: 18 of 18). Not
#     at 256 (no room for a second Q slot; one slot: seed 673.1 -> 665.2), not under causal
#     or window masks (2x8192x16x128 causal 560.3 -> 532.5 one process earlier: the static
#     tile-to-CTA assignment cannot balance tiles of different lengths as the hardware does).
#   persistent CTAs under causal / window masks on the host's longest-first schedule
#     (every tile, common.persistent_schedule; against one CTA per tile:
#     docs/performance.md). One Q slot at 128 is below two (472.5 / 520.9 / 576.8 at 2k /
#     4k / 8k, probe-rounds_pm-short-32a4efd.json). Check: 27 of 27
#     (probe-check_pm-7c818c1.json).
# (head dims 96 and 192 run the 128 and 256 tiles: hopper/common.py PADDED_HEAD_DIMS)
SM90_HOPPER_FWD = {
    # Beyond the tiles: tree_max at 64 (probes/probe-rounds-95960bf.json at fb45c0d); the split
    # tail at 128 / 256 (split_keys, probes/probe-rounds-split_keys-404193d.json at fb45c0d:
    # 2x8192x16x128 643.5 -> 651.7, 2x8192x8x256 674.3 -> 687.6, the seed 698.4 / 694.3,
    # 4x4096x16x128 624.3 / 625.7; at 64, 2x8192x32 517.6 -> 513.2: not there).
    64: HopperFwdConfig(block_n=128, stages=3, num_consumers=3, consumer_regs=160, persistent_unmasked=True,
                        q_slots=2, own_blocks=True, rescale_early=True, tree_max=True),
    128: HopperFwdConfig(block_n=128, stages=2, persistent_unmasked=True, q_slots=2, q_regs=True,
                         rescale_early=True, split_keys=1),
    256: HopperFwdConfig(block_n=64, stages=2, rescale_early_unmasked=True, split_keys=1),
}


def flipped(cfg, name):
    """``cfg``'s option ``name`` flipped, for the tests and compile rows of the options
    against the dispatched tile: a flag negated, ``split_keys`` 0 <-> 1."""
    value = getattr(cfg, name)
    if name == "split_keys":
        return 0 if value else 1
    return not value


# Hopper tier backward (Gluon dK/dV kernel + the Gluon dQ kernel), by head dim (= headdim_v).
# Shared memory (bf16): K, V 2 x 64 x D each, Q + dO rings 2 x stages x 64 x D, lse/Delta
# rings (tools/compile_check.py --bwd / --dq). Current speed: docs/performance.md.
# Tiles (probes/hopper-bwd-speed-*-{f3942c4,18c10c4}.json and
# probes/hopper-speed-d128-*-531fbf8.json at fb45c0d): Q/dO ring depth at 128 with the
# Triton dQ kernel 2: 433.1 / 391.0, 3: 437.3 / 386.3, 4: 445.2 / 402.7; the Gluon dQ at
# 128 with 128-key tiles 478.6 / 465.2 or a 3-deep ring 492.1 / 449.4, both below the
# 64-key 2-deep tile. Per-warpgroup atomic dQ inside the dK/dV kernel (per-thread
# red.global.add) ran at 298.4 at 128 (probes/hopper-bwd-speed-5387ddb.json at fb45c0d).
# dQ by TMA reduce-add of shared dS (atomic_dq, probes/bwd-probe-speed-*-9878a6e.json at
# fb45c0d, same process as the det rows): 128 with 2-deep rings 532.6 / 526.6, 3-deep
# 536.0 / 488.3, separate dQ kernel (4-deep) 483.8 / 459.7; 64 (4-deep) 421.6 / 404.8 vs
# 404.8 / 391.4.
SM90_HOPPER_BWD = {
    64: HopperBwdConfig(stages=4, dq_block_n=128, atomic_dq=True, atomic_stages=4, reg_a=2),
    128: HopperBwdConfig(stages=4, atomic_dq=True, atomic_stages=2, fresh_tiles=True),
    # dK/dV by hopper/bwd256.py (64 keys per CTA, the head-dim axis split over the two
    # consumer warpgroups, dS^T by the dP^T warpgroup: 214512 B shared) + the Gluon dQ
    # kernel with 32-key tiles (64-key tiles for dense batches, V in one slot of its own:
    # ``dq_split_v``). Options measured and not kept: docs/performance.md.
    256: HopperBwdConfig(stages=2, dq_block_n=32, reg_a=1, dq_split_v=64),
}

# Any other GPU: conservative tiles that fit in 100 KB of shared memory (sm80/sm86/sm89).
DEFAULT_FWD = {
    64: FwdConfig(128, 64, 4, 2),
    128: FwdConfig(128, 64, 8, 2),
    256: FwdConfig(64, 64, 8, 1),
    512: FwdConfig(64, 32, 8, 1),
}
DEFAULT_BWD = {
    64: BwdConfig(32, 64, 4, 2, 64, 32, 4, 2),
    128: BwdConfig(32, 64, 8, 1, 64, 32, 8, 1),
    256: BwdConfig(32, 32, 8, 1, 32, 32, 8, 1),
}


def headdim_bucket(headdim: int) -> int:
    """The power-of-two tile width a head dim is computed with (72 -> 128, 192 -> 256)."""
    padded = 16
    while padded < headdim:
        padded *= 2
    return padded


def _table_key(padded: int) -> int:
    return 64 if padded <= 64 else padded


def fwd_config(arch: str, headdim: int, headdim_v: int, fp8: bool = False) -> FwdConfig:
    """``fp8``: float8_e4m3fn inputs, converted to fp16 in registers as they are loaded."""
    if arch == "interpret":
        return INTERPRET_FWD
    key = _table_key(headdim_bucket(max(headdim, headdim_v)))
    if fp8 and arch == "sm90" and key in SM90_FP8_FWD:
        return SM90_FP8_FWD[key]
    table = SM90_FWD if arch == "sm90" else DEFAULT_FWD
    return table[key]


def bwd_config(arch: str, headdim: int, headdim_v: int) -> BwdConfig:
    if arch == "interpret":
        return INTERPRET_BWD
    table = SM90_BWD if arch == "sm90" else DEFAULT_BWD
    cfg = table[_table_key(headdim_bucket(max(headdim, headdim_v)))]
    if arch == "sm90" and not cfg.atomic_dq and not cfg.split_dkdv and max(headdim, headdim_v) not in (64, 128):
        # The separate dQ kernel is measured faster at exactly 64 and 128 (on sm90 those now
        # run the Hopper tier). Padded head dims of those buckets keep the atomic dQ path as
        # tested: their separate-dQ speed was never measured. (The "misaligned address" it
        # once hit at head dim 96 is fixed in bwd_dq_kernel itself; deterministic=True runs
        # that kernel at every head dim and passed the GPU tests at 4d73236.)
        cfg = dataclasses.replace(cfg, atomic_dq=True)
    return cfg
