"""Tensor parallelism: DTensor arguments run the dispatcher's fast impls on their local shards.

A ``DTensor`` has no storage of its own, so no Triton (or CuTe, or peer) kernel may read it. But
most of polykernel's ops work row by row: when every tensor argument is either replicated or
sharded along the op's independent rows, each rank can run the op on its own shard
(``to_local()``) with the normal selection, and the results are already the shards of the global
result. This module decides, per call, whether the placements allow that (a *plan*), runs it, and
wraps the outputs back with ``DTensor.from_local``:

- outputs get the placements of the argument they are shaped like (``Shard(d)`` stays
  ``Shard(d)``, ``Replicate()`` stays ``Replicate()``); a loss reduced over sharded rows is
  ``Partial`` (``reduction="mean"`` divides the partial sum by the global count of scored rows,
  through DTensor, so the mean is over the whole batch);
- a replicated argument (a norm's weight, cos/sin for a head-sharded RoPE) used with sharded rows
  gets its gradient back as ``Partial``: DTensor reduces it when it is redistributed or read.

Supported placements, per mesh dim (``Replicate()`` everywhere always is):

- norms (rms_norm, fused_add_rms_norm, layer_norm), softmax, cross_entropy,
  fused_linear_cross_entropy: activations (and the targets) ``Shard(d)`` on any dim but the last,
  weights and biases ``Replicate()``;
- swiglu, geglu: gate and up on the same ``Shard(d)``, any d (they are elementwise);
- rope: q and k on ``Shard`` of the batch, heads or sequence dim; cos/sin ``Shard(0)`` (per-batch
  tables) or ``Replicate()`` (batch 1) for batch, ``Replicate()`` for heads, ``Shard(1)`` for sequence.

The losses on logits sharded on the class dim or an LM head sharded on the vocabulary run
vocab-parallel instead (:mod:`.vocab`: one collective of per-row statistics inside the loss).
Anything else (sharded on the normalized dim, a ``Partial`` input) is
first redistributed to what the layout needs (``Replicate()`` on that mesh dim), then runs on the
shards the same way: logged once per op and reason, an error under ``POLYKERNEL_STRICT=1``. A
plain tensor among DTensors is an ``OpTypeError`` naming the op and the argument. An op without a
layout (``Op.dtensor_layout``, in the op's own file) runs its torch impl through DTensor's own
rules, as for any tensor subclass.
``polykernel.explain`` prints the route taken (``route: DTensor Shard(0) on mesh of 2: triton on
local shards``). Torch's DTensor module is never imported by this one: it is loaded only after a
DTensor was seen, so ``import polykernel`` stays free of it.

Once this module is loaded, every decision of an op with a layout takes the hot path's subclass
check (``dispatch.routed``): a DTensor must reach the route even where the torch impl is chosen,
since the torch impls of the losses cannot run on DTensors. Processes that never see a DTensor
pay nothing.

Example (``torchrun --nproc_per_node 2``)::

    >>> from torch.distributed.tensor import Replicate, Shard, distribute_tensor  # doctest: +SKIP
    >>> x = distribute_tensor(torch.randn(8, 4096), mesh, [Shard(0)])             # doctest: +SKIP
    >>> w = distribute_tensor(torch.ones(4096), mesh, [Replicate()])              # doctest: +SKIP
    >>> polykernel.rms_norm(x, w).placements                                      # doctest: +SKIP
    (Shard(dim=0),)
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .. import _compat
from ..core import registry
from ..core import selection as dispatch
from ..errors import ImplNotAvailableError, UnknownOpError
from .layout import ANY, ROWS, Layout, mean_divisor, rows_with, scored

if TYPE_CHECKING:
    from ..core.op import Op

__all__ = ["LAYOUTS", "Layout", "Plan", "Route", "plan", "route", "rows_with", "run"]


class _Layouts(Mapping[str, Layout]):
    """Op id -> its layout (``Op.dtensor_layout``), for the ops that have one: a read-only view
    of the ops' own facts (iterating it imports every op of the catalog)."""

    def __getitem__(self, op_id: str) -> Layout:
        try:
            layout = registry.get_op(op_id).dtensor_layout
        except UnknownOpError:
            layout = None
        if layout is None:
            raise KeyError(op_id)
        return layout

    def __iter__(self) -> Iterator[str]:
        return iter([op_id for op_id in registry.all_op_ids() if _layout_of(op_id) is not None])

    def __len__(self) -> int:
        return sum(1 for _ in self)


