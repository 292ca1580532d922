"""Benchmark cases: what shapes are measured, and the named presets.

A ``Case`` is one attention problem (shapes, masking, dtype); every case is measured in
each requested mode (fwd, bwd, fwd_bwd) by every implementation. Cases are built from
"groups", each a small dict of sweep axes::

    {"headdims": [128], "seqlens": [1024, 2048], "total_tokens": 16384}   # batch = 16384 // seqlen
    {"headdims": [256], "seqlens": [8192], "batch": 1, "nheads": 36}      # explicit sizes

A group without ``nheads`` uses FlashAttention-3's benchmark rule nheads = 2048 // headdim
(model width 2048). On the command line, shape flags select among a named preset's cases
(``filter_cases``), or, without ``--preset``, replace the default group's values
(``build_cases(..., overrides=...)``).
"""
from dataclasses import asdict, dataclass
from typing import List, Tuple

MODES = ("fwd", "bwd", "fwd_bwd")
FA3_WIDTH = 2048  # FA3 benchmarks keep nheads * headdim = 2048
SWEEP_SEQLENS = [1024, 2048, 4096, 8192, 16384]

SEED_GROUP = {"headdims": [256], "seqlens": [8192], "batch": 1, "nheads": 36}

PRESETS = {
    # The seed: FA3 at headdim 256, 1 x 8192 x 36 heads.
    "seed": [SEED_GROUP],
    # Everything the README reports on the H200.
    "h200": [
        SEED_GROUP,
        {"headdims": [64, 128, 256], "seqlens": [8192], "total_tokens": 16384},
        {"headdims": [128, 256], "seqlens": SWEEP_SEQLENS, "total_tokens": 16384},
    ],
    # Every head dim the project tunes (96 / 192: computed as 128 / 256 on sm90, forward and
    # backward),
    # at 8k tokens per sequence, 16k tokens per batch.
    "headdims": [{"headdims": [64, 96, 128, 192, 256], "seqlens": [8192], "total_tokens": 16384}],
    # FA3's own benchmark sweep (used when shape flags are given without a preset).
    "fa3": [{"headdims": [64, 128, 256], "seqlens": [512] + SWEEP_SEQLENS, "total_tokens": 16384}],
    # Tiny shapes for the CPU (Triton interpreter): checks correctness, timings mean nothing.
    "cpu": [{"headdims": [64], "seqlens": [64, 128], "batch": 1, "nheads": 2}],
}


@dataclass(frozen=True)
class Case:
    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads: int
    nheads_kv: int
    headdim: int
    headdim_v: int
    causal: bool
    window_size: Tuple[int, int]
    dtype: str  # "bf16" or "fp16"

    @property
    def has_window(self) -> bool:
        return tuple(self.window_size) != (-1, -1)

    def label(self) -> str:
        """Short human-readable name, e.g. '2x8192x16x128 causal'."""
        s = f"{self.batch}x{self.seqlen_q}"
        if self.seqlen_k != self.seqlen_q:
            s += f"/{self.seqlen_k}"
        s += f"x{self.nheads}"
        if self.nheads_kv != self.nheads:
            s += f"(kv{self.nheads_kv})"
        s += f"x{self.headdim}"
        if self.headdim_v != self.headdim:
            s += f"/{self.headdim_v}"
        s += " causal" if self.causal else " full"
        if self.has_window:
            s += f" win{tuple(self.window_size)}"
        return s

    def fields(self) -> dict:
        """The case's part of a JSON result row."""
        d = asdict(self)
        d["window_size"] = list(self.window_size)
        d["varlen"] = False
        return d


def _causal_values(causal: str) -> List[bool]:
    return {"both": [False, True], "true": [True], "false": [False]}[causal]


def build_cases(groups, causal="both", dtype="bf16", window=None, nheads_kv=None,
                seqlen_k=None, headdim_v=None, overrides=None) -> List[Case]:
    """Expand groups into Cases (in order, duplicates removed).

    overrides: dict of group keys (headdims, seqlens, batch, nheads, total_tokens) given on
    the command line; they replace the group's values. An explicit batch wins over
    total_tokens."""
    cases, seen = [], set()
    for group in groups:
        g = dict(group)
        for key, value in (overrides or {}).items():
            if value is not None:
                g[key] = value
                if key == "batch":
                    g.pop("total_tokens", None)
        if "batch" not in g and "total_tokens" not in g:
            g["total_tokens"] = 16384
        for d in g["headdims"]:
            for s in g["seqlens"]:
                batch = g.get("batch") or max(1, g["total_tokens"] // s)
                h = g.get("nheads") or max(1, FA3_WIDTH // d)
                hk = nheads_kv or h
                if h % hk:
                    raise ValueError(f"--nheads-kv {hk} does not divide nheads {h}")
                for c in _causal_values(causal):
                    case = Case(batch, s, seqlen_k or s, h, hk, d, headdim_v or d, c,
                                tuple(window) if window else (-1, -1), dtype)
                    if case not in seen:
                        seen.add(case)
                        cases.append(case)
    return cases


def filter_cases(cases, headdims=None, seqlens=None, batch=None, nheads=None,
                 total_tokens=None) -> List[Case]:
    """The cases matching every given value (None: any)."""
    def keep(c):
        return ((headdims is None or c.headdim in headdims)
                and (seqlens is None or c.seqlen_q in seqlens)
                and (batch is None or c.batch == batch)
                and (nheads is None or c.nheads == nheads)
                and (total_tokens is None or c.batch * c.seqlen_q == total_tokens))
    return [c for c in cases if keep(c)]


__all__ = ["Case", "PRESETS", "MODES", "build_cases", "filter_cases"]
