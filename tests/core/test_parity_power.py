"""The parity checks can fail: a mutant (an op's reference with ONE realistic bug) must fail
``check_parity`` on the op's own cases. A small fixed set per op family, on small cases; the full
mutation table is benchmarks/parity_power.py's. The rms_norm and layer_norm eps mutants survived
every bf16 case before the ops had a row whose mean of squares is near eps ("4x64-tiny")."""

from __future__ import annotations

import pytest
import torch

import polykernel
from _parity_mutants import MUTANTS, grad_scaled, out_scaled
from polykernel.core import registry
from polykernel.ops import fused_linear_jsd, fused_linear_orpo_loss, moe_experts, rms_norm
from polykernel.spec import CapabilityRequirement
from polykernel.testing import check_parity, isolated

F32, BF16 = torch.float32, torch.bfloat16

# (op, mutant, impl or MUTANTS key, case labels, dtypes)
POWER = [
    ("norm.rms_norm", "eps outside sqrt", None, ["4x64-tiny"], [BF16]),
    ("norm.rms_norm", "eps x10", None, ["4x64-tiny"], [BF16]),
    ("norm.layer_norm", "eps x10", None, ["4x64-tiny"], [BF16]),
    ("norm.rms_norm", "out*1.001", out_scaled(rms_norm.reference, 1.001), ["3x7"], [F32]),  # bf16: below its rounding
    ("norm.rms_norm", "dweight*1.01", grad_scaled(rms_norm.reference, 1, 1.01), ["3x7"], [F32, BF16]),
    ("norm.rms_norm", "mean of squares in x dtype", None, ["4x64-fp32w"], [BF16]),
    ("activation.swiglu", "gate/up swapped", None, None, [F32, BF16]),
    ("activation.geglu", "approximate ignored", None, None, [F32]),
    ("activation.softmax", "softmax in x dtype", None, ["2x5x33"], [BF16]),
    ("loss.cross_entropy", "ignored rows in mean denominator", None, ["13x3001-ignored"], [F32, BF16]),
    ("loss.cross_entropy", "z_loss dropped", None, ["8x1000-zloss-none"], [F32, BF16]),
    ("loss.cross_entropy", "softcap twice", None, ["8x3001-softcap"], [F32, BF16]),
    ("embedding.rope", "neox/gptj swapped", None, ["1x3x7x32-B1"], [F32, BF16]),
    ("moe.moe_router", "renormalize ignored", None, ["13x8-k2"], [F32, BF16]),
    ("moe.moe_experts", "dgate_up_proj*1.01", grad_scaled(moe_experts.reference, 3, 1.01), None, [F32]),
    # fused_linear_jsd's and ORPO's gradient bounds summed worst cases (the log-probs' error times
    # |∂ row/∂x| + |∂ row/∂y| with |x|, |y| factors; ORPO's mean log-probs as T-token sums): these
    # mutants survived every case, and fused_linear_jsd's out*1.001 too
    (
        "loss.fused_linear_jsd",
        "dstudent_hidden*1.01",
        grad_scaled(fused_linear_jsd.reference, 0, 1.01),
        ["1x8x1000", "12x24x1000-beta0-t2", "8x16x1200-teacher-h40"],
        [F32],
    ),
    (
        "loss.fused_linear_jsd",
        "dstudent_weight*1.01",
        grad_scaled(fused_linear_jsd.reference, 1, 1.01),
        ["1x8x1000", "12x24x1000-beta0-t2"],
        [F32],
    ),
    ("loss.fused_linear_jsd", "out*1.001", out_scaled(fused_linear_jsd.reference, 1.001), ["17x32x3001-ignored"], [F32]),
    (
        "loss.fused_linear_orpo_loss",
        "dhidden*1.01",
        grad_scaled(fused_linear_orpo_loss.reference, 0, 1.01),
        ["4x6x16x97-beta", "6x5x24x300"],
        [F32],
    ),
]


def _cases(op, dtype, labels):
    cases = op.cases("cpu", dtype)
    if labels is None:  # the op's smallest case with every gradient
        return [min(cases, key=lambda c: sum(a.numel() for a in c.args if isinstance(a, torch.Tensor)) or 1e18)]
    return [c for c in cases if c.label in labels]


@pytest.mark.parametrize(("op_id", "name", "impl", "labels", "dtypes"), POWER, ids=[f"{p[0]}-{p[1]}" for p in POWER])
def test_mutant_is_killed(op_id, name, impl, labels, dtypes):
    op = registry.get_op(op_id)
    fn = impl or MUTANTS[op_id][name]
    with isolated():
        polykernel.register_impl(op=op.name, backend="cuda_jit", rank=1, capabilities=frozenset({CapabilityRequirement.CPU}))(fn)
        for dtype in dtypes:
            cases = _cases(op, dtype, labels)
            assert cases, f"{op_id} has no case {labels}"
            results = check_parity(op, ["cuda_jit"], dtypes=[dtype], cases=cases)
            assert not all(r.ok for r in results), f"{op_id} {name!r} survived {dtype}:\n" + "\n".join(map(str, results))
