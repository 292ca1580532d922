"""Hopper resource check, no GPU needed: the tile configurations the sm90 dispatch picks
(``configs.SM90_FWD`` / ``SM90_BWD``) compile for sm_90a to at most 232448 bytes of shared
memory (the per-block opt-in limit of H100/H200) and without register spills, unless
``sm90_report.spill_budget`` (SPILL_RULES by kernel and head dim, SPILL_BUDGET by launch)
allows a configuration some spill bytes with a written reason.

Compiles go through ``tools/sm90_report.py`` (Triton's sm_90a compiler + ptxas);
under TRITON_INTERPRET=1 (how the rest of the suite runs) that happens in a subprocess
without it. Results are cached by Triton's hash of the kernel sources, so only edited
kernels recompile. Skipped when Triton's NVIDIA backend or ptxas is unavailable.

What runs: the launches ``sm90_report.all_dispatch_configs()`` records from the dispatch
(forward; backward preprocess, dK/dV with or without atomic dQ or as split dK/dV passes, dQ)
for every head dim {64, 72, 96, 128, 192, 256} x bf16 x the feature sets "plain", "causal"
and "all" (causal + sliding window + softcap + varlen + seqused), with deterministic False
and True, plus fp16 "plain" at head dims 64, 128, 256: ~100 distinct compiles, ~4.5 minutes
cold on 2 cores (a file lock makes pytest-xdist workers share one compile pass), seconds
when cached. The full table (fp16 everywhere, "window", "softcap" and "varlen" too: 360
launches, ~324 compiles, ~15 minutes cold) is ``python -m tools.sm90_report``;
TRIFLASH_SM90_FULL=1 makes this file check all of it.

    pytest -m sm90            # only this file's tests
    pytest -m "not sm90"      # everything else
"""
import os

import pytest

from tools import sm90_report as R

pytestmark = pytest.mark.sm90


def _jobs():
    if os.environ.get("TRIFLASH_SM90_FULL") == "1":
        return R.all_dispatch_configs()
    jobs = R.all_dispatch_configs(dtypes=("bf16",), features=("plain", "causal", "all", "kvcache", "kvcache-varlen"))
    jobs += R.all_dispatch_configs(headdims=(64, 128, 256), dtypes=("fp16",), features=("plain",))
    return jobs


JOBS = _jobs()


@pytest.fixture(scope="module")
def results():
    problem = R.toolchain_problem()
    if problem:
        pytest.skip(f"sm_90a toolchain unavailable: {problem}")
    try:
        return R.run_report(JOBS)
    except R.Unavailable as e:
        pytest.skip(f"sm_90a toolchain unavailable: {e}")


def _describe(job, r):
    return (f"{job.id}: tile (m, n, warps, stages) {job.tile}, shared {r['shared']} B, "
            f"{r['registers']} registers, spill stores {r['spill_stores']} B, "
            f"spill loads {r['spill_loads']} B")


@pytest.mark.parametrize("job", JOBS, ids=[j.id for j in JOBS])
def test_shared_memory_fits(results, job):
    r = results[job.id]
    assert r["shared"] <= R.MAX_SHARED_SM90, (
        f"{_describe(job, r)}: over the sm90 limit of {R.MAX_SHARED_SM90} B; "
        f"shrink the tile or num_stages in configs.py")


@pytest.mark.parametrize("job", JOBS, ids=[j.id for j in JOBS])
def test_no_register_spills(results, job):
    r = results[job.id]
    allowed = R.spill_budget(job)[0]
    assert R.spill_bytes(r) <= allowed, (
        f"{_describe(job, r)}: spills {R.spill_bytes(r)} B, budget {allowed} B; shrink the "
        f"tile in configs.py, or add a SPILL_BUDGET entry with the reason it is acceptable")


def test_spill_rules_are_justified():
    variants = {j.label for j in R.all_dispatch_configs()}
    for (variant, headdim), (allowed, reason) in R.SPILL_RULES.items():
        assert variant in variants and headdim in R.HEADDIMS, f"SPILL_RULES[{variant!r}, {headdim}]"
        assert isinstance(allowed, int) and allowed > 0
        assert isinstance(reason, str) and len(reason.strip()) >= 20


