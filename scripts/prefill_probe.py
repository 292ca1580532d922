"""Prefill over a KV cache on the GPU: flash_attn_with_kvcache appending new tokens (and
the same attention over a cache already holding them, no append) against flash_attn_func on
the same tokens, with the Hopper forward's seqused_k launches walking tiles as
``common.persistent_walk`` decides ("scheduled") or one CTA per tile ("grid", the walk it
replaced). Interleaved rounds; CUDA-graph replays (``decode_probe.timeit``).

    python scripts/prefill_probe.py [--rounds 3] [--json PATH]
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_probe import timeit  # noqa: E402
import triflash  # noqa: E402
from triflash.kernels.hopper import fwd as hfwd  # noqa: E402

CASES = [  # batch, cached, new, hq, hkv, d (ragged: cached lengths differ per sequence)
    (1, 3577, 2048, 32, 8, 128), (1, 3577, 2048, 32, 8, 64), (1, 3577, 2048, 32, 8, 256),
    (4, 3577, 1024, 32, 8, 128, "ragged"), (1, 16000, 512, 32, 8, 128),
]
NEW_WALK = hfwd.persistent_walk


def old_walk(unmasked, pb, params, num_tiles):
    """The walk before seqused_k launches could take the schedule: one CTA per tile."""
    return "grid" if any(pb.seq_flags) else NEW_WALK(unmasked, pb, params, num_tiles)


def make(case):
    b, n, s, hq, hk, d = case[:6]
    dt = dict(device="cuda", dtype=torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(0)
    cached = [n - 97 * i if case[6:] else n for i in range(b)]
    cap = max(cached) + s
    q = torch.randn(b, s, hq, d, generator=g, **dt)
    kc, vc = torch.randn(b, cap, hk, d, generator=g, **dt), torch.randn(b, cap, hk, d, generator=g, **dt)
    kn, vn = torch.randn(b, s, hk, d, generator=g, **dt), torch.randn(b, s, hk, d, generator=g, **dt)
    lens = torch.tensor(cached, dtype=torch.int32, device="cuda")
    return q, kc, vc, kn, vn, lens, cached


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    a = ap.parse_args()
    f, fk = triflash.flash_attn_func, triflash.flash_attn_with_kvcache
    rows = []
    for case in CASES:
        q, kc, vc, kn, vn, lens, cached = make(case)
        s = case[2]
        # caches already holding the new tokens (attention alone), and their contiguous copies
        kf, vf = kc.clone(), vc.clone()
        for i, c in enumerate(cached):
            kf[i, c:c + s], vf[i, c:c + s] = kn[i], vn[i]
        full = lens + s
        dense = None
        if not case[6:]:
            kd, vd = kf[:, :cached[0] + s].contiguous(), vf[:, :cached[0] + s].contiguous()
            dense = lambda: f(q, kd, vd, causal=True)  # noqa: E731
        ref = None
        for walk_name, walk in (("scheduled", NEW_WALK), ("grid", old_walk)):
            hfwd.persistent_walk = walk
            o = fk(q, kc.clone(), vc.clone(), k=kn, v=vn, cache_seqlens=lens, causal=True)
            o2 = fk(q, kf, vf, cache_seqlens=full, causal=True)
            torch.cuda.synchronize()
            ref = o2 if ref is None else ref
            assert torch.equal(o, o2) and torch.equal(o2, ref), (case, walk_name)
        times = {}
        for r in range(a.rounds):
            for walk_name, walk in (("scheduled", NEW_WALK), ("grid", old_walk)):
                hfwd.persistent_walk = walk
                for what, fn in (("append+attend", lambda: fk(q, kc, vc, k=kn, v=vn, cache_seqlens=lens, causal=True)),
                                 ("attend", lambda: fk(q, kf, vf, cache_seqlens=full, causal=True))):
                    times.setdefault((walk_name, what), []).append(timeit(fn))
            if dense is not None:
                times.setdefault(("dense", "flash_attn_func"), []).append(timeit(dense))
        for (walk_name, what), ts in times.items():
            row = dict(case=list(case), walk=walk_name, call=what, us=[t * 1e6 for t in ts], best_us=min(ts) * 1e6)
            rows.append(row)
            print(f"{str(case):45s} {walk_name:9s} {what:15s} best {min(ts)*1e6:8.1f} us  "
                  + " ".join(f"{t*1e6:.1f}" for t in ts), flush=True)
    hfwd.persistent_walk = NEW_WALK
    if a.json:
        meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                    triton=__import__("triton").__version__)
        json.dump(dict(meta=meta, rows=rows), open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
