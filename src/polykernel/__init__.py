"""polykernel: LLM kernels with several implementations each, and one dispatcher that picks,
per call and per device, the fastest one that is correct and runnable there.

    >>> import torch, polykernel
    >>> y = polykernel.rms_norm(torch.randn(4, 8), torch.ones(8))
    >>> print(polykernel.explain("rms_norm", device="cpu"))  # doctest: +SKIP

Public names load lazily (PEP 562), so ``import polykernel`` does not import torch, and
``polykernel.spec`` works where torch is missing.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

__version__ = "0.1.0"

# public name -> "module:attr" (module relative to this package)
_LAZY: dict[str, str] = {
    # metadata (torch-free)
    "KernelBackend": "spec:KernelBackend",
    "DeviceType": "spec:DeviceType",
    "PlatformInfo": "spec:PlatformInfo",
    "CapabilityRequirement": "spec:CapabilityRequirement",
    "capabilities_satisfied": "spec:capabilities_satisfied",
    "FormatSignature": "spec:FormatSignature",
    "KernelSpec": "spec:KernelSpec",
    # errors
    "PolykernelError": "errors:PolykernelError",
    "ImplNotAvailableError": "errors:ImplNotAvailableError",
    "UnknownOpError": "errors:UnknownOpError",
    "OpArgumentError": "errors:OpArgumentError",
    "OpTypeError": "errors:OpTypeError",
    "ImplVerificationError": "errors:ImplVerificationError",
    # registry and dispatcher
    "register_impl": "core.registry:register_impl",
    "declare_op_locations": "core.registry:declare_op_locations",
    "use_impl": "core.selection:use_impl",
    "set_impl": "core.selection:set_impl",
    "available_impls": "core.selection:available_impls",
    "explain": "core.selection:explain",
    "clear_caches": "core.selection:clear_caches",
    "decisions": "core.selection:decisions",
    "sync_decisions": "tuning:sync_decisions",
    "list_ops": "core.registry:all_op_ids",
    # The ops' public functions (polykernel.rms_norm, ...) are not listed here: each op file's
    # function named after its op, found through the catalog (_op_function), so that a new op file
    # needs no edit here.
}
_SUBMODULES = (
    "spec",
    "errors",
    "nn",
    "testing",
    "integrations",
    "core",
    "tuning",
    "compile",
    "distributed",
    "ops",
    "backends",
    "tools",
)
# Names of modules before the packages by layer (issue 26): still reachable as attributes.
_MOVED = {
    "dispatch": "core.selection",
    "registry": "core.registry",
    "library": "compile.library",
    "models": "tools.models",
    "demo": "tools.demo",
    "cli": "tools.cli",
    "bench": "tools.bench",
}


def _op_function(name: str) -> str | None:
    """``"ops.rms_norm:rms_norm"`` for an op's public name: the function named after the op in its
    op file. The catalog (polykernel.ops.OP_MODULES) is read from the op files' text, torch-free."""
    from .core.registry import load_catalog  # the catalog found by name, as the registry finds it

    for op_id, module in load_catalog().items():
        if op_id.rpartition(".")[2] == name:
            return f"{module.removeprefix(__name__ + '.')}:{name}"
    return None


def _public_names() -> list[str]:
    from .core.registry import load_catalog

    return sorted({*_LAZY, *(op_id.rpartition(".")[2] for op_id in load_catalog()), *_SUBMODULES, "__version__"})


def __getattr__(name: str) -> Any:
    if name == "__all__":  # computed on first use: it lists the catalog's ops
        value = globals()["__all__"] = _public_names()
        return value
    if name in _SUBMODULES or name in _MOVED:  # first: importing the catalog asks for some of them
        return importlib.import_module(f".{_MOVED.get(name, name)}", __name__)
    target = _LAZY.get(name)
    # A submodule (``from . import env`` asks here first) is for the import system to load, and
    # may be asked for while the catalog's own modules are importing: never the catalog.
    if target is None and not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is None:
        target = _op_function(name)
    if target is not None:
        module_name, _, attr = target.partition(":")
        value = getattr(importlib.import_module(f".{module_name}", __name__), attr)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'polykernel' has no attribute {name!r}")


def __dir__() -> list[str]:
    return globals().get("__all__") or __getattr__("__all__")