def _layout_of(op_id: str) -> Layout | None:
    try:
        return registry.get_op(op_id).dtensor_layout
    except Exception:  # an op whose module fails to import: its own calls say why
        return None


LAYOUTS: Mapping[str, Layout] = _Layouts()


def _route_laid_out(op_id: str | None = None) -> None:
    """From now on every decision of an op with a layout checks for tensor subclasses on the hot
    path (~25 ns a tensor, in processes that use DTensors only), so that a DTensor reaches the
    route below even where the torch impl is chosen (the torch impls of the losses cannot run on
    DTensors). Run for every known op when this module loads, then as a registry listener for
    ops added later (``op_id``; None: nothing new to route)."""
    ids = registry.all_op_ids() if op_id is None else [op_id]
    new = {i for i in ids if i not in dispatch.routed and _layout_of(i) is not None}
    if new:
        dispatch.routed.update(new)
        dispatch.clear_memos()


_route_laid_out()
registry.listen(lambda op_id: op_id is not None and _route_laid_out(op_id))


def mean_of_scored(total: Any, count: Any, weight_sum: Any = None) -> Any:
    """A mean loss over sharded rows from its sum, the count of scored rows and, with class
    weights, the scored targets' summed weights (DTensors, all ``Partial()``: DTensor all-reduces
    them before dividing), as the eager route and compiled calls
    (:func:`polykernel.compile.sharding.mean_of_sum`) both compute it. No scored row on any
    rank: the loss is NaN (0 / 0, as the reference's) and the gradients are zero (the
    reference's; a plain ``total / count`` would send ``inf * 0`` into the sum's backward):
    ``where`` gives the branch it does not pick a zero gradient. Scored rows whose weights sum to
    0: NaN, with NaN gradients on the scored rows (:func:`~polykernel.distributed.layout.mean_divisor`;
    the sum's backward keeps the ignored rows' 0), as ``F.cross_entropy``. One difference there:
    the fused linear cross-entropy's local backward scales every row's stored gradient by the
    loss's (NaN) gradient, so the ignored rows' gradients of hidden are NaN too, where the
    unsharded op's are 0; the loss is NaN either way."""
    import torch

    scored = count > 0
    divisor = count if weight_sum is None else mean_divisor(weight_sum)
    return torch.where(scored, total / torch.where(scored, divisor, 1.0), torch.nan)


def _is_tensor(a: Any) -> bool:
    import torch

    return isinstance(a, torch.Tensor)


