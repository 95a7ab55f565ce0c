"""Which tensors share a storage: an id per storage (the private ``_cdata``, or the storage's
address), by which polykernel tells an output that aliases an input from a fresh one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .probe import _probe


def _data_ptr_id(storage: Any) -> int:
    return storage.data_ptr()


def _cdata(storage: Any) -> int:
    return storage._cdata


_storage_key: Callable[[Any], int] = _probe(
    "storage_id", lambda: _cdata if isinstance(_cdata(torch.empty(1).untyped_storage()), int) else None, _data_ptr_id
)


def storage_id(t: torch.Tensor) -> int:
    """An id equal for tensors that share a storage (raises for a tensor without one). Fallback:
    the storage's address, equal for storages over the same memory too (an extra clone at most)."""
    return _storage_key(t.untyped_storage())
