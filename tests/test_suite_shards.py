"""TRIFLASH_TEST_SHARD=i/n (tests/conftest.py): n shards run every test once between them;
i-j/n runs shards i to j."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _collect(**set_vars):
    """``pytest --collect-only`` of tests/test_validation.py in a subprocess whose
    environment lacks the suite's own selection (a run under SHARD= or TEST_IDS=,
    scripts/gpu_run.sh, must not narrow what it collects), plus ``set_vars``: (exit code,
    the node ids, the output)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRIFLASH_TEST_SHARD", "TRIFLASH_TEST_IDS")}
    env.update(set_vars)
    p = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                        "tests/test_validation.py"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    return p.returncode, {line for line in p.stdout.splitlines() if "::" in line}, p.stdout + p.stderr


def test_shards_partition_the_suite():
    rc, every, out = _collect()
    assert rc == 0 and len(every) > 10, out
    parts = []
    for i in (1, 2, 3):
        rc, ids, out = _collect(TRIFLASH_TEST_SHARD=f"{i}/3")
        assert rc == 0, out
        parts.append(ids)
    assert set().union(*parts) == every
    assert sum(map(len, parts)) == len(every) and all(parts)


def test_shard_range_is_the_union_of_its_shards():
    rc, every, out = _collect()
    assert rc == 0 and len(every) > 10, out
    parts = [_collect(TRIFLASH_TEST_SHARD=f"{i}/4")[1] for i in (1, 2, 3, 4)]
    rc, ids, out = _collect(TRIFLASH_TEST_SHARD="2-3/4")
    assert rc == 0, out
    assert ids == parts[1] | parts[2] and ids and ids != every
    assert _collect(TRIFLASH_TEST_SHARD="1-4/4")[1] == every


@pytest.mark.parametrize("bad", ["0/2", "3/2", "x", "2-1/3", "1-4/3", "1-/3"])
def test_bad_shard_is_refused(bad):
    rc, _, out = _collect(TRIFLASH_TEST_SHARD=bad)
    assert rc != 0 and "TRIFLASH_TEST_SHARD" in out


def test_test_ids_file_keeps_only_its_tests(tmp_path):
    """TRIFLASH_TEST_IDS=path keeps exactly the node ids the file lists (comments skipped)."""
    rc, every, out = _collect()
    assert rc == 0 and len(every) > 10, out
    chosen = sorted(every)[:3]
    ids = tmp_path / "ids.txt"
    ids.write_text("# a stopped call's remainder\n" + "\n".join(chosen) + "\ntests/test_validation.py::not_a_test\n")
    rc, kept, out = _collect(TRIFLASH_TEST_IDS=str(ids))
    assert rc == 0, out
    assert kept == set(chosen)