def _dtensor_type() -> type | None:
    """The DTensor class if ``torch.distributed.tensor`` is loaded (it must be, for one to exist)."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None) if module is not None else None


def _placement(p: Any) -> str:
    if p.is_shard():
        return f"Shard({p.dim})"
    if p.is_replicate():
        return "Replicate()"
    return type(p).__name__ + "()" if not p.is_partial() else f"Partial({getattr(p, 'reduce_op', 'sum')})"


def _mesh_text(mesh: Any) -> str:
    shape = tuple(mesh.shape)
    return f"mesh of {shape[0]}" if len(shape) == 1 else "mesh " + "x".join(map(str, shape))


@dataclass
class Plan:
    """How one call runs on its local shards.

    ``text``: the lead argument's placements and the mesh (``"DTensor Shard(0) on mesh of 2"``).
    ``targets``: per tensor argument, the placements it must have (its own, unless ``moved``
    says why some must be redistributed first); ``grad_placements`` and ``out_placements``
    follow from them."""

    text: str
    mesh: Any = None
    targets: dict[int, tuple[Any, ...]] = field(default_factory=dict)
    grad_placements: dict[int, tuple[Any, ...]] = field(default_factory=dict)
    out_placements: list[tuple[Any, ...]] = field(default_factory=list)
    moved: list[str] = field(default_factory=list)  # "x Shard(1) -> Replicate() (why)"

    @property
    def reason(self) -> str | None:
        return "; ".join(self.moved) or None


def plan(op: Op, args: Sequence[Any]) -> Plan:
    """The plan for ``op`` on ``args`` (positional, in the impl's order) holding DTensors.

    Per mesh dim: when the lead (first) argument is sharded on a dim the op's layout allows, every
    tensor argument must have the placement the layout expects (a replicated weight, targets
    sharded like the rows); what does not is redistributed to it. When the lead is sharded on a
    dim that is reduced over (or is ``Partial``), every argument is replicated on that mesh dim.
    Raises ``OpTypeError`` for a plain tensor mixed with DTensors or DTensors on different meshes.
    """
    from torch.distributed.tensor import Partial, Replicate, Shard

    from ..errors import OpTypeError

    dtensor = _dtensor_type()
    names = _arg_names(op)
    tensors = [(i, a) for i, a in enumerate(args) if _is_tensor(a)]
    lead = args[0]
    for i, a in tensors:
        if dtensor is None or not isinstance(a, dtensor):
            raise OpTypeError(op.id, names[i], "is a plain tensor while other arguments are DTensors: pass DTensors for all, or none")
        if a.device_mesh != lead.device_mesh:
            raise OpTypeError(op.id, names[i], f"is on another device mesh than {names[0]}")
    mesh = lead.device_mesh
    p = Plan(f"DTensor {', '.join(map(_placement, lead.placements))} on {_mesh_text(mesh)}", mesh)
    layout = op.dtensor_layout
    targets: dict[int, list[Any]] = {i: [] for i, _ in tensors}
    grads: dict[int, list[Any]] = {i: [] for i, _ in tensors}
    outs: list[list[Any]] = [[] for _ in (layout.outputs if layout else (0,))]
    for m, lp in enumerate(lead.placements):
        expect: dict[int, int | None] | str | None = None
        d = -1
        if lp.is_shard():
            d = lp.dim % max(lead.dim(), 1)
            if layout is None:
                expect = "no row layout is known for this op"
            else:
                kinds = layout.lead_dims
                allowed = range(lead.dim() - 1) if kinds == ROWS else range(lead.dim()) if kinds == ANY else kinds
                expect = layout.expect(tuple(args), d) if d in allowed else f"it is sharded on dim {d}: {layout.why_not}"
        elif lp.is_partial():
            expect = "a partial value needs its cross-rank reduction first"
        for i, a in tensors:
            got = a.placements[m]
            if isinstance(expect, dict):
                want_dim = expect.get(i)
                want = Replicate() if want_dim is None else Shard(want_dim)
                if not (got.is_replicate() if want_dim is None else got.is_shard() and got.dim % max(a.dim(), 1) == want_dim):
                    p.moved.append(f"{names[i]} {_placement(got)} -> {_placement(want)} (with {names[0]} Shard({d}))")
                else:
                    want = got
                grads[i].append(Partial() if want_dim is None else want)  # replicated inputs of sharded rows: partial grads
            else:
                want = Replicate()
                if not got.is_replicate():
                    p.moved.append(f"{names[i]} {_placement(got)} -> Replicate() ({expect})")
                grads[i].append(Replicate())
            targets[i].append(want)
        for o, like in zip(outs, layout.outputs if layout else (0,)):
            sharded = isinstance(expect, dict)
            o.append((Partial() if sharded else Replicate()) if like == "loss" else targets[like][m])
    p.targets = {i: tuple(t) for i, t in targets.items()}
    p.grad_placements = {i: tuple(g) for i, g in grads.items()}
    p.out_placements = [tuple(o) for o in outs]
    return p


_names: dict[str, tuple[str, ...]] = {}


def _arg_names(op: Op) -> tuple[str, ...]:
    """The op's positional argument names (its reference's signature: the impl's order)."""
    hit = _names.get(op.id)
    if hit is None:
        hit = _names[op.id] = tuple(inspect.signature(op.reference).parameters)
    return hit


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(tuple(shape)):
        stride.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(stride))


def _wrap(local: Any, p: Plan, placements: tuple[Any, ...], shape: Sequence[int]) -> Any:
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, p.mesh, placements, run_check=False, shape=tuple(shape), stride=_contiguous_stride(shape))


