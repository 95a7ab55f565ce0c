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
source "$(git rev-parse --show-toplevel)/benchmarks/_stage_parts.sh"
stage_prelude
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
stage_parts "$pack" "$out"

cat > "$out/setup.sh" <<'SETUP'
#!/usr/bin/env bash
# Device side of benchmarks/stage_trl.sh: keep the carried parts in /opt/pk/trl, unpack the site
# folder once all are there, write /opt/pk/trl/env.sh and check the imports.
set -euo pipefail
shopt -s nullglob
cd "$(dirname "${BASH_SOURCE[0]}")"
source ../../benchmarks/_stage_parts.sh  # (the checkout travels with every call)
dst=${PK_TRL_DIR:-/opt/pk/trl}  # (another folder: to try it elsewhere)
py=${PYTHON:-python3}           # the image's python3 holds torch
# the name matters: dill (datasets' fingerprints) pickles by value the modules whose path has no
# "site-packages" in it, and then fails on pyarrow's types (seen with a folder named otherwise)
site=$dst/site-packages
gather_parts trl "$dst" "$site" || exit 0
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

echo "$(basename "$pack"): $(stat -c %s "$pack") bytes"
stage_runs "$out" "$k" "bash benchmarks/h200_plan.sh trl   (h200_plan.sh runs setup.sh itself)"
echo "Elsewhere on the same machine: 'source /opt/pk/trl/env.sh' (after src is on PYTHONPATH)."
