"""Host-side helpers shared by the cuTile kernels: launch on torch's stream, tile sizes, rows."""

from __future__ import annotations

import functools

import cuda.tile as ct
import torch

# cuTile addresses arrays with int32 shapes and indices by default: keep each launch's arrays
# below 2^31 elements (the launchers split rows into chunks beyond that).
MAX_ELEMS = 2**31 - 1


def pow2(n: int) -> int:
    """The next power of two >= n (>= 1): tile dims must be powers of two."""
    return 1 << max(0, int(n) - 1).bit_length()


def launch(grid: tuple[int, ...], kernel, *args) -> None:
    """Launch ``kernel`` on torch's current stream of the first tensor's device. cuTile compiles it
    on the first launch per signature (dtypes, ranks, layout facts, constants) and caches it."""
    ct.launch(torch.cuda.current_stream(), grid, kernel, args)


@functools.cache
def num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t`` as ``[M, n]`` (a view when one exists: any strides are fine for cuTile, else a copy)."""
    return t.reshape(-1, n)


def row_chunks(m: int, n: int) -> list[tuple[int, int]]:
    """[start, stop) row ranges of at most MAX_ELEMS elements each."""
    step = max(1, MAX_ELEMS // max(n, 1))
    return [(i, min(m, i + step)) for i in range(0, m, step)] or [(0, 0)]
