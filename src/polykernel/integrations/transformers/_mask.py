"""``sdpa_is_causal``: the base model's causal mask under torch.compile."""

from __future__ import annotations

import functools
import inspect
import sys
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ._code import _CannotPatch, _namespace, _with_globals


# transformers lets SDPA apply causality itself (``is_causal=True``, no mask tensor) when nothing is
# padded, but only outside torch.compile: while tracing it cannot read the padding mask's values
# (5.17), and where it tries (5.24), a torch before pytorch#176499 (2.11, say) answers True to
# ``torch.compiler.is_exporting()`` under compile. So a compiled model builds a [B, 1, S, S] mask,
# SDPA leaves its GQA path (K and V repeated to every head) and cuDNN's flash backward runs with
# a bias: on the H200, issue 14's Llama spent 31-33 ms per step in attention compiled against
# 12.4 eager. Where the mask is decidable from shapes alone (no padding mask, plain causal, no
# sliding window, no static-cache offset), the patched model takes the eager route under compile.
def _no_mask_needed(kw: dict[str, Any], causal: Callable) -> bool:
    """transformers' own eager test for "SDPA's is_causal is this mask", on shapes only."""
    if kw.get("attention_mask") is not None or not kw.get("allow_is_causal_skip", True):
        return False
    if kw.get("mask_function", causal) is not causal or kw.get("local_size") is not None:
        return False
    q_offset = kw.get("q_offset", 0)
    q_length, kv_length = kw.get("q_length"), kw.get("kv_length")
    if isinstance(q_offset, torch.Tensor) or q_length is None or kv_length is None:
        return False
    return q_length == 1 or q_length == kv_length


def _sdpa_mask_function(sdpa_mask: Callable, causal: Callable) -> Callable:
    @functools.wraps(sdpa_mask)
    def sdpa_mask_is_causal(*args: Any, **kwargs: Any) -> Any:
        if not args and torch.compiler.is_compiling() and _no_mask_needed(kwargs, causal):
            return None
        return sdpa_mask(*args, **kwargs)

    return sdpa_mask_is_causal


_MASK_CREATORS: dict[tuple[int, bool], Callable] = {}  # (id(create_*_mask), drop_positions) -> copy


def _mask_creator(fn: Callable, drop_positions: bool) -> Callable:
    """A copy of a ``masking_utils.create_*mask`` function that builds SDPA masks as above.

    ``drop_positions``: the model built ``position_ids`` itself (``arange`` from the cache
    length), so they cannot describe packed sequences; transformers looks for packing in them
    anyway, and under compile, unable to read them, assumes it may be there and builds the mask.
    Not passing them on is exact then.
    """
    fn = getattr(fn, "_polykernel_orig", fn)
    made = _MASK_CREATORS.get((id(fn), drop_positions))
    if made is not None:
        return made
    masking = sys.modules[fn.__module__]
    masks = masking.AttentionMaskInterface()  # a local override: transformers' registry is untouched
    masks["sdpa"] = _sdpa_mask_function(masking.sdpa_mask, masking.causal_mask_function)
    copy = _with_globals(
        fn, masking.__dict__, _namespace(masking.__dict__, ALL_MASK_ATTENTION_FUNCTIONS=masks), ("ALL_MASK_ATTENTION_FUNCTIONS",)
    )
    if drop_positions:

        @functools.wraps(fn)
        def made(*args: Any, **kwargs: Any) -> Any:
            if "position_ids" in kwargs:
                kwargs["position_ids"] = None
            return copy(*args, **kwargs)

    else:
        made = copy
    made._polykernel_orig = fn  # type: ignore[attr-defined]
    _MASK_CREATORS[(id(fn), drop_positions)] = made
    return made


def _mask_creator_names(modeling: types.ModuleType) -> tuple[str, ...]:
    return tuple(
        name
        for name, value in vars(modeling).items()
        if name.startswith("create_")
        and name.endswith("mask")
        and getattr(getattr(value, "_polykernel_orig", value), "__module__", "") == "transformers.masking_utils"
    )


def _base_model_forward(base: Callable, modeling: types.ModuleType) -> Callable:
    """``<Family>Model.forward`` building its masks with :func:`_mask_creator`'s copies."""
    names = _mask_creator_names(modeling)
    if not names:
        raise _CannotPatch(f"{modeling.__name__} builds no mask through transformers.masking_utils")

    def copy(drop_positions: bool) -> Callable:
        creators = {n: _mask_creator(getattr(modeling, n), drop_positions) for n in names}
        return _with_globals(base, modeling.__dict__, _namespace(modeling.__dict__, **creators), names)

    with_positions, own_positions = copy(False), copy(True)
    params = list(inspect.signature(base).parameters)
    at = params.index("position_ids") - 1 if "position_ids" in params else None  # in *args (self excluded)

    @functools.wraps(base)
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("position_ids") is not None or (at is not None and len(args) > at and args[at] is not None):
            return with_positions(self, *args, **kwargs)
        return own_positions(self, *args, **kwargs)

    forward._polykernel = "sdpa_is_causal"  # type: ignore[attr-defined]
    return forward
