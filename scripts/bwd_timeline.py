"""Where a head-dim-256 dK/dV CTA's time goes, from the kernel's own clock stamps
(``HopperBwdConfig.timeline``, ``hopper.bwd256.TIMELINE_SLOTS`` per CTA): for each case the
medians of the phases of one CTA (entry -> K / V landed -> first S^T / dP^T -> last query
block -> dK / dV stored), a least-squares line through every CTA's time against its number
of query blocks (its intercept is the per-CTA fixed cost, its slope the cost of one block),
the gaps an SM sits idle between one CTA's end and the next one's start, and the share of
the kernel's span the SMs spend inside CTAs. Runs on an sm90 GPU.

    python scripts/bwd_timeline.py [--cases 1x8192x36x256,16x1024x8x256] [--config reg_a=0] [--out DIR]

One JSON line per case on stdout (+ DIR/bwd-timeline.json).

``--steps`` (head dims 64 / 128, ``hopper/bwd.py``): each warpgroup's first
``bwd.STEP_STEPS`` query-block steps stamped at the points ``--points`` selects (0 the step's
start, 1 S^T / dP^T retired, 2 P formed and dV issued, 3 dS^T formed, 4 dK / dQ issued after
both warpgroups' dS^T, 5 dV / dK retired, 6 dQ retired, 7 dQ handed to the TMA reduce): the
median cycles between consecutive stamped points and from one step's start to the next,
per warpgroup. Every stamp costs the 128 kernel registers (all eight: ~950 B spilled
against 104 B), so its phases are the probe's view; points 0 and 7 alone stay close.

    python scripts/bwd_timeline.py --steps --cases 2x8192x16x128,2x8192x32x64 --points 0,7 [--out DIR]
"""
import argparse
import dataclasses
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import triflash  # noqa: E402
from triflash.kernels import configs  # noqa: E402
from triflash.kernels.hopper import bwd256  # noqa: E402


