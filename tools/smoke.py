"""Smoke kernel for the Hopper (Gluon) tier: the building blocks the attention kernels need,
compiled for sm_90a without a GPU.

``qk_smoke_kernel`` (one program, num_warps=4 = one warpgroup):

1. allocates one NVMMA-swizzled shared tile for Q [BLOCK_M, D] and one for K [BLOCK_N, D]
   (layouts taken from the TMA descriptors) and one mbarrier (count 1);
2. ``mbarrier.expect`` with the bytes of both tiles, then two TMA loads
   (``tma_load``) that complete on that mbarrier; ``mbarrier.wait``
   on phase 0;
3. ``warpgroup_mma(q_smem, k_smem.permute((1, 0)), acc)``: S = Q K^T into fp32 registers
   with an ``NVMMADistributedLayout(version=[3, 0])`` accumulator; K^T is a transposed
   *view* of the K tile (no data movement, wgmma reads it K-major);
4. a plain ``gl.store`` of S (pointer arithmetic in the accumulator's layout).

``compile_sm90`` builds host descriptors on small CPU tensors, specializes the arguments as
``JITFunction.run`` would (``native_specialize_impl``), and compiles through
``GluonASTSource`` + ``triton.compile(..., target=GPUTarget("cuda", 90, 32))``. Gluon has
no interpreter: run it in a process without TRITON_INTERPRET (``compile_sm90_subprocess``
does that for callers that have it set).

    python -m tools.smoke [--block-m 64 --block-n 64 --headdim 128 --dtype bf16]
"""
import argparse
import json
import os
import subprocess
import sys

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma
from triflash.kernels.common import FP_FUSION
from triflash.kernels.hopper.common import tma_load

_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


@gluon.jit
def qk_smoke_kernel(q_desc, k_desc, s_ptr, stride_sm, num_warps: gl.constexpr):
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    HEAD_D: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]

    # Shared tiles with the descriptors' NVMMA swizzle: TMA writes them, wgmma reads them.
    q_tile = gl.allocate_shared_memory(q_desc.dtype, [BLOCK_M, HEAD_D], q_desc.layout)
    k_tile = gl.allocate_shared_memory(k_desc.dtype, [BLOCK_N, HEAD_D], k_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(ready, count=1)

    # Both loads complete on one barrier: expect the sum of their bytes, then wait phase 0.
    mbarrier.expect(ready, q_desc.block_type.nbytes + k_desc.block_type.nbytes)
    tma_load(q_desc, [0, 0], ready, q_tile)
    tma_load(k_desc, [0, 0], ready, k_tile)
    mbarrier.wait(ready, 0)
    mbarrier.invalidate(ready)

    # wgmma accumulator layout: instr [m=16, n, k=256/bits], warps stacked along M.
    INSTR_N: gl.constexpr = 256 if BLOCK_N >= 256 else BLOCK_N
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1],
        instr_shape=[16, INSTR_N, 256 // q_desc.dtype.primitive_bitwidth])
    zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    # S = Q @ K^T; K^T is a permuted view of the K tile. use_acc=False ignores `zero`.
    s = warpgroup_mma(q_tile, k_tile.permute((1, 0)), zero, use_acc=False)

    rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    offs = gl.expand_dims(rows, 1) * stride_sm + gl.expand_dims(cols, 0)
    gl.store(s_ptr + offs, s)


def make_descriptors(q, k, block_m, block_n):
    """TMA descriptors for 2D Q [seqlen_q, d] and K [seqlen_k, d] (rows contiguous in d),
    blocks [block_m, d] and [block_n, d], default (widest) NVMMA swizzle for the dtype."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    gdt = getattr(gl, str(q.dtype).split(".")[-1])
    d = q.shape[-1]
    q_layout = gl.NVMMASharedLayout.get_default_for([block_m, d], gdt)
    k_layout = gl.NVMMASharedLayout.get_default_for([block_n, d], gdt)
    return (TensorDescriptor.from_tensor(q, [block_m, d], q_layout),
            TensorDescriptor.from_tensor(k, [block_n, d], k_layout))


def _specialize(fn, args):
    """signature / constexprs / attrs as ``JITFunction.run`` builds them, ``args`` every
    parameter by position (``sm90_report._specialize``)."""
    from tools.sm90_report import _specialize as specialize
    signature, constexprs, attrs, _ = specialize(fn, list(args), {})
    return signature, constexprs, attrs


def compile_sm90(block_m=64, block_n=64, headdim=128, dtype="bf16"):
    """Compile ``qk_smoke_kernel`` for sm_90a on the CPU. Returns a dict: ``shared`` (dynamic
    shared memory bytes of the launch), ``has_wgmma``, ``has_tma`` (``cp.async.bulk.tensor``
    in the PTX), ``has_mbarrier``, ``num_warps``, and the PTX line count."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("Gluon has no interpreter: unset TRITON_INTERPRET "
                           "(or use compile_sm90_subprocess)")
    tdt = getattr(torch, _DTYPES[dtype])
    q = torch.empty(block_m, headdim, dtype=tdt)  # CPU tensors: only shapes/strides matter
    k = torch.empty(block_n, headdim, dtype=tdt)
    s = torch.empty(block_m, block_n, dtype=torch.float32)
    q_desc, k_desc = make_descriptors(q, k, block_m, block_n)
    num_warps = 4
    fn = qk_smoke_kernel
    signature, constexprs, attrs = _specialize(fn, [q_desc, k_desc, s, s.stride(0), num_warps])
    src = GluonASTSource(fn, signature, constexprs, attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "enable_fp_fusion": FP_FUSION})
    ptx = compiled.asm["ptx"]
    return dict(block_m=block_m, block_n=block_n, headdim=headdim, dtype=dtype,
                num_warps=compiled.metadata.num_warps, shared=compiled.metadata.shared,
                has_wgmma="wgmma.mma_async" in ptx,
                has_tma="cp.async.bulk.tensor" in ptx,
                has_mbarrier="mbarrier.try_wait" in ptx or "mbarrier.wait" in ptx,
                ptx_lines=ptx.count("\n"))


def compile_sm90_subprocess(timeout=300, **kw):
    """``compile_sm90`` in a fresh interpreter whose environment lacks TRITON_INTERPRET."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
    env["PYTHONPATH"] = os.pathsep.join([root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    cmd = [sys.executable, "-m", "tools.smoke", "--json"]
    for key, val in kw.items():
        cmd += [f"--{key.replace('_', '-')}", str(val)]
    res = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=timeout)
    if res.returncode != 0:
        raise RuntimeError(f"sm_90a compile failed ({res.returncode}):\n{res.stderr[-4000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--block-m", type=int, default=64)
    ap.add_argument("--block-n", type=int, default=64)
    ap.add_argument("--headdim", type=int, default=128)
    ap.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16")
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    a = ap.parse_args(argv)
    r = compile_sm90(a.block_m, a.block_n, a.headdim, a.dtype)
    print(json.dumps(r) if a.json else "\n".join(f"{k}: {v}" for k, v in r.items()))


if __name__ == "__main__":
    main()
