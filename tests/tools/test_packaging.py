"""What a new user meets: a missing optional package names the command that installs it, and the
package page (docs/pypi.md) lists the ops this build registers."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = str(ROOT / "src")


@pytest.mark.parametrize(
    ("module", "package", "command"),
    [
        ("polykernel.integrations.transformers", "transformers", "pip install 'transformers>=4.45'"),
        ("polykernel.integrations.trl", "trl", "pip install 'trl>=1.16,<1.17'"),
    ],
)
def test_an_integration_without_its_package_says_how_to_install_it(module, package, command):
    # sys.modules[package] = None: its import fails as if it were not installed
    code = f"import sys; sys.modules[{package!r}] = None\ntry:\n    import {module}\nexcept ImportError as e:\n    print(type(e).__mro__[1:3], e.name, e)\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={"PYTHONPATH": SRC, "PATH": ""}, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "PolykernelError" in out.stdout and "ModuleNotFoundError" in out.stdout
    assert f" {package} is not installed" in out.stdout and command in out.stdout and f"pip install -e '.[{package}]'" in out.stdout


def test_demo_plot_without_matplotlib_says_how_to_install_it(monkeypatch):
    import importlib.util

    from polykernel.tools import demo

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    with pytest.raises(SystemExit, match=r"polykernel demo --plot: matplotlib is not installed.*pip install 'matplotlib>=3\.7'"):
        demo.main(["--plot", "x.png", "--device", "cpu"])


def test_the_extras_named_in_errors_are_pyprojects():
    tomllib = pytest.importorskip("tomllib")
    from polykernel.errors import EXTRAS

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra, (_module, requirement) in EXTRAS.items():
        assert extras[extra] == [requirement], extra


def test_demo_hf_model_without_transformers_says_how_to_install_it(monkeypatch):
    import importlib.util

    from polykernel.tools.demo import models

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else real(name, *a))
    with pytest.raises(ValueError, match=r"pip install 'transformers>=4\.45'"):
        models.model_kind("hf")
