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


# ------------------------------------------------------------------------------------------------
# make setup on a machine without an NVIDIA driver: torch from PyTorch's CPU index, or one line why not


def _cpu_torch(tmp_path, index: str) -> subprocess.CompletedProcess:
    import os
    import shutil

    if shutil.which("make") is None:
        pytest.skip("no make")
    if shutil.which("nvidia-smi") or os.path.exists("/proc/driver/nvidia"):
        pytest.skip("an NVIDIA driver is here: the default wheels are the right ones")
    probe = tmp_path / "probe.mk"
    probe.write_text("probe:\n\t$(call cpu_torch,echo PIP,torch==2.13.0)\n")
    cmd = ["make", "-s", "-f", str(ROOT / "Makefile"), "-f", str(probe), "probe", f"TORCH_CPU_INDEX={index}", f"PYTHON={sys.executable}"]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=60)


def test_make_setup_without_a_driver_takes_torch_from_the_cpu_index(tmp_path):
    import functools
    import http.server
    import threading

    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "index.html").write_text("<html></html>")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        out = _cpu_torch(tmp_path, f"http://127.0.0.1:{server.server_address[1]}")
    finally:
        server.shutdown()
    assert out.returncode == 0, out.stderr
    assert f"PIP install -q --retries 0 --timeout 10 --index-url http://127.0.0.1:{server.server_address[1]} torch==2.13.0" in out.stdout


def test_make_setup_without_a_driver_or_the_cpu_index_says_so_and_goes_on(tmp_path):
    out = _cpu_torch(tmp_path, "http://127.0.0.1:9")  # nothing listens there
    assert out.returncode == 0, out.stderr
    assert "cannot be reached" in out.stdout and "PIP" not in out.stdout
    assert len(out.stdout.strip().splitlines()) == 1


def test_the_package_page_lists_the_registered_ops():
    import re

    import polykernel

    text = (ROOT / "docs" / "pypi.md").read_text()
    section = text.split("## Ops", 1)[1].split("\n## ", 1)[0]
    listed = {
        f"{family}.{name}" for family, names in re.findall(r"^- (\w+): (.+)$", section, re.M) for name in re.findall(r"`(\w+)`", names)
    }
    assert listed == set(polykernel.list_ops())
    assert not re.search(r"pip install [\"']?polykernel\b", text)  # not on PyPI: no install by name


def test_the_readme_shows_the_h200_demo_plot():
    import re

    text = (ROOT / "README.md").read_text()
    images = re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", text)
    assert any("demo" in path for path in images), images
    assert all((ROOT / path).is_file() for path in images), images
