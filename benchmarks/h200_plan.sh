#!/usr/bin/env bash
# The H200 measurements that issues 22-25 still need, as parts of at most ~9 minutes each (one
# device command is capped at 10). Run from the project root on the H200, one part per command:
#
#   bash benchmarks/h200_plan.sh PART            # results: $OUT/h200-PART.tar.gz (or /tmp/h200 without $OUT)
#
# Staging (on this side first, carried with the command; see ../shared/gpu/README.md):
#   serving-*  : `bash benchmarks/stage_serving_peers.sh` (FlashInfer, sgl-kernel: 41 MB) and the
#                Liger wheel (`bash ../shared/gpu/stage.sh`); carry .gpu/serving/{setup.sh,manifest,parts-1}
#                and the stage script's Liger paths. Each part sets the peers up again when the
#                machine is fresh (seconds once unpacked).
#   checks     : `bash ../shared/gpu/stage.sh cute cutile` (its 2-3 runs; the CuTeDSL and cuTile tests skip without).
#   checks, overhead-graph, gpu-backends: after stage.sh, `python3 benchmarks/fit_gpu_parts.py` (its parts of 58 MB and
#                this tree pass the 64 MiB a run carries: the first run is refused); it prints each run's carry.
#   trl        : `bash benchmarks/stage_trl.sh` (TRL, datasets and the two of their dependencies the image
#                lacks, and Liger: one 1.4 MB part); carry .gpu/trl/{setup.sh,manifest,parts-1}, nothing else
#                (not the serving peers: they travel with the serving parts).
#   overhead*  : the serving parts' carry too (host_profile.py's sgl-kernel and FlashInfer rows; without them those rows are errors),
#                and .ab (`bash benchmarks/host/ab_overhead.sh stage`: the dispatcher A/B against the tree issue 36 was filed on).
#   the others : the Liger wheel only.
#
# Parts, in the order the issues' "Done when" need them (the GPU time is 30 min a session):
#   serving-a   issue 34: the serving GPU tests (peers, providers; the op files: serving-native), the serving ops in a graph and eager
#   serving-native  issue 34: the native launch path's GPU tests, the serving op files' GPU tests, Liger's preference parity
#   serving-b   issue 34: the providers' rows, the selection sweep's first six ops
#   serving-c   issue 34: the sweep's last three ops, the kernel variants
#   losses      issues 22, 35: the loss GPU tests, the distillation bench rows, the ten post-training losses vs Liger's modules
#   losses-jsd  issue 35: fused_linear_jsd's GPU tests and bench rows alone
#   moe-tests   issue 33: the MoE GPU test files alone (run with PK_NO_WHEELS=1 if .whl/ is carried)
#   moe         issue 33: the MoE GPU tests; one experts layer at Qwen3-30B-A3B, Mixtral, gpt-oss-20b shapes, profiled; the sweep
#   moe-liger   issue 33: the MoE GPU parity with Liger's fused MoE among the impls (carry the Liger wheel)
#   moe-train   issue 33: Mixtral (2 layers) and Qwen3-MoE (4 layers) widths trained: plain, polykernel, Liger (autotune off)
#   moe-train-liger  issue 33: Qwen3-MoE with Liger as it comes (its fused MoE autotuned in the first step)
#   decode      issue 34: decode logits given the same token (batch 1-128), the decode loop, a kernel profile of a step
#   trl         issue 22: TRL's DPOTrainer and GRPOTrainer on a Llama-1B shape: plain, use_liger_kernel, ours
#   trl-memory  issue 35: what GRPO's peak holds, ours (patched) and Liger's: the allocator's history, grouped by origin
#   checks      the double-backward GPU tests (CuTeDSL, cuTile) and the peers' refusal overhead
#   overhead    issue 36: dispatcher overhead and host time per call after the redesign
#   overhead-graph  issue 36: the nine original ops' GPU rows in a graph (compare with
#               benchmarks/results/h200-2026-12-01-redesign/graph.json); QuACK's RMSNorm impls against Triton's by N and rows
#   families-1..7  issue 23: each text family trained at a ~1B shape, plain / polykernel / Liger / compile
#   vision-1, -2   issue 23: Qwen2-VL (2B widths) and Qwen2.5-VL (3B widths), 8+8 layers, 4 x 1024 tokens with a 448x448
#                  image each: forward, backward, AdamW; plain / polykernel / Liger / compile
#
# Each part ends within one device command: its steps must end within 570 s of its start (PK_DEADLINE,
# epoch seconds): every step's limit is cut to what is left (a step with under 20 s left is skipped,
# said in the output), so a slow build leaves less to the last steps, and the results are packed.
# Several parts in one device command: export PK_DEADLINE=$(($(date +%s) + 570)) first.
# Each step runs under its own time limit (a step that overruns is cut, its log says so, the next
# runs); logs and JSON go to one folder, packed into one file at the end (the device returns at
# most 8 files). The GPU tests run serially: with -n they filled the GPU's memory.
# `polykernel bench` and the benchmark scripts write each row to their JSON file as it is measured
# (polykernel.tools.rows: "complete": false until the end), so a step cut at its limit keeps its
# rows. The GPU tests: `make test-gpu PART=...` parts (docs/testing.md), each under 8 min:
#
#   compile-cache  the compile caches as $OUT/compile-cache.tar.xz.part-* (run it last in a call; copy
#               them into .gpu/compile-cache/ here and carry that folder: see "Compile caches" below)
#   gpu-PART    one part of the GPU suite (norms norms3 norms2 norms4 edge grads losses preference moe serving peers backends reliability parity compile models rest)
#
# A dry run on the CPU: `PK_DRY_RUN=FILE bash benchmarks/h200_plan.sh PART` runs nothing (no peers,
# builds, nvidia-smi or pack) and appends each step to FILE as a JSON line {"part", "name", "limit"
# (after PK_DEADLINE's cut, the clock moved on by each limit), "declared", "argv"};
# tests/tools/test_h200_plan.py checks every part's commands and limits so.
set -u
part=${1:?usage: bash benchmarks/h200_plan.sh PART}
R=/tmp/h200/$part
live() { [ -z "${PK_DRY_RUN:-}" ]; }  # false in a dry run
dry_elapsed=0  # the dry run's clock: each step moves it on by its limit
now() { echo $(($(date +%s) + dry_elapsed)); }
live && mkdir -p "$R"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
dest=${OUT:-/tmp/h200}
# the sweeps point POLYKERNEL_CACHE_DIR under their --out (a fresh store): their builds stay behind
pack() { tar czf "$dest/h200-$part.tar.gz" --exclude="cache/native" --exclude="cache/cuda_jit" -C /tmp/h200 "$part"; echo "packed $dest/h200-$part.tar.gz"; }
live && trap pack EXIT

