"""Does a forward option change the outputs? (H200; one device-call step, ~1 minute.)

Options that only move instructions or barriers (e.g. ``pv_overlap`` and ``thread_arrives``,
measured and not kept: docs/performance.md) must give the dispatched
kernels' outputs bit for bit. For each head dim (64, 128, 256),
causal and not, odd lengths (GQA 8 / 2 heads, seqlen_q 1000, seqlen_k 1537): O and LSE with
the dispatched tile, then with each override spec (as ``hopper_probe.py --config``);
``torch.equal`` on both. Prints one JSON line per case; exit status 1 on any difference.

    python scripts/same_outputs.py --variants "q_regs=0;own_blocks=0"
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import triflash  # noqa: E402
from triflash.kernels import configs  # noqa: E402

from hopper_probe import _apply_overrides  # noqa: E402  (scripts/ is sys.path[0])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", required=True, help="override specs, ';'-separated")
    args = ap.parse_args()
    base = dict(configs.SM90_HOPPER_FWD)
    bad = 0
    torch.manual_seed(0)
    for d in (64, 128, 256):
        q = torch.randn(2, 1000, 8, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(2, 1537, 2, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        for causal in (False, True):
            configs.SM90_HOPPER_FWD.update(base)
            ref = triflash.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
            for spec in args.variants.split(";"):
                configs.SM90_HOPPER_FWD.update(base)
                _apply_overrides(spec)  # (every head dim's tile)
                out = triflash.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
                same = all(torch.equal(a, b) for a, b in zip(ref[:2], out[:2]))
                bad += not same
                print(json.dumps(dict(d=d, causal=causal, variant=spec, same=same,
                                      max_diff=float((ref[0].float() - out[0].float()).abs().max()))), flush=True)
    configs.SM90_HOPPER_FWD.update(base)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
