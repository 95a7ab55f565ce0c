"""Hugging Face ``transformers`` integration: run a model's norms, MLP activations, RoPE and loss
on polykernel's ops, in place, with the same results.

    >>> from transformers import AutoModelForCausalLM                       # doctest: +SKIP
    >>> from polykernel.integrations.transformers import patch, unpatch, patched
    >>> model = AutoModelForCausalLM.from_pretrained("meta-llama/Llama-3.2-1B")  # doctest: +SKIP
    >>> patch(model)                     # this model only                  # doctest: +SKIP
    >>> patch("llama")                   # the classes: models built from now on too  # doctest: +SKIP
    >>> patched(model)                   # {"rms_norm": [...], "swiglu": [...], ...}  # doctest: +SKIP
    >>> unpatch(model)                                                      # doctest: +SKIP

What is swapped (families: Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma2, Olmo2):

- ``rms_norm``: ``<Family>RMSNorm.forward`` -> :func:`polykernel.rms_norm`; Llama-style norms
  (``weight * x̂.to(dtype)``) use ``casting="llama"``, Gemma's ``(x̂ · (1 + w)).to(dtype)`` uses
  ``offset=1.0, casting="fp32"``, Olmo2's ``(w · x̂).to(dtype)`` ``casting="fp32"``. Qwen3's
  and Olmo2's ``q_norm``/``k_norm`` are RMSNorms too.
- ``swiglu``: ``<Family>MLP.forward`` -> ``down(swiglu(gate(x), up(x)))`` when the MLP's
  activation is SiLU, ``down(geglu(gate(x), up(x), approximate))`` when it is GELU (tanh or
  exact); any other activation is left alone (and logged).
- ``rope``: the ``apply_rotary_pos_emb`` that ``<Family>Attention.forward`` calls ->
  :func:`polykernel.rope` (cases it does not cover — ``unsqueeze_dim != 1``, partial rotary
  dims, mixed dtypes — go to the original function).
- ``cross_entropy``: the causal-LM loss when logits are computed (eval with labels, or
  ``fused_linear_cross_entropy=False``) -> :func:`polykernel.cross_entropy`, with
  ``ForCausalLMLoss``'s shift, ``ignore_index`` and ``num_items_in_batch`` semantics.
- ``fused_linear_cross_entropy``: ``<Family>ForCausalLM.forward`` in training mode with
  ``labels`` -> hidden states from the base model, then
  :func:`polykernel.fused_linear_cross_entropy` with ``lm_head``'s weight (tied or not): the
  ``[tokens, vocab]`` logits are never materialized and ``output.logits`` is ``None``.
  Without labels, in eval mode, with ``logits_to_keep != 0``, a custom ``loss_function``, final
  logit soft-capping or scaling, or an ``lm_head`` that is not a plain ``nn.Linear`` (quantized,
  hooked, offloaded, sharded), the model's own forward runs.
- ``sdpa_is_causal`` (no op of ours): ``<Family>Model.forward`` builds its attention masks so
  that, under ``torch.compile``, SDPA gets ``is_causal=True`` and no mask wherever transformers
  itself skips the mask outside compile (nothing padded, plain causal, positions the model made
  itself or a cache). transformers materializes a ``[B, 1, S, S]`` mask there instead (5.17
  always; 5.24 with a torch before pytorch#176499, such as 2.11), which takes SDPA off its
  flash/GQA path.

How: an already-built model is patched per module instance (each patched module gets its own
``forward``; other models of the same class are untouched); RoPE is swapped by giving the patched
attention modules a copy of their ``forward`` whose globals see polykernel's
``apply_rotary_pos_emb`` (the modeling module itself is not changed). ``patch("<model_type>")``
instead swaps the class ``forward`` methods and the modeling module's ``apply_rotary_pos_emb``.
Calling ``patch`` again re-applies it with the new switches (idempotent); ``unpatch`` restores
the originals. A switch whose polykernel op is not in this build is skipped with a warning.

Only this module imports ``transformers`` (an optional extra).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import logging
import sys
import types
from collections.abc import Callable
from typing import Any

import torch
import transformers  # noqa: F401  (the optional extra: fail here, with its own ImportError)
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

try:
    from transformers.loss.loss_utils import LOSS_MAPPING
except ImportError:  # transformers too old to route losses: its CausalLMs use plain cross-entropy
    LOSS_MAPPING = None

import polykernel as _pk
from polykernel import _compat

__all__ = ["SUPPORTED_MODEL_TYPES", "patch", "patched", "unpatch"]

logger = logging.getLogger(__name__)

# switch -> the polykernel public ops it needs (the MLP switch covers both gated activations)
_SWITCH_OPS = {
    "rms_norm": ("rms_norm",),
    "swiglu": ("swiglu", "geglu"),
    "rope": ("rope",),
    "cross_entropy": ("cross_entropy",),
    "fused_linear_cross_entropy": ("fused_linear_cross_entropy",),
    "sdpa_is_causal": (),  # no polykernel op: how transformers hands the causal mask to SDPA
}


# -- the supported families --------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Norm:
    """How a family's RMSNorm rounds: polykernel.rms_norm's ``offset``/``casting`` and the eps attribute."""

    offset: float
    casting: str
    eps_attr: str


_LLAMA_NORM = _Norm(offset=0.0, casting="llama", eps_attr="variance_epsilon")  # weight * x̂.to(dtype)
_GEMMA_NORM = _Norm(offset=1.0, casting="fp32", eps_attr="eps")  # (x̂ * (1 + w.float())).type_as(x)
_OLMO2_NORM = _Norm(offset=0.0, casting="fp32", eps_attr="variance_epsilon")  # (weight * x̂).to(dtype)


@dataclasses.dataclass(frozen=True)
class _Family:
    model_type: str  # config.model_type
    prefix: str  # class-name prefix in the modeling module
    norm: _Norm

    @property
    def module(self) -> str:
        return f"transformers.models.{self.model_type}.modeling_{self.model_type}"

    def role(self, class_name: str) -> str | None:
        return {
            f"{self.prefix}RMSNorm": "rms_norm",
            f"{self.prefix}MLP": "mlp",
            f"{self.prefix}Attention": "attention",
            f"{self.prefix}ForCausalLM": "causal_lm",
            f"{self.prefix}Model": "base_model",
        }.get(class_name)


_FAMILIES: dict[str, _Family] = {
    f.model_type: f
    for f in (
        _Family("llama", "Llama", _LLAMA_NORM),
        _Family("mistral", "Mistral", _LLAMA_NORM),
        _Family("qwen2", "Qwen2", _LLAMA_NORM),
        _Family("qwen3", "Qwen3", _LLAMA_NORM),
        _Family("gemma", "Gemma", _GEMMA_NORM),
        _Family("gemma2", "Gemma2", _GEMMA_NORM),  # final logit soft-capping: the fused loss steps aside
        _Family("olmo2", "Olmo2", _OLMO2_NORM),
    )
}
_FAMILY_BY_MODULE = {f.module: f for f in _FAMILIES.values()}
SUPPORTED_MODEL_TYPES = tuple(_FAMILIES)


# -- op availability (ops land independently; a missing one skips its switch) ------------------
@functools.cache
def _has_op(name: str) -> bool:
    try:
        getattr(_pk, name)
    except (ImportError, AttributeError):
        return False
    return True


def _missing_ops(switch: str) -> tuple[str, ...]:
    return tuple(name for name in _SWITCH_OPS[switch] if not _has_op(name))


def _gated_ops() -> frozenset[str]:
    return frozenset(n for n in _SWITCH_OPS["swiglu"] if _has_op(n))


def _enabled(switches: dict[str, bool]) -> dict[str, bool]:
    out = {}
    for name, on in switches.items():
        missing = _missing_ops(name) if on else ()
        if on and missing and len(missing) == len(_SWITCH_OPS[name]):
            logger.warning("polykernel: %s is not available in this build; %s= is skipped", ", ".join(missing), name)
            on = False
        out[name] = bool(on)
    return out


# -- RMSNorm -----------------------------------------------------------------------------------
def _rms_norm_forward(base: Callable, norm: _Norm) -> Callable:
    offset, casting, eps_attr = norm.offset, norm.casting, norm.eps_attr

    @functools.wraps(base)
    def forward(self: nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        weight = self.weight
        # Llama's `weight * x̂.to(dtype)` promotes: an fp32 weight on bf16 x gives an fp32 result,
        # which polykernel (output dtype = x.dtype) does not; the original handles that case.
        if args or kwargs or (casting == "llama" and torch.promote_types(weight.dtype, hidden_states.dtype) != hidden_states.dtype):
            return base(self, hidden_states, *args, **kwargs)
        return _pk.rms_norm(hidden_states, weight, getattr(self, eps_attr), offset=offset, casting=casting)

    forward._polykernel = "rms_norm"  # type: ignore[attr-defined]
    return forward


# -- gated MLP ---------------------------------------------------------------------------------
def _gated_activation(act: Any) -> tuple[str, str | None] | None:
    """``("swiglu", None)`` / ``("geglu", approximate)`` for the activations polykernel fuses, else None."""
    cls = type(act)
    name = cls.__name__
    from_hf = cls.__module__ == "transformers.activations"
    if isinstance(act, nn.SiLU) or (from_hf and name == "SiLUActivation"):
        return ("swiglu", None)
    if from_hf and name in ("GELUTanh", "PytorchGELUTanh"):
        return ("geglu", "tanh")
    if from_hf and name == "GELUActivation":  # nn.functional.gelu or the erf formula: exact GELU
        return ("geglu", "none")
    if isinstance(act, nn.GELU) and act.approximate in ("none", "tanh"):
        return ("geglu", act.approximate)
    return None


def _mlp_forward(base: Callable, ops: frozenset[str]) -> Callable:
    """``ops``: the gated activations available in this build (``swiglu``, ``geglu``)."""

    @functools.wraps(base)
    def forward(self: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        kind = _gated_activation(getattr(self, "act_fn", None))
        if args or kwargs or kind is None or kind[0] not in ops:
            return base(self, x, *args, **kwargs)
        gate, up = self.gate_proj(x), self.up_proj(x)
        if kind[0] == "swiglu":
            return self.down_proj(_pk.swiglu(gate, up))
        return self.down_proj(_pk.geglu(gate, up, approximate=kind[1]))

    forward._polykernel = "swiglu"  # type: ignore[attr-defined]
    return forward


def _mlp_supported(module: nn.Module) -> str | None:
    """Why this MLP cannot be patched, or None."""
    for attr in ("gate_proj", "up_proj", "down_proj", "act_fn"):
        if not hasattr(module, attr):
            return f"it has no {attr}"
    kind = _gated_activation(module.act_fn)
    if kind is None:
        return f"its activation {type(module.act_fn).__name__} is not SiLU or GELU"
    if not _has_op(kind[0]):
        return f"polykernel.{kind[0]} is not available in this build"
    return None


# -- RoPE --------------------------------------------------------------------------------------
def _rope_function(orig: Callable) -> Callable:
    """A drop-in ``apply_rotary_pos_emb`` that runs polykernel.rope where it has the same semantics."""
    orig = getattr(orig, "_polykernel_orig", orig)
    try:
        extra_names = [p.name for p in inspect.signature(orig).parameters.values()][4:]
    except (TypeError, ValueError):
        extra_names = ["unsqueeze_dim"]

    @functools.wraps(orig)
    def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *args: Any, **kwargs: Any):
        if args or kwargs:
            extra = dict(zip(extra_names, args))
            extra.update(kwargs)
            if len(args) > len(extra_names) or extra.get("unsqueeze_dim", 1) != 1:
                return orig(q, k, cos, sin, *args, **kwargs)
        if not _rope_supported(q, k, cos, sin):
            return orig(q, k, cos, sin, *args, **kwargs)
        return _pk.rope(q, k, cos, sin)

    apply_rotary_pos_emb._polykernel = "rope"  # type: ignore[attr-defined]
    apply_rotary_pos_emb._polykernel_orig = orig  # type: ignore[attr-defined]
    return apply_rotary_pos_emb


def _rope_supported(q: Any, k: Any, cos: Any, sin: Any) -> bool:
    """q/k ``[B, H, T, D]``, cos/sin ``[B or 1, T, D]`` of one dtype (HF's output dtype follows
    promotion otherwise), full rotary dim."""
    if not all(isinstance(t, torch.Tensor) for t in (q, k, cos, sin)):
        return False
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or sin.shape != cos.shape:
        return False
    b, _, t, d = q.shape
    return (
        k.shape[0] == b
        and k.shape[2] == t
        and k.shape[3] == d
        and cos.shape[0] in (1, b)
        and cos.shape[1] == t
        and cos.shape[2] == d
        and d % 2 == 0
        and q.dtype == k.dtype == cos.dtype == sin.dtype
    )


class _CannotPatch(Exception):
    pass


def _with_globals(fn: Callable, old: dict, new: dict, calls: tuple[str, ...] = ("apply_rotary_pos_emb",)) -> types.FunctionType:
    """A copy of ``fn`` whose code sees ``new`` instead of the module globals ``old``; its code
    must name one of ``calls`` (the globals the copy exists to replace).

    Decorators made with ``functools.wraps`` (``fn.__wrapped__`` held in the wrapper's closure)
    are copied too, so the copy behaves like ``fn`` in every other way.
    """
    if not isinstance(fn, types.FunctionType):
        raise _CannotPatch(f"{fn!r} is not a Python function")
    inner = fn.__dict__.get("__wrapped__")
    closure = fn.__closure__
    if inner is not None:
        new_inner = _with_globals(inner, old, new, calls)
        cells, found = [], False
        for cell in closure or ():
            try:
                held = cell.cell_contents
            except ValueError:  # empty cell
                held = None
            if held is inner:
                cells.append(types.CellType(new_inner))
                found = True
            else:
                cells.append(cell)
        if not found:
            raise _CannotPatch(f"decorator {fn.__qualname__} does not hold the function it wraps in its closure")
        closure = tuple(cells)
    elif fn.__globals__ is not old:
        raise _CannotPatch(f"{fn.__qualname__} is not defined in the modeling module")
    elif not any(name in fn.__code__.co_names for name in calls):
        raise _CannotPatch(f"{fn.__qualname__} does not call {' or '.join(calls)}")
    out = types.FunctionType(fn.__code__, new if fn.__globals__ is old else fn.__globals__, fn.__name__, fn.__defaults__, closure)
    out.__kwdefaults__ = fn.__kwdefaults__
    out.__dict__.update(fn.__dict__)
    out.__qualname__, out.__module__, out.__doc__ = fn.__qualname__, fn.__module__, fn.__doc__
    if inner is not None:
        out.__wrapped__ = new_inner  # type: ignore[attr-defined]
    return out


def _namespace(module_globals: dict, **overrides: Any) -> dict:
    """Globals for :func:`_with_globals`: ``module_globals`` with ``overrides``, without
    ``__name__``. torch.compile (dynamo) finds the globals of a frame through the module that
    ``__name__`` names, so it would guard on the module's own functions, not the ones the copy
    calls (and fail to build a guard where their closures differ); without it, dynamo guards on
    this dict itself."""
    ns = {**module_globals, **overrides}
    ns.pop("__name__", None)
    return ns


_ROPE_NAMESPACES: dict[str, dict] = {}


def _attention_forward(base: Callable, modeling: types.ModuleType) -> Callable:
    ns = _ROPE_NAMESPACES.get(modeling.__name__)
    if ns is None:
        ns = _namespace(modeling.__dict__, apply_rotary_pos_emb=_rope_function(modeling.apply_rotary_pos_emb))
        _ROPE_NAMESPACES[modeling.__name__] = ns
    forward = _with_globals(base, modeling.__dict__, ns)
    forward._polykernel = "rope"  # type: ignore[attr-defined]
    return forward


# -- the causal mask under torch.compile -------------------------------------------------------
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


# -- the causal-LM loss ------------------------------------------------------------------------
def _shifted_targets(labels: torch.Tensor, ignore_index: int, shift_labels: torch.Tensor | None) -> torch.Tensor:
    """ForCausalLMLoss's targets: tokens < n predict n; the last position is ignored."""
    if shift_labels is None:
        shift_labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    return shift_labels.reshape(-1)


def _reduce(loss: torch.Tensor, num_items_in_batch: Any) -> torch.Tensor:
    if num_items_in_batch is None:
        return loss
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def _ce_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    num_items_in_batch: Any = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
) -> torch.Tensor:
    target = _shifted_targets(labels, ignore_index, shift_labels).to(logits.device)
    reduction = "mean" if num_items_in_batch is None else "sum"
    loss = _pk.cross_entropy(logits.reshape(-1, logits.shape[-1]), target, ignore_index=ignore_index, reduction=reduction)
    return _reduce(loss, num_items_in_batch)


