"""``polykernel.backends._fallback``: a backend runs another impl (the torch impl, by default) by its
registered name, resolved through the registry on the first call, so that no backend package
imports another (the independence contract in pyproject.toml's ``[tool.importlinter]``)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import polykernel
from polykernel.backends import _fallback
from polykernel.backends._fallback import registered
from polykernel.core import registry
from polykernel.errors import UnknownImplError, UnknownOpError

SRC = Path(__file__).resolve().parents[2] / "src"


def _impl(op_id: str, name: str = "torch"):
    return registry.load_impl(registry.specs_for(op_id)[name])


def test_it_runs_the_registered_torch_impl():
    fallback = registered("activation.softmax")
    assert fallback is registered("activation.softmax", "torch")  # one object per (op, name)
    assert fallback.resolve() is _impl("activation.softmax")
    assert fallback.resolve().__module__ == "polykernel.backends.torch.softmax"
    x = torch.randn(3, 7)
    torch.testing.assert_close(fallback(x), torch.softmax(x, -1), rtol=0, atol=0)
    assert "resolved" in repr(fallback) and "not" not in repr(fallback)


def test_another_name_resolves_that_impl():
    fallback = registered("norm.rms_norm", "torch_compile")
    assert fallback.resolve() is _impl("norm.rms_norm", "torch_compile")


def test_an_unknown_name_is_a_clear_error_naming_the_op_and_the_impl():
    fallback = registered("norm.rms_norm", "no_such_impl")  # not resolved yet: no error here
    with pytest.raises(UnknownImplError, match=r"norm\.rms_norm.*'no_such_impl'.*its impls are: .*torch") as err:
        fallback(torch.ones(2, 4), torch.ones(4), 1e-6, 0.0, "fp32")
    assert err.value.op == "norm.rms_norm" and err.value.impl == "no_such_impl" and "torch" in err.value.valid
    with pytest.raises(UnknownOpError):
        registered("norm.no_such_op")()


def test_it_follows_the_registry_when_the_impl_is_registered_again_or_removed():
    fallback = registered("activation.softmax")
    other = registered("norm.rms_norm")
    x = torch.randn(2, 5)
    torch_softmax = fallback.resolve()
    other.resolve()
    saved = registry.snapshot()
    try:

        @polykernel.register_impl(op="activation.softmax", backend="torch", rank=100)
        def planted(x):
            return x * 0 + 7

        assert "not resolved" in repr(fallback)  # the registration dropped what it had resolved
        assert "not resolved" not in repr(other)  # and only that op's
        assert fallback.resolve() is planted
        torch.testing.assert_close(fallback(x), torch.full_like(x, 7.0))

        registry.unregister_impl("activation.softmax", "torch")
        with pytest.raises(UnknownImplError, match=r"activation\.softmax.*'torch'"):
            fallback(x)
    finally:
        registry.restore(saved)
    assert fallback.resolve() is torch_softmax  # restore() put the torch impl back, and it is followed
    torch.testing.assert_close(fallback(x), torch.softmax(x, -1), rtol=0, atol=0)


def test_a_resolution_that_a_change_overtook_is_not_kept(monkeypatch):
    fallback = registered("activation.softmax")
    fallback.forget()
    load_impl = registry.load_impl

    def load_then_change(spec):  # the op's impls change while the function is being loaded
        fn = load_impl(spec)
        registry.changed("activation.softmax")
        return fn

    monkeypatch.setattr(_fallback.registry, "load_impl", load_then_change)
    x = torch.randn(2, 3)
    torch.testing.assert_close(fallback(x), torch.softmax(x, -1))  # this call runs what it found
    assert "not resolved" in repr(fallback)  # but the next one resolves again
    monkeypatch.undo()
    fallback(x)
    assert "not resolved" not in repr(fallback)


# A fresh process: nothing of the torch backend's impl modules is loaded before the fallback's first
# call, neither by making it nor by importing a backend module that holds one; the call then
# imports the torch impl's module alone (no other backend's).
SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    from polykernel.backends._fallback import registered

    def impl_modules():
        return {m for m in sys.modules if m.startswith("polykernel.backends.") and m.count(".") >= 3
                and m.rpartition(".")[2] not in ("manifest", "_gates")}

    fallback = registered("norm.rms_norm")
    caller = None
    try:
        import triton  # noqa: F401
    except ImportError:
        pass
    else:  # a backend module that holds a fallback
        from polykernel.backends.triton import rms_norm as caller
        assert caller._torch_rms_norm is fallback
    before = impl_modules()
    assert not {m for m in before if m.startswith("polykernel.backends.torch.")}, sorted(before)
    y = fallback(torch.ones(2, 4), torch.ones(4), 1e-6, 0.0, "fp32")
    assert y.shape == (2, 4)
    assert impl_modules() - before == {"polykernel.backends.torch.rms_norm"}, sorted(impl_modules() - before)
    print("ok")
    """
)


def test_the_torch_backend_is_imported_only_on_the_first_call():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]), "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env)
    assert out.returncode == 0 and out.stdout.split() == ["ok"], out.stderr


def test_importing_the_module_is_torch_free():
    code = "import sys; sys.modules['torch'] = None\nfrom polykernel.backends._fallback import registered\nregistered('norm.rms_norm')\n"
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
