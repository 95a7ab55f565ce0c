"""The H200 plan (``benchmarks/h200_plan.sh``) on the CPU: every part's dry run (``PK_DRY_RUN``) and
what it would run. GPU time is scarce and a typo costs a whole part of it, so: each part's limits
fit one device command; every script exists and its argument parser accepts the exact arguments
(parsed in a process of their own, stopped right after parsing: nothing measures); every module
exists, ``polykernel``'s CLI accepts its command line; every test file exists and each ``-k``
selects tests; every ``make test-gpu PART=`` is one of the Makefile's GPU parts."""

from __future__ import annotations

import fnmatch
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PLAN = ROOT / "benchmarks" / "h200_plan.sh"
BUDGET_S = 570  # a device command is capped at 600 s: set-up and the pack take the rest
BUILDS = {"native-build", "flashinfer-jit", "cuda-jit-build"}  # guards that are usually done in tens of seconds


def gpu_parts() -> list[str]:
    (line,) = re.findall(r"^GPU_PARTS\s*:=\s*(.+)$", (ROOT / "Makefile").read_text(), re.M)
    return line.split()


PARTS = [
    *("serving-a", "serving-native", "serving-b", "serving-c", "losses", "losses-jsd", "moe", "moe-tests", "moe-liger"),
    *("moe-train", "moe-train-liger", "decode", "trl", "trl-memory", "checks", "overhead", "overhead-graph"),
    *(f"families-{k}" for k in range(1, 8)),
    "vision-1",
    "vision-2",
    *(f"gpu-{p}" for p in gpu_parts()),
]


# ---- the dry run -------------------------------------------------------------------------------


def staged_root(tmp: Path) -> Path:
    """The project root as a GPU command sees it with everything staged (the serving peers' set-up,
    .ab): each conditional step is in the dry run. Links to this checkout's files."""
    root = tmp / "root"
    root.mkdir()
    for entry in ROOT.iterdir():
        if entry.name not in {".gpu", ".ab", ".whl"}:
            (root / entry.name).symlink_to(entry)
    (root / ".gpu" / "serving").mkdir(parents=True)
    (root / ".gpu" / "serving" / "setup.sh").write_text("exit 0\n")
    (root / ".ab").mkdir()
    bin_dir = tmp / "bin"  # `python3` is this interpreter (the script calls python3)
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (bin_dir / "python3").chmod(0o755)
    return root


