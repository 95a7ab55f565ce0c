# Sourced by the stage_*.sh scripts: split a packed site folder into the parts a device call carries.
#
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
