"""The implementations the benchmark compares ("impls").

Every impl takes q (batch, seqlen_q, nheads, headdim), k, v (batch, seqlen_k, nheads_kv,
headdim[_v]) and returns out (batch, seqlen_q, nheads, headdim_v), differentiable. Each
has:

    load()            imports what it needs; raises (ImportError, RuntimeError) if unusable
    unsupported(case) None, or why this impl cannot run the case (it is skipped, not crashed)
    make(case, dev)   a callable fn(q, k, v) -> out, with per-case setup (masks) done here
    context()         context manager entered around every call, forward and backward

Nothing here imports triflash or a peer at module import time: the CLI must choose the
device (and set TRITON_INTERPRET) before triflash is imported.
"""
import contextlib
import importlib

GPU_IMPLS = ("triflash", "triflash-portable", "triflash-varlen", "triflash-deterministic",
             "triflash-sdpa", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "flex", "fa2", "fa3", "fa4")
CPU_IMPLS = ("triflash", "triflash-portable", "triflash-varlen", "sdpa-math")
# Loaded and timed in a worker process of their own unless --isolate says otherwise (CUDA
# runs): importing FlashAttention-4 made every torch call in the process dearer
# (docs/performance.md; ``benchmarks/NOTES.md`` at fb45c0d, section bb86392, item 4);
# FA2/FA3 are separate native packages as well. triflash-sdpa activates triflash as SDPA's
# flash backend for its whole process.
ISOLATED_BY_DEFAULT = ("fa2", "fa3", "fa4", "triflash-sdpa")
SUBJECTS = ("triflash", "triflash-portable", "triflash-varlen", "triflash-deterministic", "triflash-sdpa")  # what is under test: failures set the exit code


def _first(out):
    """Peers differ in whether they also return lse; keep the output."""
    return out[0] if isinstance(out, (tuple, list)) else out


class Impl:
    name = "?"
    devices = ("cuda",)

    def load(self):
        pass

    def unsupported(self, case):
        return None

    def make(self, case, device):
        raise NotImplementedError

    def context(self):
        return contextlib.nullcontext()

    def version(self):
        return None


class Triflash(Impl):
    """triflash.flash_attn_func with normal dispatch, or pinned to one backend."""
    devices = ("cuda", "cpu")

    def __init__(self, name, backend=None, deterministic=False):
        self.name, self.backend, self.deterministic = name, backend, deterministic

    def load(self):
        self.tf = importlib.import_module("triflash")

    def make(self, case, device):
        f, causal, window = self.tf.flash_attn_func, case.causal, tuple(case.window_size)
        det = self.deterministic
        return lambda q, k, v: f(q, k, v, causal=causal, window_size=window, deterministic=det)

    def context(self):
        if self.backend is None:
            return contextlib.nullcontext()
        return self.tf.force_backend(self.backend)

    def version(self):
        return getattr(self.tf, "__version__", None)


class TriflashVarlen(Triflash):
    """triflash.flash_attn_varlen_func on the case's batch packed as equal-length sequences
    (views of the dense tensors, no copies): varlen against dense on the same problem."""
    varlen = True

    def unsupported(self, case):
        return None

    def make(self, case, device):
        import torch
        f, causal, window = self.tf.flash_attn_varlen_func, case.causal, tuple(case.window_size)
        b, sq, sk = case.batch, case.seqlen_q, case.seqlen_k
        cu_q = torch.arange(0, (b + 1) * sq, sq, dtype=torch.int32, device=device)
        cu_k = torch.arange(0, (b + 1) * sk, sk, dtype=torch.int32, device=device)

        def fn(q, k, v):
            out = f(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_q, cu_k, sq, sk,
                    causal=causal, window_size=window)
            return out.unflatten(0, (b, sq))
        return fn


class Sdpa(Impl):
    """torch.nn.functional.scaled_dot_product_attention pinned to one SDPBackend, fed
    .transpose(1, 2) views. SDPA's is_causal is top-left aligned, so causal is only
    comparable when seqlen_q == seqlen_k, and there is no sliding window."""

    def __init__(self, name, backend, devices=("cuda",)):
        self.name, self.backend_name, self.devices = name, backend, devices

    def load(self):
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
        self.backend = getattr(SDPBackend, self.backend_name)
        self.sdpa_kernel = sdpa_kernel
        self.F = torch.nn.functional

    def unsupported(self, case):
        if case.has_window:
            return "SDPA has no sliding-window option"
        if case.causal and case.seqlen_q != case.seqlen_k:
            return "SDPA's is_causal is top-left aligned; triflash/FA use bottom-right"
        return None

    def make(self, case, device):
        sdpa, causal = self.F.scaled_dot_product_attention, case.causal
        kw = {"enable_gqa": True} if case.nheads_kv != case.nheads else {}

        def fn(q, k, v):
            o = sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal, **kw)
            return o.transpose(1, 2)
        return fn

    def context(self):
        return self.sdpa_kernel(self.backend)


