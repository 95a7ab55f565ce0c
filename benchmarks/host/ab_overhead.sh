#!/usr/bin/env bash
# The dispatcher's overhead (benchmarks/host/overhead.py) of this checkout against an older
# commit's, interleaved on one host. The H200 machines' host speed differs between runs by 10-25%
# (a no-op called directly: 0.0515-0.064 µs on 2026-12-01..04), so figures of two runs compare
# only through a ratio; an A/B in one run compares the code itself (issue 36's "at or below").
#
#   bash benchmarks/host/ab_overhead.sh stage [COMMIT]     # here: COMMIT's src/ and benchmarks/host/
#                                                          # into .ab/COMMIT/ (default ed50770, the
#                                                          # tree when issue 36 was filed); carry .ab
#   bash benchmarks/host/ab_overhead.sh run [PAIRS] [OUT]  # there: PAIRS alternations (default 6) of
#                                                          # old then new, rows and a summary in OUT;
#                                                          # then the serving ops' entry (serving_entry.py)
#                                                          # on AB_DEVICE (default cpu; AB_SERVING=0: not)
#   AB_PIN=CPU pins every process to that CPU (taskset): the H200 hosts' spread between processes
#   (0.52-1.10 µs for one tree on 2026-12-05) is mostly where the scheduler puts them. The summary
#   gives each side's median and best (the least disturbed process, as overhead.py's best round).
set -euo pipefail
cmd=${1:?usage: ab_overhead.sh stage [COMMIT] | run [PAIRS] [OUT]}
case $cmd in
  stage)
    commit=${2:-ed50770}
    dest=.ab/$commit
    rm -rf "$dest" && mkdir -p "$dest"
    git archive "$commit" src benchmarks/host | tar -x -C "$dest"
    echo "staged $commit in $dest (carry .ab)"
    ;;
  run)
    pairs=${2:-6}
    py=${PYTHON:-python3}
    out=${3:-${OUT:-/tmp}/ab_overhead}
    old=$(ls -d .ab/*/ 2>/dev/null | head -1)
    [ -n "$old" ] || { echo "nothing staged under .ab/ (run: ab_overhead.sh stage)"; exit 2; }
    pin=()
    [ -n "${AB_PIN:-}" ] && pin=(taskset -c "$AB_PIN")
    mkdir -p "$out"
    echo "A/B: ${old%/} against this checkout, $pairs alternations of overhead.py --rounds 60 --calls 200${AB_PIN:+ (pinned to CPU $AB_PIN)}"
    for i in $(seq 1 "$pairs"); do
      PYTHONPATH=${old}src "${pin[@]}" "$py" "${old}benchmarks/host/overhead.py" --rounds 60 --calls 200 --json "$out/old-$i.json" >/dev/null
      PYTHONPATH=src "${pin[@]}" "$py" benchmarks/host/overhead.py --rounds 60 --calls 200 --json "$out/new-$i.json" >/dev/null
      echo "  pair $i done"
    done
    # the serving ops' entry at one token (benchmarks/host/serving_entry.py, this checkout's script
    # on both trees), on AB_DEVICE (cpu; the H200 plan sets cuda)
    [ "${AB_SERVING:-1}" = 0 ] || echo "A/B: the serving entry on ${AB_DEVICE:-cpu}, $pairs alternations of serving_entry.py --rounds 20"
    for i in $(seq 1 "$pairs"); do
      [ "${AB_SERVING:-1}" = 0 ] && break
      PYTHONPATH=${old}src "$py" benchmarks/host/serving_entry.py --device "${AB_DEVICE:-cpu}" --rounds 20 --json "$out/serving-old-$i.json" >/dev/null
      PYTHONPATH=src "$py" benchmarks/host/serving_entry.py --device "${AB_DEVICE:-cpu}" --rounds 20 --json "$out/serving-new-$i.json" >/dev/null
      echo "  pair $i done"
    done
    "$py" - "$out" "${old%/}" <<'PY'
import json, pathlib, statistics, sys
out, old = pathlib.Path(sys.argv[1]), sys.argv[2]
summary = {"old_tree": old}
for side in ("old", "new"):
    runs = [json.loads(p.read_text())["overhead"] for p in sorted(out.glob(f"{side}-*.json"))]
    summary[side] = {k: {"median": statistics.median(r[k] for r in runs), "best": min(r[k] for r in runs), "all": [round(r[k], 4) for r in runs]}
                     for k in ("dispatch_alone_us", "real_impl_us")}
    entry = {}
    for p in sorted(out.glob(f"serving-{side}-*.json")):
        for row in json.loads(p.read_text())["rows"]:
            entry.setdefault(row["op"], []).append(row["entry_us"])
    summary[side]["serving_entry_us"] = {op: {"median": statistics.median(v), "all": [round(x, 3) for x in v]} for op, v in entry.items()}
for k in ("dispatch_alone_us", "real_impl_us"):
    o, n = summary["old"][k]["median"], summary["new"][k]["median"]
    ob, nb = summary["old"][k]["best"], summary["new"][k]["best"]
    print(f"{k}: old {o:.3f} µs, new {n:.3f} µs (median of {len(summary['new'][k]['all'])}; new/old {n / o:.3f}); best old {ob:.3f}, new {nb:.3f} (new/old {nb / ob:.3f})")
for op, v in summary["new"]["serving_entry_us"].items():
    o = summary["old"]["serving_entry_us"].get(op, {}).get("median", float("nan"))
    print(f"serving entry {op}: old {o:.3f} µs, new {v['median']:.3f} µs (new/old {v['median'] / o:.3f})")
(out / "summary.json").write_text(json.dumps(summary, indent=1))
PY
    ;;
  *)
    echo "usage: ab_overhead.sh stage [COMMIT] | run [PAIRS] [OUT]"
    exit 2
    ;;
esac
