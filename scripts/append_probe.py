"""Times kvcache.append_kv (2048 new tokens, 8 KV heads, d 128, bf16, into a dense cache at row 3577)
under a few block sizes / warp counts on the GPU, each checked to write the rows exactly; times are
CUDA-graph replays (decode_probe.timeit: no host launch cost)."""
import importlib
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_probe import timeit  # noqa: E402
import triflash.kernels.kvcache as K  # noqa: E402
src = open(K.__file__).read()
assert src.count("block_n = 16") == 1
dt = dict(device="cuda", dtype=torch.bfloat16)
kn = torch.randn(1, 2048, 8, 128, **dt); vn = torch.randn_like(kn)
kc = torch.randn(1, 5625, 8, 128, **dt); vc = torch.randn_like(kc)
st = torch.tensor([3577], dtype=torch.int32, device="cuda")
for b, w in ((16, 4), (32, 4), (64, 4), (64, 8), (128, 8)):
    p = K.__file__.replace("kvcache.py", f"_probe_kv{b}_{w}.py")
    open(p, "w").write(src.replace("block_n = 16", f"block_n = {b}").replace("num_warps=4)", f"num_warps={w})"))
    m = importlib.import_module(f"triflash.kernels._probe_kv{b}_{w}")
    kc[:, 3577:].zero_(); vc[:, 3577:].zero_()
    m.append_kv(kn, vn, kc, vc, st); torch.cuda.synchronize()
    ok = torch.equal(kc[0, 3577:], kn[0]) and torch.equal(vc[0, 3577:], vn[0])
    t = timeit(lambda: m.append_kv(kn, vn, kc, vc, st))
    print(f"append block_n {b} warps {w}: {t*1e6:.2f} us, {4*kn.numel()*2/t/1e12:.2f} TB/s (read+written) ok={ok}", flush=True)
