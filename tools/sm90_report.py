"""Compile the Triton kernels for Hopper (sm_90a) on any machine, GPU or not, and report what
each launch the sm90 dispatch can make costs: shared memory, registers, spills.

    python -m tools.sm90_report             # the whole table (cached results reused)
    python -m tools.sm90_report --no-cache  # recompile everything, time each compile
    python -m tools.sm90_report --only ID ... [--json out.json]

(from the repository root: ``tools/`` is a developer folder beside the package, not installed).

What is compiled, so that it matches real launches:

1. ``dispatch.run_fwd`` / ``run_bwd`` run on ``meta`` tensors of a representative problem
   with the target forced to "sm90" and every Triton kernel replaced by a recorder. So the
   tile config, the atomic-dQ rule, split dK/dV passes, arguments, constexprs and launch
   options are exactly the dispatch's and the host code's; one host call can record several
   launches (preprocess, dK/dV pass(es), dQ). ``compile_sm90`` with an explicit config
   records the same way with that config in place of the table's.
2. The recorded arguments are specialized with Triton's own ``native_specialize_impl`` (what
   ``JITFunction.run`` does): ints equal to 1 become constexprs, ints divisible by 16 and
   pointers get ``tt.divisibility=16``. Pointers count as 16-byte aligned (torch allocations
   are). The problem: MHA, 16 heads, dense batch 2 x seqlen 4096, so the strides of
   contiguous (batch, seqlen, heads, dim) tensors are divisible by 16 exactly when
   heads * dim is, and the head stride when dim is (72: it is not, as on a real launch).
   Varlen: batch stride 0, 8007 tokens, max_seqlen 2048.
3. ``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))`` builds PTX and a cubin
   without a driver. ``metadata.shared`` is the dynamic shared memory the launch requests.
   Registers and spills are not in the metadata without a driver (``n_regs``/``n_spills``
   come from loading the module), so the report of Triton's own ``ptxas -v`` run is
   captured (TRITON_DUMP_PTXAS_LOG) and parsed; when Triton's cache served the kernel, its
   PTX is assembled again with the same ptxas and flags. The register count is checked
   against ``cuobjdump --dump-resource-usage`` of Triton's cubin. ``shared`` = Triton's
   dynamic shared memory + ptxas's static ``smem`` (0 for these kernels); the 1 KiB that
   cuobjdump lists as SHARED on sm_90 is the per-block reservation, not part of the limit.

Identical compiles (same kernel, signature, constexprs, divisibility and options; e.g. the
preprocess kernel ignores the mask features) are compiled once, on a process pool. Results
are cached on disk under Triton's cache directory, keyed by Triton's own source hash of the
kernel and everything it calls, so editing a kernel invalidates exactly its entries; a file
lock there makes concurrent runs (pytest-xdist workers) compile each kernel once.

TRITON_INTERPRET: compiling needs real JITFunctions. If this process imported triflash
under the interpreter, ``run_report``, ``compile_sm90`` and ``main`` do the compiling in a
subprocess whose environment lacks TRITON_INTERPRET (enumerating works either way).
"""
import argparse
import concurrent.futures
import contextlib
import dataclasses
import functools
import hashlib
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Dict, List, Optional

from triflash.kernels import configs

# Hopper: largest shared memory one block may opt into (cudaDevAttrMaxSharedMemoryPerBlockOptin
# on H100/H200; the SM has 228 KiB, 1 KiB of which is reserved per block).
MAX_SHARED_SM90 = 232448

# Launches allowed to spill: job id (see ``Job.id``) -> (max spill bytes, stores + loads,
# "the written reason it is acceptable"). Overrides SPILL_RULES for one launch.
SPILL_BUDGET: Dict[str, tuple] = {}

_MEASURED = ("chosen over the tiles that do not spill because it measured faster on the H200 "
             "(benchmarks/results/sweep-h200-6ffbd25.json, configs.py lists the numbers)")
_MASKED_D = ("a head dim that is not a power of two runs on the next power-of-two tile with a "
             "masked head-dim axis; at 72 the head stride is not a multiple of 16, so Triton "
             "cannot vectorize or pipeline the loads and they spill (a multiple_of(8) stride "
             "hint removed it in a compile-only experiment). Tiles of their own for 72/96/192 "
             "are future work")
_PORTABLE = ("the masked (causal/window/softcap/varlen) variants need the visibility mask on "
             "top of the same accumulators; removing these spills needs more registers per "
             "thread than Triton's 255-per-thread allocation gives, which is the Hopper tier's job")
