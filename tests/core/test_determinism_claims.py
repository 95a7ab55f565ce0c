"""Impls registered ``deterministic=True`` must not reduce with float atomics.

On the CPU interpreter programs run one after another, so a run-twice test cannot catch an
atomic reduction there; this structural check can: it reads each such impl's module source
(found, not imported: CuTeDSL and cuTile kernel modules import their DSL at load, which CI lacks).
"""

import importlib.util
import re
from pathlib import Path

import pytest

import polykernel
from polykernel.core import registry
from polykernel.ops import OP_MODULES


@pytest.mark.parametrize("op", sorted(OP_MODULES))
def test_deterministic_impls_use_no_atomics(op):
    for name, spec in registry.specs_for(op).items():
        if not spec.deterministic or spec.backend.value not in ("triton", "cute_dsl", "cutile"):
            continue
        path = Path(importlib.util.find_spec(spec.target.partition(":")[0]).origin)
        source = path.read_text()
        # A kernel module may import helpers from siblings: check those too.
        for sibling in re.findall(r"^from \.(\w+) import", source, flags=re.M):
            source += (path.parent / f"{sibling}.py").read_text()
        assert not ATOMIC.search(source), f"{op} [{name}] claims deterministic=True but uses atomics"


# Triton's tl.atomic_add, CuTeDSL's cute.arch.atomic_add / atomic_fadd, cuTile's ct.atomic_add, ...
# An atomic max or min is exact and order-independent (the serving per-tensor fp8 scale), so it
# does not count.
ATOMIC = re.compile(r"\batomic(?!_?(?:max|min)\()_?\w*\(")


def test_the_check_sees_atomics():
    for call in ("tl.atomic_add(ptr, v)", "cute.arch.atomic_add(p, v)", "ct.atomic_add(arr, i, v)", "tl.atomic_cas(p, a, b)"):
        assert ATOMIC.search(call)
    assert not ATOMIC.search("no atomics anywhere, so the result is deterministic")
    assert not ATOMIC.search("tl.atomic_max(S_BITS, bits)") and not ATOMIC.search("tl.atomic_min(p, v)")
    assert polykernel.available_impls("rms_norm", device="cpu")
