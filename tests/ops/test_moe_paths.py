"""The Triton MoE impls' two paths: ``torch._grouped_mm`` with our kernels around it
(backends/triton/_grouped_mm.py), and our own grouped GEMMs (_grouped.py). On a GPU the first
runs for 16-bit dtypes; on the CPU the second, so here each path is forced in turn and checked
against the reference (forward and every gradient, within the op's error model), with awkward
routings, double backward and the path's refusals."""

import pytest
import torch

import _moe_helpers as moe
import polykernel
from _spies import count_calls
from polykernel.backends.triton import _grouped_mm
from polykernel.ops import moe_experts as op
from polykernel.ops import moe_experts_gpt_oss as oss_op
from polykernel.testing import assert_parity, runnable_impls

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")

OPS = {"moe_experts": op, "moe_experts_gpt_oss": oss_op}


def _need_triton(device="cpu", dtype=torch.float32):
    if "triton" not in runnable_impls("moe_experts", device, dtype):
        pytest.skip("triton not runnable here")


def _need_grouped_mm(device="cpu", dtype=torch.float32):
    from polykernel.backends.torch import moe_experts as torch_moe

    why = torch_moe.grouped_mm_refusal(
        torch.zeros(2, 16, device=device, dtype=dtype),
        torch.zeros(1, 32, 16, device=device, dtype=dtype),
        torch.zeros(1, 16, 16, device=device, dtype=dtype),
    )
    if why:
        pytest.skip(why)


