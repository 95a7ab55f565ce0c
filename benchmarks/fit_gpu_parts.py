"""Re-split the payloads ``../shared/gpu/stage.sh`` staged in ``.gpu/`` so each device run fits.

    bash ../shared/gpu/stage.sh cute && python3 benchmarks/fit_gpu_parts.py

stage.sh cuts each payload into 58 MB parts, leaving ~9 MB of the 64 MiB a run may carry for the
project's tree; this tree is larger (12.7 MB of tracked files on 2026-12-05), so its first run was
refused. Here each payload's parts are joined and cut again: the first part leaves room for the tree
and ``.gpu/wheels`` (which ride with it), every later part for the tree alone. The manifest's part
counts and checksums are kept right (``.gpu/setup.sh`` checks the joined payload's sha256). Prints
each run's carry list.
"""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

LIMIT = 64 * 1024 * 1024  # what one device run may carry, the tree included
SLACK = 1_000_000  # the run's own small files (setup.sh, manifest) and rounding


def tracked_bytes() -> int:
    names = subprocess.run(["git", "ls-files", "-z"], capture_output=True, check=True).stdout.split(b"\0")
    return sum(Path(n.decode()).stat().st_size for n in names if n and Path(n.decode()).is_file())


def main() -> None:
    gpu = Path(".gpu")
    manifest = (gpu / "manifest").read_text().split("\n")
    wheels = sum(f.stat().st_size for f in (gpu / "wheels").glob("*.whl"))
    room = LIMIT - tracked_bytes() - SLACK
    if room - wheels <= 0:
        raise SystemExit(f"the tree leaves {room} bytes a run: too little for .gpu/wheels ({wheels})")
    runs: list[list[str]] = []
    lines = []
    for line in manifest:
        if not line.strip():
            continue
        name, file, _count, digest = line.split()
        parts = sorted(Path(".").glob(f".gpu/parts-{name}-*/{name}.*"), key=lambda p: int(p.suffix[1:]))
        data = b"".join(p.read_bytes() for p in parts)
        if hashlib.sha256(data).hexdigest() != digest:
            raise SystemExit(f"{name}: its parts do not join to the staged payload (sha256); stage again")
        for p in parts:
            p.unlink()
            p.parent.rmdir()
        cuts, at = [], 0
        while at < len(data):
            size = (room - wheels) if not runs and not cuts else room  # the very first part carries the wheels
            cuts.append(data[at : at + size])
            at += size
        for k, chunk in enumerate(cuts, 1):
            folder = gpu / f"parts-{name}-{k}"
            folder.mkdir()
            (folder / f"{name}.{k - 1}").write_bytes(chunk)
            runs.append([str(folder)])
        lines.append(f"{name} {file} {len(cuts)} {digest}")
    (gpu / "manifest").write_text("\n".join(lines) + "\n")
    if runs:
        runs[0].append(".gpu/wheels")
    else:
        runs.append([".gpu/wheels"])
    print(f"{room} bytes a run besides the tree; make these runs one right after another:")
    for k, paths in enumerate(runs, 1):
        tail = " && source /opt/pk/env.sh && <your command>" if k == len(runs) else ""
        print(f"  run {k}: carry [.gpu/setup.sh, .gpu/manifest, {', '.join(paths)}]  command: bash .gpu/setup.sh{tail}")


if __name__ == "__main__":
    main()