def run(op: Op, impl: Any, p: Plan, args: tuple[Any, ...]) -> Any:
    """Run ``op`` on the local shards of ``args`` (redistributed first where ``p`` says) through
    :meth:`Op.call` (the normal selection, memo and fault policy on plain tensors) and wrap the
    outputs as DTensors."""
    local = list(args)
    for i, gp in p.grad_placements.items():
        a = args[i]
        if tuple(a.placements) != p.targets[i]:
            a = a.redistribute(p.mesh, p.targets[i])
        local[i] = _waited(a.to_local(grad_placements=gp))
    layout = op.dtensor_layout
    loss = None if layout is None else layout.loss_args
    mean = loss is not None and args[loss[2]] == "mean"
    if mean:  # the local sum, divided below by the global count of scored rows
        local[loss[2]] = "sum"
    argkey = op.key(**dict(zip(_arg_names(op), local)))
    out = _WaitGrads.around(op.call(impl, argkey, *local))
    if loss is not None:
        if args[loss[2]] == "none":  # per-row losses: placed like the targets
            return _wrap(out, p, p.targets[loss[0]], args[loss[0]].shape)
        total = _wrap(out, p, p.out_placements[0], ())
        if not mean:
            return total
        count, weight_sum = scored(layout, local[loss[0]], tuple(local))  # type: ignore[arg-type]
        count = _wrap(count.to(out.dtype), p, p.out_placements[0], ())
        weight_sum = None if weight_sum is None else _wrap(weight_sum.to(out.dtype), p, p.out_placements[0], ())
        return mean_of_scored(total, count, weight_sum)
    outputs = layout.outputs if layout is not None else (0,)
    outs = out if isinstance(out, tuple) else (out,)
    wrapped = tuple(_wrap(o, p, pl, args[like].shape) for o, pl, like in zip(outs, p.out_placements, outputs))
    return wrapped if isinstance(out, tuple) else wrapped[0]


def _waited(t: Any) -> Any:
    """``t`` as a plain tensor: a redistribution's result may be an ``AsyncCollectiveTensor``
    (functional collectives' wrapper subclass, whose storage is not its data until waited on),
    which no raw-memory kernel may read."""
    return t.wait() if _compat.is_async_collective(t) else t


def _grad_wait_fn() -> Any:
    import torch

    class WaitGrads(torch.autograd.Function):
        """Identity between an impl's outputs and ``DTensor.from_local``. In the backward,
        ``from_local`` hands down its gradient's local tensor, which is an
        ``AsyncCollectiveTensor`` when a collective made it (the reduce-scatter behind a
        sequence-parallel layer): it is waited on here, before the impl's own backward (a Triton
        kernel) reads it."""

        @staticmethod
        def forward(ctx: Any, *xs: Any) -> Any:
            return tuple(x.view_as(x) for x in xs)

        @staticmethod
        def backward(ctx: Any, *grads: Any) -> Any:
            return tuple(_waited(g) if g is not None else None for g in grads)

    return WaitGrads


class _WaitGrads:
    fn: Any = None

    @classmethod
    def around(cls, out: Any) -> Any:
        """``out`` (a tensor or a tuple of tensors) behind :func:`_grad_wait_fn`'s node when it
        takes gradients; unchanged otherwise (no node, no cost)."""
        outs = out if isinstance(out, tuple) else (out,)
        if not any(getattr(o, "requires_grad", False) for o in outs):
            return out
        if cls.fn is None:
            cls.fn = _grad_wait_fn()
        waited = cls.fn.apply(*outs)
        return tuple(waited) if isinstance(out, tuple) else waited[0]


class Route:
    """What :meth:`Op.call` runs for DTensor arguments (it quacks like a ``Decision``): per call,
    the plan for the placements, then the op on the local shards."""

    raw = False  # Op.call must not send this through the subclass guard again
    cuda = False  # nor through the CUDA-graph check: the local call makes its own decision
    guarded = False

    def __init__(self, op: Op, key: tuple[Any, ...]) -> None:
        self.op, self.key = op, key

    def fn(self, *args: Any) -> Any:
        layout = self.op.dtensor_layout
        if layout is not None and layout.vocab is not None:  # a loss sharded over the vocabulary
            from . import vocab

            vp = vocab.vocab_plan(self.op.id, layout.vocab, _arg_names(self.op), args)
            if vp is not None:
                if vp.moved:
                    _redistributing(self.op, Plan(vp.text, vp.mesh, moved=vp.moved))
                out = vocab.run(self.op.id, vp)
                dispatch.record_route(self.op, self.key, "DTensor", "torch", "vocab-parallel route")
                return out
        p = plan(self.op, args)
        if p.moved:
            _redistributing(self.op, p)
        return run(self.op, self.key.impl, p, args)

    def on_fault(self, exc: Exception, args: tuple[Any, ...]) -> Any:
        raise exc  # the local call has its own fault policy


def route(op: Op, key: tuple[Any, ...]) -> Route | None:
    """The route for a call whose arguments hold a DTensor (``key``: the call's memo key); None
    for an op without a row layout. Never memoized: Op.call reaches it through the subclass
    check, which every decision of a routed op takes (see ``dispatch.routed``)."""
    return Route(op, key) if op.dtensor_layout is not None else None


