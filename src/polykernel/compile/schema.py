"""A ``torch.library`` schema from an op's ``reference`` signature: its parameters' types and
defaults, and its return types."""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Sequence
from typing import Any

import torch

from ..core.op import Op

_SCALARS: dict[Any, str] = {
    torch.Tensor: "Tensor",
    float: "float",
    int: "SymInt",  # SymInt, so an int argument Dynamo makes dynamic still fits
    bool: "bool",
    str: "str",
    torch.dtype: "ScalarType",
    torch.device: "Device",
}
_LISTS = (list, tuple, Sequence)


def _schema_type(tp: Any, where: str) -> str:
    """A Python annotation -> a schema type (``Tensor``, ``Tensor?``, ``float``, ``SymInt[]``...)."""
    if tp in _SCALARS:
        return _SCALARS[tp]
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            inner = _schema_type(rest[0], where)
            if not inner.endswith("?"):
                return inner + "?"
    if origin in _LISTS or (isinstance(origin, type) and issubclass(origin, Sequence)):
        elems = [a for a in args if a is not Ellipsis]
        if len(set(elems)) == 1:
            return _schema_type(elems[0], where) + "[]"
    raise TypeError(f"polykernel: {where}: annotation {tp!r} has no torch.library schema type")


def _return_types(tp: Any, where: str) -> list[str]:
    """The reference's return annotation -> schema return types (a list of ``Tensor`` usually)."""
    if tp is inspect.Signature.empty or tp is None:
        return ["Tensor"]
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is tuple and args and Ellipsis not in args:
        return [_schema_type(a, where) for a in args]
    return [_schema_type(tp, where)]


def _default(value: Any) -> str | None:
    """A schema default literal, or None when the value has none (the argument is then required)."""
    if value is None:
        return "None"
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value) if value == value and value not in (float("inf"), float("-inf")) else None
    if isinstance(value, str) and '"' not in value and "\\" not in value:
        return f'"{value}"'
    return None


class _Param(typing.NamedTuple):
    name: str
    type: str  # schema type
    default: str | None  # schema literal
    value: Any  # the Python default (inspect.Parameter.empty when none)


def _params(op: Op) -> tuple[list[_Param], list[str]]:
    """The impl's parameters (from the reference) and the return types, as schema pieces."""
    ref = op.reference
    sig = inspect.signature(ref)
    try:
        hints = typing.get_type_hints(ref)
    except Exception:  # unresolvable string annotations: fall back per parameter
        hints = {}
    params = []
    for p in sig.parameters.values():
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            raise TypeError(f"polykernel: {op.id}: reference parameter {p.name!r} must be positional (it is {p.kind.description})")
        if p.name in ("impl", "grad_outputs", "grad_mask") or p.name.startswith(("grad_output_", "saved_")):
            raise TypeError(f"polykernel: {op.id}: reference parameter name {p.name!r} is reserved")
        tp = hints.get(p.name)
        if tp is None:  # unannotated: the default's type, else a tensor
            tp = type(p.default) if p.default is not p.empty and p.default is not None else torch.Tensor
        default = _default(p.default) if p.default is not p.empty else None
        params.append(_Param(p.name, _schema_type(tp, f"{op.id} parameter {p.name!r}"), default, p.default))
    returns = _return_types(hints.get("return", inspect.Signature.empty), f"{op.id} return")
    return params, returns


def _schema(params: Sequence[_Param], returns: Sequence[str], *, with_defaults: bool, prefix: str = "", suffix: str = "") -> str:
    parts = [prefix] if prefix else []
    for p in params:
        parts.append(f"{p.type} {p.name}" + (f"={p.default}" if with_defaults and p.default is not None else ""))
    if suffix:
        parts.append(suffix)
    parts.append("*, str? impl=None")
    ret = returns[0] if len(returns) == 1 else f"({', '.join(returns)})"
    return f"({', '.join(parts)}) -> {ret}"
