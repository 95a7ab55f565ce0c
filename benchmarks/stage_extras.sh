#!/usr/bin/env bash
# What the H200 image lacks for `polykernel demo` / `polykernel bench` beyond ../shared/gpu/stage.sh:
# rich (required by the CLI) and transformers (the demo's Hugging Face Llama; Liger's patch needs it),
# with their pure-Python and cp312 dependencies, minus what the image has (numpy, filelock, fsspec,
# typing_extensions come with torch/cupy) and hf_xet (only for hub downloads, which the demo never does).
# matplotlib is not staged: plot on this machine from the JSON (`--load FILE.json --plot FILE.png`).
#
#   bash ../shared/gpu/stage.sh && bash benchmarks/stage_extras.sh
#
# Then, as the FIRST of the GPU runs (before stage.sh's), send the paths [".gpu/extras"] with:
#   mkdir -p /opt/pk/wheels && cp .gpu/extras/*.whl /opt/pk/wheels/
# stage.sh's last run installs every wheel in /opt/pk/wheels (setup.sh), these included.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
rm -rf .gpu/extras && mkdir -p .gpu/extras
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .gpu/extras "rich>=13" "transformers>=4.45"
rm -f .gpu/extras/numpy-* .gpu/extras/filelock-* .gpu/extras/fsspec-* .gpu/extras/typing_extensions-* .gpu/extras/hf_xet-*
du -sh .gpu/extras
echo 'GPU run 0 (before stage.sh runs): paths [".gpu/extras"], command: mkdir -p /opt/pk/wheels && cp .gpu/extras/*.whl /opt/pk/wheels/'
