"""Parity harness and pytest helpers (public: use them for your own impls too).

``check_parity`` runs an op's impls on the op's own parity cases (or yours) and compares the
forward outputs and the gradients of every input that requires grad with the op's torch
reference, using the op's per-dtype tolerances::

    >>> from polykernel.testing import assert_parity
    >>> assert_parity("rms_norm", impls=["torch"], device="cpu")  # raises AssertionError on a mismatch

The pytest fixture ``polykernel_reset`` (import it into a conftest) gives each test a clean
dispatcher: no ``set_impl`` settings, no memoized decisions or fault marks, no tuned entries.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .core import registry
from .core import selection as dispatch
from .core.op import Case, Op
from .errors import ImplNotAvailableError, UnknownImplError

__all__ = ["ParityResult", "assert_parity", "check_parity", "exact", "fresh", "isolated", "polykernel_reset", "runnable_impls"]


@dataclass
class ParityResult:
    op: str
    impl: str
    case: str
    dtype: str
    ok: bool
    forward_error: float  # max |out - ref| / (atol + rtol |ref|): <= 1 passes
    backward_error: float
    message: str = ""
    # Why the impl did not run this case at all (it cannot run here: no CUDA device, a module not
    # installed, a dtype or a case its predicate refuses); ok is then False, nothing was compared.
    skipped: str = ""

    def __str__(self) -> str:
        if self.skipped:
            return f"skip {self.op} [{self.impl}] {self.case} {self.dtype}: not available here: {self.skipped}"
        status = "ok" if self.ok else "FAIL"
        return (
            f"{status:4} {self.op} [{self.impl}] {self.case} {self.dtype}: "
            f"fwd {self.forward_error:.3g}, bwd {self.backward_error:.3g} (x tolerance){' - ' + self.message if self.message else ''}"
        )


def fresh(value: Any) -> Any:
    """A leaf copy of a tensor with the same shape, strides, dtype and requires_grad."""
    if not isinstance(value, torch.Tensor):
        return value
    leaf = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device)
    with torch.no_grad():
        leaf.copy_(value.detach())
    return leaf.requires_grad_(value.requires_grad)


def _as_tuple(out: Any) -> tuple[Any, ...]:
    return out if isinstance(out, tuple) else (out,)


def exact(value: Any) -> Any:
    """A float64 leaf copy of a floating tensor (same values, same requires_grad); others as is."""
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        return value
    return value.detach().to(torch.float64).requires_grad_(value.requires_grad)


RATIO_ELEMENTS = 1 << 25  # float64 elements per block of _ratio's walk (256 MiB a temporary)


def _blocks(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``t`` as rows of its last dim (one row for 0-d and 1-d) and the rows per block."""
    rows = t.reshape(1, 1) if t.dim() == 0 else t.reshape(-1, t.shape[-1])
    return rows, max(1, RATIO_ELEMENTS // max(rows.shape[1], 1))


def _ratio(out: torch.Tensor, want: torch.Tensor, ref: torch.Tensor, tol_of: Any, nonfinite_rows: bool = False) -> tuple[float, str]:
    """Worst |out - ref| / (atol + rtol |ref|) against the float64 ``ref``; ``want`` is the
    reference in the call's own dtypes (its shape and dtype are the contract). NaN/inf must match
    the float64 reference rounded to the output dtype (with ``nonfinite_rows``, a row whose
    reference holds a non-finite value may also be NaN anywhere: see ErrorModel). Large tensors
    (an LM head's gradient: 10^9 elements) are walked in row blocks, so the float64 temporaries
    stay ``RATIO_ELEMENTS`` each, never several copies of the whole tensor."""
    if out.shape != want.shape:
        return float("inf"), f"shape {tuple(out.shape)} != reference {tuple(want.shape)}"
    if out.dtype != want.dtype:
        return float("inf"), f"dtype {out.dtype} != reference {want.dtype}"
    if out.numel() == 0:
        return 0.0, ""
    if not out.dtype.is_floating_point:  # integer outputs (a router's expert index) are exact
        return (0.0, "") if torch.equal(out, ref) else (float("inf"), "integer values differ from the reference")
    o_rows, step = _blocks(out.detach())
    r_rows, _ = _blocks(ref.detach())
    masked = nonfinite_rows and out.dim() > 0

    def block(s: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
        """(o, r, finite mask, non-finite values agree) of the rows from ``s``, in float64."""
        o, r = o_rows[s : s + step].double(), r_rows[s : s + step].double()
        rounded = r.to(out.dtype).double()  # the reference rounded to the output dtype (fp8 has no isfinite)
        if masked:
            spread = (~torch.isfinite(rounded)).any(-1, keepdim=True) & torch.isnan(o)
            o, r, rounded = o.masked_fill(spread, 0.0), r.masked_fill(spread, 0.0), rounded.masked_fill(spread, 0.0)
        o_bad, r_bad = ~torch.isfinite(o), ~torch.isfinite(rounded)
        agree = torch.equal(o_bad, r_bad) and torch.equal(o[o_bad].nan_to_num(), rounded[r_bad].nan_to_num())
        return o, r, ~r_bad, agree

    starts = range(0, o_rows.shape[0], step)
    first = block(0) if len(starts) == 1 else None  # one block: computed once, used by both passes
    largest = -1.0  # the reference's largest finite magnitude: the tolerance's scale
    for s in starts:
        o, r, ok, agree = first or block(s)
        if not agree:
            return float("inf"), "non-finite values differ from the reference"
        if ok.any():
            largest = max(largest, r[ok].abs().max().item())
    if largest < 0:
        return 0.0, ""
    tol = tol_of(largest)
    worst = 0.0
    for s in starts:
        o, r, ok, _ = first or block(s)
        if ok.any():
            r_ok = r[ok]
            worst = max(worst, ((o[ok] - r_ok).abs() / (tol.atol + tol.rtol * r_ok.abs())).max().item())
    return worst, ""


def runnable_impls(op: str | Op, device: torch.device | str, dtype: torch.dtype) -> list[str]:
    return dispatch.available_impls(registry.get_op(op).id, device=device, dtype=dtype)


def check_parity(
    op: str | Op,
    impls: Sequence[str] | None = None,
    *,
    device: torch.device | str = "cpu",
    dtypes: Sequence[torch.dtype] | None = None,
    cases: Sequence[Case] | None = None,
    large: bool = False,
    backward: bool = True,
    seed: int = 0,
) -> list[ParityResult]:
    """Compare impls with the op's reference, forward and backward, on every case and dtype.

    The reference runs in float64 on the same input values: it stands for the exact result, and
    each impl must be within the op's error model of it (:class:`~polykernel.core.op.ErrorModel`),
    whatever order its sums run in. With ``backward=False`` the inputs do not require grad (the
    call a forward-only impl takes). ``impls`` defaults to every impl runnable on ``device``;
    ``cases`` to the op's own (``large=True`` adds its full-size GPU cases). Inputs are drawn
    fresh per case and dtype from ``seed``.

    A named impl that cannot take a case here (no CUDA device, a module not installed, its dtype
    or predicate) gives a result with ``skipped`` set to the reason, not a failure; a name the op
    does not have raises :class:`~polykernel.errors.UnknownImplError` (listing the op's impls)
    before anything runs. Unnamed impls are checked only on the cases they would be chosen for.
    """
    the_op = registry.get_op(op)
    if impls is not None:
        impls = [impls] if isinstance(impls, str) else list(impls)
        known = registry.specs_for(the_op)
        for name in impls:
            if not isinstance(name, str) or name not in known:
                raise UnknownImplError(the_op.id, name, sorted(known), "check_parity(impls=)")
    results: list[ParityResult] = []
    with contextlib.ExitStack() as stack:
        compiling = False
        for dtype in dtypes or the_op.dtypes:
            names = list(impls) if impls is not None else runnable_impls(the_op, device, dtype)
            if "torch_compile" in names and not compiling:
                stack.enter_context(_compile_every_case())
                compiling = True
            torch.manual_seed(seed)
            for case in cases if cases is not None else the_op.cases(device, dtype, large) if large else the_op.cases(device, dtype):
                if not backward:
                    case = _without_grad(case)
                for name in names:
                    if impls is None and refusal(the_op, name, case) is not None:
                        continue  # e.g. a peer's predicate refuses this case (Liger: N > 65536): never selected there
                    results.append(_one(the_op, name, case, dtype, backward))
    return results


def _without_grad(case: Case) -> Case:
    """``case`` with no input requiring grad: a forward-only check (``backward=False``) is the call
    without a gradient, which forward-only impls (the serving peers' rms_norm) take; the op's
    cases require grad, and a dispatcher asked for a gradient passes those impls by."""
    if not any(isinstance(a, torch.Tensor) and a.requires_grad for a in (*case.args, *case.kwargs.values())):
        return case
    off = lambda a: a.detach() if isinstance(a, torch.Tensor) else a
    return Case(case.label, tuple(off(a) for a in case.args), {k: off(v) for k, v in case.kwargs.items()})


# Parity cases: more argument classes than Dynamo's recompile limit (8 per function) allows.
_RECOMPILES = 1024


@contextlib.contextmanager
def _compile_every_case() -> Iterator[None]:
    """Raise Dynamo's recompile limits while the ``torch_compile`` impls are checked: past the
    limit Dynamo warns and runs the reference eagerly, so the later cases would check the eager
    reference against itself instead of the compiled code."""
    from torch._dynamo import config

    per_function = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # torch < 2.6: its old name
    limits = {k: max(_RECOMPILES, getattr(config, k)) for k in (per_function, "accumulated_recompile_limit") if hasattr(config, k)}
    with config.patch(limits):
        yield


def refusal(op: str | Op, impl: str, case: Case) -> str | None:
    """Why ``impl`` cannot take ``case``'s arguments (its argument class), or None if it can."""
    the_op = registry.get_op(op)
    try:
        rows = dispatch.explain(the_op.id, *case.args, **case.kwargs).impls
    except Exception:  # arguments the op rejects: _one reports what the impl does with them
        return None
    for row in rows:
        if row["name"] == impl:
            return None if row["runnable"] else row["reason"]
    return f"no impl {impl!r}"


def _one(op: Op, impl: str, case: Case, dtype: torch.dtype, backward: bool) -> ParityResult:
    public = _public_fn(op)
    label = dict(op=op.id, impl=impl, case=case.label, dtype=str(dtype).removeprefix("torch."))
    args_impl = [fresh(a) for a in case.args]
    args_ref = [exact(a) for a in case.args]
    try:
        out = _as_tuple(public(*args_impl, impl=impl, **case.kwargs))
    except Exception as exc:
        if isinstance(exc, ImplNotAvailableError) and not isinstance(exc, UnknownImplError) and (exc.op, exc.impl) == (op.id, impl):
            # The dispatcher refused the impl before running it: not a parity failure
            return ParityResult(**label, ok=False, forward_error=float("nan"), backward_error=float("nan"), skipped=exc.reason)
        return ParityResult(
            **label, ok=False, forward_error=float("inf"), backward_error=float("nan"), message=f"raised {type(exc).__name__}: {exc}"
        )
    with torch.no_grad():  # the contract's shapes and dtypes
        want = _as_tuple(op.reference(*[fresh(a) for a in case.args], **case.kwargs))
    ref = _as_tuple(op.reference(*args_ref, **case.kwargs))
    bounds = op.error_model(*case.args, **case.kwargs)
    rounding = _rounding(op, impl, case)
    fwd_err, messages = 0.0, []
    if len(out) != len(ref):
        return ParityResult(**label, ok=False, forward_error=float("inf"), backward_error=float("nan"), message="output count differs")
    for k, (o, w, r) in enumerate(zip(out, want, ref)):
        if isinstance(r, torch.Tensor):
            model = bounds.output(k)
            e, m = _ratio(o, w, r, lambda scale, d=w.dtype, model=model: model.tol(d, scale, rounding), model.nonfinite_rows)
            fwd_err = max(fwd_err, e)
            if m:
                messages.append(m)
    bwd_err = 0.0
    if backward:
        pairs = [(o, r) for o, r in zip(out, ref) if isinstance(r, torch.Tensor) and r.requires_grad]
        leaves = [(i, a) for i, a in enumerate(args_impl) if isinstance(a, torch.Tensor) and a.requires_grad]
        if pairs and leaves:
            # Cotangents in [-1, 1): error models may count on |dy| <= 1.
            cot = [(2 * torch.rand_like(o, dtype=torch.float32) - 1).to(o.dtype) for o, _ in pairs]
            try:
                g_out = torch.autograd.grad([o for o, _ in pairs], [a for _, a in leaves], cot, allow_unused=True)
            except Exception as exc:
                return ParityResult(
                    **label,
                    ok=False,
                    forward_error=fwd_err,
                    backward_error=float("inf"),
                    message=f"backward raised {type(exc).__name__}: {exc}",
                )
            cot_ref = [c.double() if c is not None else None for c in cot]
            g_ref = torch.autograd.grad([r for _, r in pairs], [args_ref[i] for i, _ in leaves], cot_ref, allow_unused=True)
            for (i, a), go, gr in zip(leaves, g_out, g_ref):
                if gr is None:
                    continue
                if go is None:
                    messages.append(f"no gradient for argument {i}")
                    bwd_err = float("inf")
                    continue
                model = bounds.grads.get(i)
                if model is None:
                    messages.append(f"grad {i}: the op's error model has no bound for this gradient")
                    bwd_err = float("inf")
                    continue
                e, m = _ratio(go, a, gr, lambda scale, d=a.dtype, model=model: model.tol(d, scale, rounding))
                bwd_err = max(bwd_err, e)
                if m:
                    messages.append(f"grad {i}: {m}")
    ok = fwd_err <= 1.0 and bwd_err <= 1.0 and not messages
    return ParityResult(**label, ok=ok, forward_error=fwd_err, backward_error=bwd_err, message="; ".join(messages))


def _rounding(op: Op, impl: str, case: Case) -> float:
    """2 where the impl's conversions to bf16 truncate: Triton's CPU interpreter (fp16 rounds)."""
    from .spec import KernelBackend, triton_interpret_allows

    tensors = [a for a in case.args if isinstance(a, torch.Tensor)]
    spec = registry.specs_for(op).get(impl)
    if not tensors or spec is None or spec.backend not in (KernelBackend.TRITON, KernelBackend.LIGER):
        return 1.0
    from .spec import PlatformInfo

    return 2.0 if triton_interpret_allows(PlatformInfo.detect(tensors[0])) else 1.0


def _public_fn(op: Op) -> Any:
    import polykernel

    return getattr(polykernel, op.name)


def assert_parity(op: str | Op, impls: Sequence[str] | None = None, **kwargs: Any) -> list[ParityResult]:
    """``check_parity`` that raises ``AssertionError`` listing every failing case."""
    results = check_parity(op, impls, **kwargs)
    failed = [r for r in results if not r.ok]  # a case an impl could not run fails here too: it was asked for
    if failed:
        raise AssertionError(f"{len(failed)} of {len(results)} parity checks failed:\n" + "\n".join(map(str, failed)))
    if not results:
        raise AssertionError(f"no parity check ran for {op} (no runnable impl or no case)")
    return results


@contextlib.contextmanager
def isolated() -> Iterator[None]:
    """Run a block with a clean dispatcher state; restore settings and registrations after.

    Impls registered and locations declared inside the block are removed again on exit.
    """
    settings = dispatch.get_impl_settings()
    registrations = registry.snapshot()
    dispatch.restore_impl_settings({})
    try:
        yield
    finally:
        registry.restore(registrations)
        dispatch.restore_impl_settings(settings)


try:
    import pytest

    @pytest.fixture
    def polykernel_reset() -> Iterator[None]:
        """pytest fixture: a clean dispatcher for the test (settings, memo, faults, tuning)."""
        with isolated():
            yield

except ImportError:  # pytest is a test-time extra
    pass
