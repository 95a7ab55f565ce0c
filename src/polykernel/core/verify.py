"""Verify on first use: a new decision's impl is compared once with the op's torch impl.

``POLYKERNEL_VERIFY`` (read when a decision is made, like the other variables):

- ``first`` (the default on CUDA devices): the first call of each decision (an impl for a new
  argument class in this process) runs the impl and the op's torch impl on a copy of the call's
  inputs and compares their outputs, and, when the class needs grad, their gradients for one
  fixed random cotangent, within the op's error model (``op.error_model``). Then the real call
  runs, and the decision's callable is the bare impl again: later calls cost nothing;
- ``always``: every call (for debugging; each call pays the check);
- ``off`` (the default elsewhere: on the CPU the torch impl is what auto selection picks, and
  Triton there is the test interpreter, which the parity suite covers).

A mismatch raises :class:`~polykernel.errors.ImplVerificationError` from the first call, which
the fault policy (:meth:`polykernel.core.selection.Decision.on_fault`) treats as any runtime fault:
the impl is marked broken for the argument class, one warning says what differed and by how much,
and the call reruns with the next impl; under ``POLYKERNEL_STRICT=1`` and for a forced impl
(``impl=``, an op-scoped ``use_impl``, ``POLYKERNEL_IMPL_<OP>``) the error is raised.

It never runs for the torch impl itself, while a CUDA graph is captured, while torch.compile
traces, under ``torch.func`` transforms, inside tuning's measuring (which checks parity itself), or
on tensor subclasses (a DTensor call runs the op on its local shards through the dispatcher: that
plain call is verified instead). Inside a ``torch.utils.checkpoint`` region (or other saved-tensor
hooks) it runs on hooks of its own and a forked RNG: the region's forward saves and draws what its
recomputation, which runs no check, does.

    >>> import os, torch, polykernel
    >>> os.environ["POLYKERNEL_VERIFY"] = "first"  # doctest: +SKIP
    >>> y = polykernel.rms_norm(x_cuda, w_cuda)      # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import threading
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from ..errors import ImplVerificationError, shown
from .errormodel import compute_dtype

if TYPE_CHECKING:
    import torch

    from .protocols import DecisionLike

__all__ = ["ENV", "MODES", "mode", "paused", "verify"]

log = logging.getLogger("polykernel")

ENV = "POLYKERNEL_VERIFY"
MODES = ("first", "off", "always")

# Cost rule. The check holds one copy of the call's tensors (the impl and the torch impl run on
# the same leaf copies, the torch impl first, so an impl that writes its inputs cannot change the
# reference; an op that writes its arguments, ``Op.writes``, gives each side its own copy), both
# sides' outputs and gradients, and the comparison's temporaries, which are
# bounded by comparing in row blocks of CHUNK_ELEMENTS. The comparison is against the torch impl
# in the call's own dtypes, never a float64 reference: that would be a float64 [N, V] logits for the
# fused linear CE at N = 8192, V = 128256 (8 GB; the torch impl is chunked). On CUDA, a check whose
# estimate (MEMORY_FACTOR x the bytes of the call's tensors) exceeds half the free device memory
# is skipped, with one log line, and so is one that runs out of memory: the user's step must not
# fail for a check. Time: one forward (and backward) of each side, once per decision.
CHUNK_ELEMENTS = 1 << 24
# by needs_grad: copies, 2 x outputs (and 2 x grads), slack; +1 for an op that writes its arguments (a second copy)
MEMORY_FACTOR = {False: 4, True: 6}

_paused: ContextVar[bool] = ContextVar("polykernel_verify_paused", default=False)
_noted: set[tuple[Any, ...]] = set()
_noted_lock = threading.Lock()  # check and add as one: threads meeting one key log it once


def mode(decision: DecisionLike) -> str:
    """The mode for a new decision: ``POLYKERNEL_VERIFY``'s value, else ``first`` on CUDA devices
    and ``off`` elsewhere; ``off`` for the torch impl (the reference itself). A value that is not
    a mode is a ``ValueError`` naming the variable."""
    raw = os.environ.get(ENV, "")
    value = raw.strip().lower()
    if value and value not in MODES:
        raise ValueError(f"{ENV}: {shown(raw)} is not a verification mode; expected one of: {', '.join(MODES)}")
    if decision.impl == "torch":
        return "off"
    if not value:
        # The torch impl is the reference on the CPU and what auto picks there; CPU Triton is
        # the test interpreter. A GPU kernel is what may be broken on a given machine and driver.
        value = "first" if getattr(decision.key.argclass[0], "type", None) == "cuda" else "off"
    return value


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """No verification inside this block (tuning's measuring: it checks parity itself)."""
    token = _paused.set(True)
    try:
        yield
    finally:
        _paused.reset(token)


def verify(decision: DecisionLike, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    """Compare ``fn`` (the decision's impl) with the op's torch impl on copies of ``args``.

    Returns when they agree or when the check cannot run here (see the module doc); raises
    :class:`ImplVerificationError` on a mismatch. An exception of the impl's forward propagates
    (a runtime fault); one of the torch impl, the error model or the check itself only skips the
    check (logged once): it never marks the impl broken."""
    import torch

    if _skipped(args):
        return
    op = decision.op
    device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
    if device is None or device.type == "meta":  # no values to compare
        return
    needs_grad = bool(decision.key.argclass[2])
    too_big = _over_budget(args, needs_grad, device, bool(op.writes))
    if too_big is not None:
        _note(op.id, decision.impl, f"not verified: {too_big}")
        return
    try:
        with _isolated(device):
            _check(decision, fn, args, needs_grad, device)
    except _ImplRaised as exc:  # the impl's own fault, as if the real call had raised it
        raise exc.original from None
    except ImplVerificationError:
        raise
    except torch.OutOfMemoryError:
        _note(op.id, decision.impl, "not verified: out of memory during the check")
    except _ReferenceFailed as exc:
        _note(op.id, decision.impl, f"not verified: {exc}")
    except Exception as exc:  # the check's own failure must never mark the impl broken
        _note(op.id, decision.impl, f"not verified: the check raised {type(exc).__name__}: {exc}")


class _ReferenceFailed(Exception):
    """The torch impl or the op's error model could not run on these arguments."""


class _ImplRaised(Exception):
    """The impl's forward raised ``original`` on the check's copies."""

    def __init__(self, original: Exception) -> None:
        self.original = original


def _skipped(args: tuple[Any, ...]) -> bool:
    import torch

    if _paused.get() or torch.compiler.is_compiling():
        return True
    from .. import _compat

    if _compat.functorch_transforms_active():  # vmap/grad wrappers: copies are not plain
        return True
    plain = (torch.Tensor, torch.nn.Parameter)
    for a in args:
        if isinstance(a, torch.Tensor):
            # A subclass (DTensor, FakeTensor) has no plain storage to copy; a DTensor's local call
            # is verified as a plain call of its own.
            if type(a) not in plain:
                return True
            if a.is_cuda and torch.cuda.is_current_stream_capturing():
                return True
        elif isinstance(a, (list, tuple)) and any(isinstance(t, torch.Tensor) for t in a):
            return True  # no op takes tensor lists today: nothing to copy them by
    return False


@contextlib.contextmanager
def _isolated(device: torch.device) -> Iterator[None]:
    """The check's own autograd and RNG state, so that the caller's step is as without it.

    Saved-tensor hooks of the caller (a non-reentrant ``torch.utils.checkpoint`` region,
    ``save_on_cpu``) must not see the check's tensors: the checkpoint would count them among
    the region's saved tensors (the recomputation, which runs no check, saves fewer: a
    CheckpointError in the backward), and the check's own backward would unpack them and so
    recompute the region in the middle of its forward, running the check again inside. Identity
    hooks, pushed over the caller's, keep the check's graph to itself; none where the caller has
    none (torch.func's grad, which Liger's chunked losses call, refuses to run under any hooks).
    A forked RNG: the check
    consumes none of the caller's random stream (a checkpoint replays that stream in its
    recomputation; dropout after the check must draw what it drew without it)."""
    import torch

    from .. import _compat

    with contextlib.ExitStack() as stack:
        if _compat.saved_tensors_hooks_active():
            try:
                stack.enter_context(torch.autograd.graph.saved_tensors_hooks(_same, _same))
            except RuntimeError:  # saved-tensor hooks disabled here (disable_saved_tensors_hooks): none to keep out
                pass
        # The CPU stream always; the call's CUDA device's too (a list: no walk over every device).
        cuda = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
        stack.enter_context(torch.random.fork_rng(devices=cuda, device_type="cuda"))
        yield


def _same(t: Any) -> Any:
    return t


def _over_budget(args: tuple[Any, ...], needs_grad: bool, device: torch.device, writes: bool = False) -> str | None:
    import torch

    if device.type != "cuda":
        return None
    need = (MEMORY_FACTOR[needs_grad] + writes) * sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor))
    free = torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if need <= free // 2:
        return None
    return f"the check needs about {need / 2**30:.2f} GiB, more than half of the {free / 2**30:.2f} GiB free"