def _flce_loss(
    hidden: torch.Tensor,
    head: nn.Linear,
    labels: torch.Tensor,
    num_items_in_batch: Any = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
) -> torch.Tensor:
    weight, bias = head.weight, head.bias
    hidden = hidden.reshape(-1, hidden.shape[-1])
    if hidden.dtype != weight.dtype and torch.is_autocast_enabled(hidden.device.type):
        dtype = torch.get_autocast_dtype(hidden.device.type)  # what lm_head's F.linear would run in
        hidden, weight = hidden.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
    target = _shifted_targets(labels, ignore_index, shift_labels).to(hidden.device)
    reduction = "mean" if num_items_in_batch is None else "sum"
    loss = _pk.fused_linear_cross_entropy(hidden, weight, target, bias, ignore_index=ignore_index, reduction=reduction)
    return _reduce(loss, num_items_in_batch)


def _standard_loss(model: nn.Module) -> bool:
    """The model's loss is transformers' ForCausalLMLoss (no custom ``loss_function``)."""
    if "_loss_function" in model.__dict__:
        return False
    if LOSS_MAPPING is None:
        return True
    return getattr(model, "loss_function", LOSS_MAPPING.get("ForCausalLM")) is LOSS_MAPPING.get("ForCausalLM")


_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_softcapping", "logits_scaling", "logit_scale", "output_multiplier_scale")


