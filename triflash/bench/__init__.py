"""triflash.bench: the benchmark behind the README's numbers.

Usage::

    python -m triflash.bench                      # CUDA: --preset h200; no CUDA: --preset cpu
    python -m triflash.bench --preset seed        # 1 x 8192 x 36 heads x 256, causal and not
    python -m triflash.bench --headdims 128 --seqlens 1024 4096 16384 --total-tokens 16384
    python -m triflash.bench --batch 2 --seqlen 8192 --nheads 16 --nheads-kv 4 --headdim 128
    python -m triflash.bench --window 256 0 --causal false --impls triflash,flex,fa3
    python scripts/readme_table.py bench-out/results.json --update README.md

Impls (``--impls``, default all): ``triflash`` (normal dispatch), ``triflash-portable``
(inside ``triflash.force_backend("portable")``), ``triflash-varlen`` (the same batch
through ``flash_attn_varlen_func`` as equal-length packed sequences, ``"varlen": true``),
``triflash-deterministic`` (``deterministic=True``), ``sdpa-flash``, ``sdpa-cudnn``,
``sdpa-efficient`` (SDPA pinned to one backend, ``.transpose(1, 2)`` views), ``flex``
(compiled FlexAttention), ``fa2``, ``fa3``, ``fa4`` (Dao-AILab packages), and on the CPU
``sdpa-math``. A peer that does not import, or fails on its first case, is skipped with the
reason in ``meta.peers_skipped``; a peer that cannot express a case (SDPA: windows, causal
with seqlen_q != seqlen_k) gets rows with ``"note": "skipped: <reason>"``. ``--isolate``
(default on CUDA: fa2, fa3, fa4) loads, checks and times a peer in a worker process of its
own on the parent's tensors (``bench/isolate.py``), so that what its import does to a
process (host time per torch call) falls on no other implementation.

Without CUDA the same command runs tiny cases on the CPU under Triton's interpreter
(re-running itself with TRITON_INTERPRET=1, which must be set before the kernels are
defined). That checks correctness; its timings mean nothing.

Conventions (see /work/shared/ANCHORS.md): ``triton.testing.do_bench(fn, warmup, rep,
return_mode="median")``; fwd timed with autograd on; bwd timed as
``torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)`` on one forward output;
``host_ms`` records the CPU time per call, to expose launch-bound measurements;
TFLOPS from ``triflash.testing.flops`` (fwd 4*b*h*sq*sk*d, halved when causal; bwd 2.5x).
Correctness: FlashAttention-3's rule, max |impl - ref_fp32| <= fa_tolerance(ref_fp32,
ref_lowp), per tensor. Exit status 1 when a triflash row fails its check.

JSON schema (``--out``, default ``bench-out/results.json``)::

    {
      "meta": {
        "commit": str,          # --commit, else `git rev-parse HEAD`, else $TRIFLASH_COMMIT, else "unknown"
        "dirty": bool | null,   # tracked files modified (null when unknown)
        "date": str,            # ISO 8601, UTC
        "gpu": str,             # torch.cuda.get_device_name(), or "none (CPU, Triton interpreter)"
        "device": "cuda" | "cpu",
        "torch": str, "triton": str, "cudnn": str | null, "cuda": str | null, "python": str,
        "peers_skipped": {impl: reason},
        "impl_versions": {impl: str},
        "preset": str, "interpreter": bool, "argv": [str],
        "timing": {"warmup_ms": int, "rep_ms": int, "return_mode": "median",
                   "rounds": int,           # --rounds: interleaved timings per impl and case
                   "fwd_autograd": bool,    # false with --inference-fwd (fwd under no_grad)
                   "isolated": [str]},      # impls measured in worker processes (--isolate)
        "tflops_convention": str,
        "complete": bool,       # false while the run is in progress: the file is rewritten
                                # after every case, so a run cut short keeps what it measured
        "resumed": {"from": str, "date": str, "cases_kept": [str]}
                                # only with --resume: the partial file (same commit, preset and
                                # GPU) whose cases were kept, each case's rows from one process
      },
      "results": [
        {
          "impl": str, "mode": "fwd" | "bwd" | "fwd_bwd",
          "batch": int, "seqlen_q": int, "seqlen_k": int, "nheads": int, "nheads_kv": int,
          "headdim": int, "headdim_v": int, "causal": bool, "window_size": [left, right],
          "dtype": "bf16" | "fp16", "varlen": bool,
          "ms": float | null,                 # median; null when skipped or errored
          "ms_rounds": [float],               # with --rounds > 1: each round's median (ms is their median)
          "host_ms": float | null,            # CPU time to issue one call (CUDA only)
          "tflops": float | null,
          "bwd_fwd_ratio": float | null,      # on bwd rows when fwd was measured too
          "max_err": {"out": float | null, "dq": ..., "dk": ..., "dv": ...},   # grads: bwd/fwd_bwd rows
          "tolerance": {"out": float, ...} | null,   # the FA3 tolerance each error is held to
          "passed": bool | null,              # null: skipped, or not checked (--no-check)
          "note": str                         # "skipped: why", "error: ...", the checked subset,
                                              # "launch-bound? host ..." when host_ms > 0.7 x ms
        }
      ]
    }

Decoding (``--preset decode``; ``--preset decode-cpu``: tiny cases for the interpreter):
``flash_attn_with_kvcache`` over dense and paged caches (page sizes 1 to 256, pages in a
random permutation, K and V two views of one tensor as vLLM lays them out), ragged lengths,
4 query tokens, a batch of 256, and one prefill chunk over a cache (2048 new tokens after
3577 cached) beside ``flash_attn_func`` on the same tokens (``triflash-dense``). Peers:
``sdpa-cudnn``, ``sdpa-flash``, ``fa4`` (dense caches), ``fa4-kvcache`` (FA4's
``flash_attn_varlen_func`` with ``seqused_k`` and ``page_table``), ``fa3`` and ``flashinfer`` when
importable (``bench/decode.py``). Each case is measured in K+V bytes read per second
against a device-to-device copy timed in the same process (``meta.copy_tb_s``); the
terminal table gives triflash / the best peer and triflash / the copy
(``python -m triflash.bench.report FILE`` prints it again). Cases and byte accounting:
``bench/decode_cases.py``. The JSON has the same ``meta`` (``preset`` "decode") plus::

    "copy_tb_s": float,         # the fastest device copy of the run, (bytes read + written) / s / 1e12
    "copy": {"bytes": int, "ms": [float], "tb_s": [float], "what": str},   # before and after the cases
    "tb_s_convention": str

and one row per (case, impl)::

    {
      "impl": str, "mode": "decode" | "prefill-cache",
      "batch": int, "cache_len": int,         # tokens cached per sequence (ragged: the most)
      "nheads": int, "nheads_kv": int, "headdim": int, "headdim_v": int,
      "page_size": int | null,                # null: dense cache
      "seqlen_q": int,                        # query tokens per sequence (causal, bottom-right)
      "seqlen_new": int,                      # keys/values the call appends (prefill-cache)
      "seqlen_k": int,                        # keys attended at most: cache_len + seqlen_new
      "ragged": bool, "lens_seed": int,       # ragged: lengths uniform in [1, cache_len], this seed
      "causal": bool, "dtype": "bf16" | "fp16",
      "kv_layout": "paged" | "dense",         # what this impl read ("dense" for a peer without
                                              # page tables on a paged case: the same tokens)
      "kv_full": bool,                        # read every sequence's whole cache (ragged, peers
                                              # without per-sequence lengths)
      "kv_tokens": int, "kv_bytes": int,      # keys it attends, summed over sequences; their K+V bytes
      "ms": float | null, "ms_rounds": [float], "host_ms": float | null,
      "tb_s": float | null,                   # kv_bytes / (ms / 1e3) / 1e12
      "tflops": float | null,                 # FA convention over the (query, key) pairs visited
      "max_err": {"out": float | null}, "tolerance": {"out": float} | null,
      "passed": bool | null, "note": str
    }
"""


def main(argv=None):
    """Run the benchmark (see ``python -m triflash.bench --help``); returns the exit status."""
    from .__main__ import main as _main
    return _main(argv)


__all__ = ["main"]
