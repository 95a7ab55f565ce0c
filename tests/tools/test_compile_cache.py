"""``h200_plan.sh compile-cache`` packs the compile caches in parts a device call can return, and a
later machine's first part unpacks them where each tool looks: Triton's and Inductor's under
``$CACHES``, polykernel's native builds and FlashInfer's JIT modules under ``$HOME``; the tuning store
never travels."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PLAN = ROOT / "benchmarks" / "h200_plan.sh"

pytestmark = pytest.mark.skipif(not all(shutil.which(t) for t in ("bash", "tar", "xz", "split")), reason="needs bash, tar, xz, split")


def _env(home: Path, cc: Path, out: Path) -> dict[str, str]:
    """A device command's environment, with its home, cache folder and $OUT in ``tmp_path``."""
    env = {k: v for k, v in os.environ.items() if k not in {"PK_DEADLINE", "PK_DRY_RUN", "PYTHONPATH"}}
    env.update(HOME=str(home), PK_COMPILE_CACHE=str(cc), OUT=str(out))
    return env


def _plan(plan: Path, part: str, cwd: Path, home: Path, cc: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(plan), part], cwd=cwd, env=_env(home, cc, out), capture_output=True, text=True, timeout=60)


def test_the_caches_go_out_in_parts_and_come_back_where_each_tool_looks(tmp_path):
    home, cc, out, work = (tmp_path / d for d in ("home", "cc", "out", "work"))
    for d in (out, work):
        d.mkdir()
    files = {
        cc / "triton" / "K1" / "k.cubin": os.urandom(40_000),  # incompressible: more than one part
        cc / "inductor" / "fxgraph" / "g.py": b"graph",
        home / ".cache" / "polykernel" / "native" / "t-py" / "polykernel_native.so": b"so",
        home / ".cache" / "flashinfer" / "m.so": b"fi",
    }
    tuning = home / ".cache" / "polykernel" / "decisions.json"  # the tuning store: stays behind
    for path, data in {**files, tuning: b"{}"}.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    text = PLAN.read_text()
    assert "split -b 15M" in text
    plan = tmp_path / "plan.sh"
    plan.write_text(text.replace("split -b 15M", "split -b 16K"))  # small parts for the test
    r = _plan(plan, "compile-cache", work, home, cc, out)
    assert r.returncode == 0, r.stdout + r.stderr
    parts = sorted(out.glob("compile-cache.tar.xz.part-*"))
    assert len(parts) >= 2 and sorted(p.name for p in out.iterdir()) == [p.name for p in parts]  # nothing else packed
    # a fresh machine: no caches, the parts carried as .gpu/compile-cache/
    shutil.rmtree(home)
    shutil.rmtree(cc)
    carried = work / ".gpu" / "compile-cache"
    carried.mkdir(parents=True)
    for p in parts:
        shutil.move(p, carried / p.name)
    r = _plan(plan, "compile-cache", work, home, cc, out)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "compile caches unpacked" in r.stdout
    for path, data in files.items():
        assert path.read_bytes() == data, path
    assert not tuning.exists()
    # packed again: the unpack's own marker stays behind; a later part on the machine unpacks nothing
    listing = subprocess.run(
        f"cat {out}/compile-cache.tar.xz.part-* | xz -d | tar tf -", shell=True, capture_output=True, text=True, check=True
    ).stdout.split()
    assert "./triton/K1/k.cubin" in listing and not any(".unpacked" in name for name in listing)
    r = _plan(plan, "compile-cache", work, home, cc, out)
    assert r.returncode == 0 and "compile caches unpacked" not in r.stdout, r.stdout + r.stderr


