"""How an op's arguments may be placed on a device mesh so that its rows stay independent: the
type of the op's own fact ``Op(dtensor_layout=...)``, read by :mod:`polykernel.distributed.dtensor`
(eager DTensor calls) and :mod:`polykernel.compile.sharding` (compiled ones).

Free of side effects and of torch at import, so that an op file can import it without routing
anything (importing :mod:`polykernel.distributed.dtensor` does).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["ANY", "ROWS", "Layout", "rows_with"]

ROWS = "rows"  # any dim but the last (the normalized / class dim)
ANY = "any"


@dataclass(frozen=True)
class Layout:
    """How an op's tensor arguments may be placed so that its rows stay independent.

    ``lead_dims``: which dims of the first tensor argument may be sharded (:data:`ROWS`: any dim
    but the last; :data:`ANY`; or a tuple of dims). ``expect(args, d)`` gives, for the lead sharded
    on dim ``d``, the placement every tensor argument must have on that mesh dim (a dim for
    ``Shard``, None for ``Replicate``), or a string saying why ``d`` cannot be sharded.
    ``outputs``: for each output, the index of the argument it is shaped and placed like, or
    ``"loss"`` for a reduced loss (its placement follows ``reduction``). A loss also gives
    ``loss_args``: the positions of its ``target``, ``ignore_index`` and ``reduction`` arguments
    (positional, in the impl's order); ``loss_weight``: the position of its class weights (a
    weighted mean divides by their sum over the scored targets, not by the count), if it has any. ``vocab``: the loss can run vocab-parallel
    (:mod:`polykernel.distributed.vocab`) when its ``"logits"`` are sharded on the class dim or
    its LM head ``"weight"`` on the vocabulary (dim 0); None: such a call is gathered first.
    """

    lead_dims: str | tuple[int, ...]
    expect: Callable[[tuple[Any, ...], int], dict[int, int | None] | str]
    outputs: tuple[int | str, ...]
    why_not: str = "it is the dim the op reduces over, which needs a cross-rank reduction"
    loss_args: tuple[int, int, int] | None = None
    loss_weight: int | None = None
    vocab: str | None = None

    def __post_init__(self) -> None:
        if ("loss" in self.outputs) != (self.loss_args is not None):
            raise ValueError("Layout: a 'loss' output and loss_args (target, ignore_index, reduction) go together")


def scored(layout: Layout, target: Any, args: tuple[Any, ...]) -> tuple[Any, Any]:
    """A mean loss's divisor over ``target`` (local or DTensor): (the count of scored targets,
    their summed class weights or None without class weights (``layout.loss_weight``, given)).
    The weights are read through ``embedding``, which DTensor shards like its indices with the
    table replicated. :func:`mean_divisor` turns the summed weights into the divisor once the
    ranks' sums are added."""
    ignore = args[layout.loss_args[1]]  # type: ignore[index]
    valid = target != ignore
    w = args[layout.loss_weight] if layout.loss_weight is not None and layout.loss_weight < len(args) else None
    if w is None:
        return valid.sum(), None
    import torch

    idx = torch.where(valid, target, 0).clamp(0, w.shape[0] - 1)
    per = torch.nn.functional.embedding(idx, w.detach().reshape(-1, 1)).squeeze(-1)
    return valid.sum(), torch.where(valid, per, 0.0).sum()


def mean_divisor(weight_sum: Any) -> Any:
    """A weighted mean's divisor, the scored targets' summed class weights (over every rank), with
    0 as NaN: the distributed layer's statement of :func:`polykernel.ops.cross_entropy.mean_divisor`
    (which it may not import). ``F.cross_entropy`` divides its nll and smoothing parts by that sum
    separately, so when it is 0 the nll part is 0/0: the loss is NaN and so are the scored rows'
    gradients (one division of the whole sum would give +inf with label smoothing); the callers
    keep the ignored rows' gradients 0. Read by the vocab-parallel path
    (:func:`polykernel.distributed.vocab_math.divisor`) and the mean over sharded rows
    (:func:`polykernel.distributed.dtensor.mean_of_scored`)."""
    import torch

    return torch.where(weight_sum == 0, torch.nan, weight_sum)


def _is_tensor(a: Any) -> bool:
    import torch

    return isinstance(a, torch.Tensor)


def rows_with(*same: int) -> Callable[[tuple[Any, ...], int], dict[int, int | None]]:
    """Expectations for a row-wise op: the lead and the ``same`` arguments share the shard dim,
    every other tensor argument is replicated. (Also read by polykernel.compile.sharding, whose
    arguments are DTensor specs: they have ``placements``.)"""

    def expect(args: tuple[Any, ...], d: int) -> dict[int, int | None]:
        return {i: (d if i == 0 or i in same else None) for i, a in enumerate(args) if _is_tensor(a) or hasattr(a, "placements")}

    return expect
