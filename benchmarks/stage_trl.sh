#!/usr/bin/env bash
# Stage TRL for the H200 (Python 3.12, torch 2.11+cu130, transformers 5.17, no package index), for
# the `trl` part of benchmarks/h200_plan.sh (trl_dpo.py, trl_grpo.py). Run from the project root:
#
#   bash benchmarks/stage_trl.sh
#
# Only what the image lacks is staged (its package list: KINDS.md of the device notes, 2026-11-17):
#   trl 1.16.0, datasets 5.2.0   the versions the CPU tests here run (pure Python)
#   dill 0.4.1, multiprocess 0.70.19   datasets' two dependencies missing from the image (the py312 build)
#   liger-kernel 0.8.5           the `liger` variant (use_liger_kernel=True); the same wheel as
#                                ../shared/gpu/stage.sh's, so the part needs nothing else
# The image already has accelerate (1.15.0; TRL asks >= 1.10.1), pyarrow, pandas, xxhash, fsspec,
# huggingface-hub (1.33.0; datasets asks >= 1.31), jinja2, psutil, pyyaml, tqdm, filelock and of
# course torch, numpy and transformers: none of them is staged, so none is shadowed. setup.sh checks
# the staged packages' requirements against what the image has and says which it does not meet.
# One tar.xz of ~2 MB under .gpu/trl/ (git-ignored), split into parts of at most 58 MB like the
# serving peers' (one part), with .gpu/trl/setup.sh and .gpu/trl/manifest. On the H200, setup.sh
# unpacks to /opt/pk/trl/site-packages (PK_TRL_DIR moves /opt/pk/trl) and writes /opt/pk/trl/env.sh.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
exclude=$(git rev-parse --git-path info/exclude)  # (a worktree shares its repository's)
mkdir -p "$(dirname "$exclude")"
grep -qx '/.gpu/' "$exclude" 2>/dev/null || echo '/.gpu/' >> "$exclude"
cache=${PK_GPU_CACHE:-$HOME/.cache/pk-gpu}
py=${PYTHON:-python3}
mkdir -p "$cache/whl"
plat=(--python-version 3.12 --implementation cp --only-binary=:all:
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
wheels=(trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 liger-kernel==0.8.5)
files=(trl-1.16.0 datasets-5.2.0 dill-0.4.1 multiprocess-0.70.19 liger_kernel-0.8.5)
"$py" -m pip download -q --no-deps "${plat[@]}" -d "$cache/whl" "${wheels[@]}"
whl=()
for f in "${files[@]}"; do whl+=("$(ls "$cache"/whl/"$f"-*.whl | head -1)"); done
ls -l "${whl[@]}"

pack="$cache/trl-site-trl1.16.0-ds5.2.0-liger0.8.5.tar.xz"
if [ ! -s "$pack" ]; then
  site=$(mktemp -d)
  "$py" -m pip install -q --root-user-action=ignore --no-deps --no-compile --target "$site" "${plat[@]}" "${whl[@]}"
  rm -rf "$site/bin"  # console scripts whose shebang names this machine's Python
  # guard: nothing the image has may come along (it would shadow the image's copy)
  for m in torch numpy transformers accelerate pyarrow pandas huggingface_hub fsspec; do
    [ ! -e "$site/$m" ] || { echo "stage_trl: $m got into the site folder" >&2; exit 1; }
  done
  tar -C "$site" -cf - . | xz -T2 -6 > "$pack.tmp" && mv "$pack.tmp" "$pack"
  rm -rf "$site"
fi

out=.gpu/trl
source benchmarks/_stage_parts.sh
stage_parts "$pack" "$out"

cat > "$out/setup.sh" <<'SETUP'
#!/usr/bin/env bash
# Device side of benchmarks/stage_trl.sh: keep the carried parts in /opt/pk/trl, unpack the site
# folder once all are there, write /opt/pk/trl/env.sh and check the imports.
set -euo pipefail
shopt -s nullglob
cd "$(dirname "${BASH_SOURCE[0]}")"
dst=${PK_TRL_DIR:-/opt/pk/trl}  # (another folder: to try it elsewhere)
py=${PYTHON:-python3}           # the image's python3 holds torch
mkdir -p "$dst/parts"
for d in parts-*; do cp -f "$d"/* "$dst/parts/"; done
read -r name file count sum < manifest
have=("$dst"/parts/site.*)
if [ ${#have[@]} -lt "$count" ]; then
  echo "trl: ${#have[@]} of $count parts here; send the next part"; exit 0
fi
# the name matters: dill (datasets' fingerprints) pickles by value the modules whose path has no
# "site-packages" in it, and then fails on pyarrow's types (seen with a folder named otherwise)
site=$dst/site-packages
if [ ! -f "$site/.complete-$sum" ]; then
  cat "$dst"/parts/site.* > "$dst/$file"
  echo "$sum  $dst/$file" | sha256sum -c --quiet
  rm -rf "$site" && mkdir -p "$site"
  tar -C "$site" -xJf "$dst/$file" && rm -f "$dst/$file"
  touch "$site/.complete-$sum"
fi
# appended after what PYTHONPATH already holds (src, the peers): the staged packages are ones the
# image lacks, so the order only matters against another staged copy of Liger (the same version)
cat > "$dst/env.sh" <<ENV
export PYTHONPATH=\${PYTHONPATH:+\$PYTHONPATH:}$site
ENV
source "$dst/env.sh"
echo "trl: ready; source $dst/env.sh"
"$py" - "$site" <<'PY'
import importlib, importlib.metadata as md, sys
try:
    from packaging.requirements import Requirement
except ImportError:  # (the image has packaging; the check is advice only)
    Requirement = None
# the staged packages' requirements that the image does not meet (a warning: pip is not asked)
for dist in ("trl", "datasets", "liger-kernel") if Requirement else ():
    for text in md.requires(dist) or []:
        req = Requirement(text)
        if req.marker and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            have = md.version(req.name)
        except md.PackageNotFoundError:
            print(f"   {dist} needs {req}: missing"); continue
        if not req.specifier.contains(have, prereleases=True):
            print(f"   {dist} needs {req}: the image has {have}")
for m in ("trl", "accelerate", "datasets", "liger_kernel"):
    try:
        mod = importlib.import_module(m)
        where = "staged" if mod.__file__.startswith(sys.argv[1]) else "image"
        print("  ", m, md.version(m.replace("_", "-")), where)
    except Exception as e:
        print("  ", m, "unavailable:", type(e).__name__, str(e)[:160])
PY
SETUP
chmod +x "$out/setup.sh"

echo "Staged in $out (git-ignored): $k part(s) of $(basename "$pack") ($(stat -c %s "$pack") bytes)."
echo "GPU runs, one right after another; send with each the paths it lists:"
for i in $(seq 1 "$k"); do
  cmd="bash $out/setup.sh"
  [ "$i" = "$k" ] && cmd="bash benchmarks/h200_plan.sh trl   (h200_plan.sh runs setup.sh itself)"
  echo "  run $i: carry [\"$out/setup.sh\", \"$out/manifest\", \"$out/parts-$i\"]"
  echo "          command: $cmd"
done
echo "Elsewhere on the same machine: 'source /opt/pk/trl/env.sh' (after src is on PYTHONPATH)."
