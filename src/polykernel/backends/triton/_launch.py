"""Launch a cached compiled Triton kernel directly, skipping ``kernel[grid](...)``'s binder.

``kernel[grid](*args, **meta)`` spends most of its host time before the launch: reading knobs,
binding and specializing every argument, building a string cache key, checking globals. For a
kernel that has run before with arguments of the same kind, all of that is known. ``launch``
keeps its own cache per kernel, keyed on everything Triton specializes on, or more:

- the current CUDA device (Triton compiles per device);
- each tensor's dtype and whether its address is 16-byte aligned;
- each int's type, whether it equals 1, whether it is divisible by 16, and whether it fits i32
  or i64 (Triton's ``i32``/``i64``/``u64`` and its ``1``/divisibility specializations);
- each other argument's type (float, bool, None) and, for bools and None, the value;
- every keyword (constexprs, ``num_warps``, ``num_stages``) by name and value.

A finer key than Triton's only costs an extra entry, never a wrong kernel: on a miss the call
goes through ``kernel[grid]``, which compiles (or finds) the right kernel and launches it, and
its compiled handle is stored under our key. Everything else goes through ``kernel[grid]``
too: the CPU interpreter (``TRITON_INTERPRET=1``), a kernel that is not a plain ``JITFunction``
(autotuned, heuristics), pre-run or launch hooks (profilers such as Proton), a global the kernel
reads (a ``tl.constexpr`` module constant) rebound since it compiled, and any
Triton whose internals differ from what this module expects (then the fast path turns itself off
for that kernel, with one log line). ``POLYKERNEL_FAST_LAUNCH=0`` turns it off everywhere.

Environment knobs that Triton reads per launch (``TRITON_DEBUG``, instrumentation) are read when
a specialization is first launched here; after changing one in-process, call :func:`clear`.

Example::

    launch(_rms_fwd_kernel, (triton.cdiv(m, rows),), x2, w, y, rstd, m, n, x2.stride(0),
           y.stride(0), eps, offset, BLOCK_N=block_n, ROWS=rows, LLAMA=False, num_warps=8)
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ... import _compat, env
from ...core import codegen

log = logging.getLogger("polykernel")

_JITFunction: type | None = _compat.triton_jit_function()
_runtime_knobs = _compat.triton_runtime_knobs()
_get_device = _compat.cuda_current_device
_get_stream = _compat.cuda_raw_stream


def _enabled_by_env() -> bool:
    return env.flag("POLYKERNEL_FAST_LAUNCH", True)


# Off: the interpreter (kernels are not JITFunctions then anyway), a CPU-only torch, a Triton
# without the pieces used here, or the user's switch.
_SUPPORTED = (
    not env.triton_interpret()
    and _JITFunction is not None
    and _runtime_knobs is not None
    and _get_device is not None
    and _get_stream is not None
)
ENABLED = _SUPPORTED and _enabled_by_env()


class _KernelState:
    """Per-kernel fast-path state: the argument-key function and the compiled entries."""

    __slots__ = ("arity", "entries", "key", "on", "supported")

    def __init__(self) -> None:
        self.on = self.supported = True
        self.arity = -1
        self.key: Callable[..., tuple[Any, ...]] | None = None
        # our key -> (launcher, function handle, packed metadata, trailing parameter values, globals)
        self.entries: dict[tuple[Any, ...], tuple[Any, Any, Any, tuple[Any, ...], tuple[Any, ...]]] = {}


_MISSING = object()
_states: list[_KernelState] = []  # every kernel's state, for clear()
_SLOT = "_polykernel_fast_launch"


def _arg_key_function(args: Sequence[Any]) -> Callable[..., tuple[Any, ...]]:
    """Generated ``key(a0, a1, ...)`` (a loop over the kinds costs ~2-3x more per launch:
    ``benchmarks/host/per_call_helpers.py``) for arguments of the kinds seen in ``args`` (a tensor, an
    int, anything else). A later call whose argument kinds differ either raises inside it (a
    tensor slot given an int) or gets other values for the type entries: a miss, never a hit."""
    parts = []
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            parts.append(f"a{i}.dtype, not a{i}.data_ptr() & 15")
        elif type(a) is int:
            # bool(a & 15) etc.: Triton's divisibility by 16, its `== 1` specialization, int width.
            parts.append(f"type(a{i}), a{i} == 1, not a{i} & 15, -0x80000000 <= a{i} <= 0x7FFFFFFF, a{i} <= 0x7FFFFFFFFFFFFFFF")
        elif a is None or type(a) is bool:
            parts.append(f"type(a{i}), a{i}")
        else:
            parts.append(f"type(a{i})")
    names = ", ".join(f"a{i}" for i in range(len(args)))
    src = f"def key({names}):\n    return ({', '.join(parts)}{',' if len(parts) == 1 else ''})\n"
    return codegen.define(src, f"<polykernel fast-launch key: {len(args)} arguments>", "key", {})


def _state(kernel: Any) -> _KernelState:
    state = kernel.__dict__.get(_SLOT)
    if state is None:
        state = _KernelState()
        state.supported = type(kernel) is _JITFunction and not getattr(kernel, "pre_run_hooks", None)
        state.on = ENABLED and state.supported
        setattr(kernel, _SLOT, state)
        _states.append(state)
    return state


def _hooked(hook: Any) -> bool:
    """A launch hook is set: a function, or Triton's hook chain (the default) with a member."""
    return hook is not None and bool(getattr(hook, "calls", True))


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **meta: Any) -> Any:
    """``kernel[grid](*args, **meta)``, launching the cached compiled kernel directly on a hit.

    Runtime arguments go positionally, constexprs and launch options (``num_warps``...) by
    keyword, the same at every call site of a kernel.
    """
    state = kernel.__dict__.get(_SLOT) or _state(kernel)
    if not state.on or _hooked(_runtime_knobs.launch_enter_hook) or _hooked(_runtime_knobs.launch_exit_hook):
        return kernel[grid](*args, **meta)
    try:
        device = _get_device()
        key = (device, *meta.items(), *state.key(*args)) if len(args) == state.arity else None
        entry = state.entries.get(key) if key is not None else None
    except Exception:  # an argument of another kind than the first call's, an unhashable value
        key = entry = None
    if entry is None:
        return _miss(state, kernel, grid, args, meta, key)
    run, function, packed, tail, globs = entry
    for namespace, name, value in globs:  # Triton's check that used globals kept their values
        if namespace.get(name, _MISSING) is not value:  # rebound since: Triton's path (it raises)
            return kernel[grid](*args, **meta)
    grid_n = len(grid)
    run(
        grid[0], grid[1] if grid_n > 1 else 1, grid[2] if grid_n > 2 else 1,
        _get_stream(device), function, packed, None, None, None,
        *args, *tail,
    )  # fmt: skip
    return None


