"""Instance patching: a module's own forward installed and restored, and what polykernel runs in
a module (its family and role, its patched forward's kind)."""

from __future__ import annotations

import sys
import types
from collections.abc import Callable

from torch import nn

from ._code import _CannotPatch
from ._families import _FAMILY_BY_MODULE, _config_left_alone, _Family
from ._layers import _GATED_MLP, _gated_activation, _mlp_layout, _mlp_supported
from ._merged import merge, mergeable, unmerged
from ._switches import _gated_ops

_SAVED = "_polykernel_saved"  # module.__dict__ entry: (slot, previous value or None, the forward's maker)
_REDUCE = "__reduce_ex__"  # module.__dict__ entry: how copy and pickle copy a patched module (see _reduce)


def _classify(module: nn.Module) -> tuple[_Family, str, type] | None:
    """The family, role and family class of ``module`` (a subclass that overrides forward: None)."""
    for cls in type(module).__mro__:
        family = _FAMILY_BY_MODULE.get(cls.__module__)
        if family is None:
            continue
        role = family.role(cls.__name__)
        if role is None:
            return None
        if type(module).forward is not cls.forward:
            return None
        return family, role, cls
    return None


def _install(module: nn.Module, make_forward: Callable[[Callable], Callable]) -> None:
    """Give ``module`` its own forward, built from the one it runs now. ``make_forward``: a
    ``functools.partial`` of a module-level function on picklable arguments, kept to make the
    forward again on a copy of the module (:func:`_reduce`).

    accelerate's hooks keep the real forward in ``_old_forward`` (and a wrapper in ``forward``):
    that is the slot to swap then, so the hook keeps working.
    """
    d = module.__dict__
    slot = "_old_forward" if ("_old_forward" in d and "forward" in d) else "forward"
    prev = d.get(slot)
    if prev is None:
        base = type(module).forward
    elif isinstance(prev, types.MethodType) and prev.__self__ is module:
        base = prev.__func__
    else:
        raise _CannotPatch(f"its {slot} was replaced by {prev!r}")
    d[slot] = types.MethodType(make_forward(base), module)
    d[_SAVED] = (slot, prev, make_forward)
    cls = type(module)
    if cls.__reduce_ex__ is object.__reduce_ex__ and cls.__reduce__ is object.__reduce__:  # (a class's own: left to it)
        d[_REDUCE] = types.MethodType(_reduce, module)


def _reduce(module: nn.Module, protocol: int) -> tuple:
    """A patched module for ``copy.deepcopy``, ``copy.copy``, ``pickle`` and ``torch.save`` (they
    look ``__reduce_ex__`` up on the instance): its state as it was before the patch, and the patch
    made again on the copy from its maker, whose arguments (a model's residual stream, an MLP's
    activation) are copied with the module. The bound forward itself would come back from pickle
    as ``getattr(copy, "forward")``, the class's (unpatched, with our bookkeeping still there),
    and from deepcopy bound to the copy but with the original's closure. The merged inference
    weights are not copied: the copy merges its own."""
    state = type(module).__getstate__(module)  # nn.Module's: a copy of __dict__
    state.pop(_REDUCE, None)
    _, prev, make = state.pop(_SAVED)
    slot = _installed_slot(module)
    if slot is None:  # replaced since: copied as it is, not patched again
        make = None
    else:
        _restore(state, slot, prev, module)
    merged = unmerged(state)
    return _copied, (type(module),), (state, make, merged)


def _copied(cls: type) -> nn.Module:
    """The new module of a copy, which :func:`_reduce`'s state patches once it has its own."""
    module = cls.__new__(cls)
    module.__dict__["__setstate__"] = types.MethodType(_set_copied_state, module)  # pickle and copy look it up on the instance
    return module


def _set_copied_state(module: nn.Module, state: tuple) -> None:
    d, make, merged = state
    del module.__dict__["__setstate__"]
    type(module).__setstate__(module, d)
    if make is None:
        return
    for group in merged:
        if mergeable(module, group) is None:
            merge(module, group)
    _install(module, make)


def _restore(d: dict, slot: str, prev: object, module: nn.Module) -> None:
    """Put back into ``d`` (``module.__dict__`` or a copy of it) what ``slot`` held before the patch."""
    if prev is not None:
        d[slot] = prev
    elif slot == "forward":
        d.pop(slot)
    else:  # a hook's wrapper calls `_old_forward`: the class's forward, as it would have saved it
        d[slot] = types.MethodType(type(module).forward, module)


