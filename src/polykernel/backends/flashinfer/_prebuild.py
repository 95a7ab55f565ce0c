"""Building FlashInfer's JIT modules that our adapters call, all at once, before the first call.

FlashInfer compiles each kernel module with nvcc on its first call and caches it on disk. Called
one op after another (a test file, a sweep, a server's warm-up), the modules build one at a time:
on a fresh H200 machine the serving GPU tests spent their whole 240 s on it, and passed in 80 s
once the modules were there (h200-2026-12-04-sixth/serving-native/serving-tests*.log). FlashInfer's
``build_jit_specs`` builds several modules in one ninja run, in parallel (``MAX_JOBS``)::

    python -m polykernel.backends.flashinfer._prebuild

once per machine (FlashInfer's cache: ``FLASHINFER_WORKSPACE_BASE``), before serving or testing.
"""

from __future__ import annotations

import importlib
import sys
import time
from typing import Any

# (FlashInfer module, spec generator, its arguments): the JIT modules behind our adapters
# (silu_and_mul.py, gelu_and_mul.py: erf (its tanh form is refused); rms_norm.py, fused_add_rms_norm_.py and
# rms_norm_quant_fp8.py: the norm module, the CUDA form FlashInfer takes without nvidia-cutlass-dsl;
# rotary_embedding_.py: rope)
MODULES: tuple[tuple[str, str, tuple[Any, ...]], ...] = (
    ("flashinfer.jit.activation", "gen_act_and_mul_module", ("silu",)),
    ("flashinfer.jit.activation", "gen_act_and_mul_module", ("gelu",)),
    ("flashinfer.jit.norm", "gen_norm_module", ()),
    ("flashinfer.jit.rope", "gen_rope_module", ()),
)


def specs() -> list[Any]:
    """FlashInfer's JitSpec of each module in MODULES (imports flashinfer)."""
    return [getattr(importlib.import_module(mod), gen)(*args) for mod, gen, args in MODULES]


def build() -> list[str]:
    """Build every module not yet in FlashInfer's cache, in one parallel ninja run; their names."""
    from flashinfer.jit.core import build_jit_specs

    todo = specs()
    build_jit_specs(todo)
    return [str(getattr(s, "name", s)) for s in todo]


def main() -> int:
    start = time.perf_counter()
    try:
        importlib.import_module("flashinfer.jit.core")
    except Exception as exc:  # not installed, or its import raises (the backend is unavailable then too)
        print(f"flashinfer: not importable ({type(exc).__name__}: {exc}); nothing built")
        return 0
    names = build()  # a failed build raises: its compiler output says why
    print(f"flashinfer: {len(names)} JIT modules ready ({', '.join(names)}) in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
