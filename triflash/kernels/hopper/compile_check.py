"""sm_90a compile check of the Gluon (Hopper) kernels on a machine without a GPU.

For every tile in ``configs.SM90_HOPPER_FWD`` and each feature set, the forward kernel is
specialized as a launch would specialize it (host TMA descriptors on small CPU tensors),
compiled for sm_90a, and its PTX run through ``ptxas -v``. Reported per kernel: dynamic
shared memory (must be <= 232448 B), spill bytes (must be 0), whether ``setmaxnreg``
(register hand-off from the loader warp to the consumer warpgroups), wgmma and TMA
instructions are present.

Gluon has no interpreter: run this in a process without TRITON_INTERPRET
(``run_subprocess`` does that for callers that have it set, e.g. the test suite).

    python -m triflash.kernels.hopper.compile_check [--json]
"""
import argparse
import json
import os
import subprocess
import sys

FEATURES = {
    # name: (causal, window_left, softcap)
    "plain": (False, -1, 0.0),
    "causal": (True, -1, 0.0),
    "window-softcap": (True, 128, 30.0),
}


def compile_fwd(headdim: int, dtype: str, feature: str) -> dict:
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from .. import configs, sm90_report
    from ..portable import AttnParams
    from . import fwd as H
    from .smoke import _specialize
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("Gluon has no interpreter: unset TRITON_INTERPRET (or use run_subprocess)")
    cfg = configs.SM90_HOPPER_FWD[headdim]
    causal, left, softcap = FEATURES[feature]
    tdt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    b, s, h, hk = 2, 1000, 4, 2  # shapes only specialize strides; any will do
    q = torch.empty(b, s, h, headdim, dtype=tdt)
    k, v = torch.empty(b, s, hk, headdim, dtype=tdt), torch.empty(b, s, hk, headdim, dtype=tdt)
    out, lse = torch.empty_like(q), torch.empty(b, h, s)
    p = AttnParams(headdim ** -0.5, left, 0 if causal else -1, softcap, s, s)
    qk_scale, softcap_log2 = p.score_constants()
    bm = H.ROWS_PER_CONSUMER
    args = [H.descriptor(q, bm), H.descriptor(k, cfg.block_n), H.descriptor(v, cfg.block_n),
            H.descriptor(out, bm), lse, *lse.stride(), h, hk, s, s, 64, 8, qk_scale, softcap_log2,
            p.window_left, p.window_right, cfg.block_n, cfg.stages, cfg.num_consumers,
            p.window_left >= 0, p.window_right >= 0, softcap > 0.0, cfg.pingpong,
            cfg.loader_regs, cfg.consumer_regs]
    signature, constexprs, attrs = _specialize(H.hopper_fwd_kernel, args)
    compiled = triton.compile(GluonASTSource(H.hopper_fwd_kernel, signature, constexprs, attrs),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    ptx = compiled.asm["ptx"]
    info = sm90_report.parse_ptxas_log(sm90_report._run_ptxas(ptx, compiled.metadata))
    return dict(kernel="hopper_fwd", headdim=headdim, dtype=dtype, feature=feature,
                block_n=cfg.block_n, stages=cfg.stages, shared=compiled.metadata.shared,
                num_warps=compiled.metadata.num_warps,
                spill_bytes=info["spill_stores"] + info["spill_loads"],
                setmaxnreg="setmaxnreg.inc" in ptx and "setmaxnreg.dec" in ptx,
                has_wgmma="wgmma.mma_async" in ptx, has_tma="cp.async.bulk.tensor" in ptx)


def all_fwd(dtypes=("bf16", "fp16")):
    from .. import configs
    return [compile_fwd(d, dt, f) for d in sorted(configs.SM90_HOPPER_FWD)
            for dt in dtypes for f in FEATURES]


def run_subprocess(timeout=900) -> list:
    """``all_fwd()`` in a fresh interpreter whose environment lacks TRITON_INTERPRET."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    env["PYTHONPATH"] = os.pathsep.join([root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    res = subprocess.run([sys.executable, "-m", "triflash.kernels.hopper.compile_check", "--json"],
                         env=env, capture_output=True, text=True, timeout=timeout)
    if res.returncode != 0:
        raise RuntimeError(f"sm_90a compile failed ({res.returncode}):\n{res.stderr[-4000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    a = ap.parse_args(argv)
    rows = all_fwd()
    if a.json:
        print(json.dumps(rows))
    else:
        for r in rows:
            print(" ".join(f"{k}={v}" for k, v in r.items()))


if __name__ == "__main__":
    main()