# Spill budgets by (kernel variant, head dim): the worst case over dtypes and features
# (the full table: plain, causal, window, softcap, varlen, all), rounded up to 64 B, as measured by
# this report (then ``triflash/kernels/sm90_report.py``) at the tiles of commit 9f1c860, and at bcff93c for
# the backward tiles of the round-2 sweep (3-stage rings: more spills on the masked variants,
# faster on the H200, sweep-h200-{4cf91bc,25aaea1}.json.gz). A change that spills more fails
# tests/test_sm90_resources.py.
SPILL_RULES: Dict[tuple, tuple] = {
    ("fwd", 64): (1152, f"128x128 tile, 4 warps: {_MEASURED}; {_PORTABLE} (1116 B on the all-features "
                        f"variant with the one-dimensional launch, common.launch_order; 1088 without it)"),
    ("bwd_dq", 64): (896, f"64x128 dQ tile, 4 warps, under the window/varlen masks: {_MEASURED}"),
    ("bwd_dkdv", 64): (1536, f"64x128 dK/dV tile: {_MEASURED}; {_PORTABLE}"),
    ("fwd", 72): (11968, f"{_MASKED_D} (11728 B with the one-dimensional launch; 11928 when every block's Q / "
                         f"O rows were 64-bit, now only under WIDE_ROWS; 11264 with neither)"),
    ("bwd_dkdv", 72): (14272, _MASKED_D),
    ("bwd_dkdv+atomic_dq", 72): (16960, _MASKED_D),
    ("bwd_dq", 72): (4160, f"{_MASKED_D} (4116 B with the launch order's two extra divisions, "
                           f"common.launch_order)"),
    ("fwd", 96): (64, _MASKED_D),
    ("bwd_dkdv", 96): (3712, f"{_MASKED_D}; and the 64x128 dK/dV tile of head dim 128"),
    ("bwd_dkdv+atomic_dq", 96): (4288, f"{_MASKED_D}; and the 64x128 dK/dV tile of head dim 128"),
    ("bwd_dq", 96): (384, f"{_MASKED_D}; and the 128x64 dQ tile of head dim 128"),
    ("fwd", 128): (64, f"128x128 tile, 8 warps: {_MEASURED}"),
    ("bwd_dkdv", 128): (3712, f"64x128 dK/dV tile, 3 stages: {_MEASURED}; {_PORTABLE}"),
    ("bwd_dq", 128): (384, f"128x64 dQ tile, 3 stages, under masks: {_MEASURED}"),
    ("fwd", 192): (192, f"{_MASKED_D} (varlen: 176 B with the scale folded into exp2, 25aaea1)"),
    ("bwd_dkdv[dk]", 192): (2048, f"{_MASKED_D}; and the dK pass of head dim 256"),
    ("bwd_dkdv[dv]", 192): (1280, f"{_MASKED_D}; and the dV pass of head dim 256"),
    ("bwd_dq", 192): (64, _MASKED_D),
    ("fwd", 256): (192, f"128x64 tile, 8 warps: {_MEASURED}"),
    ("bwd_dkdv[dk]", 256): (2048, f"32x128 dK pass, 3 stages: {_MEASURED} (317 TFLOPS against 256 "
                                   f"for 16x128); {_PORTABLE}"),
    ("bwd_dkdv[dv]", 256): (1280, f"32x128 dV pass, 3 stages: {_MEASURED}; {_PORTABLE}"),
    ("bwd_dq", 256): (64, f"128x32 dQ tile: {_MEASURED}"),
}
# The paged KV-cache forward (flash_attn_with_kvcache with a page table): each key block's
# rows come from a page-table load, two int64 row-offset vectors on top of the forward's tile
# (measured when it was added: bf16, left padding and seqused_k, dense and packed
# queries, 288 / 6396 B worst at 64 / 72; its speed is not measured: decoding has no split-KV yet).
_PAGED = "page-table row offsets on top of the forward's tile; speed not measured (decoding)"
SPILL_RULES.update({
    ("fwd+paged", 64): (320, _PAGED), ("fwd+paged", 72): (6400, f"{_PAGED}; {_MASKED_D}"),
    ("fwd+paged", 96): (64, _PAGED), ("fwd+paged", 128): (128, _PAGED),
    ("fwd+paged", 256): (192, _PAGED),
})


def spill_budget(job, release: str = None) -> tuple:
    """(bytes, reason) a launch may spill under Triton ``release`` (default: the running
    one): that release's budget by id (tools/triton_budgets.py), else SPILL_BUDGET by id,
    else SPILL_RULES by (variant, head dim), else (0, "")."""
    from tools import triton_budgets
    by_release = triton_budgets.for_release("portable", release)
    if job.id in by_release:
        return by_release[job.id]
    if job.id in SPILL_BUDGET:
        return SPILL_BUDGET[job.id]
    return SPILL_RULES.get((job.label, job.headdim), (0, ""))

HEADDIMS = (64, 72, 96, 128, 192, 256)   # 72, 96, 192: not powers of two (masked head dim)
DTYPES = ("bf16", "fp16")
KERNELS = ("flash_fwd_kernel", "bwd_preprocess_kernel", "bwd_dkdv_kernel", "bwd_dq_kernel")
_CACHE_FORMAT = 2


@dataclass(frozen=True)
class Features:
    """The problem features that change a kernel's constexprs (and the user's
    ``deterministic`` flag, which picks atomic dQ vs the dQ kernel)."""
    causal: bool = False
    window: tuple = (-1, -1)   # (left, right), -1 unbounded; causal sets right = 0
    softcap: float = 0.0
    varlen: bool = False
    seqused: bool = False      # seqused_q and seqused_k (varlen only)
    deterministic: bool = False
    kvcache: bool = False      # a paged KV cache with left padding (forward only, dense q)

    def window_left_right(self):
        left, right = self.window
        return left, (0 if self.causal else right)


# Constexpr combinations: HAS_RIGHT (causal), HAS_LEFT + HAS_RIGHT (window), SOFTCAP,
# IS_VARLEN, and everything on (+ HAS_SEQUSED_Q/K).
FEATURES = {
    "plain": Features(),
    "causal": Features(causal=True),
    "window": Features(window=(256, 256)),
    "softcap": Features(softcap=30.0),
    "varlen": Features(varlen=True),
    "all": Features(causal=True, window=(256, -1), softcap=30.0, varlen=True, seqused=True),
    "kvcache": Features(causal=True, kvcache=True),
    "kvcache-varlen": Features(causal=True, kvcache=True, varlen=True),  # packed q over the cache
}

