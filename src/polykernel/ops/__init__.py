"""The op catalog: op id -> the module that defines it (imported on the op's first use).

Each op module is the single source of truth for its op: public function, argument validation,
torch reference, per-dtype tolerances, parity cases and its table of impls.

Importing this package also wires the core to the layers between it and the ops (the core never
imports them): compiled calls to :mod:`polykernel.compile`, DTensor calls to
:mod:`polykernel.distributed` (both imported lazily, on their first use).
"""

import pkgutil
import re

from .. import compile as _compile
from .. import distributed as _distributed
from ..core.hooks import hooks as _hooks

_hooks.install(compiled_call=_compile.custom_op_for, dtensor_route=_distributed.route, dtensor_explain=_distributed.explain_local)


def _op_modules() -> dict[str, str]:
    """Op id -> module, read from this package's op files without importing them (so that
    ``import polykernel`` and ``list_ops()`` stay torch-free): every public module here (no
    leading ``_``) is an op file, and its ``OP_ID = "family.name"`` line names its op. A new op
    file is in the catalog with no list to edit, as a backend's manifest is (backends/__init__.py)."""
    found: dict[str, str] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.ispkg or info.name.startswith("_"):
            continue
        name = f"{__name__}.{info.name}"
        spec = info.module_finder.find_spec(name)  # type: ignore[call-arg]  # finds, never imports
        text = spec.loader.get_source(name) if spec is not None and spec.loader is not None else None
        if text is None:
            raise ImportError(f"{name}: the op catalog reads op files' source, and found none")
        ids = _OP_ID.findall(text)
        if len(ids) != 1:  # a clear error at the catalog, not an op missing at its first use
            raise ImportError(f"{name}: an op file needs exactly one 'OP_ID = \"family.name\"' line, found {len(ids)}")
        if ids[0] in found:
            raise ImportError(f"op {ids[0]} is defined by both {found[ids[0]]} and {name}")
        found[ids[0]] = name
    return found


_OP_ID = re.compile(r'^OP_ID = "([A-Za-z_][\w]*\.[A-Za-z_]\w*)"', re.M)
OP_MODULES: dict[str, str] = _op_modules()
