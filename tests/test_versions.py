"""The support matrix (``triflash.versions``) and the run-time rule it sets: on a Triton
release the Hopper tier was not validated on, an sm90 call runs the portable tier with one
warning naming the version, unless the Hopper tier is forced."""
import warnings

import pytest
import torch

from triflash import dispatch, force_backend, versions


def test_release_of_a_version_string():
    assert versions.triton_release("3.8.0") == "3.8"
    assert versions.triton_release("3.6.0+git1a2b3c") == "3.6"
    assert versions.triton_release("3.10.1") == "3.10"


@pytest.mark.parametrize("version,trusted", [("3.6.0", True), ("3.8.0", True), ("3.8.1", True),
                                             ("3.9.0", True), ("3.7.0", False), ("3.10.0", False),
                                             ("3.5.1", False)])
def test_trusted_releases(version, trusted):
    why = versions.hopper_untrusted_reason(version)
    assert (why == "") == trusted
    if not trusted:
        assert version in why and "3.6" in why and "3.8" in why


def test_validated_releases_are_in_the_matrix():
    """CI tests every release the Hopper tier is trusted on; the matrix may hold newer ones
    (their CPU suite passes) whose Hopper tier has not run on an H200 yet."""
    assert set(versions.VALIDATED_TRITON) <= set(versions.matrix_releases())
    assert versions.matrix_releases() == tuple(t.rsplit(".", 1)[0] for _, t in versions.MATRIX)


def test_running_triton_decides_the_gate():
    assert dispatch.TRITON_UNTRUSTED == versions.hopper_untrusted_reason()


@pytest.fixture
def fake_sm90(monkeypatch):
    """An sm90 target whose two tiers are stand-ins recording which one ran."""
    ran = []
    monkeypatch.setattr(dispatch, "target_of", lambda device: "sm90")
    monkeypatch.setattr(dispatch, "hopper_fwd_supports", lambda *a, **k: "")
    monkeypatch.setattr(dispatch, "hopper_bwd_supports", lambda *a, **k: "")

    class FakeHopper:
        @staticmethod
        def fwd(*a, **k):
            ran.append("hopper")
            return "hopper-out", "hopper-lse"

        @staticmethod
        def bwd(*a, **k):
            ran.append("hopper")
            return "hopper-grads"

    monkeypatch.setattr(dispatch, "hopper_fwd", FakeHopper)
    monkeypatch.setattr(dispatch, "hopper_bwd", FakeHopper)
    monkeypatch.setattr(dispatch.portable, "fwd", lambda *a, **k: ran.append("portable") or ("out", "lse"))
    monkeypatch.setattr(dispatch.portable, "bwd", lambda *a, **k: ran.append("portable") or "grads")
    monkeypatch.setattr(dispatch.problem, "alloc_fwd_outputs",
                        lambda q, v, varlen, out=None: (torch.empty_like(q), None))
    monkeypatch.setattr(dispatch.configs, "SM90_HOPPER_FWD", {64: None})
    monkeypatch.setattr(dispatch.configs, "SM90_HOPPER_BWD", {64: None})
    monkeypatch.setattr(versions, "_warned", False)
    return ran


def _calls():
    q = torch.zeros(1, 8, 2, 64, dtype=torch.float16)
    p = dispatch.problem.AttnParams(softmax_scale=0.125, window_left=-1, window_right=-1, softcap=0.0,
                                    max_seqlen_q=8, max_seqlen_k=8)
    dispatch.run_fwd(q, q, q, None, None, None, None, p)
    dispatch.run_bwd(q, q, q, q, q, None, None, None, None, None, p, False)


def test_untrusted_triton_falls_back_with_one_warning(fake_sm90, monkeypatch):
    monkeypatch.setattr(dispatch, "TRITON_UNTRUSTED", versions.hopper_untrusted_reason("3.99.0"))
    with pytest.warns(RuntimeWarning, match=r"triton 3\.99\.0 .*force_backend\('hopper'\)") as caught:
        _calls()
    # it names the pairs to pin: each a matrix pair whose triton is validated
    assert "torch 2.14.1 / triton 3.8.0" in str(caught[0].message)
    assert "torch 2.15.0 / triton 3.9.0" in str(caught[0].message)
    assert "3.7.1" not in str(caught[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process: the next calls are silent
        _calls()
    assert fake_sm90 == ["portable"] * 4


def test_forced_hopper_runs_on_an_untrusted_triton(fake_sm90, monkeypatch):
    monkeypatch.setattr(dispatch, "TRITON_UNTRUSTED", versions.hopper_untrusted_reason("3.99.0"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with force_backend("hopper"):
            _calls()
    assert fake_sm90 == ["hopper", "hopper"]


def test_validated_triton_runs_the_hopper_tier(fake_sm90, monkeypatch):
    monkeypatch.setattr(dispatch, "TRITON_UNTRUSTED", "")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _calls()
    assert fake_sm90 == ["hopper", "hopper"]


def test_pyproject_bounds_are_the_matrix_oldest_pair():
    import pathlib
    import re
    text = (pathlib.Path(__file__).parents[1] / "pyproject.toml").read_text()
    deps = dict(re.findall(r'"(torch|triton)>=([0-9.]+)"', text))
    oldest_torch, oldest_triton = min(versions.MATRIX, key=lambda pair: tuple(map(int, pair[0].split("."))))
    assert deps == {"torch": ".".join(oldest_torch.split(".")[:2]), "triton": ".".join(oldest_triton.split(".")[:2])}