def _flce_head(model: nn.Module) -> nn.Linear | None:
    """lm_head when the fused loss computes exactly what it would, else None."""
    config = getattr(model, "config", None)
    if any(getattr(config, name, None) not in (None, 1, 1.0) for name in _LOGIT_TRANSFORMS):
        return None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else getattr(model, "lm_head", None)
    if not isinstance(head, nn.Linear) or type(head).forward is not nn.Linear.forward:
        return None  # quantized / LoRA / custom heads
    if _compat.module_has_hooks(head) or hasattr(head, "_hf_hook"):
        return None  # hooks (accelerate offload, user hooks) must see the lm_head call
    if not head.weight.is_floating_point() or head.weight.device.type == "meta":
        return None
    if type(head.weight.data).__name__ == "DTensor":
        return None  # tensor-parallel lm_head: leave it to the sharded path
    return head


_KEEP_NAMES = ("logits_to_keep", "num_logits_to_keep")
# the base model's outputs passed on (the cache field is `cache` or `past_key_values` by version)
_OUTPUT_FIELDS = tuple(f.name for f in dataclasses.fields(CausalLMOutputWithPast) if f.name not in ("loss", "logits"))


def _causal_lm_forward(base: Callable, use_flce: bool, use_ce: bool) -> Callable:
    sig = inspect.signature(base)  # follows __wrapped__ to the real parameters (self first)
    positional = [p.name for p in sig.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][1:]
    takes_return_dict = "return_dict" in sig.parameters
    labels_at = positional.index("labels") if "labels" in positional else None

    @functools.wraps(base)
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        labels = kwargs.get("labels")
        if labels is None and labels_at is not None and len(args) > labels_at:
            labels = args[labels_at]
        if labels is None or len(args) > len(positional):
            return base(self, *args, **kwargs)  # the common inference path: untouched
        call = dict(zip(positional, args))
        if set(call) & set(kwargs):
            return base(self, *args, **kwargs)  # let the original raise its TypeError
        call.update(kwargs)
        keep = next((call[n] for n in _KEEP_NAMES if n in call), 0)
        if not (isinstance(keep, int) and keep == 0) or not _standard_loss(self):
            return base(self, *args, **kwargs)
        return_dict = call.pop("return_dict", None)
        if return_dict is None:
            return_dict = getattr(getattr(self, "config", None), "return_dict", True)
        loss_kwargs = {n: call[n] for n in ("num_items_in_batch", "ignore_index", "shift_labels") if n in call}

        head = _flce_head(self) if (use_flce and self.training) else None
        if head is not None:
            model_kwargs = {n: v for n, v in call.items() if n not in ("labels", *_KEEP_NAMES)}
            outputs = getattr(self, self.base_model_prefix)(return_dict=True, **model_kwargs)
            loss = _flce_loss(outputs[0], head, labels, **loss_kwargs)
            extra = {name: getattr(outputs, name, None) for name in _OUTPUT_FIELDS}
            out = CausalLMOutputWithPast(loss=loss, logits=None, **extra)
        elif use_ce:
            call["labels"] = None
            if takes_return_dict:
                call["return_dict"] = True
            out = base(self, **call) if takes_return_dict else base(self, return_dict=True, **call)
            loss = _ce_loss(out.logits, labels, **loss_kwargs)
            out = type(out)(loss=loss, **{n: v for n, v in out.items() if n != "loss"})
        else:
            return base(self, *args, **kwargs)
        return out if return_dict else out.to_tuple()

    forward._polykernel = "loss"  # type: ignore[attr-defined]
    return forward


