"""Compile the Triton kernels for Hopper (sm_90a) on any machine, GPU or not, and report what
each configuration the sm90 dispatch can pick costs: shared memory, registers, spills.

    python -m triflash.kernels.sm90_report            # the whole table (cached results reused)
    python -m triflash.kernels.sm90_report --no-cache # recompile everything, time each compile
    python -m triflash.kernels.sm90_report --json out.json --only ID ...

How a configuration becomes a compile, so that it matches a real launch:

1. ``portable.fwd`` / ``portable.bwd`` (the host code dispatch calls on sm90) run on ``meta``
   tensors of a representative problem while every JIT kernel in ``portable`` is replaced by
   a recorder; so the arguments, constexprs and launch options are exactly the host code's.
2. The recorded arguments are specialized with Triton's own ``native_specialize_impl`` (what
   ``JITFunction.run`` does): ints equal to 1 become constexprs, ints divisible by 16 and
   pointers get ``tt.divisibility=16``. Pointers count as 16-byte aligned (torch allocations
   are); the problem is MHA with 16 heads, dense seqlen 4096, so the strides of contiguous
   (batch, seqlen, heads, dim) tensors are divisible by 16 exactly when heads * dim is, and
   the head stride when dim is (72: no). Varlen: batch stride 0, 8007 tokens, max_seqlen 2048.
3. ``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))`` builds PTX and a cubin
   without a driver. ``metadata.shared`` is the dynamic shared memory the launch requests.
   Registers and spills are not in the metadata without a driver (``n_regs``/``n_spills``
   come from loading the module), so the report of Triton's own ``ptxas -v`` run is
   captured (TRITON_DUMP_PTXAS_LOG) and parsed; when Triton's cache served the kernel, its
   PTX is assembled again with the same ptxas and flags. The register count is checked
   against ``cuobjdump --dump-resource-usage`` of Triton's cubin. ``shared`` = Triton's
   dynamic shared memory + ptxas's static ``smem`` (0 for these kernels); the 1 KiB that
   cuobjdump lists as SHARED on sm_90 is the per-block reservation, not part of the limit.

Identical compiles (same kernel, signature, constexprs, divisibility and options, e.g. the
preprocess kernel, which ignores the mask features) are compiled once. Results are cached
on disk under Triton's cache directory, keyed by Triton's own source hash of the kernel and
everything it calls, so editing a kernel invalidates exactly its entries.

TRITON_INTERPRET: the kernels must be real JITFunctions. If this process imported triflash
under the interpreter, ``run_report`` (and ``main``) do the work in a subprocess whose
environment lacks TRITON_INTERPRET.
"""
import argparse
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Dict, List, Optional

from . import configs

# Hopper: largest shared memory one block may opt into (cudaDevAttrMaxSharedMemoryPerBlockOptin
# on H100/H200; the SM has 228 KiB, 1 KiB of which is reserved per block).
MAX_SHARED_SM90 = 232448
MAX_REGISTERS = 255

# Configurations allowed to spill: job id (see ``Job.id``) -> (max spill bytes, stores +
# loads, and the reason it is acceptable). Every entry needs a written reason.
SPILL_BUDGET: Dict[str, tuple] = {}

HEADDIMS = (64, 72, 96, 128, 192, 256)   # 72 and 96: not powers of two (masked head dim)
DTYPES = ("bf16", "fp16")
KERNELS = ("flash_fwd_kernel", "bwd_preprocess_kernel", "bwd_dkdv_kernel", "bwd_dq_kernel")
_CACHE_FORMAT = 1


@dataclass(frozen=True)
class Features:
    """The problem features that change a kernel's constexprs."""
    causal: bool = False
    window: tuple = (-1, -1)   # (left, right), -1 unbounded; causal sets right = 0
    softcap: float = 0.0
    varlen: bool = False
    seqused: bool = False      # seqused_q and seqused_k (varlen only)
    deterministic: bool = False  # backward: separate dQ kernel instead of atomic dQ

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
}