def _redistributing(op: Op, p: Plan) -> None:
    """Placements that need cross-rank communication before the op can run on shards: logged
    once per op and reason; ``POLYKERNEL_STRICT=1`` makes it an error (before any collective)."""
    message = f"polykernel: {op.id}: {p.text}: redistributing {p.reason} before running on local shards"
    if dispatch.strict_mode():
        raise ImplNotAvailableError(op.id, "local shards", f"{p.text}: needs a redistribution: {p.reason}")
    dispatch.log_once(("dtensor", op.id, p.text, p.reason), message)


# -- explain ---------------------------------------------------------------------------------


def explain_local(
    op: Op, key: tuple[Any, ...], args: tuple[Any, ...], kwargs: dict[str, Any], explain_plain: Callable[..., Any]
) -> tuple[Any, Callable[[str | None], str] | None]:
    """For ``polykernel.explain`` on DTensor arguments (given as the public function takes them;
    ``key``: the call's memo key): ``(explanation, None)`` when the call runs on local shards (the
    local call's explanation, with its route), else ``(None, route)``, where ``route(chosen)``
    words the path taken instead."""
    memoized = op.memoized(key)
    if memoized is not None and not memoized.raw:  # Op.call runs that impl on the DTensors
        why = "the decision memoized for plain tensors of this argument class accepts DTensors"
        return None, lambda chosen: f"DTensor: {chosen} impl on the DTensors through DTensor's rules ({why})"
    try:
        bound = inspect.signature(op.reference).bind(*args, **kwargs)
    except TypeError:  # the normal path names the problem
        return None, None
    bound.apply_defaults()
    values = tuple(bound.arguments.values())
    vocab_route = _explain_vocab(op, bound.arguments, args, kwargs, explain_plain)
    if vocab_route is not None:
        return vocab_route, None
    p = plan(op, values)
    # Stand-ins shaped like the shards the call would run on (no collective: explain may be
    # called on one rank only).
    shards = {name: _shard_like(values[i], p.targets[i]) for i, name in enumerate(bound.arguments) if i in p.targets}
    names = list(bound.arguments)
    local_args = tuple(shards.get(names[i], a) for i, a in enumerate(args))
    local_kwargs = {k: shards.get(k, v) for k, v in kwargs.items()}
    local = explain_plain(*local_args, **local_kwargs)
    moved = f"redistributed ({p.reason}), then " if p.moved else ""
    local.route = f"{p.text}: {moved}{local.chosen or 'no impl'} on local shards"
    return local, None


def _shard_like(a: Any, targets: tuple[Any, ...]) -> Any:
    """An empty plain tensor of the local shape ``a`` would have with ``targets`` (rank 0's)."""
    import torch

    shape = list(a.shape)
    for m, t in enumerate(targets):
        if t.is_shard():
            n = a.device_mesh.size(m)
            shape[t.dim] = -(-shape[t.dim] // n)
    out = torch.empty(shape, dtype=a.dtype, device=a.device)
    return out.requires_grad_() if a.requires_grad else out


def _explain_vocab(
    op: Op, arguments: Mapping[str, Any], args: tuple[Any, ...], kwargs: dict[str, Any], explain_plain: Callable[..., Any]
) -> Any:
    """``explain`` for a vocab-parallel loss call (see :mod:`.vocab`), or None when it is not one:
    the local slices' explanation, with the route and the torch math it runs."""
    layout = op.dtensor_layout
    if layout is None or layout.vocab is None:
        return None
    from torch.distributed.tensor import Replicate

    from . import vocab

    vp = vocab.vocab_plan(op.id, layout.vocab, tuple(arguments), tuple(arguments.values()))
    if vp is None:
        return None
    lead = "logits" if vp.kind == "logits" else "weight"
    shards = {
        name: _shard_like(a, tuple(a.placements) if name in (lead, "bias") else (Replicate(),))
        for name, a in arguments.items()
        if _is_tensor(a)
    }
    names = list(arguments)
    local = explain_plain(*(shards.get(names[i], a) for i, a in enumerate(args)), **{k: shards.get(k, v) for k, v in kwargs.items()})
    local.route = vocab.explain_text(vp)
    local.chosen, local.source = "torch", "vocab-parallel route"
    return local