def _installed_slot(module: nn.Module) -> str | None:
    """Where the forward :func:`_install` gave ``module`` is now: accelerate's ``add_hook_to_module``
    after the patch moves it into ``_old_forward`` (its wrapper in ``forward``), and
    ``remove_hook_from_module`` moves it back into ``forward``; None where it was replaced."""
    d = module.__dict__
    for slot in ("forward", "_old_forward"):
        fn = d.get(slot)
        if isinstance(fn, types.MethodType) and fn.__self__ is module and hasattr(fn.__func__, "_polykernel"):
            return slot
    return None


def _uninstall(module: nn.Module) -> None:
    module.__dict__.pop(_REDUCE, None)
    saved = module.__dict__.pop(_SAVED, None)
    if saved is None:
        return
    slot = _installed_slot(module)
    if slot is None:  # replaced since (not ours to restore over)
        return
    _restore(module.__dict__, slot, saved[1], module)


def _installed_forward(module: nn.Module) -> Callable | None:
    """The function of the forward :func:`_install` gave ``module`` (None where it was replaced)."""
    slot = _installed_slot(module)
    return module.__dict__[slot].__func__ if slot is not None else None


def _kind(module: nn.Module) -> str | None:
    """What polykernel runs in ``module``: its own patched forward's kind, else (``patch("<model
    type>")``) its patched class's; a gated MLP's is its activation's op (swiglu or geglu)."""
    if _SAVED in module.__dict__:
        kind = getattr(_installed_forward(module), "_polykernel", None)
    else:
        kind = _class_kind(module)
    if kind == _GATED_MLP:  # one forward for both: the module's activation says which op runs
        layout = _mlp_layout(module)
        gated = _gated_activation(layout[1]) if layout is not None and _mlp_supported(module) is None else None
        return gated[0] if gated is not None and gated[0] in _gated_ops() else None
    return kind


def _kinds(module: nn.Module) -> tuple[str, ...]:
    """Every kind polykernel runs in ``module``: :func:`_kind`'s, then a patched attention's second
    (``attention_sinks`` beside ``rope``)."""
    kind = _kind(module)
    if kind is None:
        return ()
    if _SAVED in module.__dict__:
        return (kind, *getattr(_installed_forward(module), "_polykernel_also", ()))
    found = _classify(module)  # patched by model type: the modeling module's eager attention
    if kind == "rope" and found is not None and found[1] == "attention" and _sinks_swapped(found[0]):
        return (kind, "attention_sinks")
    return (kind,)


def _sinks_swapped(family: _Family) -> bool:
    """Whether ``patch("<model type>")`` swapped the family's eager attention with sinks."""
    modeling = sys.modules.get(family.module)
    return family.attention_sinks and getattr(getattr(modeling, "eager_attention_forward", None), "_polykernel", None) == "attention_sinks"


def _class_kind(module: nn.Module) -> str | None:
    """The kind of a module whose family's classes ``patch("<model type>")`` patched: its class's
    forward's, or for an attention layer that calls the rotary function, ``rope`` where that
    function is patched (the class-level RoPE swap changes the modeling module, not the class)."""
    found = _classify(module)
    if found is None:
        return None
    family, role, cls = found
    if role != "attention":
        return getattr(cls.forward, "_polykernel", None)
    modeling = sys.modules.get(family.module)
    rope = any(getattr(getattr(modeling, name, None), "_polykernel", None) == "rope" for name, _ in family.rope)
    config = getattr(module, "config", None)
    if not rope or not _calls_rope(module) or (config is not None and "rope" in _config_left_alone(family, config)):
        return "attention_sinks" if _sinks_swapped(family) else None
    return "rope"


_LEFT_ALONE = "_polykernel_left_alone"  # the patched model's __dict__ entry: kind -> why


def _calls_rope(attention: nn.Module) -> bool:
    """False for NoPE layers, whose forward calls no rotary function: SmolLM3's ``use_rope``
    layers and a hybrid EXAONE 4's global (non-sliding) layers."""
    if not getattr(attention, "use_rope", True):
        return False
    return getattr(attention, "sliding_window", None) is None or getattr(attention, "is_sliding", True)


def _unpatch_model(model: nn.Module) -> nn.Module:
    """Every module of ``model`` back on the forward it had before :func:`_install`."""
    for module in model.modules():
        module.__dict__.pop(_LEFT_ALONE, None)  # (a model patched before it was wrapped keeps it)
        unmerged(module.__dict__)  # mode="inference"'s merged weights (the parameters still view them)
        _uninstall(module)
    return model