# -- instance patching -------------------------------------------------------------------------
_SAVED = "_polykernel_saved"  # module.__dict__ entry: (slot, previous value or None)


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
    """Give ``module`` its own forward, built from the one it runs now.

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
    d[_SAVED] = (slot, prev)


def _uninstall(module: nn.Module) -> None:
    saved = module.__dict__.pop(_SAVED, None)
    if saved is None:
        return
    slot, prev = saved
    if prev is None:
        module.__dict__.pop(slot, None)
    else:
        module.__dict__[slot] = prev


def _kind(module: nn.Module) -> str | None:
    saved = module.__dict__.get(_SAVED)
    if saved is None:
        return None
    fn = module.__dict__.get(saved[0])
    return getattr(getattr(fn, "__func__", None), "_polykernel", None)


def _patch_model(model: nn.Module, switches: dict[str, bool]) -> nn.Module:
    found = [(name, m, c) for name, m in model.named_modules() if (c := _classify(m)) is not None]
    if not found:
        model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        raise ValueError(
            f"polykernel.integrations.transformers.patch: {model_type!r} has no module of a supported family; "
            f"supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    unpatch(model)
    on = _enabled(switches)
    use_loss = on["fused_linear_cross_entropy"] or on["cross_entropy"]
    for name, module, (family, role, _cls) in found:
        try:
            if role == "rms_norm" and on["rms_norm"]:
                _install(module, lambda base, n=family.norm: _rms_norm_forward(base, n))
            elif role == "mlp" and on["swiglu"]:
                why = _mlp_supported(module)
                if why is not None:
                    logger.info("polykernel: MLP %s left as is: %s", name, why)
                    continue
                _install(module, lambda base: _mlp_forward(base, _gated_ops()))
            elif role == "attention" and on["rope"]:
                modeling = sys.modules[family.module]
                _install(module, lambda base, m=modeling: _attention_forward(base, m))
            elif role == "base_model" and on["sdpa_is_causal"]:
                modeling = sys.modules[family.module]
                _install(module, lambda base, m=modeling: _base_model_forward(base, m))
            elif role == "causal_lm" and use_loss:
                flce, ce = on["fused_linear_cross_entropy"], on["cross_entropy"]
                _install(module, lambda base, f=flce, c=ce: _causal_lm_forward(base, f, c))
        except _CannotPatch as exc:
            logger.warning("polykernel: %s (%s) left as is: %s", name or "<model>", role, exc)
    counts = {kind: len(names) for kind, names in patched(model).items()}
    logger.info("polykernel: patched %s: %s", type(model).__name__, counts or "nothing")
    return model


# -- class patching ----------------------------------------------------------------------------
_CLASS_PATCHES: dict[str, list[tuple[Any, str, Any]]] = {}  # model_type -> [(owner, attr, original)]


def _patch_classes(model_type: str, switches: dict[str, bool]) -> None:
    family = _FAMILIES.get(model_type)
    if family is None:
        raise ValueError(
            f"polykernel.integrations.transformers.patch: unsupported model type {model_type!r}; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    _unpatch_classes(model_type)
    modeling = importlib.import_module(family.module)
    on = _enabled(switches)
    done: list[tuple[Any, str, Any]] = []

    def swap(owner: Any, attr: str, make: Callable[[Any], Any]) -> None:
        original = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
        setattr(owner, attr, make(original))
        done.append((owner, attr, original))

    cls = functools.partial(getattr, modeling)
    if on["rms_norm"]:
        swap(cls(f"{family.prefix}RMSNorm"), "forward", lambda f: _rms_norm_forward(f, family.norm))
    if on["swiglu"]:
        swap(cls(f"{family.prefix}MLP"), "forward", lambda f: _mlp_forward(f, _gated_ops()))
    if on["rope"]:
        swap(modeling, "apply_rotary_pos_emb", _rope_function)
    if on["fused_linear_cross_entropy"] or on["cross_entropy"]:
        flce, ce = on["fused_linear_cross_entropy"], on["cross_entropy"]
        swap(cls(f"{family.prefix}ForCausalLM"), "forward", lambda f: _causal_lm_forward(f, flce, ce))
    if on["sdpa_is_causal"]:
        swap(cls(f"{family.prefix}Model"), "forward", lambda f: _base_model_forward(f, modeling))
    _CLASS_PATCHES[model_type] = done
    logger.info("polykernel: patched %s classes: %s", model_type, [f"{getattr(o, '__name__', o)}.{a}" for o, a, _ in done])


def _unpatch_classes(model_type: str) -> None:
    for owner, attr, original in reversed(_CLASS_PATCHES.pop(model_type, [])):
        setattr(owner, attr, original)


# -- public API --------------------------------------------------------------------------------
def patch(
    model: nn.Module | str,
    *,
    rms_norm: bool = True,
    swiglu: bool = True,
    rope: bool = True,
    cross_entropy: bool = True,
    fused_linear_cross_entropy: bool = True,
    sdpa_is_causal: bool = True,
) -> nn.Module | None:
    """Run a Hugging Face model's norms, MLP activations, RoPE and loss on polykernel's ops.

    ``model``: a built model (patched in place, per module instance; returns it), or a model type
    string such as ``"llama"`` (patches the classes, so every model of that type, built before or
    after, uses polykernel; returns None). ``swiglu`` covers the gated MLP activation (SwiGLU or
    GeGLU, whichever the model uses). ``sdpa_is_causal``: under ``torch.compile``, where nothing
    is padded, SDPA gets ``is_causal=True`` instead of a materialized ``[B, 1, S, S]`` mask, as
    transformers does outside compile (same result; keeps SDPA's flash/GQA path). Patching again
    re-applies with the new switches.

    >>> patch(model, rope=False)        # doctest: +SKIP
    """
    switches = {
        "rms_norm": rms_norm,
        "swiglu": swiglu,
        "rope": rope,
        "cross_entropy": cross_entropy,
        "fused_linear_cross_entropy": fused_linear_cross_entropy,
        "sdpa_is_causal": sdpa_is_causal,
    }
    if isinstance(model, str):
        _patch_classes(model, switches)
        return None
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"polykernel.integrations.transformers.patch: expected a torch.nn.Module or a model type string, got {type(model).__name__}"
        )
    return _patch_model(model, switches)


def unpatch(model: nn.Module | str) -> nn.Module | None:
    """Undo :func:`patch` (a model: its modules' own forwards; a model type: the classes)."""
    if isinstance(model, str):
        _unpatch_classes(model)
        return None
    for module in model.modules():
        _uninstall(module)
    return model


def patched(model: nn.Module | str) -> dict[str, list[str]]:
    """What polykernel runs in ``model``: kind (``rms_norm``, ``swiglu``, ``rope``, ``loss``) ->
    the qualified names of the patched modules (a model type: the patched class attributes)."""
    out: dict[str, list[str]] = {}
    if isinstance(model, str):
        for owner, attr, _ in _CLASS_PATCHES.get(model, []):
            value = getattr(owner, attr)
            kind = getattr(value, "_polykernel", None)
            if kind is not None:
                out.setdefault(kind, []).append(f"{getattr(owner, '__name__', owner)}.{attr}")
        return out
    for name, module in model.named_modules():
        kind = _kind(module)
        if kind is not None:
            out.setdefault(kind, []).append(name)
    return out
