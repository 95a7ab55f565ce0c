"""Test set-up: Triton kernels run on the CPU through Triton's interpreter when there is no GPU.

GPU-only tests are marked ``gpu`` and skip without CUDA; ``-m gpu`` selects them on the H200.
"""

import os
import sys

import pytest

# Tests live in subfolders by area; their shared helpers (_scripts.py, _tuning_helpers.py, ...)
# stay here, importable from every folder.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

try:
    import torch

    _cuda = torch.cuda.is_available()
except ImportError:  # the torch-free spec tests still run
    _cuda = False

# Liger >= 0.8.5 autotunes its fused MoE kernels on first use (~170 Triton configs per shape: minutes
# on a GPU); the tests check its results, not its speed: its one default config per kernel (read by
# liger_kernel at import; a value set by whoever runs the tests wins)
os.environ.setdefault("LIGER_FUSED_MOE_AUTOTUNE", "0")

if not _cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # Import triton now, while TRITON_INTERPRET=1: a later first import (torch imports it from
    # e.g. use_deterministic_algorithms) under a test's TRITON_INTERPRET=0 would fix the mode.
    try:
        import triton  # noqa: F401
    except ImportError:
        pass

from polykernel.testing import polykernel_reset  # noqa: F401  (fixture)

pytest_plugins = ["_failures_now"]  # PK_FAILURES_NOW=1: each failure's message as it happens (make test-gpu)


@pytest.fixture(autouse=True)
def _seeded(request):
    """Every test draws from its own seed (from its id), so results do not depend on test order
    or on how pytest-xdist splits the tests; tests that seed explicitly still do."""
    import random
    import zlib

    seed = zlib.crc32(request.node.nodeid.encode())
    random.seed(seed)
    try:
        import torch

        torch.manual_seed(seed)
    except ImportError:  # the torch-free spec tests
        pass
    yield


@pytest.fixture(autouse=True)
def _clean_dispatch(polykernel_reset, monkeypatch):  # noqa: F811 - uses the imported fixture
    for name in list(os.environ):
        if name.startswith("POLYKERNEL_IMPL") or name == "POLYKERNEL_STRICT":
            monkeypatch.delenv(name)
    yield


def pytest_collection_modifyitems(config, items):
    if _cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