def _note(op_id: str, impl: str, message: str) -> None:
    key = (op_id, impl, message)
    with _noted_lock:
        new = key not in _noted
        _noted.add(key)
    if new:
        log.warning("polykernel: %s: impl %r %s", op_id, impl, message)


def _copy(a: Any, grad: bool) -> Any:
    """A fresh leaf with ``a``'s shape, strides (where possible), dtype and device."""
    import torch

    if not isinstance(a, torch.Tensor):
        return a
    with torch.no_grad():
        try:
            c = torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device)
            c.copy_(a.detach())
        except RuntimeError:  # overlapping strides (expand): a dense copy
            c = a.detach().clone(memory_format=torch.contiguous_format)
    return c.requires_grad_(grad and a.requires_grad and a.is_floating_point())


def _outputs(out: Any) -> tuple[Any, ...]:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _cotangents(outs: tuple[Any, ...], device: torch.device) -> list[Any] | None:
    """A fixed random cotangent in [-1, 1) (error models count on |dy| <= 1) for each output
    that takes a gradient, None for the others; None when no output does."""
    import torch

    gen = torch.Generator(device=device).manual_seed(0)  # the caller's RNG stream is left alone
    cots = [
        (2 * torch.rand(o.shape, generator=gen, device=o.device, dtype=torch.float32) - 1).to(o.dtype)
        if isinstance(o, torch.Tensor) and o.is_floating_point() and o.requires_grad
        else None
        for o in outs
    ]
    return cots if any(c is not None for c in cots) else None


