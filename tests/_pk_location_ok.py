"""Imported lazily by test_dispatch through declare_op_locations; counts its imports."""

import polykernel
from polykernel.spec import KernelSpec

IMPORTS = getattr(__import__("builtins"), "_pk_location_imports", 0) + 1
__import__("builtins")._pk_location_imports = IMPORTS


def quack_rms_norm(x, weight, eps, offset, casting):
    return polykernel.rms_norm(x, weight, eps, offset=offset, casting=casting, impl="torch") + 0


polykernel.register_impl(KernelSpec("norm.rms_norm", "quack", "_pk_location_ok:quack_rms_norm", rank=1))
