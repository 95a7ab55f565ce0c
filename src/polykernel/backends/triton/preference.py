"""The Triton impls of the fused preference/RL losses: each loss's formula (its op file's
``chunked``) through the chunked driver (``polykernel.backends._linear_logps``) with the
Triton per-token primitive (``polykernel.backends.triton._token_logps``)."""

from __future__ import annotations

from typing import Any

import torch

from ...errors import ImplNotAvailableError
from ...ops import fused_linear_cpo_loss as _cpo
from ...ops import fused_linear_dpo_loss as _dpo
from ...ops import fused_linear_grpo_loss as _grpo
from ...ops import fused_linear_kto_loss as _kto
from ...ops import fused_linear_orpo_loss as _orpo
from ...ops import fused_linear_simpo_loss as _simpo
from .._linear_logps import Head
from . import _token_logps

HEAD = Head(_token_logps)


def _head(op: Any, hidden: Any) -> Head:
    """The Triton head; fp64 is the torch impl's (fp32 math): refused, naming the op."""
    if hidden.dtype == torch.float64:
        raise ImplNotAvailableError(op.OP_ID, "triton", "dtype float64 not supported (fp32 math); use impl='torch'", ["torch"])
    return HEAD


def fused_linear_dpo_loss(*args: Any) -> Any:
    return _dpo.chunked(_head(_dpo, args[0]), *args)


def fused_linear_orpo_loss(*args: Any) -> Any:
    return _orpo.chunked(_head(_orpo, args[0]), *args)


def fused_linear_cpo_loss(*args: Any) -> Any:
    return _cpo.chunked(_head(_cpo, args[0]), *args)


def fused_linear_simpo_loss(*args: Any) -> Any:
    return _simpo.chunked(_head(_simpo, args[0]), *args)


def fused_linear_kto_loss(*args: Any) -> Any:
    return _kto.chunked(_head(_kto, args[0]), *args)


def fused_linear_grpo_loss(*args: Any) -> Any:
    return _grpo.chunked(_head(_grpo, args[0]), *args)