def _grads(outs: tuple[Any, ...], leaves: tuple[Any, ...], positions: list[int], cotangents: list[Any]) -> tuple[Any, ...]:
    import torch

    pairs = [(o, c) for o, c in zip(outs, cotangents) if c is not None]
    return torch.autograd.grad([o for o, _ in pairs], [leaves[i] for i in positions], [c for _, c in pairs], allow_unused=True)


def _detached(outs: tuple[Any, ...]) -> tuple[Any, ...]:
    import torch

    return tuple(o.detach() if isinstance(o, torch.Tensor) else o for o in outs)


def _no_autocast(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    import torch

    try:
        return torch.autocast(device.type, enabled=False)
    except RuntimeError:  # a device type without autocast: nothing to turn off
        return contextlib.nullcontext()


def _check(decision: DecisionLike, fn: Callable[..., Any], args: tuple[Any, ...], needs_grad: bool, device: torch.device) -> None:
    import torch

    from ..spec import KernelBackend, PlatformInfo, triton_interpret_allows
    from . import registry

    op, impl = decision.op, decision.impl
    specs = registry.specs_for(op)
    # Triton's CPU interpreter truncates fp32 -> bf16 instead of rounding to nearest: one ulp,
    # not half, for the impls run through it (as polykernel.testing and tuning count it).
    spec = specs.get(impl)
    interpreted = spec is not None and spec.backend in (KernelBackend.TRITON, KernelBackend.LIGER)
    rounding = 2.0 if interpreted and triton_interpret_allows(PlatformInfo.detect(device)) else 1.0
    names = [p.name for p in inspect.signature(op.reference).parameters.values()]
    leaves = tuple(_copy(a, needs_grad) for a in args)
    positions = [i for i, a in enumerate(leaves) if isinstance(a, torch.Tensor) and a.requires_grad]
    grad = needs_grad and bool(positions)

    against = "the torch impl" if "torch" in specs else "the op's reference"

    def fail(what: str, detail: str, **numbers: float) -> ImplVerificationError:
        return ImplVerificationError(op.id, impl, what, detail, against=against, **numbers)

    # Like for like: autocast would lower the torch impl's matmuls and not a kernel's.
    with _no_autocast(device), torch.enable_grad() if grad else torch.no_grad():
        try:  # the torch impl first: an impl that writes its inputs cannot change the reference
            reference = registry.load_impl(specs["torch"]) if "torch" in specs else op.reference
            bounds = op.error_model(*leaves)
            ref_out = _outputs(reference(*leaves))
            cotangents = _cotangents(ref_out, device) if grad else None
            ref_grads = _grads(ref_out, leaves, positions, cotangents) if cotangents is not None else ()
            ref_out = _detached(ref_out)
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:  # not the impl's fault: nothing to hold it to
            raise _ReferenceFailed(f"the torch impl or the error model raised {type(exc).__name__}: {exc}") from exc
        # An op that writes its arguments (Op.writes) has written the torch impl's results into
        # the leaves: the impl gets copies of its own, made from the caller's untouched args.
        impl_leaves = tuple(_copy(a, needs_grad) for a in args) if op.writes else leaves
        try:
            outs = _outputs(fn(*impl_leaves))
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:  # propagates (verify): a runtime fault of the impl
            raise _ImplRaised(exc) from exc
        if len(outs) != len(ref_out):
            raise fail("the outputs", f"{len(outs)} outputs, the torch impl's {len(ref_out)}")
        single = len(ref_out) == 1
        grads: tuple[Any, ...] = ()
        if cotangents is not None:
            for k, (o, c) in enumerate(zip(outs, cotangents)):
                if c is not None and not (isinstance(o, torch.Tensor) and o.requires_grad):
                    raise fail("the output" if single else f"output {k}", "no autograd graph, where its inputs require grad")
            try:
                grads = _grads(outs, impl_leaves, positions, cotangents)
            except torch.OutOfMemoryError:
                raise
            except Exception as exc:
                raise fail("the backward", f"it raised {type(exc).__name__}: {exc}") from exc
        outs = _detached(outs)
    for k, (o, r) in enumerate(zip(outs, ref_out)):
        if isinstance(r, torch.Tensor):
            _compare(fail, "the output" if single else f"output {k}", o, r, bounds.output(k), rounding)
    # An op that writes its arguments: the k-th destination must hold the k-th result (an impl
    # that returned right values in new tensors would leave the caller's tensors unwritten).
    for k, w in enumerate(op.writes):
        dest, r = impl_leaves[names.index(w)], ref_out[k] if k < len(ref_out) else None
        if isinstance(r, torch.Tensor) and isinstance(dest, torch.Tensor):
            _compare(fail, f"{w!r} as written", dest.detach(), r, bounds.output(k), rounding)
    for i, g, r in zip(positions, grads, ref_grads):
        what = f"the gradient of {names[i] if i < len(names) else f'argument {i}'}"
        if r is None:
            continue
        if g is None:
            raise fail(what, "the impl gives none")
        model = bounds.grads.get(i)
        if model is not None:  # else the op's error model does not bound this gradient: nothing to hold it to
            _compare(fail, what, g, r, model, rounding)


def _compare(fail: Callable[..., ImplVerificationError], what: str, o: Any, r: torch.Tensor, model: Any, rounding: float) -> None:
    """Raise ``fail(...)`` unless ``o`` is within ``model``'s tolerance of the torch impl's ``r``.

    Both sides are approximations held to the same error model against the exact result (the
    parity suite holds every impl, the torch one included, to it), so by the triangle inequality
    they differ by at most the sum of their two tolerances: that sum is the bound here. The scale
    is max |r|, standing for max |exact| (they differ by less than the tolerance itself)."""
    import torch

    if not isinstance(o, torch.Tensor):
        raise fail(what, f"the impl returned {type(o).__name__}, not a tensor")
    if o.shape != r.shape or o.dtype != r.dtype:
        raise fail(
            what,
            f"shape {tuple(o.shape)} and dtype {str(o.dtype).removeprefix('torch.')}, "
            f"the torch impl's {tuple(r.shape)} and {str(r.dtype).removeprefix('torch.')}",
        )
    if o.numel() == 0:
        return
    if not r.is_floating_point():
        if not torch.equal(o, r):
            raise fail(what, f"{int((o != r).sum())} of {r.numel()} values differ (exact dtype)")
        return
    acc = compute_dtype(r.dtype)  # |o - r| of two close values: exact enough
    n = r.shape[-1] if r.dim() and r.shape[-1] else 1
    o2, r2 = o.detach().reshape(-1, n), r.detach().reshape(-1, n)
    step = max(1, CHUNK_ELEMENTS // n)
    blocks = range(0, r2.shape[0], step)

    def block(s: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        oc, rc = o2[s : s + step].to(acc), r2[s : s + step].to(acc)
        bad = ~torch.isfinite(rc)
        keep = ~bad.any(-1, keepdim=True).expand_as(bad) if model.nonfinite_rows else torch.ones_like(bad)
        return oc, rc, keep  # nonfinite_rows: a row the torch impl makes non-finite may differ anywhere

    scale = 0.0
    for s in blocks:  # non-finite values must agree; the scale over the finite ones
        oc, rc, keep = block(s)
        bad_o, bad_r = ~torch.isfinite(oc) & keep, ~torch.isfinite(rc) & keep
        if not torch.equal(bad_o, bad_r) or not torch.equal(oc[bad_r].nan_to_num(), rc[bad_r].nan_to_num()):
            count = int((bad_o != bad_r).sum())
            raise fail(what, f"non-finite values differ ({count} positions non-finite on one side only)")
        fin = keep & ~bad_r
        if fin.any():
            scale = max(scale, rc.abs().masked_fill(~fin, 0).max().item())
    t_impl, t_torch = model.tol(r.dtype, scale, rounding), model.tol(r.dtype, scale, 1.0)
    atol, rtol = t_impl.atol + t_torch.atol, t_impl.rtol + t_torch.rtol
    ratio = max_abs = max_rel = 0.0
    for s in blocks:
        oc, rc, keep = block(s)
        fin = keep & torch.isfinite(rc)
        rc = rc.masked_fill(~fin, 0)  # NaN and inf agreed above: they must not hide an error below
        diff = (oc.masked_fill(~fin, 0) - rc).abs()
        ratio = max(ratio, (diff / (atol + rtol * rc.abs())).max().item())
        max_abs = max(max_abs, diff.max().item())
        max_rel = max(max_rel, (diff / rc.abs()).masked_fill(rc == 0, 0).max().item())
    if ratio > 1.0:
        raise fail(
            what,
            f"max abs error {max_abs:.3g}, max rel error {max_rel:.3g}: {ratio:.3g}x the tolerance "
            f"(atol {atol:.3g} + rtol {rtol:.3g}·|ref|, both sides' error models summed)",
            max_abs=max_abs,
            max_rel=max_rel,
            ratio=ratio,
            atol=atol,
            rtol=rtol,
        )
