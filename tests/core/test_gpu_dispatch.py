"""Dispatcher behaviour that needs a CUDA device: per-device decisions, CUDA-graph capture."""

import pytest
import torch

import polykernel
from polykernel.ops.rms_norm import reference
from polykernel.spec import CapabilityRequirement, PlatformInfo

pytestmark = pytest.mark.gpu


def test_platform_detect_cuda_tensor():
    info = PlatformInfo.detect(torch.zeros(1, device="cuda"))
    assert info.device_type == "cuda" and info.cuda_arch == torch.cuda.get_device_capability()
    assert info.device_index == torch.cuda.current_device()


def test_cpu_and_cuda_tensors_get_their_own_impl_in_one_process(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    polykernel.clear_caches()
    cpu = (torch.randn(8, 64), torch.randn(64))
    gpu = tuple(t.cuda() for t in cpu)
    assert polykernel.explain("rms_norm", *gpu).chosen == "triton"
    assert polykernel.explain("rms_norm", *cpu).chosen == "torch"
    y_gpu, y_cpu = polykernel.rms_norm(*gpu), polykernel.rms_norm(*cpu)
    torch.testing.assert_close(y_gpu.cpu(), y_cpu, atol=1e-5, rtol=1e-5)
    # Interleaved calls keep using each device's decision (memo per device).
    for _ in range(3):
        polykernel.rms_norm(*cpu)
        polykernel.rms_norm(*gpu)
    keys = {k[0][0].type for k in polykernel.core.registry.get_op("rms_norm")._memo}
    assert keys == {"cpu", "cuda"}


def test_graph_capture_excludes_unsafe_impls():
    calls = []

    def unsafe(x, weight, eps, offset, casting):
        calls.append("liger")
        return reference(x, weight, eps, offset, casting)

    polykernel.register_impl(
        op="rms_norm", backend="liger", rank=1, cuda_graph_safe=False, capabilities=frozenset({CapabilityRequirement.CUDA})
    )(unsafe)
    x, w = torch.randn(8, 64, device="cuda"), torch.randn(64, device="cuda")
    polykernel.rms_norm(x, w)
    # On CUDA the decision's first call is verified (POLYKERNEL_VERIFY=first): the impl runs once
    # on copies of the inputs, then for the call itself, so it is called twice here, not once.
    assert calls and set(calls) == {"liger"}, calls
    eager_calls = len(calls)
    polykernel.rms_norm(x, w, impl="triton")  # compile the triton kernel outside the capture
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        y = polykernel.rms_norm(x, w)
    graph.replay()
    torch.cuda.synchronize()
    assert len(calls) == eager_calls  # not called during capture
    torch.testing.assert_close(y, reference(x, w), atol=1e-5, rtol=1e-5)
