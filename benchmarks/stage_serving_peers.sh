#!/usr/bin/env bash
# Stage the serving peers for the H200 (Python 3.12, torch 2.11+cu130, CUDA 13.0 nvcc, no package
# index): FlashInfer and sgl-kernel. Run from the project root:
#
#   bash benchmarks/stage_serving_peers.sh
#
# What is staged, and why this way (sizes as downloaded 2026-12-01):
#   flashinfer-python 0.7.4      101 MB wheel (py3-none-any; JIT-compiles its kernels with nvcc)
#   apache-tvm-ffi 0.1.15.post2  3.3 MB (cp312), the one dependency `import flashinfer` needs that
#                                the image lacks (cuda-bindings, requests, jinja2, ... are there;
#                                cudnn-frontend, nccl4py and cutlass-dsl are optional imports)
#   sglang-kernel 0.4.6          377 MB wheel: the last release built for torch 2.11 / CUDA 13
#                                (0.4.8 pins torch 2.13, 0.4.9+ torch 2.14.1; sgl-kernel 0.3.21,
#                                536 MB, predates torch 2.11). 342 MB of it is FA3 (flash_ops.abi3.so)
#                                and 17 MB the sm_100 library: neither is imported by `import
#                                sgl_kernel` on sm_90, so they are left out.
#   flashinfer-cubin 0.6.13      458 MB, and for another version: not staged (FlashInfer JIT-builds)
# Everything is installed here into one site folder (pip --target for the H200's Python 3.12),
# packed as one tar.xz (43 MB: xz packs FlashInfer's sources 17x) and split into parts of at most
# 58 MB under .gpu/serving/ (git-ignored), one folder per GPU run (one run today). Make the runs one right after another (the machine goes back
# after 30 s idle), each sending the paths printed below; the last one prints `serving: ready`.
# Then every run on that machine starts with `source /opt/pk/serving/env.sh`.
set -euo pipefail
source "$(git rev-parse --show-toplevel)/benchmarks/_stage_parts.sh"
stage_prelude
wheels=(flashinfer-python==0.7.4 apache-tvm-ffi==0.1.15.post2 sglang-kernel==0.4.6)
"$py" -m pip download -q --no-deps "${plat[@]}" -d "$cache/whl" "${wheels[@]}"
ls -l "$cache"/whl/{flashinfer_python-0.7.4,apache_tvm_ffi-0.1.15.post2,sglang_kernel-0.4.6}-*.whl

pack="$cache/serving-site-fi0.7.4-sgl0.4.6.tar.xz"
if [ ! -s "$pack" ]; then
  site=$(mktemp -d)
  "$py" -m pip install -q --no-deps --no-compile --target "$site" "${plat[@]}" \
    "$cache"/whl/flashinfer_python-0.7.4-*.whl "$cache"/whl/apache_tvm_ffi-0.1.15.post2-*.whl
  unzip -q -o "$cache"/whl/sglang_kernel-0.4.6-*.whl -x 'sgl_kernel/flash_ops.abi3.so' 'sgl_kernel/sm100/*' -d "$site"
  rm -rf "$site/bin"
  tar -C "$site" -cf - . | xz -T2 -6 > "$pack.tmp" && mv "$pack.tmp" "$pack"
  rm -rf "$site"
fi

out=.gpu/serving
stage_parts "$pack" "$out"

cat > "$out/setup.sh" <<'SETUP'
#!/usr/bin/env bash
# Device side of benchmarks/stage_serving_peers.sh: keep the carried parts in /opt/pk/serving,
# unpack the site folder once all are there, write /opt/pk/serving/env.sh and check the imports.
set -euo pipefail
shopt -s nullglob
cd "$(dirname "${BASH_SOURCE[0]}")"
source ../../benchmarks/_stage_parts.sh  # (the checkout travels with every call)
dst=${PK_SERVING_DIR:-/opt/pk/serving}  # (another folder: to try it elsewhere)
gather_parts serving "$dst" "$dst/site" || exit 0
cat > "$dst/env.sh" <<ENV
export PYTHONPATH=$dst/site\${PYTHONPATH:+:\$PYTHONPATH}
export FLASHINFER_CUDA_ARCH_LIST=\${FLASHINFER_CUDA_ARCH_LIST:-9.0}   # JIT for the H200 only
export MAX_JOBS=\${MAX_JOBS:-16}
# FlashInfer's JIT finds nvcc through CUDA_HOME or PATH; ../shared/gpu's env.sh unsets CUDA_HOME
# when cuTile is staged, so put the image's toolkit back on PATH for it
if [ -x /usr/local/cuda/bin/nvcc ]; then export PATH=\$PATH:/usr/local/cuda/bin; fi
ENV
source "$dst/env.sh"
echo "serving: ready; source $dst/env.sh"
python3 - <<'PY'
import importlib
for m in ("flashinfer.norm", "flashinfer.activation", "flashinfer.rope", "sgl_kernel"):
    try:
        importlib.import_module(m); print("  ", m, "ok")
    except Exception as e:
        print("  ", m, "unavailable:", type(e).__name__, str(e)[:160])
PY
SETUP
chmod +x "$out/setup.sh"

echo "$(basename "$pack"): $(stat -c %s "$pack") bytes"
stage_runs "$out" "$k" "bash $out/setup.sh && source /opt/pk/serving/env.sh && <your tests or benchmark>"
echo "Later runs on the same machine carry nothing extra: 'source /opt/pk/serving/env.sh && ...'."
echo "If setup.sh says a part is missing, the machine was given back in between: start again at run 1."
