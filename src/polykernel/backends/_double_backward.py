"""Double backward (``create_graph=True``) for the impls' autograd Functions.

A backward that launches kernels, or fills buffers in place, builds no graph: torch then takes
its gradients for constants, and a Hessian (``torch.autograd.functional.hessian``) comes out as
zeros. ``torch.is_grad_enabled()`` is true inside a backward only under ``create_graph=True``,
so each Function's backward checks it (one flag read on the usual path) and then either

- recomputes its gradients through the op's torch formula with autograd (:func:`graph_grads`):
  they are then differentiable in the inputs and in the cotangents, with the formula's second
  derivatives; or
- hands back its gradients wrapped so that differentiating them raises a clear error
  (:func:`refuse`), where the gradients were computed in the forward and the inputs are gone.

:func:`native_backward` is the same for the native path's C++ autograd nodes (``csrc``).

Example::

    if torch.is_grad_enabled():  # in a Function's backward: create_graph=True
        dx, dw, _ = graph_grads(reference, (x, w, eps), (dy,), (True, True, False))
        (dx,) = refuse(OP_ID, "triton", 'the gradient is made in the forward; use impl="torch"', ctx.saved_tensors, dx)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import _compat

Grads = list["torch.Tensor | None"]


def graph_grads(fn: Callable[..., Any], args: Sequence[Any], grads: Sequence[torch.Tensor | None], needs: Sequence[bool]) -> Grads:
    """Gradients of ``fn(*args)`` for the cotangents ``grads`` (one per output; None: unused)
    w.r.t. ``args[i]`` where ``needs[i]`` (None elsewhere), with a graph (``create_graph``).

    ``args`` must be the Function's own inputs (its saved inputs, unpacked in the backward), not
    tensors made from them in the forward: those carry no graph back to the inputs.
    """
    out: Grads = [None] * len(args)
    wanted = [i for i, need in enumerate(needs) if need]
    if not wanted:
        return out
    with torch.enable_grad():
        result = fn(*args)
    outs = result if isinstance(result, (tuple, list)) else (result,)
    pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
    if not pairs:
        return out
    got = torch.autograd.grad([o for o, _ in pairs], [args[i] for i in wanted], [g for _, g in pairs], create_graph=True, allow_unused=True)
    for i, g in zip(wanted, got):
        out[i] = g
    return out


def anchor(t: torch.Tensor | None) -> torch.Tensor | None:
    """A handle on ``t``'s place in the graph, for :func:`refuse`, that keeps none of its memory
    alive: ``t`` itself for a leaf (its owner keeps it anyway), else an empty tensor made from it.
    Run it with grad mode on (a Function's forward: under ``torch.enable_grad()``)."""
    if t is None or not t.requires_grad:
        return None
    # one op (~1 us; a slice and a clone cost twice that), and it saves no tensor
    return t if t.grad_fn is None else torch.narrow_copy(t if t.dim() else t.view(1), 0, 0, 0)


def refuse(
    op: str, impl: str, why: str, anchors: Sequence[torch.Tensor | None], *grads: torch.Tensor | None
) -> tuple[torch.Tensor | None, ...]:
    """``grads`` unchanged in value, except that differentiating them raises a RuntimeError that
    names the op and impl. ``anchors``: the Function's inputs or their :func:`anchor`, saved.

    ``once_differentiable`` is not enough: its error node hangs off fresh leaves only, so
    ``torch.autograd.grad(grads, inputs)`` (a Hessian's second pass) never reaches it and reads
    zeros; an error node that also takes the anchors lies on a path from the gradients to each
    input. (Not the Function's output: saving it would forbid in-place edits of the loss.)
    """
    if not torch.is_grad_enabled() or all(g is None for g in grads):
        return grads
    message = f"{op} [{impl}]: double backward (create_graph=True) is not supported: {why}"
    err = _compat.delayed_error(message, len(grads) + len(anchors))
    out = err(*[None if g is None else g.detach().requires_grad_() for g in grads], *anchors)
    return tuple(out[: len(grads)])


def refusing(fn: type[torch.autograd.Function], op: str, impl: str, inputs: Sequence[int], kept: bool = True) -> Any:
    """A subclass of a peer's autograd Function ``fn`` (Liger's: not ours, their backward builds
    no graph) whose gradients :func:`refuse` to be differentiated under create_graph: second
    derivatives then raise, naming ``op`` and ``impl``, where they silently read zeros.

    The same forward and first-order results; it costs one attribute store in the forward and one
    flag read in the backward (~1 us on the 2-core dev CPU; an identity Function around each call
    costs ~10x more): ``benchmarks/host/peer_refusing.py``. ``inputs``: the positions of the
    differentiable inputs (tensors or None); ``kept``: whether the peer keeps them for its backward
    anyway (then they are held as they are, else by :func:`anchor`, which keeps none of their
    memory but costs a graph op per non-leaf input); held until the first backward.
    """
    why = f'{impl}\'s autograd Function builds no graph in its backward; use impl="torch"'
    base_forward, base_backward = fn.forward, fn.backward

    def forward(ctx: Any, *args: Any) -> Any:
        if kept:
            ctx.pk_anchors = tuple(args[i] for i in inputs)
        else:
            with torch.enable_grad():
                ctx.pk_anchors = [anchor(args[i]) for i in inputs]
        return base_forward(ctx, *args)

    def backward(ctx: Any, *grads: Any) -> Any:
        out = base_backward(ctx, *grads)
        anchors, ctx.pk_anchors = ctx.pk_anchors, None
        if not torch.is_grad_enabled():
            return out
        if anchors is None:  # a second backward through a retained graph: the handles are gone
            raise RuntimeError(f"{op} [{impl}]: double backward (create_graph=True) is not supported: {why}")
        outs = list(out) if isinstance(out, tuple) else [out]
        at = [i for i, o in enumerate(outs) if isinstance(o, torch.Tensor)]
        handles = [a if isinstance(a, torch.Tensor) and a.requires_grad else None for a in anchors]
        handles += [g for g in grads if isinstance(g, torch.Tensor) and g.requires_grad]  # d/d(cotangent) raises too
        for i, g in zip(at, refuse(op, impl, why, handles, *[outs[i] for i in at])):
            outs[i] = g
        return tuple(outs) if isinstance(out, tuple) else outs[0]

    return type(fn)(f"{fn.__name__}Refusing", (fn,), {"forward": staticmethod(forward), "backward": staticmethod(backward)})


# ---------------------------------------------------------------------------------------------
# The ops' gradient formulas for a create_graph backward (shared by the Python Functions and the
# native path): each takes the Function's inputs (with their graph), options and cotangents.


def rms_norm_grads(x, weight, eps: float, offset: float, casting: str, dy, needs: Sequence[bool]) -> Grads:
    """(dx, dw) of ``norm.rms_norm``."""
    from ..ops.rms_norm import reference

    return graph_grads(reference, (x, weight, eps, offset, casting), (dy,), (needs[0], needs[1], False, False, False))[:2]


def layer_norm_grads(x, weight, bias, eps: float, dy, needs: Sequence[bool]) -> Grads:
    """(dx, dw, db) of ``norm.layer_norm`` (weight and bias may be None)."""
    from ..ops.layer_norm import reference

    need = (needs[0], weight is not None and needs[1], bias is not None and needs[2], False)
    return graph_grads(reference, (x, weight, bias, eps), (dy,), need)[:3]


def fused_add_rms_norm_grads(s, weight, eps: float, offset: float, dy, ds_out, needs: Sequence[bool]) -> Grads:
    """(dx, dresidual, dw) of ``norm.fused_add_rms_norm`` from its output ``s = x + residual``
    (saved as an output: differentiating through it runs the node again, which maps the residual
    stream's gradient to x and residual unchanged)."""
    ds, dw = None, None
    if dy is not None:
        ds, dw = rms_norm_grads(s, weight, eps, offset, "fp32", dy, (True, needs[2]))
    if ds_out is not None:
        ds = ds_out if ds is None else ds + ds_out
    return [ds if needs[0] else None, ds if needs[1] else None, dw]


# The GLU kernels' activation codes (backends/{triton,cutile}/glu.py): 0 silu, 1 gelu tanh, 2 gelu erf.
def glu_reference(gate: torch.Tensor, up: torch.Tensor, act: int) -> torch.Tensor:
    """``act(gate) * up`` by its op's reference."""
    if act == 0:
        from ..ops.swiglu import reference

        return reference(gate, up)
    from ..ops.geglu import reference as geglu_reference

    return geglu_reference(gate, up, "tanh" if act == 1 else "none")


def glu_grads(gate, up, act: int, dy, needs: Sequence[bool]) -> Grads:
    """(dgate, dup) of ``swiglu`` (act 0) or ``geglu`` (1: tanh, 2: erf)."""
    return graph_grads(glu_reference, (gate, up, act), (dy,), (needs[0], needs[1], False))[:2]


def rope_grads(cos, sin, gq, gk, needs: Sequence[bool], interleaved: bool = False) -> Grads:
    """(dq, dk) of ``embedding.rope`` without cos/sin gradients. The map is linear in q and k, so
    its gradients depend on the cotangents alone: the reference is differentiated at zeros
    (partial rotary follows from the tables' width; ``interleaved`` is the op's option)."""
    from ..ops.rope import reference

    use_q, use_k = gq is not None and needs[0], gk is not None and needs[1]
    if not (use_q or use_k):
        return [None, None]
    q = torch.zeros_like(gq if use_q else gk).requires_grad_(use_q)
    k = torch.zeros_like(gk if use_k else gq).requires_grad_(use_k)
    args = (q, k, cos, sin, None, interleaved)
    return graph_grads(reference, args, (gq if use_q else None, gk if use_k else None), (use_q, use_k, False, False, False, False))[:2]


def native_backward(op: str, tensors: Sequence[Any], options: Sequence[Any], grads: Sequence[Any], needs: Sequence[bool]) -> Grads:
    """The create_graph backward of the native path's C++ autograd nodes: their gradients for
    their tensor inputs, in order (None where not needed), differentiable.

    Called from a node's ``backward`` when ``GradMode::is_enabled()``, with (undefined tensors
    as None; ``needs`` is the node's ``needs_input_grad`` of those inputs):

    ==================== ============================ ===================== ============== ==========
    op                   tensors (saved)              options               grads          returns
    ==================== ============================ ===================== ============== ==========
    "rms_norm"           (x, w)                       (eps, offset, llama)  (dy,)          (dx, dw)
    "layer_norm"         (x, w or None, b or None)    (eps,)                (dy,)          (dx, dw, db)
    "fused_add_rms_norm" (s, w): s the saved output   (eps, offset)         (dy, ds_out)   (dx, dres, dw)
    "glu"                (gate, up)                   (act,)                (dy,)          (dgate, dup)
    "rope"               (cos, sin)                   ()                    (dq, dk)       (dq, dk)
    ==================== ============================ ===================== ============== ==========
    """
    if op == "rms_norm":
        eps, offset, llama = options
        return rms_norm_grads(*tensors, eps, offset, "llama" if llama else "fp32", grads[0], needs)
    if op == "layer_norm":
        return layer_norm_grads(*tensors, options[0], grads[0], needs)
    if op == "fused_add_rms_norm":
        return fused_add_rms_norm_grads(*tensors, options[0], options[1], grads[0], grads[1], needs)
    if op == "glu":
        return glu_grads(*tensors, int(options[0]), grads[0], needs)
    if op == "rope":
        return rope_grads(*tensors, grads[0], grads[1], needs)
    raise ValueError(f"native_backward: unknown op {op!r}")
