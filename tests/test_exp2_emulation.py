"""The PTX of ``hopper.common.exp2_mixed``'s emulated exponential (``_exp2_asm``), run on the
CPU by a small interpreter of the instructions it uses (fp32 arithmetic in numpy): one value
in every 2 / 4 / 8 computed by the polynomial, the rest by ``ex2.approx``; relative error of
the polynomial lane below 1e-5 over the softmax's range (x <= 0), exactly 0 below -126 and
at -inf (masked scores: a row that sees no key must sum to exactly 0). The hardware's own
behaviour is checked on the H200 (tests/test_hopper_tier.py)."""
import numpy as np
import pytest

common = pytest.importorskip("triflash.kernels.hopper.common")


def _f32(hexconst):
    return np.frombuffer(bytes.fromhex(hexconst[2:])[::-1], dtype=np.float32)[0]


def _run(asm, xs):
    pack = len(xs)
    regs = {f"${i + pack}": np.float32(x) for i, x in enumerate(xs)}

    def val(a):
        return _f32(a) if a.startswith("0f") else regs[a]
    for line in asm.split("\n"):
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, rest = line.split(" ", 1)
        a = [t.strip() for t in rest.split(",")]
        with np.errstate(all="ignore"):
            if op.startswith("ex2.approx"):
                regs[a[0]] = np.float32(np.exp2(np.float64(val(a[1]))))
            elif op.startswith("max."):
                regs[a[0]] = np.float32(max(val(a[1]), val(a[2])))
            elif op.startswith("add.rn"):
                regs[a[0]] = np.float32(val(a[1]) + val(a[2]))
            elif op.startswith("sub.rn"):
                regs[a[0]] = np.float32(val(a[1]) - val(a[2]))
            elif op.startswith("fma.rn"):  # one rounding: exact in float64, then to fp32
                regs[a[0]] = np.float32(np.float64(val(a[1])) * np.float64(val(a[2])) + np.float64(val(a[3])))
            elif op == "mov.b32":  # reinterpret
                v = np.asarray(val(a[1]))
                regs[a[0]] = v.view(np.uint32) if v.dtype == np.float32 else v.astype(np.uint32).view(np.float32)
            elif op == "shl.b32":
                regs[a[0]] = np.uint32((int(val(a[1])) << int(a[2])) & 0xFFFFFFFF)
            elif op == "add.s32":
                regs[a[0]] = np.uint32((int(val(a[1])) + int(val(a[2]))) & 0xFFFFFFFF)
            elif op.startswith("setp.lt"):
                regs[a[0]] = bool(val(a[1]) < val(a[2]))
            elif op == "selp.f32":
                regs[a[0]] = val(a[1]) if regs[a[3]] else val(a[2])
            else:
                raise AssertionError(f"instruction the interpreter does not know: {op}")
    return [regs[f"${i}"] for i in range(pack)]


@pytest.mark.parametrize("pack", [2, 4, 8])
def test_exp2_polynomial_lane(pack):
    asm = common._exp2_asm(pack)
    assert asm.count("ex2.approx") == pack - 1
    rng = np.random.default_rng(pack)
    xs = np.concatenate([-rng.random(3000) * 126.0, -rng.random(500) * 4.0,
                         [0.0, -1e-9, -0.5, -0.49999, -1.5, -125.9, -126.0]]).astype(np.float32)
    worst = 0.0
    for x in xs:
        got = float(_run(asm, [x] * pack)[-1])
        ref = 2.0 ** float(x)
        if x >= -125.0:
            worst = max(worst, abs(got / ref - 1.0))
        else:  # the bottom of the normal range: tiny, never above the true value by much
            assert 0.0 <= got <= 1.01 * ref
    assert worst < 1e-5, worst
    for x in (-126.01, -127.0, -300.0, -np.inf):
        assert float(_run(asm, [np.float32(x)] * pack)[-1]) == 0.0, x
