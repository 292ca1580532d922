"""Decoding cases (``--preset decode``): what is measured, and how many bytes each
implementation reads. Pure Python (no torch): the case list and the byte accounting are
tested on any machine.

A ``DecodeCase`` is one call of ``flash_attn_with_kvcache``: ``batch`` sequences, each with
``seqlen_q`` new query tokens (1 when decoding) against a cache of ``cache_len`` tokens,
dense (batch, capacity, nheads_kv, headdim) or paged (blocks of ``page_size`` tokens, a
random permutation of pages in the page table). ``ragged``: each sequence's cache holds
``lens[i]`` tokens, drawn uniformly in [1, cache_len] from ``lens_seed`` (``seqlens``);
otherwise every sequence holds cache_len. ``seqlen_new`` > 0: the call first appends that
many new keys/values to each cache (mode "prefill-cache", a chunk of prefill over a cache),
and attends to cache_len + seqlen_new keys.

Bytes: ``tb_s`` = K+V bytes read / time / 1e12, where the bytes are those the implementation
logically needs, sum over sequences of the keys it attends x nheads_kv x (headdim +
headdim_v) x the element size (``kv_bytes``). An implementation that reads the whole dense
cache of a ragged case (a peer without per-sequence lengths) is counted with every
sequence's full cache_len (``full=True``). Page tables, q and the output are not counted.
"""
import json
import random
from dataclasses import asdict, dataclass
from typing import List, Optional

ITEMSIZE = {"bf16": 2, "fp16": 2, "fp8": 1}
# The implementations that take fp8 (e4m3) q and caches (FA3's fp8 forward)
FP8_IMPLS = ("triflash", "triflash-dense", "fa3")
MODES = ("decode", "prefill-cache")
# The implementations (decode.py), named here for the CLI without importing torch.
GPU_IMPLS = ("triflash", "triflash-dense", "sdpa-cudnn", "sdpa-flash", "fa4", "fa4-kvcache", "fa3", "flashinfer")
CPU_IMPLS = ("triflash", "triflash-dense", "sdpa-math")
ISOLATED_BY_DEFAULT = ("fa4", "fa4-kvcache", "fa3", "flashinfer")  # worker processes of their own (isolate.py)
SUBJECTS = ("triflash", "triflash-dense")  # under test: a failed check sets the exit status