_SHORT = {"flash_fwd_kernel": "fwd", "bwd_preprocess_kernel": "bwd_pre",
          "bwd_dkdv_kernel": "bwd_dkdv", "bwd_dq_kernel": "bwd_dq"}


@dataclass(frozen=True)
class Job:
    """One kernel launch the sm90 dispatch can make."""
    kernel: str
    config: object          # FwdConfig or BwdConfig
    headdim: int
    headdim_v: int
    dtype: str              # "bf16" / "fp16"
    feature_name: str
    features: Features

    @property
    def variant(self) -> str:
        if self.kernel == "bwd_dkdv_kernel":
            return "bwd_dkdv" if self.features.deterministic else "bwd_dkdv+atomic_dq"
        return _SHORT[self.kernel]

    @property
    def id(self) -> str:
        d = f"d{self.headdim}" if self.headdim == self.headdim_v else f"d{self.headdim}v{self.headdim_v}"
        return f"{self.variant}-{d}-{self.dtype}-{self.feature_name}"

    def tile(self):
        """(block_m, block_n, num_warps, num_stages) of this kernel's launch."""
        c = self.config
        if self.kernel == "flash_fwd_kernel":
            return c.block_m, c.block_n, c.num_warps, c.num_stages
        if self.kernel == "bwd_dkdv_kernel":
            return c.dkdv_block_m, c.dkdv_block_n, c.dkdv_warps, c.dkdv_stages
        if self.kernel == "bwd_dq_kernel":
            return c.dq_block_m, c.dq_block_n, c.dq_warps, c.dq_stages
        return None  # preprocess: fixed in portable.bwd


def all_dispatch_configs(headdims=HEADDIMS, dtypes=DTYPES, features=tuple(FEATURES)) -> List[Job]:
    """Every (kernel, tile config, head dim, dtype, features) the sm90 dispatch can launch:
    forward; backward preprocess; dK/dV with atomic dQ (deterministic=False, the default);
    dK/dV without atomics + the dQ kernel (deterministic=True)."""
    jobs = []
    for d in headdims:
        dv = d
        fcfg = configs.fwd_config("sm90", d, dv)
        bcfg = configs.bwd_config("sm90", d, dv)
        for dtype in dtypes:
            for name in features:
                f = FEATURES[name]
                det = dataclasses.replace(f, deterministic=True)
                jobs += [Job("flash_fwd_kernel", fcfg, d, dv, dtype, name, f),
                         Job("bwd_preprocess_kernel", bcfg, d, dv, dtype, name, f),
                         Job("bwd_dkdv_kernel", bcfg, d, dv, dtype, name, f),
                         Job("bwd_dkdv_kernel", bcfg, d, dv, dtype, name, det),
                         Job("bwd_dq_kernel", bcfg, d, dv, dtype, name, det)]
    return jobs


# ---------------------------------------------------------------------------------------------
# Toolchain


class Unavailable(RuntimeError):
    """The sm_90a toolchain (Triton's NVIDIA backend, ptxas) cannot be used here."""


def kernels_interpreted() -> bool:
    """True when triflash's kernels were built by Triton's CPU interpreter in this process."""
    from .fwd import flash_fwd_kernel
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


def _toolchain_id() -> str:
    import triton
    ptxas = subprocess.run([_ptxas_path(), "--version"], capture_output=True, text=True).stdout
    return f"triton {triton.__version__}; {ptxas.strip().splitlines()[-1] if ptxas else '?'}"


# ---------------------------------------------------------------------------------------------
# Recording a launch and specializing it like JITFunction.run


class _Recorder:
    def __init__(self, fn, log):
        self.fn = fn
        self.log = log

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.log.append((self.fn, args, kwargs))
        return launch


@contextlib.contextmanager
def _recording(module):
    from triton.runtime.jit import JITFunction
    log = []
    saved = {n: v for n, v in vars(module).items() if isinstance(v, JITFunction)}
    if not saved:
        raise RuntimeError(f"{module.__name__} holds no JITFunction (TRITON_INTERPRET set?)")
    try:
        for n, v in saved.items():
            setattr(module, n, _Recorder(v, log))
        yield log
    finally:
        for n, v in saved.items():
            setattr(module, n, v)


