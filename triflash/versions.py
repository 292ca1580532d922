"""The torch / Triton pairs triflash is tested with, and which Triton releases the Hopper
tier trusts at run time.

The Hopper tier is written in Gluon, Triton's experimental low-level dialect: its API and its
code generation (register allocation, hence spills and speed) change between Triton
releases, and torch pins the Triton it runs with, so a user's torch decides which Triton
runs triflash. A release is listed in ``VALIDATED_TRITON`` only after, under it, the whole
GPU suite passed on a Hopper card (H200, or the H100 when that is the card lent: the same sm_90a
code) at one commit and the benchmark's seed and 8k cases ran there (the files in
benchmarks/results name the version). On any other release the Hopper tier is not trusted:
dispatch warns once and runs the portable Triton kernels, unless the user insists with
``triflash.force_backend("hopper")`` or ``TRIFLASH_BACKEND=hopper``.

``MATRIX`` is the support matrix: CI runs the CPU suite (the interpreter and the sm_90a
compile checks, with the spill budgets measured on that release) under each pair.
"""
import warnings

import triton

# (torch, triton) pairs: CI installs each and runs the test suite on the CPU.
MATRIX = (
    ("2.11.0", "3.6.0"),  # the GPU machine's pair (torch 2.10 and 2.11 pin triton 3.6.0)
    ("2.12.1", "3.7.1"),  # torch 2.12 and 2.13 pin triton 3.7
    ("2.14.1", "3.8.0"),  # torch 2.14 pins triton 3.8.0
    ("2.15.0", "3.9.0"),  # the newest: what `pip install triflash` resolves (torch 2.15 pins 3.9.0)
)

# Triton releases (major.minor) the Hopper tier was GPU-tested and benchmarked under (the
# files in benchmarks/results name each run's triton).
VALIDATED_TRITON = ("3.6", "3.8", "3.9")


def triton_release(version: str = None) -> str:
    """'3.8' for '3.8.0' (or the running Triton's, '3.8.0+git1234' included)."""
    parts = (version or triton.__version__).split("+")[0].split(".")
    return ".".join(parts[:2])


def matrix_releases() -> tuple:
    """The Triton releases (major.minor) of the support matrix, in its order."""
    return tuple(triton_release(triton_version) for _, triton_version in MATRIX)


def validated_pairs() -> str:
    """'torch 2.11.0 / triton 3.6.0, torch 2.14.1 / triton 3.8.0': the matrix's pairs whose
    Triton the Hopper tier is validated on (what to pin)."""
    return ", ".join(f"torch {torch_version} / triton {triton_version}" for torch_version, triton_version in MATRIX
                     if triton_release(triton_version) in VALIDATED_TRITON)


def hopper_untrusted_reason(version: str = None) -> str:
    """'' when the Hopper tier is validated on this Triton release, else why not."""
    release = triton_release(version)
    if release in VALIDATED_TRITON:
        return ""
    return (f"triton {version or triton.__version__} is not one of the releases the Hopper tier "
            f"was validated on ({', '.join(VALIDATED_TRITON)})")


_warned = False


def warn_untrusted_once(reason: str) -> None:
    """One RuntimeWarning per process: the Hopper tier is off on this Triton."""
    global _warned
    if _warned:
        return
    _warned = True
    warnings.warn(f"triflash: {reason}: the Hopper (Gluon) kernels are off and the portable "
                  f"Triton kernels run instead (slower on H100/H200). Use a validated triton "
                  f"({validated_pairs()}), or "
                  f"run the Hopper tier anyway with triflash.force_backend('hopper') or "
                  f"TRIFLASH_BACKEND=hopper.", RuntimeWarning, stacklevel=4)
