"""The torch impls of the fused preference/RL losses: the chunked driver
(:mod:`._linear_logps`) with the torch per-token primitive (:mod:`._token_logps`); the losses'
formulas live in their op files (``polykernel.ops.fused_linear_*_loss``)."""

from __future__ import annotations

from typing import Any

from ...ops import fused_linear_cpo_loss as _cpo
from ...ops import fused_linear_dpo_loss as _dpo
from ...ops import fused_linear_grpo_loss as _grpo
from ...ops import fused_linear_kto_loss as _kto
from ...ops import fused_linear_orpo_loss as _orpo
from ...ops import fused_linear_simpo_loss as _simpo


def fused_linear_dpo_loss(*args: Any) -> Any:
    return _dpo.chunked("torch", *args)


def fused_linear_orpo_loss(*args: Any) -> Any:
    return _orpo.chunked("torch", *args)


def fused_linear_cpo_loss(*args: Any) -> Any:
    return _cpo.chunked("torch", *args)


def fused_linear_simpo_loss(*args: Any) -> Any:
    return _simpo.chunked("torch", *args)


def fused_linear_kto_loss(*args: Any) -> Any:
    return _kto.chunked("torch", *args)


def fused_linear_grpo_loss(*args: Any) -> Any:
    return _grpo.chunked("torch", *args)
