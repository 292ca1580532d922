"""CUDA graphs: the forward and backward captured in one graph (what serving engines and
``torch.compile(mode="reduce-overhead")`` do to drop the per-call host cost) replay, on
fresh inputs copied into the captured tensors, to exactly what eager calls return.

``deterministic=True`` makes eager and replayed results bitwise comparable (no atomics).
"warm": the shape ran eagerly before the capture, so the graph reads the cached longest-first
schedule of a masked persistent launch, which must outlive the schedule cache; "cold": a shape
the capture meets first, where no schedule can be copied to the device inside the capture
and the launch takes one CTA per tile (``hopper.common.schedule_table``).
"""
import pytest
import torch

import triflash
from conftest import DEVICE

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")]

# batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, causal, window
CASES = [
    (2, 1000, 1000, 8, 2, 128, True, (-1, -1)),
    (1, 777, 1500, 4, 4, 64, False, (-1, -1)),
    (2, 700, 700, 4, 4, 256, True, (-1, -1)),
    (1, 900, 900, 6, 3, 128, False, (100, 0)),
]


def _attention(q, k, v, dout, causal, window):
    out, lse = triflash.flash_attn_func(q, k, v, causal=causal, window_size=window,
                                        deterministic=True, return_attn_probs=True)
    return (out, lse, *torch.autograd.grad(out, (q, k, v), dout))


def _fill(tensors, gen):
    with torch.no_grad():
        for t in tensors:
            t.copy_(torch.randn(t.shape, generator=gen, device=t.device, dtype=t.dtype))


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c[:6])) + f"-c{int(c[6])}-w{c[7][0]}")
def test_graph_replay_matches_eager(case, warm, monkeypatch):
    from triflash.kernels.hopper import common as hopper_common
    b, sq, sk, h, hk, d, causal, window = case
    gen = torch.Generator(device=DEVICE).manual_seed(sq * 31 + d)
    q = torch.empty(b, sq, h, d, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    k = torch.empty(b, sk, hk, d, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    v = torch.empty(b, sk, hk, d, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    dout = torch.empty(b, sq, h, d, device=DEVICE, dtype=torch.bfloat16)
    _fill((q, k, v, dout), gen)

    # warm-up on a side stream, as torch.cuda.graph asks (it also compiles every kernel the
    # capture launches); "cold" warms up as a capture would run: without schedule tables
    hopper_common._SCHEDULES.clear()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), monkeypatch.context() as m:
        if not warm:
            m.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        for _ in range(2):
            _attention(q, k, v, dout, causal, window)
    torch.cuda.current_stream().wait_stream(side)
    if not warm:
        assert not hopper_common._SCHEDULES, "a capture must not build schedule tables"

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _attention(q, k, v, dout, causal, window)

    # the schedule cache may drop its tables; the graph keeps what it reads
    hopper_common._SCHEDULES.clear()
    torch.cuda.empty_cache()
    garbage = torch.full((1 << 24,), -1, dtype=torch.int32, device=DEVICE)  # reuse freed memory

    for _ in range(2):  # fresh inputs each replay
        _fill((q, k, v, dout), gen)
        for t in captured:
            t.detach().fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        eager = _attention(q, k, v, dout, causal, window)
        for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), captured, eager):
            assert torch.equal(got, want), (
                f"{name}: replay differs from eager, max |diff| {(got.float() - want.float()).abs().max().item()}")
    del garbage