# Representative problem (see the module docstring).
_BATCH, _SEQLEN, _NHEADS, _NHEADS_KV = 2, 4096, 16, 16
_VARLEN_BATCH, _VARLEN_TOTAL, _VARLEN_MAX = 4, 8007, 2048


def _record_launch(job: Job):
    """Run the host code on meta tensors; return (JITFunction, args, kwargs) of ``job.kernel``."""
    import torch
    from . import portable
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[job.dtype]
    f = job.features
    d, dv = job.headdim, job.headdim_v
    meta = dict(device="meta", dtype=dt)
    if f.varlen:
        tq = tk = _VARLEN_TOTAL
        q = torch.empty(tq, _NHEADS, d, **meta)
        k = torch.empty(tk, _NHEADS_KV, d, **meta)
        v = torch.empty(tk, _NHEADS_KV, dv, **meta)
        out = torch.empty(tq, _NHEADS, dv, **meta)
        lse = torch.empty(_NHEADS, tq, device="meta", dtype=torch.float32)
        cu = torch.empty(_VARLEN_BATCH + 1, device="meta", dtype=torch.int32)
        used = torch.empty(_VARLEN_BATCH, device="meta", dtype=torch.int32) if f.seqused else None
        max_q = max_k = _VARLEN_MAX
    else:
        q = torch.empty(_BATCH, _SEQLEN, _NHEADS, d, **meta)
        k = torch.empty(_BATCH, _SEQLEN, _NHEADS_KV, d, **meta)
        v = torch.empty(_BATCH, _SEQLEN, _NHEADS_KV, dv, **meta)
        out = torch.empty(_BATCH, _SEQLEN, _NHEADS, dv, **meta)
        lse = torch.empty(_BATCH, _NHEADS, _SEQLEN, device="meta", dtype=torch.float32)
        cu = used = None
        max_q = max_k = _SEQLEN
    left, right = f.window_left_right()
    p = portable.AttnParams(softmax_scale=d ** -0.5, window_left=left, window_right=right,
                            softcap=f.softcap, max_seqlen_q=max_q, max_seqlen_k=max_k)
    with _recording(portable) as log:
        if job.kernel == "flash_fwd_kernel":
            portable.fwd(q, k, v, cu, cu, used, used, p, job.config, upcast=False)
        else:
            portable.bwd(torch.empty_like(out), q, k, v, out, lse, cu, cu, used, used, p,
                         job.config, deterministic=f.deterministic, upcast=False)
    found = [entry for entry in log if entry[0].__name__ == job.kernel]
    if not found:
        raise LookupError(f"{job.id}: the host code launched {[e[0].__name__ for e in log]}, "
                          f"not {job.kernel}")
    return found[0]


def _specialize(fn, args, kwargs):
    """(signature, constexprs, attrs, options) exactly as JITFunction.run would build them."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.jit import MockTensor
    import torch
    names = [p.name for p in fn.params]
    options = {k: v for k, v in kwargs.items() if k not in names}
    bound = fn.signature.bind(*args, **{k: v for k, v in kwargs.items() if k in names})
    bound.apply_defaults()
    signature, constexprs, attrs = {}, {}, {}
    for i, (kp, (name, val)) in enumerate(zip(fn.params, bound.arguments.items())):
        assert kp.name == name
        if kp.is_constexpr:
            signature[name] = "constexpr"
            constexprs[(i,)] = val
            continue
        if isinstance(val, torch.Tensor):
            val = MockTensor(val.dtype)  # data_ptr 0: 16-byte aligned
        ty, spec = native_specialize_impl(CUDABackend, val, kp.is_const, not kp.do_not_specialize,
                                          not kp.do_not_specialize_on_alignment)
        if kp.annotation_type:
            raise NotImplementedError(f"annotated kernel parameter {name}: not handled")
        signature[name] = ty
        if ty == "constexpr":
            constexprs[(i,)] = spec
        elif isinstance(spec, str):
            attrs[(i,)] = CUDABackend.parse_attr(spec)
    return signature, constexprs, attrs, options


def _spec_of(job: Job) -> dict:
    fn, args, kwargs = _record_launch(job)
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


def _run_ptxas(ptx: str, md) -> str:
    """``ptxas -v`` with Triton's flags (see CUDABackend.make_cubin) on ``ptx``; its report."""
    from triton.backends.nvidia.compiler import sm_arch_from_capability
    flags = ["-lineinfo", "-v", f"--gpu-name={sm_arch_from_capability(90)}"]
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