# Compile caches carried from one session's machine to the next (a fresh machine compiles every
# Triton kernel and Inductor graph again: moe_experts' large parity 49-76 s a dtype cold, 2.6 s
# in fp32 warm, benchmarks/results/h200-2026-12-06-seventeenth/). Triton's and Inductor's caches go under
# $CACHES (Triton's binaries only), polykernel's native and CUDA JIT builds and FlashInfer's JIT
# modules stay under $HOME (copied in when packed); the part `compile-cache` packs them all into
# $dest/compile-cache.tar.xz.part-* (15 MiB a file); carried back as .gpu/compile-cache/, they are
# unpacked before a machine's first part. A cache entry's key holds its source and versions: a
# stale one is never used, only carried. Never the tuning store: a carried decision would be a
# measurement of another machine.
CACHES=${PK_COMPILE_CACHE:-/tmp/pk-compile-cache}  # (a test points it elsewhere)
# (not CC: an exported CC, as the device image has, names the C compiler Triton and Inductor call)
CACHED=(.cache/polykernel/native .cache/polykernel/cuda_jit .cache/flashinfer)  # under $HOME
if live; then
  export TRITON_CACHE_DIR=$CACHES/triton TORCHINDUCTOR_CACHE_DIR=$CACHES/inductor TRITON_STORE_BINARY_ONLY=1
  if ls .gpu/compile-cache/compile-cache.tar.xz.part-* >/dev/null 2>&1; then
    mkdir -p "$CACHES/home"
    (  # once a machine; parts started side by side: one unpacks, the others wait for it
      command -v flock >/dev/null && flock 9
      if [ ! -e "$CACHES/.unpacked" ]; then
        cat .gpu/compile-cache/compile-cache.tar.xz.part-* | tar xJf - -C "$CACHES" && cp -a "$CACHES/home/." "$HOME/" \
          && touch "$CACHES/.unpacked" && echo "compile caches unpacked: $(du -sh "$CACHES" | cut -f1)"
      fi
    ) 9>"$CACHES.lock"
  fi
