"""benchmarks/fit_gpu_parts.py re-cuts stage.sh's parts so each device run, tree included, fits."""

from __future__ import annotations

import hashlib
import importlib.util
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _load():
    spec = importlib.util.spec_from_file_location("fit_gpu_parts", ROOT / "benchmarks" / "fit_gpu_parts.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_parts_are_recut_to_fit_beside_the_tree_and_join_to_the_payload(tmp_path, monkeypatch, capsys):
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "tree.bin").write_bytes(b"t" * 3000)
    subprocess.run(["git", "-C", str(tmp_path), "add", "tree.bin"], check=True)
    payload = bytes(range(256)) * 100  # 25,600 bytes, cut by stage.sh into two parts
    gpu = tmp_path / ".gpu"
    for k, (a, b) in enumerate(((0, 20000), (20000, len(payload))), 1):
        (gpu / f"parts-cute-{k}").mkdir(parents=True)
        (gpu / f"parts-cute-{k}" / f"cute.{k - 1}").write_bytes(payload[a:b])
    (gpu / "wheels").mkdir()
    (gpu / "wheels" / "small.whl").write_bytes(b"w" * 2000)
    digest = hashlib.sha256(payload).hexdigest()
    (gpu / "manifest").write_text(f"cute big.whl 2 {digest}\n")
    mod = _load()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(mod, "LIMIT", 13000)
    monkeypatch.setattr(mod, "SLACK", 0)
    mod.main()
    parts = sorted(gpu.glob("parts-cute-*/cute.*"), key=lambda p: int(p.suffix[1:]))
    assert b"".join(p.read_bytes() for p in parts) == payload
    room = 13000 - 3000
    assert parts[0].stat().st_size + 2000 <= room  # the first run carries the wheels too
    assert all(p.stat().st_size <= room for p in parts)
    assert (gpu / "manifest").read_text().split() == ["cute", "big.whl", str(len(parts)), digest]
    assert "run 1: carry [.gpu/setup.sh, .gpu/manifest, .gpu/parts-cute-1, .gpu/wheels]" in capsys.readouterr().out
