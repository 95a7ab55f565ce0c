"""Load a script from ``benchmarks/`` as a module, for tests of its pure parts."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str) -> types.ModuleType:
    """``benchmarks/<name>.py`` imported as the module ``name`` (registered in sys.modules, so
    its own pickling and dataclasses resolve)."""
    (path,) = BENCHMARKS.glob(f"*/{name}.py")  # benchmarks/<area>/<name>.py
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
