"""H200 speed of the Hopper forward at the padded head dims (96, 192: computed as 128 / 256)
beside the portable forward and SDPA-cuDNN, three interleaved rounds, median TFLOPS (FLOPs of
the real head dim).

    python scripts/padded_probe.py [--out DIR]
"""
import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import triflash  # noqa: E402
from triflash import testing  # noqa: E402

CASES = [(2, 8192, 16, 96), (2, 8192, 8, 192), (1, 8192, 36, 192), (16, 1024, 16, 96)]


def _ms(b, s, h, d, causal, impl):
    import triton
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    if impl == "cudnn":
        from torch.nn.attention import SDPBackend, sdpa_kernel
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            fn = lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)  # noqa: E731
            return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    with triflash.force_backend(impl):
        fn = lambda: triflash.flash_attn_func(q, k, v, causal=causal)  # noqa: E731
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    rows = []
    for (b, s, h, d) in CASES:
        for causal in (False, True):
            flops = testing.flops(b, h, s, s, d, causal=causal)
            times = {i: [] for i in ("hopper", "portable", "cudnn")}
            for _ in range(3):
                for impl in times:
                    try:
                        times[impl].append(flops / _ms(b, s, h, d, causal, impl) / 1e9)
                    except Exception as e:  # report, keep going
                        times[impl].append(float("nan"))
                        print(impl, type(e).__name__, str(e)[:200], flush=True)
            row = dict(case=f"{b}x{s}x{h}x{d}", causal=causal,
                       **{i: round(statistics.median(t), 1) for i, t in times.items()},
                       rounds={i: [round(x, 1) for x in t] for i, t in times.items()})
            print(json.dumps(row), flush=True)
            rows.append(row)
    with open(os.path.join(args.out, "padded-probe.json"), "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, results=rows), f, indent=1)


if __name__ == "__main__":
    main()