def _worker_init():
    os.environ.pop("TRITON_INTERPRET", None)


def _compile_uncached(spec: dict, always_compile: bool) -> dict:
    if always_compile:
        from triton import knobs
        knobs.compilation.always_compile = True
    return _compile_spec(spec)


def _run_here(jobs: List[Job], workers: int, use_cache: bool, progress) -> Dict[str, dict]:
    """Compile ``jobs`` in this process's children; needs JIT (non-interpreted) kernels."""
    problem = toolchain_problem()
    if problem:
        raise Unavailable(problem)
    if kernels_interpreted():
        raise RuntimeError("triflash was imported under TRITON_INTERPRET; use run_report()")
    toolchain = _toolchain_id()
    specs, keys = {}, {}
    for job in jobs:
        spec = _spec_of(job)
        key = _spec_key(spec, toolchain)
        keys[job.id] = key
        specs.setdefault(key, spec)
    results = {}
    todo = []
    for key in specs:
        hit = _cache_get(key) if use_cache else None
        if hit is not None:
            results[key] = dict(hit, cached=True)
        else:
            todo.append(key)
    if progress:
        progress(f"{len(jobs)} launches, {len(specs)} distinct compiles, {len(results)} cached, "
                 f"{len(todo)} to compile on {workers} worker(s)")
    if todo:
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
    out = {}
    for job in jobs:
        r = dict(results[keys[job.id]])
        r["key"] = keys[job.id]
        out[job.id] = r
    return out


def _clean_env() -> dict:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
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
    with tempfile.TemporaryDirectory() as tmp:
        ids, out = os.path.join(tmp, "jobs.json"), os.path.join(tmp, "out.json")
        with open(ids, "w") as fh:
            json.dump([_job_to_json(j) for j in jobs], fh)
        cmd = [sys.executable, "-m", "triflash.kernels.sm90_report", "--quiet", "--json", out,
               "--jobs-file", ids, "--workers", str(workers)]
        if not use_cache:
            cmd.append("--no-cache")
        proc = subprocess.run(cmd, env=_clean_env(), capture_output=True, text=True)
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
                features=dataclasses.asdict(job.features))


def _job_from_json(d: dict) -> Job:
    cfg = getattr(configs, d["config_type"])(**d["config"])
    f = dict(d["features"], window=tuple(d["features"]["window"]))
    return Job(d["kernel"], cfg, d["headdim"], d["headdim_v"], d["dtype"], d["feature_name"],
               Features(**f))


def _jobs_from_ids(ids) -> List[Job]:
    by_id = {j.id: j for j in all_dispatch_configs()}
    missing = [i for i in ids if i not in by_id]
    if missing:
        raise KeyError(f"unknown job ids (not in all_dispatch_configs()): {missing[:5]}")
    return [by_id[i] for i in ids]


