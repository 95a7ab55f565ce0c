"""The expert sort that the MoE impls share: token-expert pairs grouped by expert, once per call.

``top_k_index [T, k]`` flattened is ``S = T·k`` pairs; pair ``p`` is token ``p // k``'s ``p % k``-th
choice. :func:`sort_by_expert` returns the pairs' order sorted by expert (stable: within an
expert, pairs keep their token order, so every run sums in the same order) and the offsets of
each expert's group in it, without a host sync (no ``bincount``, whose output size is
data-dependent): ``offsets[e] = #pairs with index < e``, by a binary search of the sorted ids.

An index outside ``[0, E)`` never reaches a kernel unnoticed. On the CPU the public function has
already rejected it (``polykernel.moe_experts`` reads the values), and the sort checks again,
for free (the sorted ids' first and last), for the calls that reach an impl without it (a
DTensor's local shards, a compiled graph's custom op). On other devices reading the values would
cost a host sync per call, so the check is on the device: ``offsets[0]`` counts the pairs below
0 and ``S - offsets[E]`` those at or above E, and ``torch._assert_async`` (:data:`polykernel._compat.assert_async`) fails the stream (a
device-side assert, raised at the next synchronization) unless both are 0. The kernels only
visit pairs inside ``[offsets[0], offsets[E])``, so even then nothing is read out of bounds.
"""

from __future__ import annotations

import torch

from .. import _compat
from ..errors import OpArgumentError

OP_ID = "moe.moe_experts"


def sort_by_expert(
    top_k_index: torch.Tensor, n_experts: int, *, device_check: bool | None = None, op_id: str = OP_ID
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(perm, offsets)``: ``perm [S]`` (int64) lists the pairs by expert, ``offsets [E + 1]``
    (int64) bounds each expert's group in it (``perm[offsets[e]:offsets[e + 1]]``).
    ``device_check``: the range check on the device (default: off the CPU only); ``op_id``: the
    op its errors name."""
    flat = top_k_index.reshape(-1)
    expert, perm = torch.sort(flat, stable=True)
    bounds = torch.arange(n_experts + 1, device=flat.device, dtype=flat.dtype)
    offsets = torch.searchsorted(expert, bounds)
    if not flat.numel():
        return perm, offsets
    if flat.device.type != "cpu" if device_check is None else device_check:
        outside = offsets[0] + (flat.numel() - offsets[n_experts])
        _compat.assert_async(outside == 0, f"polykernel.{op_id.rpartition('.')[2]}: an expert index in 'top_k_index' is outside [0, E)")
    elif not torch.compiler.is_compiling():
        lo, hi = int(expert[0]), int(expert[-1])
        if lo < 0 or hi >= n_experts:
            raise OpArgumentError(
                op_id, "top_k_index", f"expert index {lo if lo < 0 else hi} is out of range [0, {n_experts}) (E = gate_up_proj.shape[0])"
            )
    return perm, offsets


def inverse(perm: torch.Tensor) -> torch.Tensor:
    """The inverse permutation: ``inverse(perm)[perm[i]] == i``."""
    inv = torch.empty_like(perm)
    return inv.scatter_(0, perm, torch.arange(perm.numel(), device=perm.device, dtype=perm.dtype))


def assert_in_range(top_k_index: torch.Tensor, n_experts: int) -> None:
    """The same device-side check without the sort (for impls that route on their own)."""
    if top_k_index.device.type != "cpu" and top_k_index.numel():
        lo, hi = torch.aminmax(top_k_index)
        _compat.assert_async((lo >= 0) & (hi < n_experts), "polykernel.moe_experts: an expert index in 'top_k_index' is outside [0, E)")