class TriflashSdpa(Sdpa):
    """F.scaled_dot_product_attention with triflash activated as its flash backend
    (``torch.nn.attention.activate_flash_attention_impl("triflash")``): the SDPA route
    against calling triflash directly. Activated once at load, for the whole process, so it
    runs in a worker process of its own (ISOLATED_BY_DEFAULT)."""

    def __init__(self, name="triflash-sdpa"):
        super().__init__(name, "FLASH_ATTENTION")

    def load(self):
        super().load()
        import triflash  # registers "triflash" with torch's registry
        from torch.nn.attention import activate_flash_attention_impl
        activate_flash_attention_impl("triflash")
        self.tf = triflash

    def version(self):
        return getattr(self.tf, "__version__", None)


class Flex(Impl):
    """torch.compile'd FlexAttention; causal/window as a block mask (bottom-right aligned)."""

    def load(self):
        import torch
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        for knob in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                     "accumulated_recompile_limit"):
            if hasattr(torch._dynamo.config, knob):  # one compile per shape
                setattr(torch._dynamo.config, knob, max(256, getattr(torch._dynamo.config, knob)))
        self.create_block_mask = create_block_mask
        self.flex = torch.compile(flex_attention, dynamic=False)

    def make(self, case, device):
        left, right = case.window_size
        if case.causal:
            right = 0
        shift = case.seqlen_k - case.seqlen_q
        block_mask = None
        if left >= 0 or right >= 0:
            def mask_mod(b, h, q_idx, kv_idx):
                ok = kv_idx >= 0
                if right >= 0:
                    ok = ok & (kv_idx <= q_idx + shift + right)
                if left >= 0:
                    ok = ok & (kv_idx >= q_idx + shift - left)
                return ok
            block_mask = self.create_block_mask(mask_mod, None, None, case.seqlen_q,
                                                case.seqlen_k, device=device)
        kw = {"enable_gqa": True} if case.nheads_kv != case.nheads else {}
        flex = self.flex

        def fn(q, k, v):
            o = flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                     block_mask=block_mask, **kw)
            return o.transpose(1, 2)
        return fn


class FlashAttn(Impl):
    """FlashAttention 2 / 3 / 4 (Dao-AILab), whichever module is installed."""

    def __init__(self, name, modules, window_none=False):
        self.name, self.modules, self.window_none = name, modules, window_none

    def load(self):
        errors = []
        for mod_name in self.modules:
            try:
                mod = importlib.import_module(mod_name)
                self.func = mod.flash_attn_func
                self.module = mod_name
                return
            except (ImportError, AttributeError, OSError, RuntimeError) as e:
                errors.append(f"{mod_name}: {type(e).__name__}: {e}")
        raise ImportError("; ".join(errors))

    def make(self, case, device):
        f, causal = self.func, case.causal
        window = tuple(case.window_size)
        if self.window_none:  # FA4 spells "unbounded" as None
            window = tuple(None if w < 0 else w for w in window)
        if case.has_window:
            return lambda q, k, v: _first(f(q, k, v, causal=causal, window_size=window))
        return lambda q, k, v: _first(f(q, k, v, causal=causal))

    def version(self):
        top = self.module.split(".")[0]
        try:  # the installed distribution (FA4's module has no __version__): "flash-attn-4 4.0.0b36"
            from importlib import metadata
            dists = sorted(set(metadata.packages_distributions().get(top, [])))
            if dists:
                return f"{self.module} ({', '.join(f'{d} {metadata.version(d)}' for d in dists)})"
        except Exception:  # metadata unavailable: fall back to the module's own attribute
            pass
        mod = importlib.import_module(top)
        return f"{self.module} {getattr(mod, '__version__', '')}".strip()


def make_impl(name):
    """A fresh (not yet loaded) Impl for a name; KeyError for unknown names."""
    table = {
        "triflash": lambda: Triflash("triflash"),
        "triflash-portable": lambda: Triflash("triflash-portable", "portable"),
        "triflash-varlen": lambda: TriflashVarlen("triflash-varlen"),
        "triflash-deterministic": lambda: Triflash("triflash-deterministic", deterministic=True),
        "triflash-sdpa": lambda: TriflashSdpa(),
        "sdpa-flash": lambda: Sdpa("sdpa-flash", "FLASH_ATTENTION"),
        "sdpa-cudnn": lambda: Sdpa("sdpa-cudnn", "CUDNN_ATTENTION"),
        "sdpa-efficient": lambda: Sdpa("sdpa-efficient", "EFFICIENT_ATTENTION"),
        "sdpa-math": lambda: Sdpa("sdpa-math", "MATH", devices=("cpu",)),
        "flex": lambda: Flex(),
        "fa2": lambda: FlashAttn("fa2", ["flash_attn"]),
        "fa3": lambda: FlashAttn("fa3", ["flash_attn_interface"]),
        "fa4": lambda: FlashAttn("fa4", ["flash_attn.cute", "flash_attn.cute.interface"],
                                 window_none=True),
    }
    impl = table[name]()
    impl.name = name
    return impl


__all__ = ["GPU_IMPLS", "CPU_IMPLS", "SUBJECTS", "ISOLATED_BY_DEFAULT", "make_impl", "Impl"]
