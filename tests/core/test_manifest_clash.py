"""An impl is declared once (issue 36): an op's built-in impls are the union of the backends'
manifests and the op file's own table (``polykernel.backends.declared``, merged by
``registry.add_op``). The same impl declared in an op file and in a manifest, or in two manifests,
is a clear error that names where it is declared, not a silent choice of one row.

A toy op (outside the catalog) and toy manifests (``polykernel.backends.manifests`` monkeypatched),
inside ``polykernel.testing.isolated()``: nothing of them is left for other tests.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from polykernel import backends
from polykernel.backends.torch import TORCH
from polykernel.backends.triton import TRITON
from polykernel.core import registry
from polykernel.core.op import Bounds, ErrorModel, Op
from polykernel.testing import isolated

OP_ID = "test.pk_manifest_clash_op"


def _reference(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def _toy_op(impls=()) -> Op:
    return Op(
        OP_ID,
        fields=("device", "dtype", "needs_grad"),
        key=lambda x: (x.device, x.dtype, torch.is_grad_enabled() and x.requires_grad),
        default_key=lambda device, dtype: (device, dtype, False),
        reference=_reference,
        error_model=lambda *a, **k: Bounds(outputs=(ErrorModel(),), grads={0: ErrorModel()}),
        dtypes=(torch.float32,),
        cases=lambda device, dtype, large=False: [],
        example=lambda *a, **k: None,
        impls=impls,
    )


def _manifest(name: str, row) -> SimpleNamespace:
    """A toy manifest module: its ``__name__`` and its ``IMPLS`` (op id -> impl row)."""
    return SimpleNamespace(__name__=f"polykernel.backends.{name}.manifest", IMPLS={OP_ID: row})


@pytest.fixture
def fake_manifests(monkeypatch):
    """Set the manifests the registry reads (the real ones plus the toys given)."""
    real = backends.manifests()

    def use(*toys: SimpleNamespace) -> None:
        monkeypatch.setattr(backends, "manifests", lambda: (*real, *toys))

    with isolated():
        yield use


def test_an_op_file_and_a_manifest_together_give_the_op_its_impls(fake_manifests):
    # the control: distinct impls from the two places are merged
    fake_manifests(_manifest("triton", TRITON.impl(rank=10, target=f"{__name__}:_reference")))
    _toy_op(impls=[TORCH.impl(rank=100, target=f"{__name__}:_reference").spec(OP_ID)])
    assert sorted(s.impl for s in registry.builtin_impls(OP_ID)) == ["torch", "triton"]


def test_an_impl_in_the_op_file_and_in_a_manifest_is_an_error(fake_manifests):
    fake_manifests(_manifest("triton", TRITON.impl(rank=10, target=f"{__name__}:_reference")))
    with pytest.raises(
        ValueError, match=rf"{OP_ID}: impl triton declared both by the op file and by polykernel\.backends\.triton\.manifest"
    ):
        _toy_op(impls=[TRITON.impl(rank=10, target=f"{__name__}:_reference").spec(OP_ID)])
    assert registry.loaded_op(OP_ID) is None  # refused whole: nothing of it registered


def test_an_impl_in_two_manifests_is_an_error(fake_manifests):
    # a second package's manifest declaring the triton backend's impl for the op
    fake_manifests(
        _manifest("triton", TRITON.impl(rank=10, target=f"{__name__}:_reference")),
        _manifest("peers", TRITON.impl(rank=20, target=f"{__name__}:_reference")),
    )
    with pytest.raises(
        ValueError,
        match=rf"{OP_ID}: impl triton declared by more than one backend manifest "
        r"\(polykernel\.backends\.triton\.manifest, polykernel\.backends\.peers\.manifest\)",
    ):
        backends.declared(OP_ID)
    with pytest.raises(ValueError, match="more than one backend manifest"):
        _toy_op()
    assert registry.loaded_op(OP_ID) is None
