"""Where the layers above the core plug into it: the core never imports them.

``polykernel.ops`` (the op catalog, above both) wires these when it is imported, and the registry
imports the catalog by name before any op runs (:func:`polykernel.core.registry.load_catalog`),
so an op defined outside the catalog (a user's, a test's toy op) finds them installed too.

- ``compiled_call(op) -> callable(impl, *args)``: the op's ``torch.library`` custom op, which a
  call under ``torch.compile`` runs instead of dispatching in Python (:mod:`polykernel.compile`);
- ``dtensor_route(op, key) -> route | None``: DTensor arguments run on their local shards
  (:mod:`polykernel.distributed`); ``dtensor_explain(op, key, args, kwargs, explain)``: the same
  for ``explain``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class Hooks:
    """The plug points (None until the catalog installs them)."""

    compiled_call: Callable[[Any], Callable[..., Any]] | None = None
    dtensor_route: Callable[[Any, tuple[Any, ...]], Any] | None = None
    dtensor_explain: Callable[..., tuple[Any, Any]] | None = None

    def install(self, **hooks: Callable[..., Any]) -> None:
        for name, fn in hooks.items():
            if not hasattr(Hooks, name):
                raise AttributeError(f"polykernel: no hook named {name!r}")
            setattr(self, name, fn)


hooks = Hooks()


def require(name: str) -> Callable[..., Any]:
    """The hook ``name``, installing the catalog's hooks first if they are not yet."""
    fn = getattr(hooks, name)
    if fn is None:
        from . import registry  # same layer: the catalog is imported by module name

        registry.load_catalog()
        fn = getattr(hooks, name)
    if fn is None:
        raise RuntimeError(f"polykernel: the {name} hook is not installed (is polykernel.ops importable?)")
    return fn