@dataclass(frozen=True)
class DecodeCase:
    batch: int
    cache_len: int              # tokens in each sequence's cache (ragged: the most)
    nheads: int
    nheads_kv: int
    headdim: int
    page_size: Optional[int] = None   # None: a dense cache
    seqlen_q: int = 1           # query tokens per sequence (> 1: causal, bottom-right aligned)
    seqlen_new: int = 0         # keys/values appended by the call (mode "prefill-cache")
    ragged: bool = False        # per-sequence cache lengths uniform in [1, cache_len]
    lens_seed: int = 0          # their seed (fixed: every run draws the same lengths)
    headdim_v: Optional[int] = None   # None: = headdim
    causal: bool = True
    dtype: str = "bf16"

    def __post_init__(self):
        if self.headdim_v is None:
            object.__setattr__(self, "headdim_v", self.headdim)
        if self.nheads % self.nheads_kv:
            raise ValueError(f"nheads_kv {self.nheads_kv} does not divide nheads {self.nheads}")
        if self.page_size is not None and self.page_size < 1:
            raise ValueError(f"page_size {self.page_size}: must be >= 1 (None: dense)")
        if self.page_size is not None and self.headdim_v != self.headdim:
            raise ValueError("paged cases hold K and V in one tensor (vLLM's layout): headdim_v = headdim")
        if self.ragged and self.seqlen_new:
            raise ValueError("a ragged case appends no new keys (its lengths are the cache's)")

    @property
    def mode(self) -> str:
        return "prefill-cache" if self.seqlen_new else "decode"

    @property
    def seqlen_k(self) -> int:
        """Keys one sequence attends to at most."""
        return self.cache_len + self.seqlen_new

    @property
    def capacity(self) -> int:
        """Rows one sequence's cache holds: seqlen_k, rounded up to whole pages."""
        ps = self.page_size or 1
        return -(-self.seqlen_k // ps) * ps

    @property
    def pages_per_seq(self) -> int:
        return self.capacity // self.page_size if self.page_size else 0

    def seqlens(self) -> List[int]:
        """Cache tokens per sequence before the call (``cache_seqlens``)."""
        if not self.ragged:
            return [self.cache_len] * self.batch
        rng = random.Random(self.lens_seed)
        return [rng.randint(1, self.cache_len) for _ in range(self.batch)]

    def keys(self, full=False) -> List[int]:
        """Keys each sequence's queries attend to: its cache plus the appended tokens, or with
        ``full`` every sequence's whole cache (what a reader of the dense cache without
        per-sequence lengths attends to)."""
        if full:
            return [self.seqlen_k] * self.batch
        return [n + self.seqlen_new for n in self.seqlens()]

    def kv_tokens(self, full=False) -> int:
        return sum(self.keys(full))

    def kv_bytes(self, full=False) -> int:
        """K+V bytes read: keys attended x nheads_kv x (headdim + headdim_v) x element size."""
        return self.kv_tokens(full) * self.nheads_kv * (self.headdim + self.headdim_v) * ITEMSIZE[self.dtype]

    def flops(self, full=False) -> float:
        """FlashAttention's convention: 2 matmuls over the (query, key) pairs visited."""
        return sum(2.0 * self.nheads * visible_pairs(self.seqlen_q, k, self.causal) * (self.headdim + self.headdim_v)
                   for k in self.keys(full))

    def fields(self) -> dict:
        """The case's part of a JSON result row."""
        return {"mode": self.mode, **asdict(self), "seqlen_k": self.seqlen_k}

    def label(self) -> str:
        return label(self.fields())


def visible_pairs(seqlen_q, seqlen_k, causal) -> int:
    """(query, key) pairs a causal (bottom-right aligned) or full mask lets through."""
    if not causal:
        return seqlen_q * seqlen_k
    shift = seqlen_k - seqlen_q  # query i sees keys 0 .. i + shift
    return sum(max(0, min(seqlen_k, i + shift + 1)) for i in range(seqlen_q))


def label(f) -> str:
    """'64x8192 h32/8 d128 page64' from a case's fields (or a result row)."""
    s = f"{f['batch']}x{f['cache_len']}"
    if f.get("seqlen_new"):
        s += f"+{f['seqlen_new']}"
    if f.get("ragged"):
        s += f" ragged(seed {f.get('lens_seed', 0)})"
    s += f" h{f['nheads']}/{f['nheads_kv']} d{f['headdim']}"
    if f.get("headdim_v", f["headdim"]) != f["headdim"]:
        s += f"/{f['headdim_v']}"
    s += f" page{f['page_size']}" if f.get("page_size") else " dense"
    if f.get("seqlen_q", 1) != 1:
        s += f" q{f['seqlen_q']}"
    if not f.get("causal", True):
        s += " non-causal"
    if f.get("dtype", "bf16") != "bf16":
        s += f" {f['dtype']}"
    return s


def case_key(f) -> str:
    """A case's identity in result rows: its fields, nothing measured (``--resume``)."""
    keys = DecodeCase.__dataclass_fields__
    return json.dumps({k: v for k, v in f.items() if k in keys}, sort_keys=True)


def _c(batch, cache_len, heads, headdim, **kw):
    h, hk = heads
    return dict(batch=batch, cache_len=cache_len, nheads=h, nheads_kv=hk, headdim=headdim, **kw)


PRESETS = {
    # The H200 decoding set: llama-style GQA 32/8 at head dim 128 unless stated.
    "decode": [
        _c(64, 8192, (32, 8), 128),
        _c(64, 8192, (32, 8), 128, page_size=64),
        _c(64, 8192, (32, 8), 128, page_size=1),
        _c(64, 8192, (32, 8), 128, page_size=256),
        _c(128, 4096, (32, 8), 128, page_size=16),
        _c(1, 131072, (32, 8), 128),
        _c(8, 32768, (32, 8), 128),
        _c(32, 8192, (16, 2), 256),
        _c(64, 8192, (32, 8), 64),
        _c(64, 8192, (32, 8), 128, seqlen_q=4),
        _c(64, 8192, (32, 8), 128, ragged=True),
        _c(64, 8192, (32, 8), 128, page_size=64, ragged=True),
        _c(256, 2048, (32, 8), 128),
        # prefill over a cache: 2048 new tokens after 3577 cached, against flash_attn_func on
        # the same 2048 queries and 5625 keys (impl "triflash-dense")
        _c(1, 3577, (32, 8), 128, seqlen_q=2048, seqlen_new=2048),
    ],
    # Tiny shapes for the CPU (Triton interpreter): the same forms, timings mean nothing.
    "decode-cpu": [
        _c(2, 64, (4, 2), 64),
        _c(2, 64, (4, 2), 64, page_size=16),
        _c(2, 16, (4, 2), 64, page_size=1),
        _c(3, 64, (4, 2), 64, page_size=16, ragged=True),
        _c(3, 64, (4, 2), 64, ragged=True),
        _c(2, 64, (4, 2), 64, seqlen_q=4),
        _c(1, 40, (4, 2), 64, seqlen_q=24, seqlen_new=24),
    ],
}


def build_cases(preset, dtype="bf16") -> List[DecodeCase]:
    return [DecodeCase(**group, dtype=dtype) for group in PRESETS[preset]]


def filter_cases(cases, headdims=None, seqlens=None, batch=None, nheads=None) -> List[DecodeCase]:
    """The cases matching every given value (None: any); seqlens select on cache_len."""
    return [c for c in cases
            if (headdims is None or c.headdim in headdims)
            and (seqlens is None or c.cache_len in seqlens)
            and (batch is None or c.batch == batch)
            and (nheads is None or c.nheads == nheads)]


__all__ = ["DecodeCase", "PRESETS", "MODES", "GPU_IMPLS", "CPU_IMPLS", "ISOLATED_BY_DEFAULT", "SUBJECTS",
           "build_cases", "filter_cases", "label", "case_key", "visible_pairs"]
