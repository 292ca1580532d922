"""Test setup shared by every test file.

Without CUDA the suite runs the same public API and the same Triton kernels on CPU tensors
through Triton's interpreter; TRITON_INTERPRET must be set before triflash is imported.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
else:  # every repeat launch of a Hopper kernel checked against Triton's own specialization
    os.environ.setdefault("TRIFLASH_VERIFY_LAUNCHES", "1")

import pytest  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def pytest_configure(config):
    config.addinivalue_line("markers", "sm90: compiles kernels for sm_90a (CPU-only, no GPU needed)")
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU")
    config.addinivalue_line("markers", "option: a kernel configuration other than the dispatched one (a "
                            "tile option flipped or forced, a probe): run where options are measured "
                            "(scripts/variants_run.sh) and in the GPU command's options part "
                            "(scripts/gpu_run.sh TEST_MARK=option), not in its default suite")


def shard_range(spec):
    """(first, last, n) of ``TRIFLASH_TEST_SHARD``: "i/n" or "i-j/n", 1 <= i <= j <= n."""
    try:
        shards, n = spec.split("/")
        first, dash, last = shards.partition("-")
        first, n = int(first), int(n)
        last = int(last) if dash else first
        if not 1 <= first <= last <= n:
            raise ValueError
    except ValueError:
        raise pytest.UsageError(f"TRIFLASH_TEST_SHARD={spec!r}: expected i/n or i-j/n with 1 <= i <= j <= n") from None
    return first, last, n


def shard_of(nodeid, n):
    """The shard (1 .. n) of a test: a hash of its node id."""
    import zlib
    return zlib.crc32(nodeid.encode()) % n + 1


def pytest_collection_modifyitems(config, items):
    """``TRIFLASH_TEST_SHARD=i/n`` (1 <= i <= n): keep the i-th of n shards, each test's shard
    fixed by a hash of its id, so that n calls (a device call's time limit) run the suite
    once between them (scripts/gpu_run.sh SHARD=i/n); ``i-j/n``: shards i to j in one run
    (one process pool for many small shards, e.g. of FA3's whole KV-cache grid).
    ``TRIFLASH_TEST_IDS=path``: keep only the tests whose node ids the file lists, one per
    line (e.g. those a stopped call did not reach; scripts/gpu_run.sh TEST_IDS=path)."""
    ids_path = os.environ.get("TRIFLASH_TEST_IDS", "")
    if ids_path:
        with open(ids_path) as f:
            wanted = {line.strip() for line in f if line.strip() and not line.startswith("#")}
        drop = [item for item in items if item.nodeid not in wanted]
        if drop:
            config.hook.pytest_deselected(items=drop)
        items[:] = [item for item in items if item.nodeid in wanted]
    spec = os.environ.get("TRIFLASH_TEST_SHARD", "")
    if not spec:
        return
    first, last, n = shard_range(spec)
    keep, drop = [], []
    for item in items:
        (keep if first <= shard_of(item.nodeid, n) <= last else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
    items[:] = keep


def selected_params(request, argname, values):
    """The ``values`` of parameter ``argname`` that this session runs the requesting test
    function with (after -k, -m, TRIFLASH_TEST_IDS, ...): for tests whose cases run together
    in one spawned group of processes, so that a selection spawns only for what it runs."""
    chosen = {item.callspec.params.get(argname) for item in request.session.items
              if getattr(item, "originalname", None) == request.node.originalname and hasattr(item, "callspec")}
    return [v for v in values if v in chosen] or list(values)


def shared_results_dir(tmp_path_factory, key, names, produce):
    """A directory that holds what ``produce(directory, missing_names)`` writes for every
    name in ``names``, made once per test session: pytest-xdist workers (the suite's -n)
    share it under a file lock, so that one worker spawns the group of processes for a set
    of cases and the others wait for its files instead of spawning the same group again.
    ``produce`` runs for the names no earlier call has produced."""
    import fcntl
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the session's, common to its workers
    directory = root / key
    directory.mkdir(exist_ok=True)
    with open(root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        missing = [n for n in names if not (directory / f"{n}.done").exists()]
        if missing:
            produce(str(directory), missing)
            for n in missing:
                (directory / f"{n}.done").touch()
    return str(directory)


@pytest.fixture(autouse=True)
def _poison_outputs():
    """Every kernel output starts as NaN, so an element a kernel forgets to write fails."""
    from triflash.kernels import problem
    problem.POISON = True
    yield
    problem.POISON = False


def sm90_compile_in_subprocess(code):
    """Run ``code`` (a script that compiles launches for sm_90a and prints one JSON line last)
    in a Python of its own without the interpreter, from the repo root; skip where the sm_90a
    toolchain is missing. Returns the JSON line's value."""
    import json
    import subprocess
    import sys
    R = pytest.importorskip("tools.sm90_report")
    problem = R.toolchain_problem()
    if problem:
        pytest.skip(f"sm_90a toolchain unavailable: {problem}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])