@pytest.mark.parametrize("name", sorted(OPS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_grouped_mm_path_matches_the_reference(name, dtype, monkeypatch):
    # (our kernels' path is the CPU's default: test_moe_experts.py and test_moe_experts_gpt_oss.py check it)
    _need_triton()
    _need_grouped_mm()
    monkeypatch.setattr(_grouped_mm, "MODE", "grouped_mm")
    assert_parity(name, ["triton"], device="cpu", dtypes=[dtype])


def _spy(monkeypatch):
    return count_calls(monkeypatch, _grouped_mm, "forward")


@pytest.mark.parametrize("name", sorted(OPS))
def test_the_forced_path_is_the_one_that_runs(name, monkeypatch):
    # guards the parity test above: it must exercise the path it names
    _need_triton()
    _need_grouped_mm()
    calls = _spy(monkeypatch)
    case = OPS[name].example((8, 32, 32, 4, 2), torch.float32, "cpu", requires_grad=True)
    fn = getattr(polykernel, name)
    for mode, expect in (("kernels", 0), ("grouped_mm", 1)):
        monkeypatch.setattr(_grouped_mm, "MODE", mode)
        calls.clear()
        fn(*case.args, **case.kwargs, impl="triton").sum().backward()
        assert len(calls) == expect, mode


def test_auto_mode_keeps_the_cpu_and_deterministic_mode_on_our_kernels(monkeypatch):
    _need_triton()
    calls = _spy(monkeypatch)
    case = op.example((8, 32, 32, 4, 2), torch.bfloat16, "cpu", requires_grad=True)
    polykernel.moe_experts(*case.args, impl="triton").sum().backward()
    assert not calls  # auto: this path on a GPU only
    monkeypatch.setattr(_grouped_mm, "MODE", "grouped_mm")
    torch.use_deterministic_algorithms(True)
    try:
        polykernel.moe_experts(*case.args, impl="triton").sum().backward()
    finally:
        torch.use_deterministic_algorithms(False)
    assert not calls  # torch._grouped_mm makes no determinism promise


def test_grouped_mm_path_double_backward_matches_the_reference(monkeypatch):
    _need_triton()
    _need_grouped_mm()
    monkeypatch.setattr(_grouped_mm, "MODE", "grouped_mm")
    case = op.example((6, 16, 32, 3, 2), torch.float32, "cpu", requires_grad=True)
    hidden, index, weights, gate_up, down = case.args

    def second_order(fn):
        out = fn(hidden, index, weights, gate_up, down)
        (dx,) = torch.autograd.grad(out, hidden, torch.ones_like(out), create_graph=True)
        return torch.autograd.grad(dx.pow(2).sum(), (weights, down))

    ours = second_order(lambda *a: polykernel.moe_experts(*a, impl="triton"))
    for a, b in zip(ours, second_order(op.reference)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", sorted(OPS))
def test_grouped_mm_path_backward_twice_with_retain_graph(name, monkeypatch):
    # the first backward writes its gate/up gradient over the saved gate/up activations; a
    # second backward through the kept graph recomputes them and gives the same gradients
    _need_triton()
    _need_grouped_mm()
    monkeypatch.setattr(_grouped_mm, "MODE", "grouped_mm")
    case = OPS[name].example((9, 32, 32, 4, 2), torch.float32, "cpu", requires_grad=True)
    out = getattr(polykernel, name)(*case.args, impl="triton")
    leaves = [a for a in case.args if a.requires_grad]
    first = torch.autograd.grad(out, leaves, torch.ones_like(out), retain_graph=True)
    second = torch.autograd.grad(out, leaves, torch.ones_like(out), retain_graph=True)
    third = torch.autograd.grad(out, leaves, torch.ones_like(out))
    for a, b, c in zip(first, second, third):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_grouped_mm_path_backward_writes_the_gate_up_gradient_over_its_saved_input(monkeypatch):
    # the memory property at its root: the activation's backward kernel reads gate/up and
    # writes their gradient into the same buffer, not into a second [S, 2I] one
    _need_triton()
    _need_grouped_mm()
    monkeypatch.setattr(_grouped_mm, "MODE", "grouped_mm")
    seen = []
    real = _grouped_mm.launch

    def spy(kernel, grid, *args, **kw):
        if kernel is _grouped_mm._act_bwd_kernel:
            seen.append((args[0].data_ptr(), args[6].data_ptr()))  # GU, DGU
        return real(kernel, grid, *args, **kw)

    monkeypatch.setattr(_grouped_mm, "launch", spy)
    case = op.example((9, 32, 32, 4, 2), torch.float32, "cpu", requires_grad=True)
    polykernel.moe_experts(*case.args, impl="triton").sum().backward()
    assert seen and all(gu == dgu for gu, dgu in seen)


@pytest.mark.parametrize("name", sorted(OPS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_which_cases_run_our_kernels_in_auto_mode(name, dtype):
    # What the GPU tests' split rests on (tests/_moe_helpers.py): in MODE "auto" on a GPU the
    # grouped_mm path refuses the odd sizes and the strided case, so the GPU parity of the
    # test_moe_experts*.py files runs our grouped GEMMs on them unforced, and the forced run below
    # needs only the routings that grouped_mm would otherwise take.
    from polykernel.core.op import Case
    from polykernel.ops import _moe

    _need_grouped_mm("cpu", dtype)
    mod = OPS[name]
    refused = lambda args: moe.grouped_mm_refusal(mod, args)
    cases = {c.label: c for c in mod.cases("cpu", dtype)}
    odd = "9x17x23-E3-k2-odd-clamped" if name == "moe_experts_gpt_oss" else "9x17x23-E3-k2-odd"
    assert "multiples of 16 bytes" in (refused(cases[odd].args) or "")
    if name == "moe_experts":
        assert "contiguous" in (refused(cases["7x24x40-E5-k2-strided"].args) or "")
    spec = next(s for s in _moe.large_routings() if s.label == "1031x1000x700-E9-k3-odd")
    large_odd = Case(spec.label, mod.example(spec[1:6], dtype, "cpu").args)
    assert "multiples of 16 bytes" in (refused(large_odd.args) or "")
    for label in moe.KERNELS_GPU_LABELS:  # these need forcing: grouped_mm takes them
        assert refused(cases[label].args) is None, label
    # float16's triton cases on the GPU: those on the grouped_mm path and the small odd one
    kept = {c.label for c in moe.triton_gpu_cases(mod, [*cases.values(), large_odd], dtype)}
    dropped = {"7x24x40-E5-k2-strided", spec.label} if dtype == torch.float16 else set()
    assert kept == {*cases, spec.label} - dropped


# ---------------------------------------------------------------------------------------------
# GPU: the grouped_mm path is the default there for 16-bit dtypes; the GPU parity of
# test_moe_experts.py and test_moe_experts_gpt_oss.py checks it (MODE "auto", every impl; the
# triton impl's float16 cases: moe.triton_gpu_cases), and our kernels on the cases it refuses
# (above). Here our kernels, forced, on the routings it takes.


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(OPS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_our_kernels_on_the_routings_grouped_mm_takes(name, dtype, monkeypatch):
    _need_triton("cuda", dtype)
    monkeypatch.setattr(_grouped_mm, "MODE", "kernels")  # compile-bound on a fresh machine: two cases
    assert_parity(name, ["triton"], device="cuda", dtypes=[dtype], cases=moe.kernels_gpu_cases(OPS[name], dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(OPS))
def test_gpu_grouped_mm_path_at_a_model_shape(name):
    # one Qwen3-MoE-like layer (E = 64, k = 8, uneven expert loads) in bf16 against the
    # reference in fp32 on the same device: relative error of the output and every gradient
    _need_triton("cuda", torch.bfloat16)
    _need_grouped_mm("cuda", torch.bfloat16)
    mod = OPS[name]
    torch.manual_seed(0)
    case = mod.example((1024, 512, 256, 64, 8), torch.bfloat16, "cuda", requires_grad=True)
    fn = getattr(polykernel, name)
    out = fn(*case.args, impl="triton")
    dy = torch.randn_like(out)
    leaves = [a for a in case.args if a.requires_grad]
    grads = torch.autograd.grad(out, leaves, dy)
    ref_args = [a.detach().float().requires_grad_() if a.is_floating_point() else a for a in case.args]
    ref = mod.reference(*ref_args)
    ref_grads = torch.autograd.grad(ref, [a for a in ref_args if a.requires_grad], dy.float())
    for got, want in zip((out, *grads), (ref, *ref_grads)):
        err = ((got.float() - want).norm() / want.norm()).item()
        assert err < 2e-2, err  # bf16 operands, fp32 accumulation: ~4e-3 expected


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_grouped_mm_probe_is_not_fooled_by_the_callers_grad_mode(monkeypatch, mode):
    # The probe runs forward and backward once per device and dtype and is remembered: a first MoE
    # call under no_grad / inference_mode must not record "no torch._grouped_mm here" for good.
    from polykernel import _compat
    from polykernel.backends import _moe_experts

    if _compat.grouped_mm is None:
        pytest.skip("no torch._grouped_mm here")
    monkeypatch.setattr(_moe_experts, "_probed", {})
    want = _moe_experts._probe(torch.device("cpu"), torch.float32)  # under grad mode
    monkeypatch.setattr(_moe_experts, "_probed", {})
    with torch.no_grad() if mode == "no_grad" else torch.inference_mode():
        got = _moe_experts._probe(torch.device("cpu"), torch.float32)
    assert got == want