def _miss(state: _KernelState, kernel: Any, grid: tuple[int, ...], args: tuple[Any, ...], meta: dict[str, Any], key: Any) -> Any:
    """Launch through Triton, then remember the compiled kernel under our key."""
    compiled = kernel[grid](*args, **meta)
    if not state.on:
        return compiled
    try:
        if state.key is None or len(args) != state.arity:
            if state.key is not None:  # two arities for one kernel: not a pattern this caches
                raise TypeError(f"called with {len(args)} and {state.arity} positional arguments")
            state.key, state.arity = _arg_key_function(args), len(args)
            key = (_get_device(), *meta.items(), *state.key(*args))
        if key is None:
            return compiled
        # Globals the kernel reads (tl.constexpr module constants): Triton compares them to their
        # compile-time values per launch; here, the objects bound now (just checked by Triton)
        # are compared by identity, which is cheap.
        globs = tuple((ns, name, ns.get(name, _MISSING)) for (name, _), (_val, ns) in kernel.used_global_vals.items())
        if hasattr(compiled, "result"):  # an asynchronous compile's future
            compiled = compiled.result()
        tail = _trailing_params(kernel, len(args), meta)
        state.entries[key] = (compiled.run, compiled.function, compiled.packed_metadata, tail, globs)
    except Exception as exc:  # internals differ from what this module expects: Triton's path only
        state.on = state.supported = False
        log.info("polykernel: fast Triton launch off for %s (%s: %s)", getattr(kernel, "__name__", kernel), type(exc).__name__, exc)
    return compiled


def _trailing_params(kernel: Any, n_args: int, meta: dict[str, Any]) -> tuple[Any, ...]:
    """Values of the parameters after the positional ones, in declaration order, as Triton's
    launcher receives them (constexprs included: its launcher skips them)."""
    tail = []
    for p in kernel.params[n_args:]:
        if p.name in meta:
            tail.append(meta[p.name])
        elif p.default is not inspect.Parameter.empty:
            tail.append(p.default)
        else:
            raise TypeError(f"parameter {p.name!r} neither passed nor defaulted")
    return tuple(tail)


def clear() -> None:
    """Forget every cached compiled kernel (after changing a Triton knob in-process)."""
    for state in list(_states):
        state.entries.clear()


def set_enabled(on: bool) -> bool:
    """Turn the fast path on or off in this process (benchmarks A/B it); returns the old setting.
    Turning it on has no effect where it cannot work (the interpreter, a CPU-only torch)."""
    global ENABLED
    old = ENABLED
    ENABLED = bool(on) and _SUPPORTED
    for state in _states:
        state.on = ENABLED and state.supported
    return old


def cached_keys(kernel: Any) -> list[tuple[Any, ...]]:
    """The fast path's keys for ``kernel`` (tests: aligned/unaligned and dtypes separate)."""
    state = getattr(kernel, "__dict__", {}).get(_SLOT)
    return list(state.entries) if state is not None else []
