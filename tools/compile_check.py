"""sm_90a compile check of the Gluon (Hopper) kernels on a machine without a GPU.

For every tile in ``configs.SM90_HOPPER_FWD`` (``--bwd``: ``configs.SM90_HOPPER_BWD``) and each
feature set, the forward kernel (the backward's dK/dV kernel) is
specialized as a launch would specialize it (host TMA descriptors on small CPU tensors),
compiled for sm_90a, and its PTX run through ``ptxas -v``. Reported per kernel: dynamic
shared memory (must be <= 232448 B), spill bytes (must be 0), whether ``setmaxnreg``
(register hand-off from the loader warp to the consumer warpgroups), wgmma and TMA
instructions are present.

Gluon has no interpreter: run this in a process without TRITON_INTERPRET
(``run_subprocess`` does that for callers that have it set, e.g. the test suite).

    python -m tools.compile_check [--json]
"""
import argparse
import itertools
import json
import os
import subprocess
import sys

FEATURES = {
    # name: (causal, window_left, softcap)
    "plain": (False, -1, 0.0),
    "causal": (True, -1, 0.0),
    "window-softcap": (True, 128, 30.0),
}


_TOOLCHAIN = None


def _ptxas_info(ptx, md) -> dict:
    """``ptxas -v``'s resources of ``ptx`` (``sm90_report.parse_ptxas_log``), cached beside
    sm90_report's results by the PTX, ptxas's flags and the toolchain: Triton caches its own
    compile, not this second ptxas run, which is most of a repeated check's time."""
    import hashlib
    from tools import sm90_report
    global _TOOLCHAIN
    if _TOOLCHAIN is None:
        _TOOLCHAIN = sm90_report._toolchain_id()
    key = hashlib.sha256(json.dumps(["compile_check ptxas", ptx, getattr(md, "enable_fp_fusion", True),
                                     getattr(md, "ptx_options", None), _TOOLCHAIN]).encode()).hexdigest()
    info = sm90_report._cache_get(key)
    if info is None:
        info = sm90_report.parse_ptxas_log(sm90_report._run_ptxas(ptx, md))
        sm90_report._cache_put(key, info)
    return info


