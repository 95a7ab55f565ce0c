"""polykernel.nn audited as a drop-in: arguments another module's signature would put in a place
ours reads differently, options changed after construction, and defaults that differ from the
module a class names (each must be said in its docstring). test_nn.py and test_nn_dropin.py have
the parity tests."""

from __future__ import annotations

import importlib
import importlib.util
import inspect

import pytest
import torch

import polykernel
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


# ------------------------------------------------------------------------------------------------
# Preference modules: options are attributes, as on Liger's modules


PREFERENCE = [
    (pnn.FusedLinearDPOLoss, "beta", 0.5),
    (pnn.FusedLinearORPOLoss, "beta", 0.5),
    (pnn.FusedLinearCPOLoss, "alpha", 0.0),
    (pnn.FusedLinearSimPOLoss, "gamma", 1.5),
    (pnn.FusedLinearKTOLoss, "beta", 0.5),
]


def _call(cls, m):
    torch.manual_seed(0)
    h, w = torch.randn(4, 5, 16), 0.3 * torch.randn(50, 16)
    t = torch.randint(0, 50, (4, 5))
    if cls is pnn.FusedLinearKTOLoss:
        return m(h, w, t, torch.tensor([True, False, True, False]), kl=0.1)
    return m(h, w, t)


@pytest.mark.parametrize("cls, name, value", PREFERENCE, ids=[c[0].__name__ for c in PREFERENCE])
def test_preference_options_set_as_attributes_take_effect(cls, name, value):
    # Liger's modules keep each option as an attribute that forward reads: `loss_fn.beta = 0.5`
    # there changes the loss; here it set an attribute nothing read (silently the old beta)
    m = cls()
    assert getattr(m, name) == cls._options[name]
    setattr(m, name, value)
    assert getattr(m, name) == value and f"{name}={value!r}" in repr(m)
    torch.testing.assert_close(_call(cls, m).loss, _call(cls, cls(**{name: value})).loss)
    assert name not in vars(m)  # one place holds the option


def test_preference_option_attributes_are_checked():
    m = pnn.FusedLinearDPOLoss(beta=0.2)
    with pytest.raises(polykernel.OpArgumentError, match=r"FusedLinearDPOLoss.*beta"):
        m.beta = -1.0
    assert m.beta == 0.2  # a refused value leaves the option as it was
    with pytest.raises(TypeError, match="average_log_prob"):
        m.average_log_prob = "yes"
    m.note = "kept"  # other attributes are ordinary ones
    assert m.note == "kept"
    with pytest.raises(AttributeError):
        m.gamma  # noqa: B018 (SimPO's option, not DPO's)


# ------------------------------------------------------------------------------------------------
# Defaults that differ from the named module: said in the docstring


def _liger(module: str, name: str):
    if importlib.util.find_spec("liger_kernel") is None:
        pytest.skip("liger_kernel is not installed")
    return getattr(importlib.import_module(module), name)


def _defaults(cls) -> dict[str, object]:
    return {k: p.default for k, p in inspect.signature(cls.__init__).parameters.items() if p.default is not inspect.Parameter.empty}


PAIRS = ["DPO", "GRPO", "ORPO", "CPO", "SimPO", "KTO"]


@pytest.mark.parametrize("kind", PAIRS)
def test_preference_docstrings_name_every_default_that_differs_from_ligers(kind):
    # FusedLinearSimPOLoss() is beta=2.0 where LigerFusedLinearSimPOLoss() is beta=0.1, and GRPO's
    # loss_type "grpo" where Liger's is "dapo": a user swapping modules gets another loss
    ours = getattr(pnn, f"FusedLinear{kind}Loss")
    theirs = _defaults(_liger("liger_kernel.chunked_loss", f"LigerFusedLinear{kind}Loss"))
    differ = [k for k, v in ours._options.items() if k in theirs and theirs[k] != v]
    for name in differ:
        assert f"``{name}``" in ours.__doc__ and repr(theirs[name]) in ours.__doc__, f"{ours.__name__}: Liger's {name} default"
    if theirs.get("compute_nll_loss") is True and not {"compute_nll_loss", "alpha"} & set(ours._options):
        # Liger adds an NLL term by default (SimPO): ours has none, which must be said (CPO's
        # alpha=1.0 adds it as Liger's does)
        assert "``compute_nll_loss``" in ours.__doc__, f"{ours.__name__}: Liger's default NLL term"


def test_kl_div_docstring_names_torchs_and_ligers_mean_default():
    # the docstring said batchmean was Liger's default too: LigerKLDIVLoss() inherits
    # torch.nn.KLDivLoss's "mean"
    liger = _liger("liger_kernel.transformers", "LigerKLDIVLoss")
    assert liger().reduction == torch.nn.KLDivLoss().reduction == "mean" != pnn.KLDivLoss().reduction
    assert "Liger's default too" not in pnn.KLDivLoss.__doc__
    assert "LigerKLDIVLoss" in pnn.KLDivLoss.__doc__ and '``"mean"``' in pnn.KLDivLoss.__doc__
