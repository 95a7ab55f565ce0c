"""``polykernel.testing.isolated()`` (the suite's per-test reset) puts an op's declared impls back
even when the op was first loaded inside the block and a registration there replaced one by name;
and an impl registered before its op's module is first imported is not overwritten by the op's
own declaration of that name (the user's registration was explicit)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

# A fresh process: rms_norm must not be loaded before the block, as in a test that happens to be
# the first of its worker to touch the op.
SCRIPT = textwrap.dedent(
    """
    import polykernel
    from polykernel.core import registry
    from polykernel.testing import isolated

    assert registry.loaded_op("norm.rms_norm") is None
    with isolated():
        @polykernel.register_impl(op="rms_norm", backend="torch_compile", rank=1)
        def planted(x, weight, eps, offset, casting):
            return x
        assert registry.specs_for("rms_norm")["torch_compile"].target == "__main__:planted"
    specs = registry.specs_for("rms_norm")
    print(specs["torch_compile"].target)
    print(registry.load_impl(specs["torch_compile"]).__module__)
    """
)


def test_a_declared_impl_replaced_inside_the_block_comes_back():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["polykernel.backends.torch_compile.rms_norm:rms_norm", "polykernel.backends.torch_compile._compiled"]
