"""What serving.silu_and_mul and serving.gelu_and_mul share (each op's own checks:
tests/ops/test_<op>.py): the training GLUs' math and kernels, nothing written on a bad call."""

import pytest
import torch

import polykernel
from _serving_helpers import IMPLS, need
from polykernel.errors import OpArgumentError

# the interpreter's numpy exp overflows (harmlessly, to inf) in sigmoid for very negative inputs
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")


@pytest.mark.parametrize("impl", IMPLS)
def test_same_math_and_kernel_as_the_training_glus(impl):
    # the layout differs, not the kernel: bit for bit the training op's result on the two halves
    need("silu_and_mul", impl, torch.bfloat16)
    x = torch.randn(7, 2 * 300, dtype=torch.bfloat16)
    g, u = x[:, :300], x[:, 300:]
    assert torch.equal(polykernel.silu_and_mul(x, impl=impl), polykernel.swiglu(g, u, impl=impl))
    for approx in ("none", "tanh"):
        assert torch.equal(polykernel.gelu_and_mul(x, approximate=approx, impl=impl), polykernel.geglu(g, u, approx, impl=impl))


def test_nothing_is_written_when_validation_fails():
    x = torch.randn(4, 16)
    buf = torch.full((4, 16), 7.0)
    with pytest.raises(OpArgumentError, match="overlaps"):
        polykernel.silu_and_mul(buf, out=buf[:, :8])
    assert (buf == 7).all()
    out = torch.full((4, 8), 7.0)
    with pytest.raises(OpArgumentError, match="approximate"):
        polykernel.gelu_and_mul(x, approximate="erf", out=out)
    assert (out == 7).all()