_SHORT = {"flash_fwd_kernel": "fwd", "bwd_preprocess_kernel": "bwd_pre",
          "bwd_dkdv_kernel": "bwd_dkdv", "bwd_dq_kernel": "bwd_dq"}


@dataclass(frozen=True)
class Job:
    """One kernel launch the sm90 dispatch makes for one problem."""
    kernel: str             # the Triton kernel's name
    config: object          # the FwdConfig / BwdConfig the dispatch used
    headdim: int
    headdim_v: int
    dtype: str              # "bf16" / "fp16"
    feature_name: str
    features: Features
    launch: int = 0         # which launch of ``kernel`` in the host call (split dK/dV: 0, 1)
    variant: str = ""       # label from the launch's mode constexprs, e.g. bwd_dkdv[dk]+atomic_dq
    tile: Optional[tuple] = None  # (BLOCK_M, BLOCK_N, num_warps, num_stages) as launched

    @property
    def id(self) -> str:
        d = f"d{self.headdim}" if self.headdim == self.headdim_v else f"d{self.headdim}v{self.headdim_v}"
        return f"{self.label}-{d}-{self.dtype}-{self.feature_name}"

    @property
    def label(self) -> str:
        """The kernel and its mode, e.g. fwd, bwd_dkdv+atomic_dq, bwd_dkdv[dk]."""
        return self.variant or _SHORT.get(self.kernel, self.kernel)

    @property
    def direction(self) -> str:
        return "fwd" if self.kernel == "flash_fwd_kernel" else "bwd"


def _variant(name: str, constexprs: dict) -> str:
    """A short label for a launch: kernel + the mode constexprs that pick its work."""
    label = _SHORT.get(name, name)
    do_dk, do_dv = constexprs.get("DO_DK", True), constexprs.get("DO_DV", True)
    if not (do_dk and do_dv):
        label += "[dk]" if do_dk else "[dv]"
    if constexprs.get("ATOMIC_DQ"):
        label += "+atomic_dq"
    if constexprs.get("PAGED"):
        label += "+paged"
    return label


# ---------------------------------------------------------------------------------------------
# Recording the launches of one host call


class _Recorder:
    def __init__(self, fn, log):
        self.fn = fn
        self.log = log

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.log.append((self.fn, args, kwargs))
        return launch


@contextlib.contextmanager
def _patched(obj, name, value):
    saved = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, saved)


@contextlib.contextmanager
def _recording():
    """Replace every Triton kernel held by a triflash module with a recorder."""
    from triton.runtime.jit import KernelInterface
    log = []
    saved = [(m, n, v) for m in list(sys.modules.values())
             if getattr(m, "__name__", "").startswith("triflash")
             for n, v in list(vars(m).items()) if isinstance(v, KernelInterface)]
    try:
        for m, n, v in saved:
            setattr(m, n, _Recorder(v, log))
        yield log
    finally:
        for m, n, v in saved:
            setattr(m, n, v)


# Representative problem (see the module docstring).
_BATCH, _SEQLEN, _NHEADS, _NHEADS_KV = 2, 4096, 16, 16
_VARLEN_BATCH, _VARLEN_TOTAL, _VARLEN_MAX = 4, 8007, 2048


