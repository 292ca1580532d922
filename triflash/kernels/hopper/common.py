"""Pieces every Hopper (Gluon) kernel shares, written once: accumulator layouts, the view of a
2D shared tile as a rank-4 TMA box, and the host-side TMA descriptors."""
import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.constexpr_function
def _acc_layout(n, dtype):
    """wgmma accumulator of one warpgroup: instr m16 x n x k(16 for 16-bit inputs)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                     instr_shape=[16, n, 256 // dtype.primitive_bitwidth])


@gluon.jit
def _tma_view(buf, desc):
    """A 2D [rows, dim] smem tile seen as the rank-4 (1, rows, 1, dim) box of ``desc``."""
    return buf._reinterpret(desc.dtype, desc.block_type.shape, desc.layout)


def _gl_dtype(dtype):
    return {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[dtype]


@functools.lru_cache(maxsize=None)
def _box_layout(rows, dim, dtype):
    # get_default_for costs ~9 us of Python per call: computed once per (box, dtype)
    return gl.NVMMASharedLayout.get_default_for([1, rows, 1, dim], _gl_dtype(dtype))


def descriptor(x, rows, cols=None):
    """Rank-4 TMA descriptor over x (batch, seqlen, heads, dim), box (1, rows, 1, cols);
    cols defaults to the whole head dim."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    cols = x.shape[-1] if cols is None else cols
    return TensorDescriptor.from_tensor(x, [1, rows, 1, cols], _box_layout(rows, cols, x.dtype))


def tma_compatible(*tensors) -> bool:
    """TMA needs 16-byte aligned base pointers and 16-byte multiples for the outer strides."""
    for x in tensors:
        if x.data_ptr() % 16 or x.stride(-1) != 1:
            return False
        if any((s * x.element_size()) % 16 for s in x.stride()[:-1]):
            return False
    return True
