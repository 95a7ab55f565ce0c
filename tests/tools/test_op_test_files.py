"""Every op in the catalog (``polykernel.ops.OP_MODULES``) has its own test file, so that a new op
without one fails here.

The rule, op id -> file: ``tests/ops/test_<name>.py``, where ``<name>`` is the op id after its
family's dot, kept as it is (a trailing underscore too): ``norm.rms_norm`` -> ``test_rms_norm.py``,
``serving.fused_add_rms_norm_`` -> ``test_fused_add_rms_norm_.py``, ``loss.fused_linear_dpo_loss``
-> ``test_fused_linear_dpo_loss.py``. Checks the several ops share (a family's driver, the serving
ops' memory rules) may live in other files; each op's file holds at least a parity test of its impls
against the reference (``def test_..parity..``), a bad-argument test (``def test_..bad..`` or
``..error..``, ``..raises..``) and a GPU test (``@pytest.mark.gpu``). A source scan: nothing runs.
"""

from __future__ import annotations

import re
from pathlib import Path

from polykernel.ops import OP_MODULES

OPS_TESTS = Path(__file__).resolve().parents[1] / "ops"

PARITY = re.compile(r"^def test_\w*parity", re.M)
BAD_ARGUMENT = re.compile(r"^def test_\w*(bad|error|invalid|raises|refus|reject)", re.M)
GPU = re.compile(r"^@pytest\.mark\.gpu\b", re.M)


def op_test_file(op_id: str) -> Path:
    """The test file of op ``op_id`` (the rule above)."""
    family, dot, name = op_id.partition(".")
    assert dot and family and name, f"op id {op_id!r} is not 'family.name'"
    return OPS_TESTS / f"test_{name}.py"


def test_the_rule_maps_op_ids_to_file_names():
    assert op_test_file("norm.rms_norm").name == "test_rms_norm.py"
    assert op_test_file("serving.fused_add_rms_norm_").name == "test_fused_add_rms_norm_.py"
    assert op_test_file("norm.fused_add_rms_norm") != op_test_file("serving.fused_add_rms_norm_")


def test_every_op_has_its_test_file():
    assert len(OP_MODULES) >= 35
    missing = sorted(str(op_test_file(op).relative_to(OPS_TESTS.parent)) for op in OP_MODULES if not op_test_file(op).is_file())
    assert missing == [], f"ops without their tests/ops/test_<name>.py: {missing}"


def test_each_op_file_has_parity_bad_argument_and_gpu_tests():
    lacking = {}
    for op in sorted(OP_MODULES):
        path = op_test_file(op)
        if not path.is_file():
            continue  # the test above names it
        src = path.read_text()
        gaps = [what for what, pattern in (("parity", PARITY), ("bad argument", BAD_ARGUMENT), ("gpu", GPU)) if not pattern.search(src)]
        if gaps:
            lacking[op] = gaps
    assert lacking == {}, f"op test files lacking tests: {lacking}"