def _record_host_call(direction: str, config, d: int, dv: int, dtype: str, f: Features):
    """Run ``dispatch.run_fwd`` (direction "fwd") or ``run_bwd`` on meta tensors as on sm90.
    ``config``: None for the dispatch's own table, else the tile to use instead.
    Returns (the config used, [(kernel name, JIT/interpreted fn, args, kwargs), ...])."""
    import torch
    from triflash import dispatch
    from triflash.kernels import problem
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    meta = dict(device="meta", dtype=dt)
    f32 = dict(device="meta", dtype=torch.float32)
    cache = None
    if f.kvcache:  # flash_attn_with_kvcache's paged form: 64-row pages, left padding, seqused_k
        b, s, page = _BATCH, _SEQLEN, 64
        index = dict(device="meta", dtype=torch.int32)
        q = torch.empty(b * s, _NHEADS, d, **meta) if f.varlen else torch.empty(b, s, _NHEADS, d, **meta)
        k, v = torch.empty(b * s // page, page, _NHEADS_KV, d, **meta), torch.empty(b * s // page, page, _NHEADS_KV, dv, **meta)
        cache = problem.CacheAddressing(start=torch.empty(b, **index), page_table=torch.empty(b, s // page, **index))
        cu, used = (torch.empty(b + 1, **index) if f.varlen else None), torch.empty(b, **index)
        max_q = max_k = _SEQLEN
    elif f.varlen:
        t = _VARLEN_TOTAL
        q, k = torch.empty(t, _NHEADS, d, **meta), torch.empty(t, _NHEADS_KV, d, **meta)
        v = torch.empty(t, _NHEADS_KV, dv, **meta)
        out, lse = torch.empty(t, _NHEADS, dv, **meta), torch.empty(_NHEADS, t, **f32)
        cu = torch.empty(_VARLEN_BATCH + 1, device="meta", dtype=torch.int32)
        used = torch.empty(_VARLEN_BATCH, device="meta", dtype=torch.int32) if f.seqused else None
        max_q = max_k = _VARLEN_MAX
    else:
        b, s = _BATCH, _SEQLEN
        q, k = torch.empty(b, s, _NHEADS, d, **meta), torch.empty(b, s, _NHEADS_KV, d, **meta)
        v = torch.empty(b, s, _NHEADS_KV, dv, **meta)
        out, lse = torch.empty(b, s, _NHEADS, dv, **meta), torch.empty(b, _NHEADS, s, **f32)
        cu = used = None
        max_q = max_k = _SEQLEN
    left, right = f.window_left_right()
    p = problem.AttnParams(softmax_scale=d ** -0.5, window_left=left, window_right=right,
                            softcap=f.softcap, max_seqlen_q=max_q, max_seqlen_k=max_k)
    chosen = []
    table = configs.fwd_config if direction == "fwd" else configs.bwd_config

    def pick(arch, headdim, headdim_v, **kw):
        cfg = table("sm90", headdim, headdim_v, **kw) if config is None else config
        chosen.append(cfg)
        return cfg

    # The portable tier's launches (the Gluon tier has its own compile check:
    # tests/test_hopper_compile.py).
    with _patched(dispatch, "target_of", lambda device: "sm90"), \
            _patched(configs, table.__name__, pick), _recording() as log, \
            dispatch.force_backend("portable"):
        if cache is not None:
            dispatch.run_fwd_cache(q, k, v, cu, used, cache, p)
        elif direction == "fwd":
            dispatch.run_fwd(q, k, v, cu, cu, used, used, p)
        else:
            dispatch.run_bwd(torch.empty_like(out), q, k, v, out, lse, cu, cu, used, used, p,
                             f.deterministic)
    if len(chosen) != 1 or not log:
        raise RuntimeError(f"dispatch.run_{direction} picked {len(chosen)} configs and launched "
                           f"{len(log)} kernels on sm90; sm90_report expects one config and a "
                           f"portable Triton launch")
    return chosen[0], [(fn.fn.__name__, fn, args, kwargs) for fn, args, kwargs in log]


def _launch_constexprs(fn, args, kwargs) -> dict:
    """The launch's arguments by name (JITFunction and InterpretedFunction alike); the fields
    of a constexpr NamedTuple (a portable kernel's ``META``) by their own names too."""
    names = list(inspect.signature(fn.fn).parameters)
    bound = dict(zip(names, args))
    bound.update({k: v for k, v in kwargs.items() if k in names})
    for value in list(bound.values()):
        if isinstance(value, tuple) and hasattr(value, "_fields"):
            bound.update(value._asdict())
    return bound


def _jobs_of_call(direction, config, d, dv, dtype, feature_name, f, fingerprints=None) -> List[Job]:
    """The launches of one host call as Jobs; ``fingerprints`` (a dict) receives each job's
    keyword arguments (constexprs and options) by job id."""
    cfg, launches = _record_host_call(direction, config, d, dv, dtype, f)
    jobs, seen = [], {}
    for name, fn, args, kwargs in launches:
        bound = _launch_constexprs(fn, args, kwargs)
        tile = None
        if "BLOCK_N" in bound and name != "bwd_preprocess_kernel":
            tile = (bound.get("BLOCK_M"), bound.get("BLOCK_N"), kwargs.get("num_warps", 4),
                    kwargs.get("num_stages", 3))
        index = seen.get(name, 0)
        seen[name] = index + 1
        job = Job(name, cfg, d, dv, dtype, feature_name, f, index, _variant(name, bound), tile)
        jobs.append(job)
        if fingerprints is not None:
            fingerprints[job.id] = repr(sorted(kwargs.items()))
    return jobs


def all_dispatch_configs(headdims=HEADDIMS, dtypes=DTYPES, features=tuple(FEATURES)) -> List[Job]:
    """Every launch the sm90 dispatch makes, for each head dim (headdim_v = headdim, and
    FA3's MLA shape 64 / 512, forward only), dtype and feature set, with ``deterministic``
    False (the default) and True: forward; backward
    preprocess, dK/dV (with atomic dQ when the tile allows it and deterministic=False; two
    passes when the tile says split_dkdv) and the dQ kernel. Launches that are the same for
    both deterministic settings are listed once. Needs no compiler; works under
    TRITON_INTERPRET too."""
    jobs, ids = [], {}
    calls_of = {}  # (d, dv, dtype, feature name) -> [(direction, features)]
    for d in headdims:
        for dtype in dtypes:
            for name in features:
                f = FEATURES[name]
                calls = [("fwd", f), ("bwd", f), ("bwd", dataclasses.replace(f, deterministic=True))]
                calls_of[d, d, dtype, name] = calls[:1] if f.kvcache else calls  # (kvcache: forward only)
    if 64 in headdims:  # FA3's MLA shape, headdim_v 512: forward only
        for dtype in dtypes:
            for name in [n for n in features if n in ("plain", "causal")]:
                calls_of[64, 512, dtype, name] = [("fwd", FEATURES[name])]
    for (d, dv, dtype, name), calls in calls_of.items():
        for direction, feats in calls:
            prints = {}
            for job in _jobs_of_call(direction, None, d, dv, dtype, name, feats, prints):
                if job.id in ids:  # e.g. preprocess, or dQ at a tile without atomics
                    if ids[job.id] != prints[job.id]:
                        raise RuntimeError(
                            f"two different launches share the id {job.id}: give the "
                            f"mode constexpr that tells them apart a label in _variant()")
                    continue
                ids[job.id] = prints[job.id]
                jobs.append(job)
    return jobs


# ---------------------------------------------------------------------------------------------
# Toolchain


class Unavailable(RuntimeError):
    """The sm_90a toolchain (Triton's NVIDIA backend, ptxas) cannot be used here."""


def kernels_interpreted() -> bool:
    """True when triflash's kernels were built by Triton's CPU interpreter in this process."""
    from triflash.kernels.fwd import flash_fwd_kernel
    return type(flash_fwd_kernel).__name__ == "InterpretedFunction"


def _ptxas_path() -> str:
    from triton.backends.nvidia.compiler import get_ptxas
    return get_ptxas(90).path


def _tool_path(name: str) -> str:
    from triton import knobs
    return getattr(knobs.nvidia, name).path


def toolchain_problem() -> Optional[str]:
    """None when sm_90a compiles can run here, else why not."""
    try:
        import triton  # noqa: F401
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"Triton's NVIDIA backend is not importable: {e!r}"
    try:
        ptxas = _ptxas_path()
        out = subprocess.run([ptxas, "--version"], capture_output=True, text=True, timeout=60)
    except Exception as e:  # noqa: BLE001
        return f"ptxas is not runnable: {e!r}"
    if out.returncode != 0:
        return f"ptxas --version failed: {out.stderr.strip()}"
    return None


@functools.lru_cache(maxsize=None)
def _toolchain_id() -> str:
    import triton
    ptxas = subprocess.run([_ptxas_path(), "--version"], capture_output=True, text=True).stdout
    # (with the flags every run passes ptxas: cached results name all that decides them)
    return (f"triton {triton.__version__}; {ptxas.strip().splitlines()[-1] if ptxas else '?'}; "
            f"{' '.join(_triton_ptxas_fixed_flags())}")


# ---------------------------------------------------------------------------------------------
# Specializing a recorded launch like JITFunction.run


def _specialize(fn, args, kwargs):
    """(signature, constexprs, attrs, options) exactly as JITFunction.run would build them;
    tuple arguments (a kernel's strides, say) too, their elements addressed by path."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.backends.compiler import GPUTarget
    from triton.runtime.jit import MockTensor
    import torch
    names = [p.name for p in fn.params]
    options = {k: v for k, v in kwargs.items() if k not in names}
    bound = fn.signature.bind(*args, **{k: v for k, v in kwargs.items() if k in names})
    bound.apply_defaults()

    def mock(val):  # data_ptr 0: 16-byte aligned
        if isinstance(val, torch.Tensor):
            return MockTensor(val.dtype)
        if isinstance(val, tuple) and not hasattr(val, "_fields"):
            return tuple(mock(v) for v in val)
        return val

    specialization = []
    for kp, name in zip(fn.params, bound.arguments):
        assert kp.name == name
        if kp.annotation_type:
            raise NotImplementedError(f"annotated kernel parameter {name}: not handled")
        if kp.is_constexpr:
            specialization.append(("constexpr", bound.arguments[name]))
            continue
        specialization.append(native_specialize_impl(CUDABackend, mock(bound.arguments[name]), kp.is_const,
                                                     not kp.do_not_specialize,
                                                     not kp.do_not_specialize_on_alignment))
    backend = CUDABackend(GPUTarget("cuda", 90, 32))
    _, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound.arguments, specialization, options)
    return signature, constexprs, attrs, options


def _find_launch(job: Job):
    """Record ``job``'s host call again (in this process) and return its launch."""
    f = job.features
    _, launches = _record_host_call(job.direction, job.config, job.headdim, job.headdim_v,
                                    job.dtype, f)
    found = [(fn, a, k) for name, fn, a, k in launches if name == job.kernel]
    if len(found) <= job.launch:
        raise LookupError(f"{job.id}: the host code launched {[x[0] for x in launches]}, "
                          f"not launch {job.launch} of {job.kernel}")
    return found[job.launch]


def _spec_of(job: Job) -> dict:
    fn, args, kwargs = _find_launch(job)
    if kernels_interpreted():
        raise RuntimeError("compiling needs JIT kernels (TRITON_INTERPRET is set)")
    signature, constexprs, attrs, options = _specialize(fn, args, kwargs)
    return dict(module=fn.fn.__module__, name=fn.__name__, signature=signature,
                constexprs=sorted(constexprs.items()), attrs=sorted(attrs.items()),
                options=options)


def _spec_key(spec: dict, toolchain: str) -> str:
    """Triton's own source hash of the specialized kernel (covers every function it calls),
    plus the options, the target and the toolchain."""
    src = _ast_source(spec)
    blob = json.dumps([_CACHE_FORMAT, src.hash(), sorted(spec["options"].items()), "sm_90a",
                       toolchain], default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def _ast_source(spec: dict):
    import importlib
    from triton.compiler import ASTSource
    fn = getattr(importlib.import_module(spec["module"]), spec["name"])
    return ASTSource(fn=fn, signature=spec["signature"], constexprs=dict(spec["constexprs"]),
                     attrs=dict(spec["attrs"]))


# ---------------------------------------------------------------------------------------------
# Compiling and reading resources

_RE = {
    "registers": re.compile(r"Used (\d+) registers"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
    "stack": re.compile(r"(\d+) bytes stack frame"),
}
_RE_SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas_log(log: str) -> dict:
    """Registers, spills, stack frame and static shared memory from ``ptxas -v`` output."""
    out = {}
    for key, rx in _RE.items():
        m = rx.findall(log)
        if len(m) != 1:
            raise ValueError(f"ptxas -v output has {len(m)} matches for {key!r}:\n{log}")
        out[key] = int(m[0])
    smem = _RE_SMEM.findall(log)
    out["static_shared"] = int(smem[0]) if smem else 0
    # ptxas's "(C7512) Potential Performance Loss: wgmma.mma_async instructions are
    # serialized due to ..." (register resources, or other reasons): every wgmma then waits
    # for the one before it, which no spill count shows
    out["wgmma_serialized"] = "wgmma.mma_async instructions are serialized" in log
    return out


def _cubin_registers(cubin: bytes) -> Optional[int]:
    try:
        tool = _tool_path("cuobjdump")
    except Exception:  # noqa: BLE001
        return None
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as fh:
            fh.write(cubin)
        res = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True, text=True)
    m = re.search(r"REG:(\d+)", res.stdout)
    return int(m.group(1)) if res.returncode == 0 and m else None


@functools.lru_cache(maxsize=None)
def _triton_ptxas_fixed_flags() -> list:
    """The flags the running Triton always passes ptxas beside the per-kernel ones (3.8 and 3.9
    add ``--regAllocOptLevel=2``, a ptxas 13 workaround that changes register allocation)."""
    from triton.backends.nvidia.compiler import CUDABackend
    source = inspect.getsource(CUDABackend.make_cubin)
    return [flag for flag in ("--regAllocOptLevel=2",) if flag in source]


def _run_ptxas(ptx: str, md) -> str:
    """``ptxas -v`` with Triton's flags (see CUDABackend.make_cubin) on ``ptx``; its report."""
    from triton.backends.nvidia.compiler import sm_arch_from_capability
    flags = ["-lineinfo", "-v", f"--gpu-name={sm_arch_from_capability(90)}"] + _triton_ptxas_fixed_flags()
    if not getattr(md, "enable_fp_fusion", True):
        flags.append("--fmad=false")
    if getattr(md, "ptx_options", None):
        flags += md.ptx_options.split(" ")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as fh:
            fh.write(ptx)
        res = subprocess.run([_ptxas_path(), *flags, path, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"ptxas failed ({res.returncode}):\n{res.stderr}")
    return res.stdout + res.stderr


def _compile_spec(spec: dict) -> dict:
    """Compile one specialized kernel for sm_90a; runs in a worker process.

    Triton's own ptxas run prints its ``-v`` report when TRITON_DUMP_PTXAS_LOG is on; it is
    captured here. When Triton served the kernel from its cache (no ptxas run), ptxas is
    run again on the PTX with Triton's flags."""
    import io
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    knobs.nvidia.dump_ptxas_log = True
    captured = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(captured):
        compiled = triton.compile(_ast_source(spec), target=GPUTarget("cuda", 90, 32),
                                  options=dict(spec["options"]))
    t1 = time.perf_counter()
    md = compiled.metadata
    log, source = captured.getvalue(), "triton"
    if not _RE["registers"].search(log):
        log, source = _run_ptxas(compiled.asm["ptx"], md), "rerun"
    t2 = time.perf_counter()
    r = parse_ptxas_log(log)
    cubin_regs = _cubin_registers(compiled.asm["cubin"])
    if cubin_regs is not None and cubin_regs != r["registers"]:
        raise RuntimeError(f"ptxas -v says {r['registers']} registers, Triton's cubin {cubin_regs}")
    r.update(dynamic_shared=int(md.shared), shared=int(md.shared) + r["static_shared"],
             num_warps=md.num_warps, num_stages=md.num_stages, ptxas_log=source,
             compile_s=round(t1 - t0, 2), ptxas_s=round(t2 - t1, 2))
    return r


def _cache_dir() -> str:
    from triton import knobs
    return os.path.join(knobs.cache.dir, "triflash-sm90-report")


def _cache_get(key):
    try:
        with open(os.path.join(_cache_dir(), key + ".json")) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def _cache_put(key, value):
    os.makedirs(_cache_dir(), exist_ok=True)
    path = os.path.join(_cache_dir(), key + ".json")
    with tempfile.NamedTemporaryFile("w", dir=_cache_dir(), delete=False, suffix=".tmp") as fh:
        json.dump(value, fh)
    os.replace(fh.name, path)


@contextlib.contextmanager
def _cache_lock():
    """One compiling run at a time per cache directory (pytest-xdist workers, parallel CLI
    runs): the next one waits, then finds the results cached."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock, at worst duplicate work
        yield
        return
    os.makedirs(_cache_dir(), exist_ok=True)
    with open(os.path.join(_cache_dir(), ".lock"), "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _worker_init():
    os.environ.pop("TRITON_INTERPRET", None)


def _compile_uncached(spec: dict, always_compile: bool) -> dict:
    if always_compile:
        from triton import knobs
        knobs.compilation.always_compile = True
    return _compile_spec(spec)


def _compile_all(specs: Dict[str, dict], todo: List[str], workers: int, use_cache: bool,
                 results: dict, progress):
    import multiprocessing
    saved = os.environ.pop("TRITON_INTERPRET", None)  # the spawned workers inherit os.environ
    try:
        with concurrent.futures.ProcessPoolExecutor(
                max_workers=max(1, min(workers, len(todo))),
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_worker_init) as pool:
            futures = {pool.submit(_compile_uncached, specs[k], not use_cache): k for k in todo}
            for i, fut in enumerate(concurrent.futures.as_completed(futures), 1):
                key = futures[fut]
                res = fut.result()
                results[key] = dict(res, cached=False)
                _cache_put(key, res)
                if progress:
                    progress(f"[{i}/{len(todo)}] {specs[key]['name']} "
                             f"{res['compile_s'] + res['ptxas_s']:.1f}s")
    finally:
        if saved is not None:
            os.environ["TRITON_INTERPRET"] = saved


def _run_here(jobs: List[Job], workers: int, use_cache: bool, progress) -> Dict[str, dict]:
    """Compile ``jobs`` on a pool of this process's children; needs JIT kernels here."""
    problem = toolchain_problem()
    if problem:
        raise Unavailable(problem)
    toolchain = _toolchain_id()
    specs, keys = {}, {}
    for job in jobs:
        spec = _spec_of(job)
        key = _spec_key(spec, toolchain)
        keys[job.id] = key
        specs.setdefault(key, spec)
    results = {}
    with _cache_lock() if use_cache else contextlib.nullcontext():
        todo = []
        for key in specs:
            hit = _cache_get(key) if use_cache else None
            if hit is not None:
                results[key] = dict(hit, cached=True)
            else:
                todo.append(key)
        if progress:
            progress(f"{len(jobs)} launches, {len(specs)} distinct compiles, {len(results)} "
                     f"cached, {len(todo)} to compile on {min(workers, len(todo))} worker(s)")
        if todo:
            _compile_all(specs, todo, workers, use_cache, results, progress)
    return {job.id: dict(results[keys[job.id]], key=keys[job.id]) for job in jobs}


# The repository root (tools/ sits beside triflash/): the subprocesses run ``python -m
# tools.sm90_report`` with it first on PYTHONPATH, so that they import this checkout's tools
# and triflash wherever the caller's working directory is.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _clean_env() -> dict:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env["PYTHONPATH"] = os.pathsep.join([REPO_ROOT] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def run_report(jobs: Optional[List[Job]] = None, workers: Optional[int] = None,
               use_cache: bool = True, progress=None) -> Dict[str, dict]:
    """Compile every job (default: ``all_dispatch_configs()``) for sm_90a; return
    {job.id: result}. Raises ``Unavailable`` when the toolchain is missing. Under
    TRITON_INTERPRET the work happens in a subprocess without it."""
    jobs = all_dispatch_configs() if jobs is None else jobs
    workers = workers or os.cpu_count() or 1
    if not kernels_interpreted():
        return _run_here(jobs, workers, use_cache, progress)
    problem = toolchain_problem()
    if problem:
        raise Unavailable(problem)
    with tempfile.TemporaryDirectory() as tmp:
        jobs_file, out = os.path.join(tmp, "jobs.json"), os.path.join(tmp, "out.json")
        with open(jobs_file, "w") as fh:
            json.dump([_job_to_json(j) for j in jobs], fh)
        cmd = [sys.executable, "-m", "tools.sm90_report", "--quiet", "--json", out,
               "--jobs-file", jobs_file, "--workers", str(workers)]
        if not use_cache:
            cmd.append("--no-cache")
        proc = subprocess.run(cmd, env=_clean_env(), cwd=REPO_ROOT, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"sm90 report subprocess failed ({proc.returncode}):\n"
                               f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
        with open(out) as fh:
            data = json.load(fh)
    if "unavailable" in data:
        raise Unavailable(data["unavailable"])
    return data["results"]


def _job_to_json(job: Job) -> dict:
    return dict(kernel=job.kernel, config_type=type(job.config).__name__,
                config=dataclasses.asdict(job.config), headdim=job.headdim,
                headdim_v=job.headdim_v, dtype=job.dtype, feature_name=job.feature_name,
                features=dataclasses.asdict(job.features), launch=job.launch,
                variant=job.variant, tile=job.tile)


def _job_from_json(d: dict) -> Job:
    cfg = getattr(configs, d["config_type"])(**d["config"])
    f = dict(d["features"], window=tuple(d["features"]["window"]))
    return Job(d["kernel"], cfg, d["headdim"], d["headdim_v"], d["dtype"], d["feature_name"],
               Features(**f), d["launch"], d["variant"],
               None if d["tile"] is None else tuple(d["tile"]))


def _jobs_from_ids(ids) -> List[Job]:
    by_id = {j.id: j for j in all_dispatch_configs()}
    missing = [i for i in ids if i not in by_id]
    if missing:
        raise KeyError(f"unknown job ids (not in all_dispatch_configs()): {missing[:5]}")
    return [by_id[i] for i in ids]


def compile_sm90(kernel_name: str, config, headdim: int, headdim_v: int, dtype,
                 features="plain") -> dict:
    """Compile the launch(es) of ``kernel_name`` (one of KERNELS) that the sm90 dispatch makes
    with tile ``config`` (a FwdConfig or BwdConfig, used instead of the table's) for sm_90a.

    ``dtype``: "bf16"/"fp16" or a torch dtype; ``features``: a name in FEATURES or a
    Features (its ``deterministic`` is the user's flag; for bwd_dq_kernel with an atomic-dQ
    tile, deterministic=True is implied). Returns dict(shared=, registers=, spill_stores=,
    spill_loads=, ...). When the kernel is launched more than once (split_dkdv: a dK pass
    and a dV pass) the four numbers are the worst over the launches, and ``launches`` maps
    each launch's variant to its own result. Raises ``Unavailable`` without the toolchain.
    For many configurations use ``run_report`` (one pool, at most one subprocess)."""
    if not isinstance(dtype, str):
        dtype = {"torch.bfloat16": "bf16", "torch.float16": "fp16"}[str(dtype)]
    name = features if isinstance(features, str) else "custom"
    f = FEATURES[features] if isinstance(features, str) else features
    direction = "fwd" if kernel_name == "flash_fwd_kernel" else "bwd"
    jobs = [j for j in _jobs_of_call(direction, config, headdim, headdim_v, dtype, name, f)
            if j.kernel == kernel_name]
    if not jobs and kernel_name == "bwd_dq_kernel" and not f.deterministic:
        f = dataclasses.replace(f, deterministic=True)
        jobs = [j for j in _jobs_of_call(direction, config, headdim, headdim_v, dtype, name, f)
                if j.kernel == kernel_name]
    if not jobs:
        raise LookupError(f"the sm90 dispatch launches no {kernel_name} for {config}, {f}")
    results = run_report(jobs, workers=min(len(jobs), os.cpu_count() or 1))
    if len(jobs) == 1:
        return results[jobs[0].id]
    worst = {k: max(results[j.id][k] for j in jobs)
             for k in ("shared", "registers", "spill_stores", "spill_loads", "stack")}
    return dict(worst, launches={j.variant: results[j.id] for j in jobs})


# ---------------------------------------------------------------------------------------------
# Table


def spill_bytes(r: dict) -> int:
    return r["spill_stores"] + r["spill_loads"]


def problems(job: Job, r: dict) -> List[str]:
    """What is wrong with a result: shared memory over the limit, spills over the budget."""
    out = []
    if r["shared"] > MAX_SHARED_SM90:
        out.append(f"shared {r['shared']} > {MAX_SHARED_SM90}")
    allowed = spill_budget(job)[0]
    if spill_bytes(r) > allowed:
        out.append(f"spills {spill_bytes(r)} B > budget {allowed}")
    return out


def format_table(jobs: List[Job], results: Dict[str, dict]) -> str:
    head = (f"{'kernel':<22} {'hdim':>4} {'dtype':<5} {'features':<8} {'tile m,n,w,s':<13} "
            f"{'smem B':>7} {'regs':>4} {'spill st/ld B':>13} {'compile s':>9}  status")
    lines = [head, "-" * len(head)]
    for job in jobs:
        r = results[job.id]
        tile_s = "-" if job.tile is None else ",".join(map(str, job.tile))
        bad = problems(job, r)
        secs = r["compile_s"] + r["ptxas_s"]
        lines.append(
            f"{job.variant:<22} {job.headdim:>4} {job.dtype:<5} {job.feature_name:<8} {tile_s:<13} "
            f"{r['shared']:>7} {r['registers']:>4} {r['spill_stores']:>6}/{r['spill_loads']:<6} "
            f"{secs:>8.1f}{'*' if r.get('cached') else ' '}  {'; '.join(bad) if bad else 'ok'}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.sm90_report", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--no-cache", action="store_true",
                    help="recompile everything (Triton's cache bypassed too); shows compile times")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", help="write {results: {id: result}} here")
    ap.add_argument("--only", nargs="*", help="job ids (see the table) to compile")
    ap.add_argument("--jobs-file", help="JSON list of jobs (run_report writes it)")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    if kernels_interpreted():  # re-run without the interpreter (same cwd: relative paths hold)
        cmd = [sys.executable, "-m", "tools.sm90_report",
               *(sys.argv[1:] if argv is None else argv)]
        return subprocess.run(cmd, env=_clean_env()).returncode

    t0 = time.perf_counter()
    if args.jobs_file:
        with open(args.jobs_file) as fh:
            jobs = [_job_from_json(d) for d in json.load(fh)]
    elif args.only:
        jobs = _jobs_from_ids(args.only)
    else:
        jobs = all_dispatch_configs()
    say = None if args.quiet else (lambda s: print(s, file=sys.stderr, flush=True))
    try:
        results = _run_here(jobs, args.workers, not args.no_cache, say)
    except Unavailable as e:
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"unavailable": str(e)}, fh)
            return 0
        print(f"sm_90a toolchain unavailable: {e}", file=sys.stderr)
        return 2
    elapsed = time.perf_counter() - t0
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"results": results, "elapsed_s": elapsed, "toolchain": _toolchain_id()}, fh)
    if not args.quiet:
        print(format_table(jobs, results))
        distinct = {r["key"]: r for r in results.values()}
        fresh = [r for r in distinct.values() if not r.get("cached")]
        bad = [j.id for j in jobs if problems(j, results[j.id])]
        over = [j.id for j in jobs if results[j.id]["shared"] > MAX_SHARED_SM90]
        print(f"\n{len(jobs)} launches, {len(distinct)} distinct compiles "
              f"({len(fresh)} compiled now, {len(distinct) - len(fresh)} from cache, marked *)")
        if fresh:
            per = sorted(r["compile_s"] + r["ptxas_s"] for r in fresh)
            print(f"compile time per kernel (triton.compile + ptxas -v): min {per[0]:.1f}s, "
                  f"median {per[len(per) // 2]:.1f}s, max {per[-1]:.1f}s, sum {sum(per):.0f}s")
        print(f"{len(over)} launch(es) over {MAX_SHARED_SM90} B of shared memory; "
              f"{len(bad) - len(over)} more over the spill budget")
        print(f"total runtime {elapsed:.1f}s on {args.workers} worker(s); {_toolchain_id()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
