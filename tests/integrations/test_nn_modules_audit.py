"""polykernel.nn audited as a drop-in: arguments another module's signature would put in a place
ours reads differently, options changed after construction, and defaults that differ from the
module a class names (each must be said in its docstring). test_nn.py and test_nn_dropin.py have
the parity tests."""

from __future__ import annotations

import pytest
import torch

import polykernel.nn as pnn

# ------------------------------------------------------------------------------------------------
# Sizes and numbers: checked, never truncated


@pytest.mark.parametrize(
    "make, name",
    [
        (lambda: pnn.SwiGLU(8, 12.7), "intermediate_size"),  # int(12.7): a 12-wide MLP, silently
        (lambda: pnn.GEGLU(8.5, 12), "hidden_size"),
        (lambda: pnn.SwiGLU(8, True), "intermediate_size"),
        (lambda: pnn.MoEExperts(3.5, 8, 12), "num_experts"),
        (lambda: pnn.MoEExperts(3, 8, 12.2), "intermediate_size"),
        (lambda: pnn.RotaryEmbedding(8.0), "head_dim"),
        (lambda: pnn.RotaryEmbedding(8, max_position_embeddings=2048.5), "max_position_embeddings"),
        (lambda: pnn.Sparsemax(dim=1.7), "dim"),  # int(1.7): dim 1, silently
    ],
)
def test_sizes_and_dims_are_ints_not_truncated_floats(make, name):
    with pytest.raises(TypeError, match=name):
        make()


@pytest.mark.parametrize(
    "make, cls, name",
    [
        (lambda: pnn.SwiGLU(0, 12), "SwiGLU", "hidden_size"),
        (lambda: pnn.MoEExperts(0, 8, 12), "MoEExperts", "num_experts"),
        (lambda: pnn.RotaryEmbedding(-8), "RotaryEmbedding", "head_dim"),  # was "negative dimension -4"
    ],
)
def test_sizes_must_be_positive_and_errors_name_the_module(make, cls, name):
    with pytest.raises(ValueError, match=rf"{cls}.*{name}"):
        make()
    # the ints torch takes still work (a tensor's item(), numpy's through __index__)
    assert pnn.SwiGLU(torch.tensor(8).item(), 12).intermediate_size == 12
    assert pnn.Sparsemax(dim=0).dim == 0


@pytest.mark.parametrize("base", [True, float("nan"), -1.0, 0.0, float("inf")])
def test_rotary_base_is_a_positive_finite_number(base):
    # base=True built inv_freq of ones (base 1), nan/-1 NaN frequencies, 0 infinite ones: silently
    # wrong cos/sin
    with pytest.raises((TypeError, ValueError), match=r"RotaryEmbedding.*base"):
        pnn.RotaryEmbedding(8, base=base)
    assert pnn.RotaryEmbedding(8, base=500000).base == 500000.0


@pytest.mark.parametrize("flag", [True, False])
def test_dyt_refuses_a_bool_init_alpha_ligers_positional_beta(flag):
    # LigerDyT(hidden_size, beta=True, init_alpha=0.5): DyT(16, False) made alpha 0.0 (every
    # output = bias) and kept a bias; DyT(16, True) made alpha 1.0
    with pytest.raises(TypeError, match=r"DyT.*init_alpha.*bias="):
        pnn.DyT(16, flag)
    with pytest.raises(ValueError, match=r"DyT.*init_alpha"):
        pnn.DyT(16, float("nan"))
    assert pnn.DyT(16, 0.8).alpha.item() == pytest.approx(0.8)


def test_rmsnorm_offset_is_checked_at_construction():
    # offset=True failed only at the first call; a string with a TypeError from the init
    for bad in (True, float("nan"), "1"):
        with pytest.raises((TypeError, ValueError), match=r"RMSNorm.*offset"):
            pnn.RMSNorm(8, offset=bad)