def compile_sm90(kernel_name: str, config, headdim: int, headdim_v: int, dtype: str,
                 features="plain") -> dict:
    """Compile one launch for sm_90a: ``kernel_name`` one of KERNELS, ``config`` a FwdConfig
    or BwdConfig, ``dtype`` "bf16"/"fp16" (or a torch dtype), ``features`` a name in
    FEATURES or a Features (``deterministic=True`` for the dK/dV kernel without atomic dQ).
    Returns dict(shared=, registers=, spill_stores=, spill_loads=) plus details
    (dynamic/static shared, stack, compile seconds). Raises ``Unavailable`` without the
    toolchain. For many launches use ``run_report`` (one pool, one subprocess at most)."""
    if not isinstance(dtype, str):
        dtype = {"torch.bfloat16": "bf16", "torch.float16": "fp16"}[str(dtype)]
    name = features if isinstance(features, str) else "custom"
    f = FEATURES[features] if isinstance(features, str) else features
    if kernel_name == "bwd_dq_kernel" and not f.deterministic:
        f = dataclasses.replace(f, deterministic=True)  # dispatch runs dQ only then
    job = Job(kernel_name, config, headdim, headdim_v, dtype, name, f)
    return run_report([job], workers=1)[job.id]


# ---------------------------------------------------------------------------------------------
# Table


def spill_bytes(r: dict) -> int:
    return r["spill_stores"] + r["spill_loads"]


def problems(job: Job, r: dict) -> List[str]:
    """What is wrong with a result: shared memory over the limit, spills over the budget."""
    out = []
    if r["shared"] > MAX_SHARED_SM90:
        out.append(f"shared {r['shared']} > {MAX_SHARED_SM90}")
    allowed = SPILL_BUDGET.get(job.id, (0, ""))[0]
    if spill_bytes(r) > allowed:
        out.append(f"spills {r['spill_stores']}B st / {r['spill_loads']}B ld (budget {allowed})")
    return out


def format_table(jobs: List[Job], results: Dict[str, dict]) -> str:
    head = (f"{'kernel':<20} {'hdim':>5} {'dtype':<5} {'features':<8} {'tile (m,n,w,s)':<15} "
            f"{'smem B':>7} {'regs':>4} {'spill st/ld':>11} {'compile s':>9}  status")
    lines = [head, "-" * len(head)]
    for job in jobs:
        r = results[job.id]
        tile = job.tile()
        tile_s = "pre 64" if tile is None else ",".join(map(str, tile))
        bad = problems(job, r)
        secs = r["compile_s"] + r["ptxas_s"]
        lines.append(
            f"{job.variant:<20} {job.headdim:>5} {job.dtype:<5} {job.feature_name:<8} {tile_s:<15} "
            f"{r['shared']:>7} {r['registers']:>4} {r['spill_stores']:>5}/{r['spill_loads']:<5} "
            f"{secs:>8.1f}{'*' if r.get('cached') else ' '}  {'; '.join(bad) if bad else 'ok'}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m triflash.kernels.sm90_report", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--no-cache", action="store_true",
                    help="recompile everything (Triton's cache bypassed too); shows compile times")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", help="write {results: {id: result}} here")
    ap.add_argument("--only", nargs="*", help="job ids (see the table) to compile")
    ap.add_argument("--jobs-file", help="JSON list of jobs (run_report writes it)")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    if kernels_interpreted():  # re-run without the interpreter
        cmd = [sys.executable, "-m", "triflash.kernels.sm90_report", *(sys.argv[1:] if argv is None else argv)]
        return subprocess.run(cmd, env=_clean_env()).returncode

    t0 = time.perf_counter()
    jobs = all_dispatch_configs()
    if args.jobs_file:
        with open(args.jobs_file) as fh:
            jobs = [_job_from_json(d) for d in json.load(fh)]
    if args.only:
        jobs = _jobs_from_ids(args.only)
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
        print(f"\n{len(jobs)} launches, {len(distinct)} distinct compiles "
              f"({len(fresh)} compiled now, {len(distinct) - len(fresh)} from cache; * = cached)")
        if fresh:
            per = sorted(r["compile_s"] + r["ptxas_s"] for r in fresh)
            print(f"compile time per kernel (triton.compile + ptxas -v): min {per[0]:.1f}s, "
                  f"median {per[len(per) // 2]:.1f}s, max {per[-1]:.1f}s, sum {sum(per):.0f}s")
        print(f"{len(bad)} launch(es) over the shared-memory limit or spill budget")
        print(f"total runtime {elapsed:.1f}s on {args.workers} worker(s); {_toolchain_id()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
