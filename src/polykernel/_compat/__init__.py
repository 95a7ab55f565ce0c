"""Every private torch and Triton API polykernel uses, probed once, each with a fallback.

Private APIs move between releases. polykernel reaches each one only through this package, where it is
probed once (at import, or on first use where the probe needs an import polykernel should not pay up
front) and exposed under a plain name. Where the probe fails, the name holds the fallback: a public API
(a Python frame slower), a slower path, or the feature off. Each is recorded (:func:`fallbacks`), logged once.

``POLYKERNEL_COMPAT_FALLBACKS=1`` forces every fallback, as if each private API were missing
(``make test-fallbacks`` runs the CPU suite so). The hot path reads the callables bound here at
import, as module globals, as fast as before. This package sits in the bottom layer of the import
contract: it imports only :mod:`polykernel.env` (which reads that variable as every boolean is read).

Each concern is a module of its own, and this package names what they export (the table): ``probe``
(the probing and the record of fallbacks), ``dispatch`` (the hot path's per-call flags, the hit
guard), ``autograd`` (Function.apply, transforms, forward AD, backward nodes), ``custom_ops``
(autograd inside a custom op, comptime), ``storage`` (storage identity), ``distributed``, ``hooks``
(a module's forward hooks) and ``kernels`` (CUDA, Triton, MoE). A test that swaps a fallback in sets
it on the module that reads it (``_compat.storage._storage_key``, not ``_compat._storage_key``).

=============================  ============================================  ===========================================
name                           private API                                   fallback
=============================  ============================================  ===========================================
deterministic_enabled          torch._C._get_deterministic_algorithms        torch.are_deterministic_algorithms_enabled
stream_capturing               torch._C._cuda_isCurrentStreamCapturing       torch.cuda.is_current_stream_capturing
COMPILING_EXPR                 torch.compiler._is_compiling_flag (inlined)   ``compiling()`` (torch.compiler.is_compiling)
tensor_guards()                torch._C._dynamo.guards.TensorGuards          None: the argument class built in Python
function_apply(cls)            torch._C._FunctionBase.apply                  None: ``cls.apply``
functorch_transforms_active    torch._C._are_functorch_transforms_active     a Function without setup_context raises
saved_tensors_hooks_active     torch._C._autograd._top_saved_tensors_...     "active" (the check pushes its own hooks)
forward_ad_open                torch.autograd.forward_ad._current_level      every call looks for tangents (unpack_dual)
any_autocast_enabled           torch._C._is_any_autocast_enabled             torch.is_autocast_enabled per device type
delayed_error(message, n)      torch._C._functions.DelayedError              an autograd.Function whose backward raises
cuda_sleep(cycles)             torch.cuda._sleep                             matmuls on a small buffer (calibrated)
cuda_current_device            torch._C._cuda_getDevice                      torch.cuda.current_device
cuda_raw_stream(device)        torch._C._cuda_getCurrentRawStream            torch.cuda.current_stream(device).cuda_stream
triton_jit_function()          triton.runtime.jit.JITFunction (internals)    None: the fast launch path off
triton_runtime_knobs()         triton.knobs.runtime (launch hooks)           None: the fast launch path off
autograd_keys_on()             torch._C._ForceDispatchKeyGuard and the       no guard (fake impls then use each op's
                               dispatch TLS sets                             declared ``outputs``)
with_autograd(fn)              (the same guard)                              ``fn`` on a fresh thread (default TLS)
comptime()                     torch._dynamo.comptime.comptime               None: the caller's fallback (a custom op)
custom_op_overload(op, name)   torch.library.CustomOpDef._opoverload         ``torch.ops.<ns>.<name>.default``
storage_id(t)                  torch.UntypedStorage._cdata                   the storage's data_ptr()
softmax_backward_data(...)     torch._softmax_backward_data                  y * (dy - sum(dy * y)) in torch ops
is_async_collective(t)         torch.distributed._functional_collectives     the class's name
dtensor_schema_infos()         DTensor._op_dispatcher...op_to_schema_info    None: no custom sharding rules
fully_shard()                  torch.distributed._composable.fsdp            (public first; the private one on torch < 2.6)
module_has_hooks(m)            nn.Module._forward_hooks/_forward_pre_hooks   True: left alone (module_hooks_seen: False)
assert_async(cond, message)    torch._assert_async (a device-side assert)    a host check (a sync; no graph capture)
grouped_mm                     torch._grouped_mm                             None: one matmul per expert
=============================  ============================================  ===========================================

Example::

    from polykernel import _compat
    if _compat.tensor_guards() is None: ...     # the hit guard is off here
    _compat.fallbacks()                         # {'tensor_guards': 'forced (POLYKERNEL_COMPAT_FALLBACKS=1)', ...}
"""

from __future__ import annotations

from .autograd import (
    FORWARD_AD_EXPR,
    delayed_error,
    forward_ad_open,
    function_apply,
    functorch_transforms_active,
    saved_tensors_hooks_active,
    softmax_backward_data,
)
from .custom_ops import autograd_keys_guarded, autograd_keys_on, comptime, custom_op_overload, with_autograd
from .dispatch import (
    COMPILING_EXPR,
    any_autocast_enabled,
    deterministic_enabled,
    dynamo_compiling,
    is_compiling,
    stream_capturing,
    tensor_guards,
)
from .distributed import dtensor_schema_infos, fully_shard, is_async_collective
from .hooks import module_has_hooks, module_hooks_seen
from .kernels import assert_async, cuda_current_device, cuda_raw_stream, cuda_sleep, grouped_mm, triton_jit_function, triton_runtime_knobs
from .probe import FORCED, fallbacks
from .storage import storage_id

__all__ = [
    "COMPILING_EXPR",
    "FORCED",
    "FORWARD_AD_EXPR",
    "any_autocast_enabled",
    "assert_async",
    "autograd_keys_guarded",
    "autograd_keys_on",
    "comptime",
    "cuda_current_device",
    "cuda_raw_stream",
    "cuda_sleep",
    "custom_op_overload",
    "delayed_error",
    "deterministic_enabled",
    "dtensor_schema_infos",
    "dynamo_compiling",
    "fallbacks",
    "forward_ad_open",
    "fully_shard",
    "function_apply",
    "functorch_transforms_active",
    "grouped_mm",
    "is_async_collective",
    "is_compiling",
    "module_has_hooks",
    "module_hooks_seen",
    "saved_tensors_hooks_active",
    "softmax_backward_data",
    "storage_id",
    "stream_capturing",
    "tensor_guards",
    "triton_jit_function",
    "triton_runtime_knobs",
    "with_autograd",
]