def stamps(b, s, h, causal, changes, runs=3):
    """The timeline of the last of ``runs`` backward calls with the dispatched tile's fields
    ``changes`` replaced: (CTAs, TIMELINE_SLOTS) int64."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, s, h, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    ctas = -(-s // bwd256.BLOCK_N) * h * b
    buf = torch.zeros(ctas, bwd256.TIMELINE_SLOTS, dtype=torch.int64, device="cuda")
    saved, saved_buf = configs.SM90_HOPPER_BWD[256], bwd256.timeline_buffer
    configs.SM90_HOPPER_BWD[256] = dataclasses.replace(saved, timeline=True, **changes)
    bwd256.timeline_buffer = buf
    try:
        with triflash.force_backend("hopper"):
            out = triflash.flash_attn_func(q, k, v, causal=causal)
            dout = torch.randn_like(out)
            for _ in range(runs):
                torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        torch.cuda.synchronize()
    finally:
        configs.SM90_HOPPER_BWD[256], bwd256.timeline_buffer = saved, saved_buf
    return buf.cpu()


def step_stamps(b, s, h, d, causal, points, changes, runs=3):
    """The per-step stamps (``bwd.STEP_SLOTS`` int64 per CTA) of the last of ``runs``
    backward calls at head dim ``d`` (64 / 128) with the points of the mask ``points``."""
    from triflash.kernels.hopper import bwd as hbwd
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    cfg = configs.SM90_HOPPER_BWD[d]
    ctas = 4 * -(-s // hbwd.BLOCK_N) * h * b  # (room for the last wave's split pieces)
    buf = torch.full((ctas, hbwd.STEP_SLOTS), -1, dtype=torch.int64, device="cuda")
    saved = (cfg, hbwd.step_timeline_buffer, hbwd.step_points)
    configs.SM90_HOPPER_BWD[d] = dataclasses.replace(cfg, timeline=True, **changes)
    hbwd.step_timeline_buffer, hbwd.step_points = buf, points
    try:
        with triflash.force_backend("hopper"):
            out = triflash.flash_attn_func(q, k, v, causal=causal)
            dout = torch.randn_like(out)
            for _ in range(runs):
                buf.fill_(-1)
                torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        torch.cuda.synchronize()
    finally:
        configs.SM90_HOPPER_BWD[d], hbwd.step_timeline_buffer, hbwd.step_points = saved
    t = buf.cpu()
    return t[t[:, 3] >= 0]


def summarize_steps(t, points):
    """Median cycles between consecutive stamped points of a step and from a step's start to
    the next one's, per warpgroup, over every CTA's stamped steps (the first step of each
    CTA is left out: its loads are not yet pipelined)."""
    from triflash.kernels.hopper import bwd as hbwd
    pts = [p for p in range(hbwd.STEP_POINTS) if (points >> p) & 1]
    st = t[:, 4:].view(t.shape[0], 2, hbwd.STEP_STEPS, hbwd.STEP_POINTS).double()
    n = t[:, 3].clamp(max=hbwd.STEP_STEPS)
    out = {}
    for wg in range(2):
        rows = {}
        ok = torch.arange(hbwd.STEP_STEPS).unsqueeze(0) < n.unsqueeze(1)  # (CTA, step)
        ok[:, 0] = False
        for a, b in zip(pts, pts[1:]):
            x = (st[:, wg, :, b] - st[:, wg, :, a])[ok]
            rows[f"{a}->{b}"] = round(float(x.median()), 1) if x.numel() else None
        if 0 in pts:
            nxt = ok[:, 1:] & ok[:, :-1]
            x = (st[:, wg, 1:, 0] - st[:, wg, :-1, 0])[nxt]
            rows["step"] = round(float(x.median()), 1) if x.numel() else None
            if pts[-1] != 0:
                x = (st[:, wg, 1:, 0] - st[:, wg, :-1, pts[-1]])[nxt]
                rows[f"{pts[-1]}->next 0"] = round(float(x.median()), 1) if x.numel() else None
        out[f"wg{wg}"] = rows
    return dict(ctas=int(t.shape[0]), steps_median=float(t[:, 3].double().median()), cycles=out)


def summarize(t):
    """Phase medians (us), the fixed-cost line, idle gaps between CTAs on an SM, busy share."""
    t = t.double()
    blocks = t[:, 3]
    start_ns, end_ns = t[:, 1], torch.maximum(t[:, 8], t[:, 13])
    cycles = torch.maximum(t[:, 7], t[:, 12]) - t[:, 2]
    ns = end_ns - start_ns
    ok = ns > 1000  # globaltimer ticks coarsely: the clock rate from the longer CTAs
    ghz = float((cycles[ok] / ns[ok]).median()) if ok.any() else float("nan")

    def us(x):  # median of a cycle count, in microseconds
        return round(float(x.median()) / ghz / 1000.0, 3)
    phases = dict(
        entry_to_kv=us(t[:, 4] - t[:, 2]),
        kv_to_first_st=us(t[:, 5] - t[:, 4]),
        kv_to_first_dpt=us(t[:, 10] - t[:, 9]),
        last_block_wg0=us(t[:, 6] - t[:, 4]),
        last_block_wg1=us(t[:, 11] - t[:, 9]),
        stores_wg0=us(t[:, 7] - t[:, 6]),
        stores_wg1=us(t[:, 12] - t[:, 11]),
        cta_total=us(cycles),
    )
    # cycles = fixed + per_block * blocks, least squares over the CTAs that visit any block
    sel = blocks > 0
    a = torch.stack([torch.ones_like(blocks[sel]), blocks[sel]], 1)
    coef = torch.linalg.lstsq(a, cycles[sel].unsqueeze(1)).solution.squeeze(1)
    fixed_us, block_us = float(coef[0]) / ghz / 1000.0, float(coef[1]) / ghz / 1000.0
    # idle time on each SM between a CTA's end and the next CTA's start (global ns)
    gaps = []
    for sm in t[:, 0].unique():
        rows = (t[:, 0] == sm).nonzero().squeeze(1)
        order = rows[start_ns[rows].argsort()]
        gaps.append(start_ns[order[1:]] - end_ns[order[:-1]])
    gaps = torch.cat(gaps)
    span = float(end_ns.max() - start_ns.min())
    sms = int(t[:, 0].unique().numel())
    return dict(ctas=t.shape[0], sms=sms, clock_ghz=round(ghz, 3), phases_us=phases,
                fixed_us=round(fixed_us, 3), per_block_us=round(block_us, 4),
                fixed_in_blocks=round(fixed_us / block_us, 2) if block_us > 0 else None,
                mean_blocks=round(float(blocks.mean()), 2),
                gap_us=dict(median=round(float(gaps.median()) / 1000, 3), mean=round(float(gaps.mean()) / 1000, 3),
                            p90=round(float(gaps.quantile(0.9)) / 1000, 3)) if gaps.numel() else None,
                span_us=round(span / 1000, 1),
                busy_share=round(float(ns.sum()) / (sms * span), 4),
                tail_us=round(float(end_ns.max() - end_ns.quantile(0.99)) / 1000, 1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="1x8192x36x256,16x1024x8x256")
    ap.add_argument("--config", default="", help="HopperBwdConfig fields to change, k=v,... (ints)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--steps", action="store_true", help="head dims 64 / 128: per-step stamps")
    ap.add_argument("--points", default="0,1,2,3,4,5,6,7", help="--steps: the points stamped")
    a = ap.parse_args()
    changes = {k: int(v) for k, v in (kv.split("=") for kv in a.config.split(",") if kv)}
    rows = []
    points = sum(1 << int(p) for p in a.points.split(","))
    for case in a.cases.split(","):
        b, s, h, d = map(int, case.split("x"))
        assert d in ((64, 128) if a.steps else (256,)), "--steps: head dims 64 / 128; else 256"
        for causal in (False, True):
            if a.steps:
                info = summarize_steps(step_stamps(b, s, h, d, causal, points, changes), points)
                row = dict(case=case, causal=causal, config=a.config, points=a.points, **info)
            else:
                row = dict(case=case, causal=causal, config=a.config, **summarize(stamps(b, s, h, causal, changes)))
            rows.append(row)
            print(json.dumps(row), flush=True)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        tag = "-" + a.config.replace("=", "").replace(",", "-") if a.config else ""
        tag = ("-steps-p" + a.points.replace(",", "") if a.steps else "") + tag
        with open(os.path.join(a.out, f"bwd-timeline{tag}.json"), "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
