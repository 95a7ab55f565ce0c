"""The torch impls of the fused preference/RL losses: each loss's formula (its op file's
``chunked``) through the chunked driver (``polykernel.backends._linear_logps``) with the
torch per-token primitive (``polykernel.backends._token_logps``)."""

from __future__ import annotations

from typing import Any

from ...ops import fused_linear_cpo_loss as _cpo
from ...ops import fused_linear_dpo_loss as _dpo
from ...ops import fused_linear_grpo_loss as _grpo
from ...ops import fused_linear_kto_loss as _kto
from ...ops import fused_linear_orpo_loss as _orpo
from ...ops import fused_linear_simpo_loss as _simpo
from .. import _token_logps
from .._linear_logps import Head

HEAD = Head(_token_logps)


def fused_linear_dpo_loss(*args: Any) -> Any:
    return _dpo.chunked(HEAD, *args)


def fused_linear_orpo_loss(*args: Any) -> Any:
    return _orpo.chunked(HEAD, *args)


def fused_linear_cpo_loss(*args: Any) -> Any:
    return _cpo.chunked(HEAD, *args)


def fused_linear_simpo_loss(*args: Any) -> Any:
    return _simpo.chunked(HEAD, *args)


def fused_linear_kto_loss(*args: Any) -> Any:
    return _kto.chunked(HEAD, *args)


def fused_linear_grpo_loss(*args: Any) -> Any:
    return _grpo.chunked(HEAD, *args)
