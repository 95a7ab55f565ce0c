"""A class of unknown options (``available_impls(op, device, dtype)``, ``explain`` without
arguments, the GPU parity's impl list) must not be refused by a predicate for a field it does not
know: an impl so refused is left out of ``available_impls`` and of every parity run that lists
impls that way, although calls with real arguments select it (2026-12-05: Liger's LayerNorm,
GroupNorm and DPO were never checked on the GPU so)."""

from __future__ import annotations

import pytest
import torch

from polykernel.core import registry
from polykernel.core.selection.explain import _argkey_for


def _refuses(predicate, info) -> bool:
    try:
        return bool(predicate(info))
    except Exception:  # the verdicts' rule: a predicate that raises refuses its impl
        return True


def _refusals_of_the_unknown_class() -> list[tuple[str, str, torch.dtype]]:
    out = []
    for op_id in registry.all_op_ids():
        op = registry.get_op(op_id)
        for dtype in op.dtypes:
            info = op.arg_class(op.default_key(torch.device("cuda"), dtype))
            for name, spec in registry.specs_for(op).items():
                if spec.predicate is None or name == "torch_compile":  # (its predicate asks CUDA about capture)
                    continue
                if _refuses(spec.predicate, info):
                    out.append((op_id, name, dtype))
    return out


@pytest.mark.parametrize(("op_id", "impl", "dtype"), _refusals_of_the_unknown_class())
def test_a_refusal_of_the_unknown_class_holds_for_every_case(op_id, impl, dtype):
    # a predicate that refuses the unknown class says "never for this device and dtype": then it
    # must refuse each of the op's own cases too (else it refused for a field it did not know)
    op = registry.get_op(op_id)
    predicate = registry.specs_for(op)[impl].predicate
    for case in op.cases("cpu", dtype):
        info = op.arg_class(_argkey_for(op, case.args, case.kwargs, None, None))
        assert _refuses(predicate, info), f"{op_id}: {impl} refuses the unknown class but takes case {case.label}"


@pytest.mark.parametrize(
    ("op_id", "impl"),
    [
        ("norm.layer_norm", "liger"),
        ("norm.group_norm", "liger"),
        ("loss.fused_linear_dpo_loss", "liger"),
        ("serving.rotary_embedding_", "flashinfer"),
    ],
)
def test_the_unknown_class_is_not_refused_for_unknown_fields(op_id, impl):
    op = registry.get_op(op_id)
    dtype = torch.float32
    info = op.arg_class(op.default_key(torch.device("cuda"), dtype))
    assert registry.specs_for(op)[impl].predicate(info) is None