def _compile(kernel, args) -> dict:
    """Compile a Gluon kernel for sm_90a as a launch with ``args`` would specialize it; the
    resources and instructions every Hopper kernel is checked for, plus its PTX."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from tools.smoke import _specialize
    from triflash.kernels.common import FP_FUSION
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("Gluon has no interpreter: unset TRITON_INTERPRET (or use run_subprocess)")
    signature, constexprs, attrs = _specialize(kernel, args)
    compiled = triton.compile(GluonASTSource(kernel, signature, constexprs, attrs),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "enable_fp_fusion": FP_FUSION})
    ptx = compiled.asm["ptx"]
    info = _ptxas_info(ptx, compiled.metadata)
    return dict(shared=compiled.metadata.shared, num_warps=compiled.metadata.num_warps,
                registers=info["registers"], spill_bytes=info["spill_stores"] + info["spill_loads"],
                wgmma_serialized=info["wgmma_serialized"],
                setmaxnreg="setmaxnreg.inc" in ptx and "setmaxnreg.dec" in ptx,
                has_wgmma="wgmma.mma_async" in ptx, has_tma="cp.async.bulk.tensor" in ptx,
                atomics=ptx.count("red.global") + ptx.count("atom.global"),
                tma_reduce=ptx.count("cp.reduce.async.bulk"),
                # one-at-a-time fp32 -> 16-bit conversions (hopper.common.to_16bit packs two)
                scalar_cvt=ptx.count("cvt.rn.bf16.f32") + ptx.count("cvt.rn.f16.f32"),
                mufu_ex2=ptx.count("ex2.approx"), ptx=ptx)


def _problem(headdim, dtype, feature, varlen=False):
    """Small CPU tensors (shapes only specialize strides), the AttnParams of ``feature`` and
    (cu_seqlens, seqused_k): None, or with ``varlen`` packed (total, heads, dim) tensors."""
    import torch

    from triflash.kernels.problem import AttnParams
    causal, left, softcap = FEATURES[feature]
    tdt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    b, s, h, hk = 2, 1000, 4, 2
    q = torch.empty(b, s, h, headdim, dtype=tdt)
    k, v = torch.empty(b, s, hk, headdim, dtype=tdt), torch.empty(b, s, hk, headdim, dtype=tdt)
    p = AttnParams(headdim ** -0.5, left, 0 if causal else -1, softcap, s, s)
    cu = used = None
    if varlen:
        q, k, v = (x.flatten(0, 1) for x in (q, k, v))
        cu, used = torch.zeros(b + 1, dtype=torch.int32), torch.zeros(b, dtype=torch.int32)
    return q, k, v, p, cu, used


def _lse(q, cu):
    import torch
    return torch.empty(q.shape[1], q.shape[0]) if cu is not None else torch.empty(q.shape[0], q.shape[2], q.shape[1])


def _backward(headdim, dtype, feature, varlen):
    """(Problem, 4D views of q, k, v, dout, dq, dk, dv, the stats buffers, params) of a
    backward, as ``hopper.bwd.bwd`` builds them."""
    import torch

    from triflash.kernels.hopper import bwd as B
    from triflash.kernels.hopper.common import Problem, stat_rows
    q, k, v, p, cu, used = _problem(headdim, dtype, feature, varlen)
    pb = Problem(q, k, p, cu, cu, None, used)
    if varlen:
        shape = (1, pb.nheads, stat_rows(pb.total_q, pb.batch, B.BLOCK_M))
    else:
        shape = (pb.batch, pb.nheads, -(-pb.seqlen_q // B.BLOCK_M) * B.BLOCK_M)
    tensors = [pb.view(x) for x in (q, k, v, torch.empty_like(q), torch.empty_like(q),
                                    torch.empty_like(k), torch.empty_like(v))]
    return pb, tensors, torch.empty(shape), torch.empty(shape), p


def compile_fwd(headdim: int, dtype: str, feature: str, varlen: bool = False, cfg=None,
                kvcache: bool = False) -> dict:
    """The forward with the tile of ``configs.SM90_HOPPER_FWD`` (or ``cfg``); ``varlen``:
    packed (total, heads, dim) tensors with cu_seqlens (and seqused_k); ``kvcache``: a dense
    batch with seqused_k (what ``flash_attn_with_kvcache`` runs)."""
    import torch

    from triflash.kernels import configs
    from triflash.kernels.hopper import fwd as H
    from tools import kernel_arg
    cfg = cfg or configs.SM90_HOPPER_FWD[H.kernel_head_dim(headdim)]
    q, k, v, p, cu, used = _problem(headdim, dtype, feature, varlen)
    if kvcache:
        used = torch.zeros(q.shape[0], dtype=torch.int32)
    split = ws = None
    if cfg.split_keys and not p.masked and not varlen and not kvcache:
        # (the walk of a split launch, fwd.split_keys; its table's values do not specialize)
        split, ws = (torch.zeros(16, dtype=torch.int32), 132, 1, 1), torch.empty(1)
    _, args = H.kernel_args(q, k, v, torch.empty_like(q), _lse(q, cu), p, cfg, cu, cu, None, used,
                            split=split, ws=ws, wsl=ws)
    meta = kernel_arg(H.hopper_fwd_kernel, args, "META")  # (an H.FwdMeta)
    row = dict(kernel="hopper_fwd", headdim=headdim, dtype=dtype, feature=feature,
               block_n=cfg.block_n, stages=cfg.stages, num_consumers=cfg.num_consumers,
               q_slots=meta.Q_SLOTS, scheduled=meta.SCHEDULED, pieces=meta.PIECES)
    if varlen:
        row["varlen"] = True
    if kvcache:
        row["kvcache"] = True
    return dict(row, **_compile(H.hopper_fwd_kernel, args))


def compile_bwd(headdim: int, dtype: str, feature: str, atomic_dq: bool = False, cfg=None,
                varlen: bool = False, pieces: int = 1) -> dict:
    """The dK/dV kernel the dispatch runs at ``headdim`` with the tile of
    ``configs.SM90_HOPPER_BWD`` (or ``cfg``): ``hopper/bwd.py``'s, or ``hopper/bwd256.py``'s
    at head dim 256; ``atomic_dq``: with the in-kernel dQ (TMA reduce-add, the
    deterministic=False launch where the tile has ``atomic_dq``), and with ``pieces`` > 1
    the launch that splits the last wave's key tiles (``hopper.bwd.tail_pieces``);
    ``varlen``: packed sequences."""
    import torch

    from triflash.kernels import configs
    from triflash.kernels.hopper import bwd as B
    from triflash.kernels.hopper.common import kernel_head_dim
    cfg = cfg or configs.SM90_HOPPER_BWD[kernel_head_dim(headdim)]
    pb, (q, k, v, do, _, dk, dv), stat, delta, p = _backward(headdim, dtype, feature, varlen)
    row = dict(headdim=headdim, dtype=dtype, feature=feature, atomic_dq=atomic_dq,
               stages=cfg.atomic_stages if atomic_dq else cfg.stages)
    if varlen:
        row["varlen"] = True
    if kernel_head_dim(headdim) in B.SPLIT_D_HEAD_DIMS:
        from triflash.kernels.hopper import bwd256
        _, args = bwd256.kernel_args(pb, q, k, v, do, dk, dv, stat, delta, p, cfg)
        return dict(kernel="hopper_bwd256", ds_wg1=p.softcap == 0.0, **row,
                    **_compile(bwd256.hopper_bwd256_kernel, args))
    # pieces > 1 forces the split launch (every key tile in that many pieces; bwd.tail_pieces)
    split = (pieces, 0, torch.empty(1)) if atomic_dq and pieces > 1 else None
    if split:
        row["tail_split"] = pieces
    args = B._kernel_args(pb, q, k, v, do, dk, dv, stat, delta, torch.empty(q.shape), p, cfg, atomic_dq, split)
    return dict(kernel="hopper_bwd", **row, **_compile(B.hopper_bwd_kernel, args))


def compile_dq(headdim: int, dtype: str, feature: str, block_n: int = 64, varlen: bool = False,
               v_stages: int = 0) -> dict:
    """The Gluon dQ kernel (``hopper/bwd_dq.py``) with ``block_n``-key tiles in its
    ``STAGES``-deep ring (V in a ``v_stages``-deep ring of its own when > 0); ``varlen``:
    packed sequences."""
    from triflash.kernels.hopper import bwd_dq as Q
    pb, (q, k, v, do, dq, _, _), stat, delta, p = _backward(headdim, dtype, feature, varlen)
    _, args = Q.kernel_args(pb, q, k, v, do, dq, stat, delta, p, block_n, v_stages=v_stages)
    row = dict(kernel="hopper_dq", headdim=headdim, dtype=dtype, feature=feature,
               block_n=block_n, stages=Q.STAGES)
    if v_stages:
        row["v_stages"] = v_stages
    if varlen:
        row["varlen"] = True
    return dict(row, **_compile(Q.hopper_dq_kernel, args))


def all_fwd(dtypes=("bf16", "fp16")):
    """Every tile of configs.SM90_HOPPER_FWD, dense in both dtypes, varlen in bf16, and the
    KV-cache form (dense, seqused_k) in bf16 with causal and with window + softcap; the
    padded head dims (96, 192) in bf16, dense, varlen and the KV-cache form."""
    from triflash.kernels import configs
    from triflash.kernels.hopper.common import PADDED_HEAD_DIMS
    dims = sorted(configs.SM90_HOPPER_FWD)
    every = dims + sorted(PADDED_HEAD_DIMS)
    return ([compile_fwd(d, dt, f) for d in dims for dt in dtypes for f in FEATURES]
            + [compile_fwd(d, "bf16", f) for d in sorted(PADDED_HEAD_DIMS) for f in FEATURES]
            + [compile_fwd(d, "bf16", f, varlen=True) for d in every for f in FEATURES]
            + [compile_fwd(d, "bf16", f, kvcache=True) for d in every for f in ("causal", "window-softcap")])


def all_bwd(dtypes=("bf16", "fp16")):
    """Every dK/dV tile of configs.SM90_HOPPER_BWD, dense in both dtypes and varlen in bf16;
    where the tile has ``atomic_dq`` (deterministic=False, dense) that variant too, and its
    kernel splitting the last wave (``hopper.bwd.tail_pieces``) without a mask; the
    padded head dims (96, 192) in bf16, dense and varlen."""
    from triflash.kernels import configs
    from triflash.kernels.hopper.common import PADDED_HEAD_DIMS, kernel_head_dim
    dims = sorted(configs.SM90_HOPPER_BWD)
    modes = {d: (False, True) if configs.SM90_HOPPER_BWD[kernel_head_dim(d)].atomic_dq else (False,)
             for d in dims + sorted(PADDED_HEAD_DIMS)}
    split = [d for d in dims if configs.SM90_HOPPER_BWD[d].atomic_dq]
    return ([compile_bwd(d, dt, f, a) for d in dims for dt in dtypes for f in FEATURES for a in modes[d]]
            # the last wave split in pieces (hopper.bwd.tail_pieces: 4), served without a mask
            + [compile_bwd(d, dt, "plain", True, pieces=4) for d in split for dt in dtypes]
            + [compile_bwd(d, "bf16", f, varlen=True) for d in dims for f in FEATURES]
            + [compile_bwd(d, "bf16", f, a) for d in sorted(PADDED_HEAD_DIMS) for f in FEATURES
               for a in modes[d]]
            + [compile_bwd(d, "bf16", f, varlen=True) for d in sorted(PADDED_HEAD_DIMS) for f in FEATURES])


def all_dq(dtypes=("bf16", "fp16")):
    """The Gluon dQ kernel at every head dim of configs.SM90_HOPPER_BWD with its tile,
    dense in both dtypes and varlen in bf16; the padded head dims (96, 192) dense and varlen
    in bf16."""
    from triflash.kernels import configs
    from triflash.kernels.hopper import bwd_dq as Q
    from triflash.kernels.hopper.common import PADDED_HEAD_DIMS
    tiles = sorted(configs.SM90_HOPPER_BWD.items())
    padded = [(d, configs.SM90_HOPPER_BWD[w]) for d, w in sorted(PADDED_HEAD_DIMS.items())]

    def dq(d, c, dt, f, varlen=False):  # the tile as bwd.bwd launches it
        block_n, v_stages = Q.tile(c, varlen)
        return compile_dq(d, dt, f, block_n, varlen=varlen, v_stages=v_stages)
    return ([dq(d, c, dt, f) for d, c in tiles for dt in dtypes for f in FEATURES]
            + [dq(d, c, "bf16", f, varlen=True) for d, c in tiles for f in FEATURES]
            + [dq(d, c, "bf16", f, varlen=v) for d, c in padded for f in FEATURES for v in (False, True)])


def all_variants():
    """Tile options the dispatch does not use, bf16: the head-dim-256 dK/dV kernel with K / V
    read from shared memory (``reg_a`` 0). Every
    row's ``scalar_cvt`` counts the one-at-a-time conversions, ``mufu_ex2`` the exponentials
    left to the MUFU. Also (row key ``option``) the head-dim-256 dQ kernel of a dense batch
    with 32-key tiles sharing K's and V's slots (``dq_split_v`` off), and the forward rescaling O before P V
    (``rescale_early``) and with its row max by a tree (``tree_max``)."""
    import dataclasses

    from triflash.kernels import configs
    rows = []
    b256 = configs.SM90_HOPPER_BWD[256]
    for d in (64, 128, 256):  # O rescaled before P V is issued (rescale_early)
        for f in ("plain", "causal"):
            rows.append(dict(compile_fwd(d, "bf16", f, cfg=dataclasses.replace(configs.SM90_HOPPER_FWD[d],
                                                                                rescale_early=True)),
                             rescale_early=True))
    for f in ("plain", "causal"):  # the head-dim-256 dQ kernel of a dense batch without dq_split_v
        rows.append(dict(compile_dq(256, "bf16", f, b256.dq_block_n), option="dq_split_v=0"))
    # the forward with each of these flipped from its dispatched value (configs.flipped):
    # each row's max of S by a tree (tree_max), at 256 the persistent walk of unmasked tiles with one Q slot
    # (persistent_unmasked), at 128 / 256 the walk without the split tail (split_keys)
    for d, name in FWD_FLIPPED:
        c = configs.SM90_HOPPER_FWD[d]
        option = {name: configs.flipped(c, name)}
        for f in ("plain", "causal"):
            rows.append(dict(compile_fwd(d, "bf16", f, cfg=dataclasses.replace(c, **option)),
                             option=",".join(f"{k}={v}" for k, v in option.items())))
    for f in ("plain", "causal"):
        rows.append(dict(compile_bwd(256, "bf16", f, cfg=dataclasses.replace(b256, reg_a=0)), reg_a=0))
    return rows


def code_of(ptx: str) -> str:
    """The instructions of a PTX module without debug sections, labels and source-file
    lines (moving a helper to another file changes only those): two kernels
    whose ``code_of`` is equal compile to the same program (how a refactor of a kernel that
    cannot run here is checked against the version measured on the GPU)."""
    return "\n".join(line for line in ptx.split(".section")[0].splitlines()
                     if "$L__tmp" not in line and not line.lstrip().startswith((".loc", ".file")))


PARTS = ("fwd", "bwd", "dq", "variants")
# (head dim, forward option) compiled flipped from its dispatched value in the variants part
FWD_FLIPPED = tuple(itertools.product((64, 128, 256), ("tree_max",))) + (
    (256, "persistent_unmasked"), (128, "split_keys"), (256, "split_keys"))


def run_subprocess(part="fwd", timeout=900) -> list:
    """The rows of one ``part`` (``PARTS``: the forward, the dispatched dK/dV kernels, the
    dispatched Gluon dQ kernels) compiled in a fresh interpreter whose environment lacks
    TRITON_INTERPRET."""
    if part not in PARTS:
        raise ValueError(f"part={part!r} is not one of {PARTS}")
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
    env["PYTHONPATH"] = os.pathsep.join([root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    flags = [] if part == "fwd" else [f"--{part}"]
    res = subprocess.run([sys.executable, "-m", "tools.compile_check", "--json"] + flags,
                         env=env, cwd=root, capture_output=True, text=True, timeout=timeout)
    if res.returncode != 0:
        raise RuntimeError(f"sm_90a compile failed ({res.returncode}):\n{res.stderr[-4000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    ap.add_argument("--bwd", action="store_true", help="the backward's dK/dV kernel instead of the forward")
    ap.add_argument("--dq", action="store_true", help="the backward's Gluon dQ kernels")
    ap.add_argument("--variants", action="store_true",
                    help="tile options not dispatched (each flipped from a tile's value)")
    ap.add_argument("--dump", metavar="DIR",
                    help="also write each kernel's code_of(ptx) to DIR/<name>.ptx (diff two dumps "
                         "to check that a refactor compiles to the same program)")
    a = ap.parse_args(argv)
    if a.variants:
        rows = all_variants()
    elif a.dq:
        rows = all_dq()
    elif a.bwd:
        rows = all_bwd()
    else:
        rows = all_fwd()
    for r in rows:
        ptx = r.pop("ptx")
        if a.dump:
            os.makedirs(a.dump, exist_ok=True)
            name = "-".join(str(r[k]) for k in ("kernel", "headdim", "dtype", "feature", "atomic_dq") if k in r)
            name += "-varlen" if r.get("varlen") else ""
            name += "-kvcache" if r.get("kvcache") else ""
            name += "-3wg" if r.get("num_consumers", 2) == 3 else ""
            name += f"-split{r['tail_split']}" if r.get("tail_split") else ""
            with open(os.path.join(a.dump, name + ".ptx"), "w") as fh:
                fh.write(code_of(ptx))
    if a.json:
        print(json.dumps(rows))
    else:
        for r in rows:
            print(" ".join(f"{k}={v}" for k, v in r.items()))


if __name__ == "__main__":
    main()