@pytest.mark.skipif(shutil.which("flock") is None, reason="needs flock")
def test_parts_started_side_by_side_unpack_once(tmp_path):
    home, cc, out, work = (tmp_path / d for d in ("home", "cc", "out", "work"))
    for d in (home, out, work):
        d.mkdir()
    (cc / "triton").mkdir(parents=True)
    (cc / "triton" / "k.cubin").write_bytes(os.urandom(200_000))
    assert _plan(PLAN, "compile-cache", work, home, cc, out).returncode == 0
    carried = work / ".gpu" / "compile-cache"
    carried.mkdir(parents=True)
    for p in out.glob("compile-cache.tar.xz.part-*"):
        shutil.move(p, carried / p.name)
    shutil.rmtree(cc)
    env = _env(home, cc, out)
    procs = [
        subprocess.Popen(
            ["bash", str(PLAN), "compile-cache"], cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for _ in range(3)
    ]
    outputs = [p.communicate(timeout=60)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outputs
    assert sum("compile caches unpacked" in o for o in outputs) == 1, outputs


def test_the_compilers_environment_passes_through(tmp_path):
    """The device image exports CC (its C compiler, which Triton and Inductor call): the plan's
    cache folder once took that name, and every Triton build ran the folder as the compiler
    (benchmarks/results/h100-2026-12-06-eighteenth/compile-CC-clash.log). What a part's steps see:
    the caller's CC and CXX as given, the caches' variables under the cache folder."""
    home, cc, out, work = (tmp_path / d for d in ("home", "cc", "out", "work"))
    for d in (home, out, work):
        d.mkdir()
    text = PLAN.read_text()
    anchor = "\npack_caches() {"
    assert anchor in text
    plan = tmp_path / "plan.sh"
    plan.write_text(text.replace(anchor, f'\nenv > "$OUT/env.txt"; exit 0{anchor}', 1))  # the steps' environment
    env = {**_env(home, cc, out), "CC": "/opt/gcc/bin/gcc", "CXX": "/opt/gcc/bin/g++"}
    r = subprocess.run(["bash", str(plan), "compile-cache"], cwd=work, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    seen = dict(line.split("=", 1) for line in (out / "env.txt").read_text().splitlines() if "=" in line)
    assert seen["CC"] == "/opt/gcc/bin/gcc" and seen["CXX"] == "/opt/gcc/bin/g++"
    assert seen["TRITON_CACHE_DIR"] == f"{cc}/triton" and seen["TORCHINDUCTOR_CACHE_DIR"] == f"{cc}/inductor"


def _wheel(folder: Path, name: str = "pkfake", version: str = "0.1") -> Path:
    """A one-module wheel ``name`` (``import name; name.VERSION``), written by hand."""
    import zipfile

    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": f"VERSION = {version!r}\n",
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{dist}/RECORD"] = "".join(f"{path},,\n" for path in [*files, f"{dist}/RECORD"])
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for member, text in files.items():
            z.writestr(member, text)
    return path


@pytest.mark.skipif(shutil.which("flock") is None, reason="needs flock")
def test_parts_started_side_by_side_install_the_wheels_once(tmp_path):
    """Two parts' pip runs into one --target at once failed, and one part ran without Liger
    (benchmarks/results/h100-2026-12-06-nineteenth/gpu-norms4.out): parts started side by side take
    turns, one installs the carried wheels, and every part's steps import them."""
    home, cc, out, work, site = (tmp_path / d for d in ("home", "cc", "out", "work", "site"))
    for d in (home, out, work / ".whl"):
        d.mkdir(parents=True)
    _wheel(work / ".whl")
    text = PLAN.read_text()
    anchor = "\ngpu_tests() {"
    assert anchor in text
    plan = tmp_path / "plan.sh"
    # the part's set-up without its probe of torch and the GPU, then what a step would import
    probe = 'python3 -c "import torch, triton;'
    assert probe in text
    body = text.replace(probe, 'true || python3 -c "', 1)
    body = body.replace(anchor, f'\npeers; python3 -c "import pkfake; print(pkfake.__file__)" > "$OUT/seen-$$.txt"; exit 0{anchor}', 1)
    plan.write_text(body)
    env = {**_env(home, cc, out), "PK_SITE": str(site)}
    procs = [
        subprocess.Popen(["bash", str(plan), "gpu-any"], cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for _ in range(3)
    ]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outputs
    assert sum("wheels installed" in o for o in outputs) == 1, outputs
    seen = [f.read_text().strip() for f in out.glob("seen-*.txt")]
    assert seen == [str(site / "pkfake" / "__init__.py")] * 3, (seen, outputs)
    # a new set of wheels on the same machine is installed again; the same set is not
    (work / ".whl" / "pkfake-0.1-py3-none-any.whl").unlink()
    _wheel(work / ".whl", version="0.2")
    r = subprocess.run(["bash", str(plan), "gpu-any"], cwd=work, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "wheels installed" in r.stdout, r.stdout + r.stderr
    assert "VERSION = '0.2'" in (site / "pkfake" / "__init__.py").read_text()
    r = subprocess.run(["bash", str(plan), "gpu-any"], cwd=work, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "wheels installed" not in r.stdout, r.stdout + r.stderr
