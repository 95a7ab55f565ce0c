"""Every script under ``benchmarks/`` keeps its rows as they are measured and prints an estimate of
its run time first (issue 35; ``polykernel.tools.rows``), or says on an allow-list below why not.

A source scan (the calls in each script's syntax tree), so that a new script that writes its results
only at the end fails here; and one import of every script (their own imports, paths and sibling
modules), without running any."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SRC = BENCHMARKS.parent / "src"

# Calls that keep rows as measured, and calls that print the estimate (``_child.run_all`` announces
# when given its RowFile, as the models' variant scripts do).
KEEPS_ROWS = {"RowFile"}
ESTIMATES = {"announce", "run_all"}

# script (relative to benchmarks/) -> why it has no RowFile
NO_ROW_FILE = {
    "readme_table.py": "reads a results file and prints a table: measures nothing",
    "host/moe_gpu_compiles.py": "counts the MoE GPU tests' Triton compiles on the CPU: one JSON of counts, no timed rows",
    "kernels/bench_ops.py": "runs polykernel.tools.bench.main, whose rows go through a RowFile (test_bench_rows.py)",
    "kernels/moe_paths.py": "JSONL, a line appended per row as measured (its own format; edited elsewhere)",
    "kernels/ncu_kernels.py": "the counters come from ncu's report, which exists once its run ends (see its docstring)",
    "models/decode_drift.py": "JSONL, a line appended (file closed) per row as measured",
    "models/decode_profile.py": "JSONL, a line appended (file closed) per row as measured",
    "parity_power.py": "a CPU audit of the parity harness (mutants killed or not), printed per mutant: no measurement",
    "fit_gpu_parts.py": "re-cuts staged payloads into parts: measures nothing",
    "models/plot_families.py": "draws families.py's results files: measures nothing",
    "models/chain_under_compile.py": "a diagnostic of the inference patch under torch.compile: one JSON of booleans, no timed rows",
}
# script -> why it prints no estimate
NO_ESTIMATE = {
    "readme_table.py": "measures nothing",
    "host/moe_gpu_compiles.py": "prints each test's count as it goes (~1 min; ~5 min with --compile: its docstring)",
    "kernels/bench_ops.py": "polykernel.tools.bench.main announces",
    "kernels/moe_paths.py": "not yet: edited elsewhere",
    "parity_power.py": "measures nothing (verdicts, not times)",
    "fit_gpu_parts.py": "measures nothing (seconds of file copies)",
    "models/plot_families.py": "measures nothing (draws a picture)",
    "models/chain_under_compile.py": "measures nothing (a few seconds: one tiny model traced)",
}


def _calls(tree: ast.AST) -> set[str]:
    """The names called anywhere in ``tree`` (``f(...)`` and ``x.f(...)``)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            out.add(f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else "")
    return out


def _is_script(tree: ast.Module) -> bool:
    """Has an ``if __name__ == "__main__":`` block (helpers such as ``models/_common.py`` have none)."""
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Compare) and isinstance(node.test.left, ast.Name):
            if node.test.left.id == "__name__":
                return True
    return False


def _scripts() -> dict[str, set[str]]:
    """Each script under benchmarks/ (path relative to it) -> the names it calls."""
    out = {}
    for path in sorted(BENCHMARKS.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        if _is_script(tree):
            out[path.relative_to(BENCHMARKS).as_posix()] = _calls(tree)
    return out


def test_every_benchmark_keeps_its_rows_and_prints_an_estimate():
    scripts = _scripts()
    assert len(scripts) > 20 and "tuning/sweep_tuning.py" in scripts and "models/_common.py" not in scripts
    missing_rows = [s for s, calls in scripts.items() if not calls & KEEPS_ROWS and s not in NO_ROW_FILE]
    missing_estimate = [s for s, calls in scripts.items() if not calls & ESTIMATES and s not in NO_ESTIMATE]
    assert not missing_rows, (
        f"write rows through polykernel.tools.rows.RowFile as measured (or add to NO_ROW_FILE, with why): {missing_rows}"
    )
    assert not missing_estimate, f"print polykernel.tools.rows.announce(...) before measuring (or add to NO_ESTIMATE): {missing_estimate}"


def test_the_allow_lists_name_scripts_that_still_need_them():
    # an entry whose script is gone, or now uses the mechanism, is dropped from the list
    scripts = _scripts()
    for allowed, wanted in ((NO_ROW_FILE, KEEPS_ROWS), (NO_ESTIMATE, ESTIMATES)):
        for script in allowed:
            assert script in scripts, f"{script}: no such script under benchmarks/"
            assert not scripts[script] & wanted, f"{script} calls {scripts[script] & wanted}: remove it from the allow-list"
    # bench_ops's rows and estimate are polykernel bench's
    assert "polykernel.tools.bench import main" in (BENCHMARKS / "kernels" / "bench_ops.py").read_text()
    bench = ast.parse((SRC / "polykernel" / "tools" / "bench.py").read_text())
    assert {"RowFile", "announce"} <= _calls(bench)


_IMPORT_ALL = """
import importlib.util, sys
from pathlib import Path
failed = []
for rel in sys.argv[2:]:
    path = Path(sys.argv[1]) / rel
    saved = list(sys.path)  # restored after: scripts add their own folders
    sys.path.insert(0, str(path.parent))  # as `python benchmarks/<area>/<name>.py` has it
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module  # its dataclasses resolve their module
    try:
        spec.loader.exec_module(module)
    except BaseException as exc:
        failed.append(f"{rel}: {type(exc).__name__}: {exc}")
    finally:
        sys.path[:] = saved
        for name, mod in list(sys.modules.items()):  # siblings too: each script finds its own
            if str(getattr(mod, "__file__", None) or "").startswith(sys.argv[1]):
                del sys.modules[name]
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


def test_every_benchmark_imports():
    # one interpreter imports them all (no main() runs): a broken import path or sibling fails here
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-c", _IMPORT_ALL, str(BENCHMARKS) + os.sep, *_scripts()], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, f"scripts that do not import:\n{proc.stdout}{proc.stderr[-3000:]}"
