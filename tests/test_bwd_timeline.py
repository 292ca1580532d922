"""scripts/bwd_timeline.py --steps: the per-step phase medians from a synthetic stamp table."""
import importlib.util
import os

import pytest
import torch

hbwd = pytest.importorskip("triflash.kernels.hopper.bwd")
_spec = importlib.util.spec_from_file_location(
    "bwd_timeline", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts",
                                 "bwd_timeline.py"))
bwd_timeline = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bwd_timeline)


def _table(steps, period, offsets, ctas=3):
    """Stamps as the kernel writes them: step i of warpgroup w at point p = 1000 * w + period
    * i + offsets[p]; slots of steps not run stay -1."""
    t = torch.full((ctas, hbwd.STEP_SLOTS), -1, dtype=torch.int64)
    t[:, 3] = steps
    for c in range(ctas):
        for w in range(2):
            for i in range(min(steps, hbwd.STEP_STEPS)):
                for p, off in enumerate(offsets):
                    t[c, 4 + (w * hbwd.STEP_STEPS + i) * hbwd.STEP_POINTS + p] = 1000 * w + period * i + off
    return t


def test_step_phases():
    offsets = [0, 300, 420, 560, 700, 900, 950, 1000]
    t = _table(steps=10, period=1200, offsets=offsets)
    out = bwd_timeline.summarize_steps(t, 0xFF)
    assert out["ctas"] == 3 and out["steps_median"] == 10
    for wg in ("wg0", "wg1"):
        c = out["cycles"][wg]
        assert [c[f"{a}->{a + 1}"] for a in range(7)] == [b - a for a, b in zip(offsets, offsets[1:])]
        assert c["step"] == 1200 and c["7->next 0"] == 200
    # points 0 and 7 only
    c = bwd_timeline.summarize_steps(t, 0x81)["cycles"]["wg0"]
    assert c == {"0->7": 1000, "step": 1200, "7->next 0": 200}