def test_budgets_by_triton_name_matrix_releases_and_checks():
    """tools/triton_budgets.py: one row per release of the support matrix (not 3.6, whose
    budgets are the ones beside each check), each naming known checks, decode forms by name."""
    from tools import decode_compile, triton_budgets
    from triflash.versions import matrix_releases
    assert set(triton_budgets.BY_TRITON) <= set(matrix_releases()) - {"3.6"}
    for release, by_check in triton_budgets.BY_TRITON.items():
        assert by_check and set(by_check) <= set(triton_budgets.CHECKS), release
        for form, allowed in by_check.get("decode", {}).items():
            assert form in decode_compile.FORMS and isinstance(allowed, int) and allowed > 16, (release, form)
    with pytest.raises(ValueError, match="check='bwd'"):
        triton_budgets.for_release("bwd")


def test_spill_budget_entries_are_justified():
    from tools import triton_budgets
    known = {j.id for j in R.all_dispatch_configs()}
    entries = list(R.SPILL_BUDGET.items())
    entries += [e for release in triton_budgets.BY_TRITON
                for e in triton_budgets.for_release("portable", release).items()]
    for job_id, entry in entries:
        assert job_id in known, f"SPILL_BUDGET[{job_id!r}] names no dispatch configuration"
        assert isinstance(entry, tuple) and len(entry) == 2, f"SPILL_BUDGET[{job_id!r}]: (bytes, reason)"
        allowed, reason = entry
        assert isinstance(allowed, int) and allowed > 0, f"SPILL_BUDGET[{job_id!r}] bytes: {allowed!r}"
        assert isinstance(reason, str) and len(reason.strip()) >= 20, \
            f"SPILL_BUDGET[{job_id!r}] needs a written reason"


def test_parse_ptxas_log():
    log = """ptxas info    : 11 bytes gmem
ptxas info    : Compiling entry function 'flash_fwd_kernel' for 'sm_90a'
ptxas info    : Function properties for flash_fwd_kernel
    8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 16 bytes smem, 8 bytes cumulative stack size
"""
    assert R.parse_ptxas_log(log) == dict(registers=255, spill_stores=4, spill_loads=12,
                                          stack=8, static_shared=16, wgmma_serialized=False)
    serialized = log.replace("ptxas info    : Compiling", (
        "ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions are "
        "serialized due to insufficient register resources for the function 'k'\nptxas info    : Compiling"))
    assert R.parse_ptxas_log(serialized)["wgmma_serialized"] is True
    with pytest.raises(ValueError):
        R.parse_ptxas_log("ptxas info    : 11 bytes gmem\n")


def test_every_dispatch_tile_is_enumerated():
    """The table covers every head-dim bucket of the sm90 tables and every kernel."""
    from triflash.kernels import configs
    jobs = R.all_dispatch_configs()
    assert {j.kernel for j in jobs} == set(R.KERNELS)
    fwd = {j.config for j in jobs if j.kernel == "flash_fwd_kernel"}
    bwd = {j.config for j in jobs if j.kernel != "flash_fwd_kernel"}
    assert set(configs.SM90_FWD.values()) <= fwd
    assert set(configs.SM90_BWD.values()) <= bwd
    assert len({j.id for j in jobs}) == len(jobs)


def test_every_launch_states_fp_fusion():
    """Each launch asks for FP fusion (``kernels.common.FP_FUSION``) instead of taking
    Triton's default: 3.9 warns on every first compile that leaves it unset, and 3.10 turns
    it off. The portable tier's forward and backward launches and every decode form."""
    from tools import decode_compile
    launches = []
    for direction, name in (("fwd", "plain"), ("fwd", "kvcache"), ("bwd", "plain")):
        _, calls = R._record_host_call(direction, None, 128, 128, "bf16", R.FEATURES[name])
        launches += [(fn, kwargs) for _, fn, _, kwargs in calls]
    for form in decode_compile.FORMS:
        launches += [(fn, kwargs) for fn, _, kwargs in decode_compile.launches(form)]
    assert len({fn for fn, _ in launches}) >= 5
    for fn, kwargs in launches:
        assert kwargs.get("enable_fp_fusion") is True, fn
