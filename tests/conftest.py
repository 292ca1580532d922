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


@pytest.fixture(autouse=True)
def _poison_outputs():
    """Every kernel output starts as NaN, so an element a kernel forgets to write fails."""
    from triflash.kernels import portable
    portable.POISON = True
    yield
    portable.POISON = False
