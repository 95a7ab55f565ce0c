"""The rules every declaration holds: each op of the catalog and each impl that the backends'
manifests (or an op file) declare, whatever the op or the backend. Nothing here lists ops, impls
or their values: a new op or backend is checked with no edit of this file.

Per impl (its ``KernelSpec`` as ``registry.builtin_impls`` holds it):

- its target is ``polykernel.backends.<its backend>.<module>:<the op's name>``, a module of its own
  backend's package that defines that function (read from source: every impl, peers' too);
- its ``requires_modules`` name every module its code imports (its module and the backend modules
  that one imports, read from source) beyond the standard library, torch and polykernel's own
  dependencies: an undeclared one lets the impl pass for runnable where its import fails;
- it names where it runs (only the torch impl runs anywhere), within its backend's declaration:
  an op's row may narrow where the backend runs (an arch floor), never widen it;
- the dtypes it takes (none named: every floating dtype) are floating torch dtypes that the parity
  harness checks (``Op.dtypes``); only the torch impl takes them all;
- it ranks ahead of the torch impl unless its whole backend ranks behind torch: auto selection
  stops at the torch impl (``core/selection/resolution.py``, ``_auto``), so an impl ranked behind
  it (or tied, named after it) is never auto-selected;
- it says what it does (``description``: ``explain`` and the docs show it);
- its target takes the op's positional arguments (the dispatcher passes them in the reference's
  order) by the reference's names, or ``*args`` forwarded as given: loaded where its modules are
  installed here (then it carries a ``Split`` only for an op that saves tensors for one), else its
  ``def`` read from source;
- its ``predicate`` and ``rank_for`` read only the op's argument class: on the classes of the op's
  parity cases, and those ``explain`` builds without arguments, they answer (None or a reason;
  None or ``(rank, reason)``) and never raise.

Per op: a torch impl eligible everywhere (any device, dtype, determinism or capture mode, tensor
subclasses), the selection's answer of last resort; compile facts that agree with each other and
with the reference (``compile_mode``, ``saved`` where the torch impl's split is, ``saved_grads``);
a DTensor layout that fits the reference's signature and outputs (what a layout *means* is checked
by running the reference on the shards it prescribes: ``tests/distributed/test_layouts.py``).

Per manifest: its rows are its own backend's, for ops of the catalog.

``test_the_checks_catch_*`` run each check on a declaration with the mistake it is there for.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import functools
import importlib
import inspect
import re
import sys
import typing
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import polykernel
from polykernel.backends import manifests
from polykernel.backends.declare import Backend
from polykernel.compile.facts import MODES, SavedGrads
from polykernel.core import registry
from polykernel.distributed.layout import ANY, ROWS
from polykernel.ops import OP_MODULES
from polykernel.spec import CapabilityRequirement, FormatSignature, KernelSpec, Split

CUDA = CapabilityRequirement.CUDA
SRC = Path(polykernel.__file__).resolve().parent
PYPROJECT = SRC.parents[1] / "pyproject.toml"


def _op(op_id: str) -> Any:
    return registry.get_op(op_id)


def _specs(op_id: str) -> dict[str, KernelSpec]:
    return {s.impl: s for s in registry.builtin_impls(op_id)}


# Every built-in impl, as (op id, impl name): the op files load here, at collection (~0.5 s).
IMPLS = [(op_id, name) for op_id in OP_MODULES for name in _specs(op_id)]
GATED = [(op_id, name) for op_id, name in IMPLS if _specs(op_id)[name].predicate or _specs(op_id)[name].rank_for]


@functools.cache
def _backend(name: str) -> Backend:
    """The backend's declaration: the one ``Backend(name)`` in its package's ``__init__.py``."""
    package = importlib.import_module(f"polykernel.backends.{name}")
    found = {id(v): v for v in vars(package).values() if isinstance(v, Backend) and v.name.value == name}
    assert len(found) == 1, f"polykernel/backends/{name}/__init__.py declares Backend({name!r}) {len(found)} times (once per backend)"
    return next(iter(found.values()))


# ---------------------------------------------------------------------------------------------
# Source reading (no import): targets and the modules an impl's code imports


def _source_file(module: str) -> Path | None:
    """The file of a polykernel module, found on disk (never imported), or None."""
    head, *parts = module.split(".")
    if head != "polykernel":
        return None
    base = SRC.joinpath(*parts)
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


@functools.cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), str(path))


def _top_level_names(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    nodes = list(tree.body)
    while nodes:
        node = nodes.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.If, ast.Try)):  # definitions under a top-level if / try
            nodes.extend([*node.body, *node.orelse, *getattr(node, "handlers", ()), *getattr(node, "finalbody", ())])
        elif isinstance(node, ast.ExceptHandler):
            nodes.extend(node.body)
    return names


def _guards_imports(node: ast.Try) -> bool:
    """A ``try`` whose handler catches a failed import (an optional module: not required)."""
    caught = [ast.unparse(h.type) if h.type is not None else "BaseException" for h in node.handlers]
    return any(re.search(r"\b(ImportError|ModuleNotFoundError|Exception|BaseException)\b", c) for c in caught)


def _import_statements(nodes: Any) -> Any:
    """The import statements that run (not under ``if TYPE_CHECKING``, nor guarded by a ``try``)."""
    for node in nodes:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from _import_statements(node.orelse)
        elif isinstance(node, ast.Try) and _guards_imports(node):
            yield from _import_statements([*node.handlers, *node.orelse, *node.finalbody])
        else:
            yield from _import_statements(ast.iter_child_nodes(node))


def _imports(module: str) -> list[tuple[str, list[str]]]:
    """Per import statement of ``module``: the module it imports, and the names a ``from``
    import may mean as submodules (``from . import _gates``), all absolute."""
    path = _source_file(module)
    package = module.split(".") if path is not None and path.name == "__init__.py" else module.split(".")[:-1]
    found = []
    for node in _import_statements(_tree(path).body if path is not None else ()):
        if isinstance(node, ast.Import):
            found.extend((a.name, []) for a in node.names)
        else:
            base = package[: len(package) - node.level + 1] if node.level else []
            name = ".".join([*base, *([node.module] if node.module else [])])
            found.append((name, [f"{name}.{a.name}" for a in node.names]))
    return found


@functools.cache
def _always_installed() -> frozenset[str]:
    """Top-level modules every install has: the standard library's, torch and polykernel's own
    dependencies (``[project] dependencies`` in pyproject.toml)."""
    deps = re.search(r"^dependencies\s*=\s*\[(.*?)\]", PYPROJECT.read_text(encoding="utf-8"), re.M | re.S)
    assert deps is not None, f"{PYPROJECT}: no [project] dependencies"
    names = {re.split(r"[<>=!~;\[ ]", d)[0].replace("-", "_").lower() for d in re.findall(r'"([^"]+)"', deps.group(1))}
    return frozenset({*sys.stdlib_module_names, "torch", *names})


@functools.cache
def _external_imports(module: str) -> dict[str, str]:
    """The modules outside polykernel that ``module`` imports, itself or through the backend
    modules it imports (transitively), beyond those every install has: name -> where."""
    found: dict[str, str] = {}
    todo, seen = [module], set()
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        for name, submodules in _imports(current):
            if name.split(".")[0] == "polykernel":
                todo.extend(m for m in (name, *submodules) if m.startswith("polykernel.backends.") and _source_file(m) is not None)
            elif name.split(".")[0].lower() not in _always_installed():
                found.setdefault(name, current)
    return found


def _covers(required: str, imported: str) -> bool:
    """``required`` (a ``requires_modules`` entry) accounts for importing ``imported``."""
    return imported == required or imported.startswith(required + ".") or required.startswith(imported + ".")


# ---------------------------------------------------------------------------------------------
# The checks: each returns the problems it finds (empty: the rule holds)

_TARGET = re.compile(r"^polykernel\.backends\.(\w+)\.([\w.]+):(\w+)$")


def _target_problems(op: Any, spec: KernelSpec) -> list[str]:
    match = _TARGET.match(spec.target)
    if match is None:
        return [f"target {spec.target!r} is not 'polykernel.backends.<backend>.<module>:<op name>'"]
    backend, module, attr = match.groups()
    problems = []
    if backend != spec.impl:
        problems.append(f"target {spec.target!r} is in backend {backend}'s package, not in {spec.impl}'s")
    if attr != op.name:
        problems.append(f"target {spec.target!r} names {attr!r}, not the op's function {op.name!r}")
    path = _source_file(f"polykernel.backends.{backend}.{module}")
    if path is None:
        problems.append(f"target module polykernel.backends.{backend}.{module} not found")
    elif attr not in _top_level_names(_tree(path)):
        problems.append(f"{path.relative_to(SRC)} defines no {attr!r}")
    return problems


def _module_problems(op: Any, spec: KernelSpec) -> list[str]:
    module = spec.target.partition(":")[0]
    if _source_file(module) is None:
        return []  # the target check names it
    return [
        f"{where} imports {name!r}, which requires_modules {spec.requires_modules} does not name"
        for name, where in sorted(_external_imports(module).items())
        if not any(_covers(r, name) for r in spec.requires_modules)
    ]


def _within(req: CapabilityRequirement, outer: CapabilityRequirement) -> bool:
    """Every platform ``req`` admits, ``outer`` admits (same device, arch window inside)."""
    lo, hi = outer.min_cuda_arch, outer.max_cuda_arch
    return (
        req.device == outer.device
        and (lo is None or (req.min_cuda_arch is not None and req.min_cuda_arch >= lo))
        and (hi is None or (req.max_cuda_arch is not None and req.max_cuda_arch <= hi))
    )


def _capability_problems(op: Any, spec: KernelSpec) -> list[str]:
    if spec.impl == "torch":
        return []  # runs anywhere: _torch_problems
    if not spec.capabilities:
        return ["declares no capabilities, i.e. runs on every device: only the torch impl does"]
    outer = _backend(spec.impl).capabilities
    return [
        f"runs on {req}, outside its backend's {', '.join(sorted(map(str, outer)))} (a row narrows where its backend runs, never widens it)"
        for req in sorted(spec.capabilities, key=str)
        if outer and not any(_within(req, o) for o in outer)
    ]


def _dtype_problems(op: Any, spec: KernelSpec) -> list[str]:
    checked = [str(d).removeprefix("torch.") for d in op.dtypes]
    names = spec.format_signature.supported_dtypes
    problems = []
    for name in names:
        dtype = getattr(torch, name, None)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            problems.append(f"dtype {name!r} is not a floating torch dtype")
        elif name not in checked:
            problems.append(f"takes {name}, which is not one of the op's dtypes {checked}: the parity harness never checks it")
    if spec.impl != "torch" and not names:
        problems.append(f"names no dtypes, i.e. takes every floating dtype, float64 too: only the torch impl does (the op's are {checked})")
    return problems


def _rank_problems(op: Any, spec: KernelSpec, torch_rank: int) -> list[str]:
    if spec.impl == "torch" or spec.rank < torch_rank or _backend(spec.impl).rank >= torch_rank:
        return []
    return [
        f"rank {spec.rank} is not ahead of the torch impl's {torch_rank}, while its backend's ({_backend(spec.impl).rank}) is: "
        "auto selection goes no further than the torch impl (ties in name order)"
    ]


def _signature_problems(op: Any, fn: Any) -> list[str]:
    want = list(inspect.signature(op.reference).parameters)
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError) as exc:
        return [f"has no signature to check: {exc}"]
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    variadic = any(p.kind is p.VAR_POSITIONAL for p in params)
    problems = [
        f"needs keyword argument {p.name!r}, which the dispatcher never passes"
        for p in params
        if p.kind is p.KEYWORD_ONLY and p.default is p.empty
    ]
    if positional != (want[: len(positional)] if variadic else want):
        problems.append(f"takes ({', '.join(positional)}{', *args' if variadic else ''}), the op's arguments are ({', '.join(want)})")
    return problems


def _source_function(spec: KernelSpec) -> Any:
    """The target's ``def`` rebuilt from its source with an empty body and no annotations or
    default values (its parameters only), or None where the target is no plain function."""
    module, _, attr = spec.target.partition(":")
    path = _source_file(module)
    defs = [n for n in (_tree(path).body if path else ()) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == attr]
    if not defs:
        return None
    stub = copy.deepcopy(defs[-1])
    stub.decorator_list, stub.returns, stub.body = [], None, [ast.Pass()]
    args = stub.args
    for arg in (*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg):
        if arg is not None:
            arg.annotation = None
    args.defaults = [ast.Constant(None) for _ in args.defaults]
    args.kw_defaults = [None if d is None else ast.Constant(None) for d in args.kw_defaults]
    namespace: dict[str, Any] = {}
    exec(compile(ast.fix_missing_locations(ast.Module([stub], [])), str(path), "exec"), namespace)
    return namespace[attr]


def _split_problems(op: Any, fn: Any) -> list[str]:
    split = getattr(fn, "split", None)
    if split is None:
        return []
    if not isinstance(split, Split):
        return [f"its split attribute is a {type(split).__name__}, not a polykernel.spec.Split"]
    if op.saved is None:
        return ["carries a Split, but the op saves nothing (Op(saved=None)): compiled graphs never use it"]
    return []


@functools.cache
def _arg_classes(op_id: str) -> tuple[Any, ...]:
    """The argument classes of the op's parity cases on the CPU, in each of its dtypes, and the
    classes ``explain`` builds without arguments (``default_key``: sizes unknown, None)."""
    op = _op(op_id)
    signature = inspect.signature(op.reference)
    classes = []
    for dtype in op.dtypes:
        classes.append(op.arg_class(op.default_key(torch.device("cpu"), dtype)))
        for case in op.cases(torch.device("cpu"), dtype):
            bound = signature.bind(*case.args, **case.kwargs)
            bound.apply_defaults()
            classes.append(op.arg_class(op.key(*bound.arguments.values())))
    return tuple(classes)


def _is_rank(answer: Any) -> bool:
    return (
        isinstance(answer, tuple)
        and len(answer) == 2
        and isinstance(answer[0], int)
        and not isinstance(answer[0], bool)
        and isinstance(answer[1], str)
    )


def _gate_problems(op: Any, spec: KernelSpec, classes: Any) -> list[str]:
    problems: list[str] = []
    gates = [("predicate", spec.predicate, lambda r: r is None or isinstance(r, str), "None or a reason string")]
    gates.append(("rank_for", spec.rank_for, lambda r: r is None or _is_rank(r), "None or (rank, reason)"))
    for what, gate, good, expected in gates:
        if gate is None:
            continue
        for arg_class in classes:
            try:
                answer = gate(arg_class)
            except Exception as exc:
                problems.append(f"{what} raised {type(exc).__name__}: {exc} on {arg_class}")
                break
            if not good(answer):
                problems.append(f"{what} answered {answer!r} ({expected}) on {arg_class}")
                break
    return problems


def _torch_problems(op: Any, specs: dict[str, KernelSpec]) -> list[str]:
    spec = specs.get("torch")
    if spec is None:
        return [f"{op.id} has no torch impl: the selection's answer of last resort, on every device"]
    fmt = spec.format_signature
    rules = {
        "runs on every device (no capabilities)": not spec.capabilities,
        "needs no module": not spec.requires_modules,
        "takes every floating dtype (names none)": not fmt.supported_dtypes,
        "has a backward": fmt.supports_backward,
        "is deterministic": spec.deterministic,
        "is CUDA-graph safe": spec.cuda_graph_safe,
        "accepts tensor subclasses (DTensor's own rules run through it)": spec.accepts_subclasses,
        "has no predicate": spec.predicate is None,
        "has no rank_for (its rank is where auto selection stops)": spec.rank_for is None,
    }
    return [f"the torch impl must be eligible everywhere, so it {rule}: it does not" for rule, holds in rules.items() if not holds]


@functools.cache
def _n_outputs(op_id: str) -> int:
    """How many outputs the reference returns (on the op's first parity case, fp32 on the CPU)."""
    op = _op(op_id)
    case = op.cases(torch.device("cpu"), torch.float32)[0]
    with torch.no_grad():
        out = op.reference(*case.args, **case.kwargs)
    return len(out) if isinstance(out, tuple) else 1


@functools.cache
def _tensor_parameters(op_id: str) -> frozenset[str]:
    """The reference's parameters annotated as tensors (``Tensor`` or ``Tensor | None``)."""
    hints = typing.get_type_hints(_op(op_id).reference)
    return frozenset(n for n, h in hints.items() if n != "return" and (h is torch.Tensor or torch.Tensor in typing.get_args(h)))


def _compile_problems(op: Any, torch_fn: Any) -> list[str]:
    problems = []
    if op.compile_mode not in MODES:
        problems.append(f"compile_mode {op.compile_mode!r} is not one of {MODES}")
    split = isinstance(getattr(torch_fn, "split", None), Split)
    if op.saved is not None and not split:
        problems.append(f"saved={op.saved}, but its torch impl carries no Split (the torch split defines what is saved)")
    if op.saved is None and split:
        problems.append("its torch impl carries a Split, but saved is None: compiled training recomputes instead of using it")
    if op.saved is not None and not (op.saved and all(isinstance(k, str) and k for k in op.saved)):
        problems.append(f"saved={op.saved!r}: one kind (a string) per saved tensor")
    if op.compile_mode == "eager" and (op.saved is not None or op.saved_grads is not None):
        problems.append("compile_mode 'eager' builds no custom op: saved and saved_grads are never read")
    grads = op.saved_grads
    if grads is None:
        return problems
    if not isinstance(grads, SavedGrads):
        return [*problems, f"saved_grads is a {type(grads).__name__}, not a polykernel.compile.facts.SavedGrads"]
    names = list(inspect.signature(op.reference).parameters)
    unknown = sorted(set(grads.slots) - set(names))
    if unknown:
        problems.append(f"saved_grads names {unknown}, which are not parameters of the reference")
    not_tensors = [n for n in grads.slots if n in names and n not in _tensor_parameters(op.id)]
    if not_tensors:
        problems.append(f"saved_grads names {not_tensors}, which are not tensors (no gradient)")
    slots = list(grads.slots.values())
    if len(set(slots)) != len(slots) or not all(isinstance(s, int) and 0 <= s < len(op.saved or ()) for s in slots):
        problems.append(f"saved_grads slots {slots}: distinct indices of the {len(op.saved or ())} saved tensors")
    if not callable(grads.when):
        problems.append("saved_grads.when is not callable")
    if _n_outputs(op.id) != 1:
        problems.append(f"saved_grads on an op of {_n_outputs(op.id)} outputs: the saved gradients are for one scalar output")
    return problems


def _layout_problems(op: Any) -> list[str]:
    layout = op.dtensor_layout
    if layout is None:
        return []
    names = list(inspect.signature(op.reference).parameters)
    tensors = _tensor_parameters(op.id)
    problems = []
    lead = layout.lead_dims
    dims = isinstance(lead, tuple) and lead and len(set(lead)) == len(lead) and all(isinstance(d, int) and d >= 0 for d in lead)
    if lead not in (ROWS, ANY) and not dims:
        problems.append(f"lead_dims {lead!r}: {ROWS!r}, {ANY!r} or distinct dims")
    if names[0] not in tensors:
        problems.append(f"the lead argument {names[0]} is not a tensor")
    if len(layout.outputs) != _n_outputs(op.id):
        problems.append(f"outputs {layout.outputs} places {len(layout.outputs)} outputs; the reference returns {_n_outputs(op.id)}")
    for like in layout.outputs:
        if like != "loss" and not (isinstance(like, int) and 0 <= like < len(names) and names[like] in tensors):
            problems.append(f"output placed like argument {like!r}, which is not a tensor parameter of the reference")
    if layout.loss_args is not None:
        at = [names[i] if isinstance(i, int) and 0 <= i < len(names) else repr(i) for i in layout.loss_args]
        if at != ["target", "ignore_index", "reduction"]:
            problems.append(f"loss_args {layout.loss_args} are the reference's {at}, not its target, ignore_index, reduction")
    if layout.loss_weight is not None:
        taken = {0, *(layout.loss_args or ())}
        w = layout.loss_weight
        if not (isinstance(w, int) and 0 <= w < len(names) and names[w] in tensors) or w in taken:
            problems.append(f"loss_weight {w!r}: the position of the class weights, another tensor parameter of the reference")
    if layout.vocab is not None and (layout.vocab not in ("logits", "weight") or not {layout.vocab, "target"} <= set(names)):
        problems.append(f"vocab {layout.vocab!r}: 'logits' or 'weight', a parameter of the reference (with its 'target')")
    return problems


def _manifest_problems(manifest: Any) -> list[str]:
    package = manifest.__name__.split(".")[-2]
    backend = _backend(package)
    problems = []
    for op_id, row in manifest.IMPLS.items():
        if op_id not in OP_MODULES:
            problems.append(f"a row for {op_id!r}, which is no op of the catalog (it would never register)")
        if row.backend is not backend:
            problems.append(f"{op_id}: a row of backend {row.backend.name}, not of this package's {backend.name}")
    return problems


# ---------------------------------------------------------------------------------------------
# Per impl


@pytest.mark.parametrize(("op_id", "impl"), IMPLS)
def test_target_is_the_ops_function_in_the_backends_package(op_id, impl):
    assert _target_problems(_op(op_id), _specs(op_id)[impl]) == []


@pytest.mark.parametrize(("op_id", "impl"), IMPLS)
def test_required_modules_name_what_the_impl_imports(op_id, impl):
    assert _module_problems(_op(op_id), _specs(op_id)[impl]) == []


@pytest.mark.parametrize(("op_id", "impl"), IMPLS)
def test_capabilities_name_where_it_runs_within_its_backend(op_id, impl):
    assert _capability_problems(_op(op_id), _specs(op_id)[impl]) == []


@pytest.mark.parametrize(("op_id", "impl"), IMPLS)
def test_dtypes_are_floating_and_checked_by_the_parity_harness(op_id, impl):
    assert _dtype_problems(_op(op_id), _specs(op_id)[impl]) == []


@pytest.mark.parametrize(("op_id", "impl"), IMPLS)
def test_rank_is_ahead_of_torch_unless_the_backend_is_behind(op_id, impl):
    specs = _specs(op_id)
    assert "torch" in specs  # (test_the_torch_impl_is_eligible_everywhere says more)
    assert _rank_problems(_op(op_id), specs[impl], specs["torch"].rank) == []


@pytest.mark.parametrize(("op_id", "impl"), IMPLS)
def test_in_place_says_whether_the_op_writes_its_arguments(op_id, impl):
    # an op with `writes` (the serving ops) writes whichever impl runs (Op marks the write)
    assert _specs(op_id)[impl].format_signature.in_place == bool(_op(op_id).writes)
    assert registry.specs_for(op_id)[impl].format_signature.in_place == bool(_op(op_id).writes)


@pytest.mark.parametrize(("op_id", "impl"), IMPLS)
def test_description_says_what_the_impl_does(op_id, impl):
    assert _specs(op_id)[impl].description.strip()


@pytest.mark.parametrize(("op_id", "impl"), IMPLS)
def test_target_takes_the_ops_arguments(op_id, impl):
    """The target loaded where the impl's modules are installed here; else its ``def`` read from
    source (the peers': their modules are mostly missing here). Skipped, and so counted in the
    summary, only where neither can be (a missing module's impl built by a call at import)."""
    spec, op = _specs(op_id)[impl], _op(op_id)
    if spec.missing_modules():
        fn = _source_function(spec)
        if fn is None:
            pytest.skip(f"{', '.join(spec.missing_modules())} not installed here, and {spec.target} is no plain def")
    else:
        fn = registry.load_impl(spec)
        assert callable(fn)
        assert _split_problems(op, fn) == []
    assert _signature_problems(op, fn) == []


@pytest.mark.parametrize(("op_id", "impl"), GATED)
def test_predicate_and_rank_for_read_only_the_ops_argument_class(op_id, impl):
    assert _gate_problems(_op(op_id), _specs(op_id)[impl], _arg_classes(op_id)) == []


# ---------------------------------------------------------------------------------------------
# Per op


@pytest.mark.parametrize("op_id", list(OP_MODULES))
def test_the_torch_impl_is_eligible_everywhere(op_id):
    assert _torch_problems(_op(op_id), _specs(op_id)) == []
    assert "torch" in polykernel.available_impls(op_id, device="cpu", dtype=torch.float64)


@pytest.mark.parametrize("op_id", list(OP_MODULES))
def test_compile_facts_agree_with_the_torch_split_and_the_reference(op_id):
    torch_fn = registry.load_impl(_specs(op_id)["torch"])
    assert _compile_problems(_op(op_id), torch_fn) == []


@pytest.mark.parametrize("op_id", list(OP_MODULES))
def test_dtensor_layout_fits_the_reference(op_id):
    assert _layout_problems(_op(op_id)) == []


# ---------------------------------------------------------------------------------------------
# Per manifest, and the declaration machinery


@pytest.mark.parametrize("manifest", [m.__name__ for m in manifests()])
def test_a_manifest_declares_rows_of_its_own_backend_for_catalog_ops(manifest):
    assert _manifest_problems(importlib.import_module(manifest)) == []


def test_a_backend_declares_its_facts_once_and_an_impl_row_only_what_differs():
    from polykernel.backends.declare import impls

    toy = Backend("cuda_jit", modules=("m",), capabilities=CUDA, dtypes=("bfloat16",), rank=30, graph_safe=False)
    plain, odd = impls(
        "group.some_op",
        toy.impl(description="d"),
        Backend("torch").impl(rank=7, dtypes=("float32",), supports_backward=False, deterministic=False, target="a.b:c"),
    )
    assert plain == KernelSpec(
        "group.some_op",
        "cuda_jit",
        "polykernel.backends.cuda_jit.some_op:some_op",  # the default target
        capabilities=frozenset({CUDA}),
        requires_modules=("m",),
        format_signature=FormatSignature(("bfloat16",)),
        rank=30,  # the backend's default rank
        cuda_graph_safe=False,
        description="d",
    )
    assert (odd.target, odd.rank, odd.deterministic, odd.cuda_graph_safe) == ("a.b:c", 7, False, True)
    assert odd.format_signature == FormatSignature(("float32",), supports_backward=False)
    # an op's row may narrow where its backend runs (the serving fp8 kernels' sm_89 floor)
    (narrow,) = impls("group.some_op", toy.impl(capabilities=CapabilityRequirement.cuda(min_sm=89)))
    assert narrow.capabilities == frozenset({CapabilityRequirement.cuda(min_sm=89)}) and narrow.requires_modules == ("m",)
    with pytest.raises(ValueError, match="more than one impl of backend cuda_jit"):
        impls("group.some_op", toy.impl(), toy.impl(rank=1))
    with pytest.raises(ValueError):
        Backend("not_a_backend")


def _comparable(spec):
    """A spec's declared facts as JSON values (sets sorted; predicate and rank_for by name)."""
    import dataclasses

    def value(v):
        if callable(v):  # a predicate, a rank_for
            return f"{v.__module__}:{getattr(v, '__qualname__', repr(v))}"
        return repr(sorted(v, key=repr) if isinstance(v, frozenset) else v)

    return {f.name: value(getattr(spec, f.name)) for f in dataclasses.fields(spec) if getattr(spec, f.name) is not None}


def test_backend_declarations_import_without_torch():
    """The backends' declarations and manifests are torch-free and import none of the modules
    their impls need (those load when an impl is selected), and they declare, without torch, the
    very impls the registry holds with it."""
    import json
    import subprocess
    import textwrap

    code = inspect.getsource(_comparable) + textwrap.dedent(
        """
        import json, sys
        sys.modules["torch"] = None  # any import of torch fails
        from polykernel.backends import declared
        from polykernel.ops import OP_MODULES

        specs = {op_id: declared(op_id) for op_id in OP_MODULES}
        needed = sorted({m for rows in specs.values() for s in rows for m in s.requires_modules})
        rows = {op_id: sorted((_comparable(s) for s in rows), key=lambda r: r["target"]) for op_id, rows in specs.items()}
        print(json.dumps({"rows": rows, "imported": [m for m in needed if m in sys.modules]}))
        """
    )
    env = {**__import__("os").environ, "PYTHONPATH": str(SRC.parent)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["imported"] == [], "reading the manifests imported modules that the impls need"
    assert sorted(got["rows"]) == sorted(OP_MODULES)
    for op_id in OP_MODULES:
        # the same rows, but in_place, which the registry sets from the op's `writes` (torch-side)
        held = [
            dataclasses.replace(s, format_signature=dataclasses.replace(s.format_signature, in_place=False))
            for s in registry.builtin_impls(op_id)
        ]
        want = sorted((_comparable(s) for s in held), key=lambda r: r["target"])
        assert got["rows"][op_id] == want, op_id


# ---------------------------------------------------------------------------------------------
# Each check catches the mistake it is there for


def _spec(op_id: str, impl: str, **changes: Any) -> KernelSpec:
    return dataclasses.replace(_specs(op_id)[impl], **changes)


def _dtypes(op_id: str, impl: str, *dtypes: str) -> KernelSpec:
    return _spec(op_id, impl, format_signature=FormatSignature(dtypes))


def _op_with(op_id: str, **changes: Any) -> Any:
    op = copy.copy(_op(op_id))
    for name, value in changes.items():
        setattr(op, name, value)
    return op


def _layout(op_id: str, **changes: Any) -> Any:
    return _op_with(op_id, dtensor_layout=dataclasses.replace(_op(op_id).dtensor_layout, **changes))


def _torch_fn(op_id: str) -> Any:
    return registry.load_impl(_specs(op_id)["torch"])


ORPO, RMS, CE, FLCE = "loss.fused_linear_orpo_loss", "norm.rms_norm", "loss.cross_entropy", "loss.fused_linear_cross_entropy"


def _always(args: dict[str, Any]) -> bool:
    return True


MISTAKES = {
    # impl rows
    "a target copied from another op's row": (
        lambda: _target_problems(_op(ORPO), _spec(ORPO, "triton", target="polykernel.backends.triton.preference:fused_linear_dpo_loss")),
        "not the op's function",
    ),
    "a target in another backend's package": (
        lambda: _target_problems(_op(RMS), _spec(RMS, "triton", target="polykernel.backends.liger.rms_norm:rms_norm")),
        "not in triton's",
    ),
    "a target module with a typo": (
        lambda: _target_problems(_op(RMS), _spec(RMS, "triton", target="polykernel.backends.triton.rms_nrom:rms_norm")),
        "not found",
    ),
    "a peer's module left out of requires_modules": (
        lambda: _module_problems(_op(RMS), _spec(RMS, "cute_dsl", requires_modules=("tvm_ffi",))),
        "imports 'cutlass",
    ),
    "a kernel that claims every device": (
        lambda: _capability_problems(_op(RMS), _spec(RMS, "triton", capabilities=frozenset())),
        "every device",
    ),
    "a row below its backend's arch floor": (
        lambda: _capability_problems(_op(RMS), _spec(RMS, "cute_dsl", capabilities=frozenset({CapabilityRequirement.cuda(min_sm=80)}))),
        "outside its backend's",
    ),
    "a CUDA backend's row that claims the CPU": (
        lambda: _capability_problems(_op(RMS), _spec(RMS, "triton", capabilities=frozenset({CapabilityRequirement.CPU}))),
        "runs on cpu, outside",
    ),
    "a dtype typo": (lambda: _dtype_problems(_op(RMS), _dtypes(RMS, "triton", "bfloat61")), "not a floating torch dtype"),
    "a dtype the parity harness never checks": (lambda: _dtype_problems(_op(RMS), _dtypes(RMS, "triton", "float64")), "never checks"),
    "a kernel that takes every dtype": (lambda: _dtype_problems(_op(RMS), _dtypes(RMS, "triton")), "every floating dtype"),
    "a rank behind torch's": (lambda: _rank_problems(_op(RMS), _spec(RMS, "triton", rank=1000), 100), "no further than the torch impl"),
    "a rank tied with torch's": (lambda: _rank_problems(_op(RMS), _spec(RMS, "triton", rank=100), 100), "no further than the torch impl"),
    "an impl taking its arguments in another order": (
        lambda: _signature_problems(_op(RMS), lambda x, eps, weight, offset, casting: x),
        "takes (x, eps, weight",
    ),
    "an impl missing an argument": (
        lambda: _signature_problems(_op(RMS), lambda x, weight, eps, offset: x),
        "takes (x, weight, eps, offset)",
    ),
    "a peer's adapter (read from source) for another op's arguments": (
        lambda: _signature_problems(_op("serving.fused_add_rms_norm_"), _source_function(_specs(RMS)["flashinfer"])),
        "takes (x, weight, eps, offset, casting)",
    ),
    "an impl needing a keyword": (
        lambda: _signature_problems(_op(RMS), lambda x, weight, eps, offset, casting, *, out: x),
        "needs keyword argument 'out'",
    ),
    "a split on an op that saves nothing": (
        lambda: _split_problems(_op_with(RMS, saved=None), _torch_fn(RMS)),
        "saves nothing",
    ),
    "a predicate reading a field its op does not have": (
        lambda: _gate_problems(_op(RMS), _spec(RMS, "liger", predicate=lambda a: a.approximate), _arg_classes(RMS)),
        "predicate raised AttributeError",
    ),
    "a predicate answering a bool": (
        lambda: _gate_problems(_op(RMS), _spec(RMS, "liger", predicate=lambda a: a.dtype is not None), _arg_classes(RMS)),
        "predicate answered",
    ),
    "a predicate that breaks on explain's unknown sizes": (
        lambda: _gate_problems(_op(RMS), _spec(RMS, "liger", predicate=lambda a: None if a.n < 65536 else "long"), _arg_classes(RMS)),
        "predicate raised TypeError",
    ),
    "a rank_for answering a bare rank": (
        lambda: _gate_problems(_op(RMS), _spec(RMS, "quack", rank_for=lambda a: 5), _arg_classes(RMS)),
        "rank_for answered 5",
    ),
    # the torch impl
    "an op without a torch impl": (lambda: _torch_problems(_op(RMS), {"triton": _specs(RMS)["triton"]}), "has no torch impl"),
    "a torch impl with a dtype list": (
        lambda: _torch_problems(_op(RMS), {"torch": _dtypes(RMS, "torch", "float32")}),
        "takes every floating dtype",
    ),
    "a torch impl behind a predicate": (
        lambda: _torch_problems(_op(RMS), {"torch": _spec(RMS, "torch", predicate=lambda a: None)}),
        "has no predicate",
    ),
    "a torch impl refusing DTensors": (
        lambda: _torch_problems(_op(RMS), {"torch": _spec(RMS, "torch", accepts_subclasses=False)}),
        "accepts tensor subclasses",
    ),
    # compile facts
    "an unknown compile mode": (lambda: _compile_problems(_op_with(RMS, compile_mode="fused"), _torch_fn(RMS)), "is not one of"),
    "saved without the torch impl's split": (
        lambda: _compile_problems(_op_with("activation.swiglu", saved=("rows",)), _torch_fn("activation.swiglu")),
        "carries no Split",
    ),
    "saved dropped while the torch impl has a split": (
        lambda: _compile_problems(_op_with(RMS, saved=None), _torch_fn(RMS)),
        "recomputes instead",
    ),
    "saved facts on an eager op": (
        lambda: _compile_problems(_op_with(ORPO, saved_grads=SavedGrads({"hidden": 0}, _always)), _torch_fn(ORPO)),
        "never read",
    ),
    "saved_grads naming a parameter the reference does not have": (
        lambda: _compile_problems(_op_with(FLCE, saved_grads=SavedGrads({"hiden": 0}, _always)), _torch_fn(FLCE)),
        "not parameters",
    ),
    "saved_grads naming a non-tensor": (
        lambda: _compile_problems(_op_with(FLCE, saved_grads=SavedGrads({"ignore_index": 0}, _always)), _torch_fn(FLCE)),
        "not tensors",
    ),
    "saved_grads on a slot past the saved tensors": (
        lambda: _compile_problems(_op_with(FLCE, saved_grads=SavedGrads({"hidden": 3}, _always)), _torch_fn(FLCE)),
        "distinct indices",
    ),
    # DTensor layouts
    "loss_args off by one": (lambda: _layout_problems(_layout(CE, loss_args=(1, 2, 3))), "not its target, ignore_index, reduction"),
    "a layout that forgets an output": (lambda: _layout_problems(_layout("norm.fused_add_rms_norm", outputs=(0,))), "returns 2"),
    "an output placed like a scalar": (lambda: _layout_problems(_layout(RMS, outputs=(2,))), "not a tensor parameter"),
    "lead dims that are no dims": (lambda: _layout_problems(_layout(RMS, lead_dims="row")), "lead_dims 'row'"),
    "a vocab route on no parameter": (lambda: _layout_problems(_layout(CE, vocab="logit")), "vocab 'logit'"),
    "class weights at the target's position": (lambda: _layout_problems(_layout(CE, loss_weight=1)), "loss_weight 1"),
    # manifests
    "a manifest row for a misspelt op": (
        lambda: _manifest_problems(
            SimpleNamespace(__name__="polykernel.backends.triton.manifest", IMPLS={"norm.rms_nrom": _backend("triton").impl()})
        ),
        "no op of the catalog",
    ),
    "a manifest row of another backend": (
        lambda: _manifest_problems(SimpleNamespace(__name__="polykernel.backends.triton.manifest", IMPLS={RMS: _backend("liger").impl()})),
        "not of this package's triton",
    ),
}


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_the_checks_catch_the_mistake(mistake):
    check, said = MISTAKES[mistake]
    problems = check()
    assert any(said in p for p in problems), problems


def test_the_checks_catch_a_backend_declared_twice(monkeypatch):
    package = importlib.import_module("polykernel.backends.triton")
    monkeypatch.setattr(package, "TRITON_AGAIN", Backend("triton"), raising=False)
    _backend.cache_clear()
    try:
        with pytest.raises(AssertionError, match="declares Backend\\('triton'\\) 2 times"):
            _backend("triton")
    finally:
        monkeypatch.undo()
        _backend.cache_clear()
