# Sourced by the stage_*.sh scripts (host side) and by the setup.sh they write (device side, from
# the checkout that travels with every device call).

# Host: the project root as working directory, .gpu/ git-ignored, and the names every stage script
# uses: $cache (downloads and packs), $py, $plat (pip's flags for the H200's Python 3.12).
stage_prelude() {
  local exclude
  cd "$(git rev-parse --show-toplevel)"
  exclude=$(git rev-parse --git-path info/exclude)  # (a worktree shares its repository's)
  mkdir -p "$(dirname "$exclude")"
  grep -qx '/.gpu/' "$exclude" 2>/dev/null || echo '/.gpu/' >> "$exclude"
  cache=${PK_GPU_CACHE:-$HOME/.cache/pk-gpu}
  py=${PYTHON:-python3}
  mkdir -p "$cache/whl"
  plat=(--python-version 3.12 --implementation cp --only-binary=:all:
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
}

# Host: split a packed site folder into the parts a device call carries.
#   stage_parts PACK OUT   # OUT/parts-1..k (each <= 58 MB: 64 MiB a call, with room for the tree),
#                          # OUT/manifest "site FILE k SHA256"; sets k
stage_parts() {
  local pack=$1 out=$2 sum tmp f
  rm -rf "$out" && mkdir -p "$out"
  sum=$(sha256sum "$pack" | cut -d' ' -f1)
  tmp=$(mktemp -d)
  split -b 58000000 -d -a 1 "$pack" "$tmp/site."
  k=0
  for f in "$tmp"/site.*; do
    k=$((k + 1)); mkdir -p "$out/parts-$k"; mv "$f" "$out/parts-$k/"
  done
  rm -rf "$tmp"
  echo "site $(basename "$pack") $k $sum" > "$out/manifest"
}

# Host: what to carry in each device call, and the command of each.
#   stage_runs OUT K LAST   # LAST: the last run's command
stage_runs() {
  local out=$1 count=$2 last=$3 i cmd
  echo "Staged in $out (git-ignored): $count part(s)."
  echo "GPU runs, one right after another; send with each the paths it lists:"
  for i in $(seq 1 "$count"); do
    cmd="bash $out/setup.sh"
    [ "$i" = "$count" ] && cmd=$last
    echo "  run $i: carry [\"$out/setup.sh\", \"$out/manifest\", \"$out/parts-$i\"]"
    echo "          command: $cmd"
  done
}

# Device (in setup.sh, run from its own folder): keep this call's parts under DST/parts and, once
# all the manifest's parts are there, unpack the site folder into SITE (checked, once per pack).
# Returns 1, having said so, while parts are missing.
#   gather_parts LABEL DST SITE
gather_parts() {
  local label=$1 dst=$2 site=$3 name file count sum d have
  mkdir -p "$dst/parts"
  for d in parts-*; do cp -f "$d"/* "$dst/parts/"; done
  read -r name file count sum < manifest
  have=("$dst"/parts/site.*)
  if [ ${#have[@]} -lt "$count" ]; then
    echo "$label: ${#have[@]} of $count parts here; send the next part"
    return 1
  fi
  if [ ! -f "$site/.complete-$sum" ]; then
    cat "$dst"/parts/site.* > "$dst/$file"
    echo "$sum  $dst/$file" | sha256sum -c --quiet
    rm -rf "$site" && mkdir -p "$site"
    tar -C "$site" -xJf "$dst/$file" && rm -f "$dst/$file"
    touch "$site/.complete-$sum"
  fi
}
