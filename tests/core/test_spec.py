"""polykernel.spec: the torch-free metadata contract."""

import subprocess
import sys

import pytest

from polykernel.spec import (
    CapabilityRequirement,
    DeviceType,
    FormatSignature,
    KernelBackend,
    KernelSpec,
    PlatformInfo,
    capabilities_satisfied,
)

H200 = PlatformInfo("cuda", 0, (9, 0), "NVIDIA H200")
B200 = PlatformInfo("cuda", 1, (10, 0), "NVIDIA B200")
A100 = PlatformInfo("cuda", 0, (8, 0), "NVIDIA A100")
CPU = PlatformInfo("cpu", None, None, "cpu")


def test_import_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import polykernel, polykernel.spec as s\n"
        "p = s.PlatformInfo.detect(); assert p.device_type == 'cpu', p\n"
        "k = s.KernelSpec('norm.rms_norm', 'triton', 'a.b:c')\n"
        "assert (k.group, k.name, k.impl, k.accepts_subclasses) == ('norm', 'rms_norm', 'triton', False)\n"
        "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None and m == 'torch']\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env())
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_import_polykernel_does_not_import_torch():
    code = "import sys, polykernel; assert 'torch' not in sys.modules; print(polykernel.__version__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env())
    assert out.returncode == 0, out.stderr


def _env():
    import os

    env = dict(os.environ)
    src = str(__import__("pathlib").Path(__file__).resolve().parents[2] / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_enums():
    assert {b.value for b in KernelBackend} >= {"torch", "torch_compile", "triton", "cute_dsl", "cutile", "cuda_jit", "liger", "quack"}
    assert {d.value for d in DeviceType} >= {"cuda", "hip", "npu", "xpu", "cpu"}
    assert KernelBackend("triton") == "triton" and str(KernelBackend.TRITON) == "triton"


@pytest.mark.parametrize("where", [None, "cpu", "cuda:7", "not a device", 3.5, object()])
def test_detect_never_raises(where):
    info = PlatformInfo.detect(where)
    assert isinstance(info, PlatformInfo)


def test_detect_tensor_and_device():
    torch = pytest.importorskip("torch")
    assert PlatformInfo.detect(torch.zeros(1)).device is DeviceType.CPU
    assert PlatformInfo.detect(torch.device("cpu")).cuda_arch is None


def test_platform_fields_and_frozen():
    assert H200.device is DeviceType.CUDA and H200.sm == 90
    with pytest.raises(AttributeError):
        H200.name = "x"  # type: ignore[misc]


def test_capability_device_must_match():
    assert CapabilityRequirement.CUDA.is_satisfied_by(H200)
    assert not CapabilityRequirement.CUDA.is_satisfied_by(CPU)
    assert CapabilityRequirement.CPU.is_satisfied_by(CPU)
    assert not CapabilityRequirement.HIP.is_satisfied_by(H200)
    assert CapabilityRequirement.NPU.device == "npu"


def test_capability_arch_window_inclusive():
    hopper_only = CapabilityRequirement.cuda(min_sm=90, max_sm=90)
    assert hopper_only.is_satisfied_by(H200)
    assert not hopper_only.is_satisfied_by(B200)
    assert not hopper_only.is_satisfied_by(A100)
    assert CapabilityRequirement.cuda(min_sm=(9, 0)).is_satisfied_by(B200)
    assert CapabilityRequirement.cuda(min_sm=100).unmet_reason(H200) == "sm_90 < required sm_100"
    assert CapabilityRequirement.cuda(max_sm=80).unmet_reason(H200) == "sm_90 > supported sm_80"
    assert CapabilityRequirement.CUDA.unmet_reason(CPU) == "needs a CUDA device"


def test_arch_bounds_only_apply_to_cuda():
    req = CapabilityRequirement("cpu", (9, 0), None)
    assert req.is_satisfied_by(CPU)


def test_capabilities_or_semantics():
    caps = {CapabilityRequirement.cuda(min_sm=100), CapabilityRequirement.CPU}
    assert capabilities_satisfied(caps, CPU)
    assert capabilities_satisfied(caps, B200)
    assert not capabilities_satisfied(caps, H200)
    assert capabilities_satisfied(frozenset(), H200)  # empty: unrestricted
    assert capabilities_satisfied(CapabilityRequirement.CUDA, H200)  # a single one accepted
    assert hash(CapabilityRequirement.cuda(min_sm=90)) == hash(CapabilityRequirement.cuda(min_sm=(9, 0)))


def test_format_signature():
    sig = FormatSignature()
    assert sig.supported_dtypes == () and sig.supports_backward and not sig.in_place
    assert sig.supports_dtype("float64")
    torch = pytest.importorskip("torch")
    only = FormatSignature(supported_dtypes=(torch.bfloat16, "float16"))
    assert only.supported_dtypes == ("bfloat16", "float16")
    assert only.supports_dtype(torch.bfloat16) and not only.supports_dtype(torch.float32)


def test_kernel_spec_fields_and_load():
    spec = KernelSpec("norm.rms_norm", "torch", "os.path:join")
    assert (spec.group, spec.name, spec.impl, spec.rank, spec.deterministic, spec.cuda_graph_safe) == (
        "norm",
        "rms_norm",
        "torch",
        100,
        True,
        True,
    )
    assert spec.accepts_subclasses  # the torch backend goes through torch's own dispatch
    assert not KernelSpec("norm.rms_norm", "triton", "os.path:join").accepts_subclasses
    assert KernelSpec("norm.rms_norm", "triton", "os.path:join", accepts_subclasses=True).accepts_subclasses
    assert KernelSpec("rms_norm", "triton", "os.path:join").group == ""  # a bare op name has no group
    import os.path

    assert spec.load() is os.path.join
    dotted = KernelSpec("norm.rms_norm", "torch", "collections:OrderedDict.fromkeys")
    assert dotted.load().__name__ == "fromkeys"
    with pytest.raises(FrozenInstanceError):
        spec.rank = 1  # type: ignore[misc]


from dataclasses import FrozenInstanceError  # noqa: E402


@pytest.mark.parametrize("target", ["no_colon", "a:", ":b", "a b:c", "a:b:c", "1a:b"])
def test_kernel_spec_malformed_target(target):
    with pytest.raises(ValueError, match="module:attr"):
        KernelSpec("norm.rms_norm", "torch", target).load()


def test_kernel_spec_import_error_propagates():
    with pytest.raises(ModuleNotFoundError):
        KernelSpec("norm.rms_norm", "torch", "polykernel_no_such_module:f").load()


def test_kernel_spec_bad_backend():
    with pytest.raises(ValueError):
        KernelSpec("norm.rms_norm", "cuda", "a:b")


def test_kernel_spec_is_available():
    spec = KernelSpec("x.y", "cute_dsl", "a:b", capabilities={CapabilityRequirement.cuda(min_sm=90)}, requires_modules=("os",))
    assert spec.is_available(H200) and not spec.is_available(A100) and not spec.is_available(CPU)
    missing = KernelSpec("x.y", "cute_dsl", "a:b", requires_modules=("polykernel_no_such_module",))
    assert missing.unavailable_reason(CPU) == "module 'polykernel_no_such_module' not installed"