fi
pack_caches() {  # the part `compile-cache`
  local have=() d
  mkdir -p "$CACHES/home"
  for d in "${CACHED[@]}"; do [ -d "$HOME/$d" ] && have+=("$d"); done
  [ ${#have[@]} -gt 0 ] && (cd "$HOME" && cp -a --parents "${have[@]}" "$CACHES/home/")
  rm -f "$dest"/compile-cache.tar.xz.part-*
  tar cf - -C "$CACHES" --exclude=./.unpacked . | xz -T0 -6 | split -b 15M - "$dest/compile-cache.tar.xz.part-"
  du -sh "$CACHES"/* | sed 's/^/  /'
  ls -l "$dest"/compile-cache.tar.xz.part-* | awk '{print "  " $5 " bytes " $9}'
}

step() {  # step NAME LIMIT_S COMMAND...: run, keep the log, say how it ended
  local name=$1 lim=$2 declared=$2 start rc left
  shift 2
  if [ -n "${PK_DEADLINE:-}" ]; then  # epoch seconds by which every step must end (several parts in one device command)
    left=$((PK_DEADLINE - $(now)))
    if [ "$left" -lt 20 ]; then echo "== $name skipped: ${left} s left before PK_DEADLINE"; dry 0 "$declared" "$@"; return; fi
    [ "$left" -lt "$lim" ] && lim=$left
  fi
  dry "$lim" "$declared" "$@" && return
  echo "== $name (limit $lim s)"
  start=$(date +%s)
  timeout -k 5 "$lim" "$@" >"$R/$name.log" 2>&1
  rc=$?
  echo "   rc=$rc in $(($(date +%s) - start)) s$([ $rc = 124 ] && echo ' (cut at its limit)')"
  tail -3 "$R/$name.log" | cut -c1-200
}

dry() {  # dry LIMIT DECLARED COMMAND...: in a dry run, the step ($name) as a JSON line in $PK_DRY_RUN
  live && return 1
  dry_elapsed=$((dry_elapsed + $1))
  python3 -c 'import json, sys; a = sys.argv; print(json.dumps({"part": a[1], "name": a[2], "limit": int(a[3]), "declared": int(a[4]), "argv": a[5:]}))' \
    "$part" "$name" "$@" >>"$PK_DRY_RUN"
}

SITE=${PK_SITE:-/tmp/site}  # where the carried wheels (.whl/) go (a test points it elsewhere)
installed() { [ -n "$1" ] && [ "$(cat "$SITE/.wheels" 2>/dev/null)" = "$1" ]; }  # installed WHEELS: that set is in $SITE
peers() {  # whichever staged setups came with this command (idempotent)
  local wheels=""  # the carried wheels' names and sizes, as a checksum: installed once a machine
  if [ -z "${PK_NO_WHEELS:-}" ] && ls .whl/*.whl >/dev/null 2>&1; then  # e.g. liger-kernel alone, without the CuTeDSL front
    wheels=$(stat -c '%n %s' .whl/*.whl | cksum | cut -d' ' -f1)
  fi
  (  # the installs, one part at a time: parts started side by side wait for the first (two pip runs
    # into one --target at once failed, and that part ran without Liger: h100-2026-12-06-nineteenth/gpu-norms4.out)
    command -v flock >/dev/null && flock 9
    if [ -n "$wheels" ] && ! installed "$wheels"; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
        && echo "$wheels" >"$SITE/.wheels" && echo "wheels installed in $SITE"
    fi
    for s in .gpu/setup.sh .gpu/lite/setup.sh; do [ -x "$s" ] && bash "$s" >/dev/null 2>&1; done
    [ -f .gpu/serving/setup.sh ] && bash .gpu/serving/setup.sh | tail -1
    [ -f .gpu/trl/setup.sh ] && bash .gpu/trl/setup.sh  # TRL, datasets, Liger (benchmarks/stage_trl.sh)
  ) 9>"$SITE.lock"
  if installed "$wheels"; then export PYTHONPATH=$PYTHONPATH:$SITE; fi
  [ -f /opt/pk/env.sh ] && source /opt/pk/env.sh
  [ -f .gpu/serving/setup.sh ] && source /opt/pk/serving/env.sh
  if [ -f .gpu/trl/setup.sh ] && [ -f "${PK_TRL_DIR:-/opt/pk/trl}/env.sh" ]; then source "${PK_TRL_DIR:-/opt/pk/trl}/env.sh"; fi
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
}

gpu_tests() {  # gpu_tests NAME LIMIT FILES...
  local name=$1 lim=$2
  shift 2
  step "$name" "$lim" env PK_FAILURES_NOW=1 python3 -m pytest -m gpu -v -p no:cacheprovider --timeout 120 --durations=15 -rfEs --tb=short "$@"
}

SERVING_OPS=(silu_and_mul gelu_and_mul fused_add_rms_norm_ rotary_embedding_ dynamic_quant_fp8 static_quant_fp8 rms_norm_quant_fp8)
DISTILL_OPS=(kl_div jsd tvd fused_linear_jsd)

if [ "$part" = compile-cache ]; then
  if live; then trap - EXIT; pack_caches; else name=compile-cache dry 0 0 pack_caches; fi
  exit 0
fi
: "${PK_DEADLINE:=$(($(now) + 570))}"  # this part's own (unless given: several parts in one command)
live && peers
case $part in  # the eager rows: build the native launch path first (else the first process builds it
  # in the background and launches from Python meanwhile: 2026-12-04's serving-b and decode rows)
  serving-* | decode | overhead* | families-* | vision-* | trl*) step native-build 150 python3 -m polykernel.backends.triton._native ;;
esac
case $part in  # FlashInfer's JIT modules in one parallel build (else each builds on its first call, one at a
  # time: 2026-12-04's sixth run, fresh machine, the serving tests' 240 s went on them; 80 s warm)
  serving-* | overhead*) [ -f .gpu/serving/setup.sh ] && step flashinfer-jit 180 python3 -m polykernel.backends.flashinfer._prebuild ;;
esac
live && nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv >"$R/gpu.csv" 2>&1
case $part in
  serving-a)
    step cuda-jit-build 150 python3 -m polykernel.backends.cuda_jit._build
    # the peers' parity in a process of its own: a peer kernel that faults (2026-12-04: sgl-kernel's
    # silu_and_mul, a misaligned load) poisons the CUDA context, and every later test would error
    gpu_tests serving-peers 150 tests/backends/test_serving_peers.py
    # the providers apart from the op files (2026-12-04: test_torch_compile.py's Inductor compiles
    # cut the one step holding all of them at 132 s; its GPU parity now takes three full-size cases)
    gpu_tests serving-providers 120 tests/backends/test_cuda_jit.py tests/backends/test_torch_compile.py
    # (the serving op files' GPU tests: part serving-native; with them here the part's steps took 740 s)
    step serving-graph 130 python3 -m polykernel bench --graph --no-compile --out "$R/graph" "${SERVING_OPS[@]}"
    step serving-eager 100 python3 -m polykernel bench --no-compile --out "$R/eager" "${SERVING_OPS[@]}"
    ;;
  serving-native)  # the serving ops' native launch path: its GPU tests (bit-exact against the Python path, graph
    # capture), the serving op files' GPU tests, and the Liger-vs-float64 preference test (carry .whl for Liger)
    gpu_tests native-tests 180 tests/backends/test_native.py  # 110 s on 2026-12-04 (fourth run): its Triton compiles
    gpu_tests preference-liger 90 tests/ops/test_preference_losses.py -k liger
    gpu_tests serving-tests 240 tests/ops/test_serving_common.py tests/ops/test_serving_fp8.py \
      tests/ops/test_serving_glu.py tests/ops/test_serving_inplace.py tests/ops/test_silu_and_mul.py tests/ops/test_gelu_and_mul.py \
      tests/ops/test_fused_add_rms_norm_.py tests/ops/test_rotary_embedding_.py tests/ops/test_dynamic_quant_fp8.py \
      tests/ops/test_static_quant_fp8.py tests/ops/test_rms_norm_quant_fp8.py
    ;;
  serving-b)
    step cuda-jit-build 150 python3 -m polykernel.backends.cuda_jit._build
    step providers 60 python3 benchmarks/kernels/providers.py --json "$R/providers.json"
    # the decode loop: part `decode` (2026-12-04's second run: h200-2026-12-04-serving-tests/decode.json)
    # the sweep's first six ops: 2026-12-04's third run reached the seventh op in 280 s on a fresh
    # machine (FlashInfer's JIT builds); its last three ops are part serving-c
    step serving-sweep 330 python3 benchmarks/tuning/sweep_serving.py --out "$R/sweep" \
      --ops silu_and_mul gelu_and_mul fused_add_rms_norm_ rotary_embedding_ dynamic_quant_fp8 static_quant_fp8
    ;;
  serving-c)  # the sweep's last three ops (101 s on a warm machine) and the kernel variants
    step serving-sweep 200 python3 benchmarks/tuning/sweep_serving.py --out "$R/sweep" --ops rms_norm_quant_fp8 rms_norm fused_add_rms_norm
    step variants 90 python3 benchmarks/kernels/kernel_variants.py --only gelu_and_mul,rms_norm_decode --out "$R/variants"
    ;;
  losses)
    gpu_tests loss-tests 150 tests/ops/test_kl_div.py tests/ops/test_jsd.py tests/ops/test_tvd.py \
      tests/ops/test_fused_linear_jsd.py tests/ops/test_preference_losses.py tests/ops/test_ce_options.py -k "not large"
    # eager, not --graph: Liger's losses are not CUDA-graph safe, so a graph bench has no Liger row
    # (2026-12-04); at these sizes (ms per call) the GPU time dominates the host's anyway
    step distill-bench 200 python3 -m polykernel bench --no-compile --out "$R/distill" "${DISTILL_OPS[@]}"
    # the ten losses, then the eight CE-option rows, against Liger called as its users call it (its
    # own modules: the registry's predicates refused its DPO and bf16 GRPO on 2026-12-04) and the
    # plain loss; it replaces the preference ops' bench step (no room: the part's limits add up to
    # 540 s). The ten took 64 s on 2026-12-04 (sixth run); the script estimates ~150 s with the
    # options: a cut run keeps the ten, and `--only` resumes the rest
    step post-train-losses 190 python3 benchmarks/kernels/post_training_losses.py --json "$R/post_training.json"
    ;;
  losses-jsd)  # fused_linear_jsd alone: its GPU tests (~170 s on 2026-12-06's twenty-second run, before the
    # error model kept its sums on the GPU) and its bench rows (43-84 s each, cut three times inside `losses`)
    gpu_tests jsd-tests 150 tests/ops/test_fused_linear_jsd.py --durations=0
    step jsd-bench 380 python3 -m polykernel bench --no-compile --out "$R/jsd" fused_linear_jsd
    ;;
  moe | moe-tests)  # each test file on its own (2026-12-03, fresh machine: gpt-oss 54 s; the other two cut at 50-65 s, compiling);
    # their compiles, counted on the CPU: benchmarks/results/cpu-2026-12-03-moe-compiles/. No Liger wheel for this part:
    # with it, test_moe_experts.py's GPU parity also compiles Liger's fused MoE for every case (the tests turn its
    # autotuning off, tests/conftest.py, but not its compiles); Liger's MoE parity runs in the part moe-liger
    for f in test_moe_paths test_moe_experts test_moe_experts_gpt_oss test_moe_router; do
      gpu_tests "$f" 90 "tests/ops/$f.py" --durations=0
    done
    [ "$part" = moe-tests ] && exit 0
    step moe-layer 80 python3 benchmarks/kernels/moe_paths.py --rep 150 --jsonl "$R/moe_paths.jsonl"
    step moe-sweep 130 python3 benchmarks/kernels/moe_paths.py --sweep --rep 80 --jsonl "$R/moe_sweep.jsonl"
    ;;
  moe-liger)  # carries .whl/: Liger's fused MoE through our parity harness on the GPU (autotuning off: tests/conftest.py)
    gpu_tests moe-liger 300 tests/ops/test_moe_experts.py -k "parity_gpu_large or outside_the_experts" --durations=0
    ;;
  moe-train)  # carries .whl/ with the Liger wheel (the header's Notes). Liger >= 0.8.5 autotunes its fused MoE
    # kernels on first use (~170 configs: its Qwen3-MoE run took no step in 170 s on 2026-12-03): liger[fixed]
    # turns that off (Liger's default configs); the autotuned liger has its own part, moe-train-liger
    # 2026-12-04 (warm machine): Mixtral's three variants 75 s, Qwen3-MoE's 58 s; compile adds its own
    step train-mixtral 240 python3 benchmarks/models/moe_train.py --model mixtral --steps 6 --only "plain,polykernel,liger[fixed],compile" --timeout 150 --json "$R/train_mixtral.json"
    step train-qwen 300 python3 benchmarks/models/moe_train.py --model qwen3_moe --steps 8 --only "plain,polykernel,liger[fixed],compile" --timeout 150 --json "$R/train_qwen.json"
    ;;
  moe-train-liger)  # Liger as it comes: the first step autotunes (reported as "first"), then its steady rate
    step train-qwen-liger 540 python3 benchmarks/models/moe_train.py --model qwen3_moe --steps 12 --only liger --timeout 520 --json "$R/train_qwen_liger.json"
    ;;
  decode)
    step drift 120 python3 benchmarks/models/decode_drift.py --batches 1,8,32,128 --jsonl "$R/drift.jsonl"
    # strict: a patched row whose patch falls back (the twenty-first run's polykernel+compile rows ran
    # transformers' forward, logged only) raises instead of being measured as polykernel's
    step decode 240 env POLYKERNEL_STRICT=1 python3 benchmarks/models/decode_loop.py --steps 32 --repeats 3 --variants "plain[eager],polykernel[eager],plain[graph],polykernel[graph],compile[reduce-overhead],polykernel+compile[reduce-overhead]" --json "$R/decode.json"
    step profile 200 python3 benchmarks/models/decode_profile.py --jsonl "$R/decode_profile.jsonl"
    ;;
  checks)
    gpu_tests double-backward 200 tests/ops/test_double_backward.py
    step peer-refusing 90 python3 benchmarks/host/peer_refusing.py --cuda --json "$R/peer_refusing.json"
    ;;
  overhead)
    # issue 36's "at or below": this tree's dispatch against the filing tree's template in one
    # process (the hosts' processes spread too much for a process A/B: h200-2026-12-05-twelfth/)
    step templates-cpu 40 python3 benchmarks/host/hot_path_templates.py --json "$R/templates-cpu.json"
    step templates-cuda 40 python3 benchmarks/host/hot_path_templates.py --device cuda --json "$R/templates-cuda.json"
    step overhead 60 python3 benchmarks/host/overhead.py --rounds 150 --calls 200 --json "$R/overhead.json"
    step serving-entry 40 python3 benchmarks/host/serving_entry.py --device cuda --json "$R/serving_entry.json"
    # the process A/B against the filing tree, where .ab is carried (`bash benchmarks/host/ab_overhead.sh stage`)
    [ -d .ab ] && step ab-overhead 120 env AB_DEVICE=cuda bash benchmarks/host/ab_overhead.sh run 2 "$R/ab"
    step helpers 40 python3 benchmarks/host/per_call_helpers.py --rounds 150 --json "$R/per_call_helpers.json"
    step plain-vs-generated 40 python3 benchmarks/host/plain_vs_generated.py --rounds 150 --json "$R/plain_vs_generated.json"
    step host-profile 180 python3 benchmarks/host/host_profile.py --out "$R/host"  # 19 cases (2026-12-04: 17 cases cut at 60 s)
    ;;
  overhead-graph)  # (a part of its own: with the host's steps it took 760 s)
    step graph 200 python3 -m polykernel bench --graph --no-compile --out "$R/graph" rms_norm layer_norm fused_add_rms_norm swiglu \
      geglu softmax rope cross_entropy fused_linear_cross_entropy
    # where QuACK's RMSNorm impls lead Triton's by N and rows (backends/quack/_gates.py's rules; stage.sh cute)
    step norm-peers 240 python3 benchmarks/kernels/sweep_norm_peers.py --json "$R/norm_peers.json"
    ;;
  trl)  # needs .gpu/trl (the header); each variant is a process of its own (imports, a 1.2B model,
    # Triton compiles: ~30-60 s), cut at --timeout; both steps end by the part's PK_DEADLINE
    export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1  # no network there: no hub look-ups
    step trl-dpo 220 python3 benchmarks/models/trl_dpo.py --steps 8 --timeout 100 --json "$R/trl_dpo.json"
    # generation (transformers' generate, eager, token by token) is most of a GRPO step: short
    # prompts and completions, 16 completions a step (its loss sees 16 x 192 tokens)
    step trl-grpo 310 python3 benchmarks/models/trl_grpo.py --steps 4 --prompts 2 --generations 8 --prompt-len 128 \
      --completion-len 192 --timeout 120 --json "$R/trl_grpo.json"
    ;;
  trl-memory)  # needs .gpu/trl; the trl part's GRPO shape with the CUDA allocator's history recorded
    # (slower steps: no timings to compare), each record's "at_peak" what was live at its peak, by origin
    export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
    step trl-grpo-memory 300 python3 benchmarks/models/trl_grpo.py --only "polykernel+patch,liger" --steps 4 --prompts 2 \
      --generations 8 --prompt-len 128 --completion-len 192 --timeout 140 --memory-trace --json "$R/trl_grpo_memory.json"
    ;;
  families-[1-7])
    # 20 text families, 3 per part (each variant in its own process; compile's first steps compile)
    all=$(python3 -c "import sys; sys.path.insert(0, 'benchmarks/models'); import families; print(' '.join(families.FAMILIES))")
    read -r -a fams <<<"$all"
    k=${part#families-}
    chunk=$(((${#fams[@]} + 6) / 7))
    mine=$(IFS=,; echo "${fams[*]:$(((k - 1) * chunk)):$chunk}")
    mine=${PK_FAMILIES:-$mine}  # a list of one's own (e.g. PK_FAMILIES=qwen2): when the list grows, the parts' three shift
    # (PK_VARIANTS: some of them again, e.g. PK_FAMILIES=mixtral,qwen3_moe PK_VARIANTS=liger; PK_PROFILE=N:
    # each run's N kernels of most GPU time in one more step, e.g. PK_FAMILIES=gpt_oss PK_VARIANTS=polykernel,compile)
    step "families-$k" 540 python3 benchmarks/models/families.py --families "$mine" --variants "${PK_VARIANTS:-plain,polykernel,liger,compile}" \
      --steps 6 --warmup 3 --timeout 120 ${PK_PROFILE:+--profile "$PK_PROFILE"} --json "$R/families-$k.json"
    ;;
  vision-[12])
    # one vision family a part, its four variants (plain and Liger ~30 s each, polykernel's Triton
    # compiles ~60 s, torch.compile's ~150 s: ~5 min)
    fam=$([ "$part" = vision-1 ] && echo qwen2_vl || echo qwen2_5_vl)
    step "$part" 420 python3 benchmarks/models/vision_families.py --families "$fam" --steps 6 --warmup 3 --timeout 240 \
      --json "$R/$part.json"
    ;;
  gpu-*)
    step "test-$part" 480 make test-gpu PART="${part#gpu-}" PYTHON=python3
    ;;
  *)
    echo "unknown part $part (see the header)"
    exit 2
    ;;
esac