def dry_run(plan: Path, parts: list[str], root: Path) -> dict[str, list[dict]]:
    """Each part's steps ({"part", "name", "limit", "declared", "argv"}), from ``PK_DRY_RUN``."""
    out = root.parent / f"dry-{plan.stem}.jsonl"
    out.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in {"PK_DEADLINE", "PK_FAMILIES", "PK_NO_WHEELS", "OUT", "PYTHONPATH"}}
    env.update(PK_DRY_RUN=str(out), PATH=f"{root.parent / 'bin'}{os.pathsep}{env.get('PATH', '')}")
    steps: dict[str, list[dict]] = {part: [] for part in parts}
    for part in parts:
        r = subprocess.run(["bash", str(plan), part], cwd=root, env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, f"{part}: rc={r.returncode}\n{r.stdout}{r.stderr}"
    for line in out.read_text().splitlines() if out.exists() else []:
        step = json.loads(line)
        steps[step["part"]].append(step)
    return steps


# ---- what each command is, and its checks ------------------------------------------------------


def command(argv: list[str]) -> list[str]:
    """argv without a leading ``env VAR=VALUE ...``."""
    if argv[0] == "env":
        argv = argv[1:]
        while argv and re.fullmatch(r"\w+=.*", argv[0]):
            argv = argv[1:]
    return argv


def budget_problems(steps: dict[str, list[dict]]) -> list[str]:
    """A part's limits (after PK_DEADLINE's cut, as the script does it) past BUDGET_S; or its
    measurements' own limits (the build guards apart) past it."""
    problems = []
    for part, ss in steps.items():
        total = sum(s["limit"] for s in ss)
        if total > BUDGET_S:
            each = ", ".join(f"{s['name']} {s['limit']}" for s in ss)
            problems.append(f"{part}: its steps' limits add up to {total} s > {BUDGET_S} s ({each})")
        own = sum(s["declared"] for s in ss if s["name"] not in BUILDS)
        if own > BUDGET_S:
            problems.append(f"{part}: its measurements' limits add up to {own} s > {BUDGET_S} s without the builds")
    return problems


def shell_subcommands(script: Path) -> set[str]:
    """The labels of a shell script's first ``case $1``-like switch (``stage)``, ``run)``)."""
    labels = re.findall(r"^\s+([\w|-]+)\)", script.read_text(), re.M)
    return {name for label in labels for name in label.split("|")}


def static_problems(steps: dict[str, list[dict]]) -> tuple[list[str], list[tuple[str, list[str]]], list[tuple[str, list[str]]]]:
    """The checks that need no interpreter of their own; returns (problems, the scripts to parse
    [(where, argv)], the pytest steps [(where, argv after pytest)])."""
    problems: list[str] = []
    scripts: list[tuple[str, list[str]]] = []
    pytests: list[tuple[str, list[str]]] = []
    for part, ss in steps.items():
        for s in ss:
            where, argv = f"{part}/{s['name']}", command(s["argv"])
            if argv[0] == "python3" and argv[1] == "-m" and argv[2] == "pytest":
                pytests.append((where, argv[3:]))
            elif argv[0] == "python3" and argv[1] == "-m" and argv[2] == "polykernel":
                from polykernel.tools.cli import build_parser

                try:
                    build_parser().parse_args(argv[3:])
                except SystemExit:
                    problems.append(f"{where}: polykernel's CLI refuses {argv[3:]}")
            elif argv[0] == "python3" and argv[1] == "-m":
                if importlib.util.find_spec(argv[2]) is None:
                    problems.append(f"{where}: no module {argv[2]}")
            elif argv[0] == "python3" and argv[1].endswith(".py"):
                if not (ROOT / argv[1]).is_file():
                    problems.append(f"{where}: no script {argv[1]}")
                else:
                    scripts.append((where, argv[1:]))
            elif argv[0] == "bash":
                script = ROOT / argv[1]
                if not script.is_file():
                    problems.append(f"{where}: no script {argv[1]}")
                elif argv[2] not in shell_subcommands(script):
                    problems.append(f"{where}: {argv[1]} has no subcommand {argv[2]!r}")
            elif argv[0] == "make":
                targets = [a for a in argv[1:] if "=" not in a]
                made = dict(a.split("=", 1) for a in argv[1:] if "=" in a)
                if targets != ["test-gpu"] or made.get("PART") not in gpu_parts():
                    problems.append(f"{where}: `{' '.join(argv)}` is no `make test-gpu PART=` of {gpu_parts()}")
            else:
                problems.append(f"{where}: a command this test does not know how to check: {argv}")
            if "--families" in argv and not argv[argv.index("--families") + 1]:
                problems.append(f"{where}: an empty --families list")
    return problems, scripts, pytests


# Runs in a process of its own (the scripts' imports and module-level settings stay out of the
# test session): each script as __main__, stopped right after its parser accepts or refuses.
PARSE_WORKER = r"""
import argparse, contextlib, io, json, os, runpy, sys

class Parsed(Exception):
    pass

parse_args, parse_known_args = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args
inside = []

def patched_parse_args(self, args=None, namespace=None):
    inside.append(1)
    try:
        parse_args(self, args, namespace)
    finally:
        inside.pop()
    raise Parsed

def patched_parse_known_args(self, args=None, namespace=None):
    result = parse_known_args(self, args, namespace)
    if not inside:  # the script's own call (parse_args calls it too, then refuses what is left)
        raise Parsed
    return result

argparse.ArgumentParser.parse_args = patched_parse_args
argparse.ArgumentParser.parse_known_args = patched_parse_known_args
results = []
for where, argv in json.loads(sys.stdin.read()):
    path = os.path.abspath(argv[0])
    saved = sys.argv, list(sys.path), set(sys.modules), dict(os.environ)
    sys.argv, err = argv, io.StringIO()
    sys.path.insert(0, os.path.dirname(path))  # as when run as a script: its siblings import
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            runpy.run_path(path, run_name="__main__")
        problem = "ran to its end without parsing its arguments"
    except Parsed:
        problem = None
    except SystemExit as e:
        problem = f"its parser refused them (exit {e.code}): {err.getvalue().strip()[-400:]}"
    except BaseException as e:
        problem = f"failed before parsing its arguments: {type(e).__name__}: {e}"
    finally:
        sys.argv, sys.path[:] = saved[0], saved[1]
        for name in set(sys.modules) - saved[2]:  # its folder's modules (another folder has its own _common)
            if os.path.abspath(getattr(sys.modules[name], "__file__", None) or "/").startswith(os.path.dirname(os.path.dirname(path))):
                del sys.modules[name]
        os.environ.clear()
        os.environ.update(saved[3])
    if problem:
        results.append(f"{where}: {argv[0]} {argv[1:]}: {problem}")
print(json.dumps(results))
"""

# Collects the named test files once, then counts the tests each -k selects, by pytest's own -k
# matching (KeywordMatcher and Expression: what `pytest -k` uses).
COLLECT_WORKER = r"""
import json, sys
import pytest
from _pytest.mark import KeywordMatcher
from _pytest.mark.expression import Expression

files, exprs = json.loads(sys.stdin.read())
counts = {}

class Count:
    def pytest_collection_finish(self, session):
        for expr in exprs:
            compiled = Expression.compile(expr)
            counts[expr] = {f: 0 for f in files}
            for item in session.items:
                if compiled.evaluate(KeywordMatcher.from_item(item)):
                    counts[expr][item.nodeid.split("::")[0]] += 1

rc = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *files], plugins=[Count()])
print("COUNTS " + json.dumps({"rc": int(rc), "counts": counts}))
"""


def k_of(args: list[str]) -> tuple[list[str], str | None]:
    """(test files, -k expression) of pytest's arguments."""
    files, k, skip = [], None, False
    for i, a in enumerate(args):
        if skip:
            skip = False
        elif a == "-k":
            k, skip = args[i + 1], True
        elif a in {"-m", "-p", "--timeout", "--tb"}:
            skip = True
        elif not a.startswith("-"):
            files.append(a)
    return files, k


def worker_env() -> dict[str, str]:
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


def start_parse(scripts: list[tuple[str, list[str]]]) -> subprocess.Popen:
    p = subprocess.Popen(
        [sys.executable, "-c", PARSE_WORKER], cwd=ROOT, env=worker_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    p.stdin.write(json.dumps(scripts))
    p.stdin.close()
    return p


def parse_problems(p: subprocess.Popen) -> list[str]:
    out = p.stdout.read()
    assert p.wait(timeout=120) == 0, out
    return json.loads(out.splitlines()[-1])


def pytest_problems(pytests: list[tuple[str, list[str]]], collect: subprocess.Popen | None) -> list[str]:
    problems = []
    for where, args in pytests:
        files, _ = k_of(args)
        problems += [f"{where}: no test file {f}" for f in files if not (ROOT / f).is_file()]
    if collect is not None:
        out = collect.stdout.read()
        collect.wait(timeout=120)
        (line,) = [x for x in out.splitlines() if x.startswith("COUNTS ")]
        counts = json.loads(line.removeprefix("COUNTS "))
        if counts["rc"] != 0:
            problems.append(f"collecting the plan's -k test files failed (rc {counts['rc']})\n{out[-2000:]}")
        for where, args in pytests:
            files, k = k_of(args)
            if k is not None and counts["rc"] == 0 and not sum(counts["counts"][k].get(f, 0) for f in files):
                problems.append(f"{where}: -k {k!r} selects no test of {files}")
    return problems


def start_collect(pytests: list[tuple[str, list[str]]]) -> subprocess.Popen | None:
    with_k = [(files, k) for files, k in map(lambda w: k_of(w[1]), pytests) if k is not None]
    files = sorted({f for fs, _ in with_k for f in fs if (ROOT / f).is_file()})
    if not files:
        return None
    p = subprocess.Popen(
        [sys.executable, "-c", COLLECT_WORKER], cwd=ROOT, env=worker_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    p.stdin.write(json.dumps([files, sorted({k for _, k in with_k})]))
    p.stdin.close()
    return p


def all_problems(steps: dict[str, list[dict]]) -> list[str]:
    problems, scripts, pytests = static_problems(steps)
    parse, collect = start_parse(scripts), start_collect(pytests)  # both at once
    return budget_problems(steps) + problems + parse_problems(parse) + pytest_problems(pytests, collect)


# ---- the tests ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return staged_root(tmp_path_factory.mktemp("plan"))


def test_every_part_of_the_plan_holds(root):
    text = PLAN.read_text()
    # every part the script's case names is one this test runs (a part added is a part checked)
    body = text[text.index("case $part in\n  serving-a)") :]
    labels = {lab.strip() for m in re.findall(r"^  ([\w\[\]*| -]+)\)", body, re.M) for lab in m.split("|")} - {"*"}
    assert labels and all(any(fnmatch.fnmatch(p, lab) for p in PARTS) for lab in labels), labels
    steps = dry_run(PLAN, PARTS, root)
    assert all(steps.values()), [p for p, ss in steps.items() if not ss]
    assert all_problems(steps) == []


def test_the_checks_catch_a_wrong_flag_a_missing_script_and_an_over_budget_part(root, tmp_path):
    text = PLAN.read_text()
    broken = tmp_path / "broken_plan.sh"
    for old, new in [
        ("moe_paths.py --rep 150", "moe_paths.py --repeats 150"),  # a flag the script does not take
        ("benchmarks/host/overhead.py", "benchmarks/host/overhead_gone.py"),  # a script that is not there
        ("step moe-sweep 130", "step moe-sweep 400"),  # moe: 4 x 90 + 80 + 400 s
        (': "${PK_DEADLINE:=$(($(now) + 570))}"', ""),  # and no deadline of its own to cut it at 570 s
        ("test_moe_router; do", "test_moe_gone; do"),  # a moved test file
        ('-k "parity_gpu_large or outside_the_experts"', '-k "no_such_test"'),  # a -k that selects nothing
        ("ab_overhead.sh run", "ab_overhead.sh go"),  # a subcommand the shell script has not
        ("make test-gpu PART=", "make test-gpu PART=x"),  # gpu-norms -> PART=xnorms
    ]:
        assert old in text, old
        text = text.replace(old, new)
    broken.write_text(text)
    problems = "\n".join(all_problems(dry_run(broken, ["moe", "overhead", "moe-liger", "gpu-norms"], root)))
    assert "moe/moe-layer: benchmarks/kernels/moe_paths.py ['--repeats', '150'" in problems, problems
    assert "unrecognized arguments: --repeats 150" in problems, problems
    assert "overhead/overhead: no script benchmarks/host/overhead_gone.py" in problems, problems
    assert "moe: its steps' limits add up to 840 s > 570 s" in problems, problems
    assert "moe: its measurements' limits add up to 840 s > 570 s" in problems, problems
    assert "no test file tests/ops/test_moe_gone.py" in problems, problems
    assert "moe-liger/moe-liger: -k 'no_such_test' selects no test" in problems, problems
    assert "has no subcommand 'go'" in problems, problems
    assert "PART=xnorms" in problems, problems
