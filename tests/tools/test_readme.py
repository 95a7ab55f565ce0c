"""The documentation runs as written: the README's code, the runnable examples in docs/, the
sample ``polykernel explain`` output, the environment variables it lists, and every relative link.

Conventions (docs/testing.md): every ```python block of README.md runs, unless the line just
before it is ``<!-- skip: REASON -->``; a ```python block of docs/*.md runs when the line just
before it is ``<!-- run -->``. Each runs in a fresh subprocess on the CPU path: TRITON_INTERPRET
and the POLYKERNEL_* settings unset (tests/conftest.py sets the first for the suite), a private
tuning store, this checkout's ``src`` first on the path.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))

_FENCE = re.compile(r"^\s*```(\w*)\s*$")
_SKIP = re.compile(r"^<!--\s*skip:\s*(.*?)\s*-->$")
_RUN = re.compile(r"^<!--\s*run\s*-->$")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    marker: str  # the line just before the fence, stripped
    code: str

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """The fenced code blocks of a Markdown file, with the line just before each."""
    lines = path.read_text(encoding="utf-8").splitlines()
    found, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        start, body = i, []
        i += 1
        while i < len(lines) and _FENCE.match(lines[i]) is None:
            body.append(lines[i])
            i += 1
        marker = lines[start - 1].strip() if start > 0 else ""
        found.append(Block(path, start + 1, m.group(1), marker, "\n".join(body) + "\n"))
        i += 1  # the closing fence
    return found


def _runnable() -> list[Block]:
    run = [b for b in blocks(README) if b.lang == "python" and not _SKIP.match(b.marker)]
    for doc in DOCS:
        run += [b for b in blocks(doc) if b.lang == "python" and _RUN.match(b.marker)]
    return run


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET" and not k.startswith("POLYKERNEL_")}
    env["POLYKERNEL_CACHE_DIR"] = str(tmp_path / "cache")  # never the user's tuning store
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


def _run(argv: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=300)


def test_readme_has_python_blocks():
    """The parametrized test below would pass vacuously if the parser found nothing."""
    assert any(b.lang == "python" for b in blocks(README))


def test_readme_skip_markers_give_a_reason():
    for b in blocks(README):
        m = _SKIP.match(b.marker)
        if b.lang == "python" and m is not None:
            assert m.group(1), f"{b.id}: say why the block cannot run on a CPU (<!-- skip: REASON -->)"


@pytest.mark.parametrize("block", _runnable(), ids=lambda b: b.id)
def test_block_runs_as_written(block: Block, tmp_path: Path):
    script = tmp_path / "block.py"
    script.write_text(block.code, encoding="utf-8")
    if "transformers" in block.code and importlib.util.find_spec("transformers") is None:
        pytest.skip("needs the optional extra transformers")
    done = _run([sys.executable, str(script)], _env(tmp_path), tmp_path)
    assert done.returncode == 0, f"{block.id} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"


def test_pypi_description_quickstart_is_the_readmes():
    """docs/pypi.md (the package's long description) repeats the README's Quickstart, which the
    test above runs: any python block there must be one of the README's, so it cannot drift."""
    readme = {b.code for b in blocks(README) if b.lang == "python"}
    pypi = [b for b in blocks(ROOT / "docs" / "pypi.md") if b.lang == "python"]
    assert pypi, "docs/pypi.md has no quickstart"
    for b in pypi:
        assert b.code in readme, f"{b.id}: not the README's code (copy the README's Quickstart)"


def test_pyproject_readme_exists():
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    m = re.search(r'^readme\s*=\s*"([^"]+)"', text, re.M)
    assert m is not None and (ROOT / m.group(1)).is_file(), "[project] readme must name a file"


def test_explain_sample_is_the_real_output(tmp_path: Path):
    """The README's sample of `polykernel explain` is what the command prints on a machine
    without a GPU (every impl listed, its rank and verdict, the choice)."""
    samples = [b for b in blocks(README) if b.code.startswith("$ polykernel explain")]
    assert samples, "README: no sample of `$ polykernel explain ...`"
    for b in samples:
        first, *shown = b.code.rstrip("\n").splitlines()
        argv = shlex.split(first[2:].split("#")[0])
        env = _env(tmp_path)
        env["CUDA_VISIBLE_DEVICES"] = ""  # the sample is the CPU's
        done = _run([sys.executable, "-m", "polykernel", *argv[1:]], env, tmp_path)
        assert done.returncode == 0, done.stderr
        real = [line.rstrip() for line in done.stdout.rstrip("\n").splitlines()]
        assert [line.rstrip() for line in shown] == real, f"{b.id}: update the sample to the real output:\n" + "\n".join(real)


def test_readme_env_vars_exist():
    """Each variable in the README's table is read somewhere in the source."""
    text = README.read_text(encoding="utf-8")
    table = text.split("### Environment variables", 1)[1].split("\n\n", 2)[1]
    names = re.findall(r"^\| `([A-Z_]+)", table, re.M)
    assert len(names) >= 5, table
    source = "\n".join(p.read_text(encoding="utf-8") for p in (ROOT / "src").rglob("*.py"))
    for name in names:  # POLYKERNEL_IMPL_<OP> is read as the prefix POLYKERNEL_IMPL_
        assert name in source, f"README lists {name}, which no module in src/ reads"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _outside_code(path: Path) -> str:
    return re.sub(r"^\s*```.*?^\s*```", "", path.read_text(encoding="utf-8"), flags=re.S | re.M)


def _anchors(path: Path) -> set[str]:
    text = _outside_code(path)
    return {_slug(h) for h in re.findall(r"^#{1,6}\s+(.*)$", text, re.M)} | set(re.findall(r'<a (?:id|name)="([^"]+)"', text))


@pytest.mark.parametrize("doc", [README, *DOCS], ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc: Path):
    for target in re.findall(r"\]\(([^)\s]+)\)", _outside_code(doc)):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        assert file.exists(), f"{doc.name}: link to {target}: no such file"
        if anchor and file.suffix == ".md":
            assert anchor in _anchors(file), f"{doc.name}: link to {target}: no such heading in {file.name}"


def _impl_tables() -> dict[str, dict[str, bool]]:
    """op id -> impl -> whether the README's "Ops × impls" tables mark it ✓ (both tables: the
    columns named by an impl in backticks; a row may name several ops)."""
    section = README.read_text(encoding="utf-8").split("## Ops × impls", 1)[1].split("\n## ", 1)[0]
    claimed: dict[str, dict[str, bool]] = {}
    columns: list[str | None] | None = None
    for line in section.splitlines():
        if not line.startswith("|"):
            columns = None
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        if columns is None:
            columns = [m.group(1) if (m := re.match(r"`(\w+)`", c)) else None for c in cells]
        elif not set("".join(cells)) <= set("-: "):
            for op in re.findall(r"`([\w.]+)`", cells[0]):
                for impl, cell in zip(columns[1:], cells[1:]):
                    if impl is not None:
                        claimed.setdefault(op, {})[impl] = cell.startswith("✓")
    return claimed


def test_readme_ops_table_matches_the_registry():
    """Every registered op has a row, and for each impl column a ✓ exactly where the op registers
    that impl (the peers FlashInfer and sgl-kernel, and cuTile, are described in prose instead)."""
    import polykernel
    from polykernel.core import registry

    claimed = _impl_tables()
    assert set(claimed) == set(polykernel.list_ops()), "README's Ops × impls: rows to add or remove"
    for op, marks in claimed.items():
        registered = set(registry.specs_for(op))
        for impl, mark in marks.items():
            assert mark == (impl in registered), (
                f"README's Ops × impls: {op} / {impl}: {'✓' if mark else '—'} but registered: {impl in registered}"
            )


def test_integrations_doc_lists_every_nn_module():
    import polykernel.nn

    text = (ROOT / "docs" / "integrations.md").read_text(encoding="utf-8").split("## Hugging Face", 1)[0]
    missing = [name for name in polykernel.nn.__all__ if f"`{name}`" not in text]
    assert not missing, f"docs/integrations.md (polykernel.nn): add {missing}"
