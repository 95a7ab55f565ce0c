"""The FlashInfer prebuild: one build_jit_specs call with the spec of every JIT module our
adapters reach (a fake flashinfer here; the real build runs in the H200 plan's serving parts)."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from polykernel.backends.flashinfer import _prebuild

ADAPTERS = Path(_prebuild.__file__).parent


@pytest.fixture
def fake_flashinfer(monkeypatch):
    built: list[list[str]] = []

    def spec(name):
        return types.SimpleNamespace(name=name)

    mods = {
        "flashinfer": types.ModuleType("flashinfer"),
        "flashinfer.jit": types.ModuleType("flashinfer.jit"),
        "flashinfer.jit.core": types.SimpleNamespace(build_jit_specs=lambda specs: built.append([s.name for s in specs])),
        "flashinfer.jit.activation": types.SimpleNamespace(gen_act_and_mul_module=lambda act: spec(f"{act}_and_mul")),
        "flashinfer.jit.norm": types.SimpleNamespace(gen_norm_module=lambda: spec("norm")),
        "flashinfer.jit.rope": types.SimpleNamespace(gen_rope_module=lambda: spec("rope")),
    }
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    return built


def test_one_parallel_build_of_every_module(fake_flashinfer, capsys):
    assert _prebuild.main() == 0
    assert fake_flashinfer == [["silu_and_mul", "gelu_and_mul", "norm", "rope"]]
    assert "4 JIT modules ready" in capsys.readouterr().out


def test_every_flashinfer_module_an_adapter_imports_is_prebuilt():
    """An adapter that starts calling another FlashInfer module must add it to MODULES."""
    covered = {"activation", "norm", "rope"}
    assert {m.rsplit(".", 1)[1] for m, _, _ in _prebuild.MODULES} == covered
    for f in ADAPTERS.glob("*.py"):
        if f.name.startswith("_") or f.name == "manifest.py":
            continue
        for line in f.read_text().splitlines():
            if line.startswith("from flashinfer"):
                sub = line.split()[1].split(".")[1]
                assert sub in covered, (f.name, line)


def test_without_flashinfer_nothing_is_built(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "flashinfer.jit.core", None)  # its import raises ImportError
    assert _prebuild.main() == 0
    assert "not importable" in capsys.readouterr().out
