#!/usr/bin/env bash
# One device call: `ft serve` end to end on the Qwen3.6-35B-A3B shape cut to LAYERS layers
# (issue #20 items 4 and 6, #24 item 2). Stages, in order (default: all):
#   tests    (not in the default) the idle warm-up and graph-runner GPU tests
#   ckpt     ft bench checkpoint --format ftw into /tmp (not $OUT: 35.7 GB at 20 layers)
#   start    two starts of `ft serve --moe-backend hybrid`: empty kernel caches, then a restart
#            on the caches the first one filled; start -> ready phases, the first request's
#            first token right after ready, the idle warm-up, TTFT of 160/1000/3000 words
#   hybrid offload auto
#            ft bench serve W1 at full scale, cache rate 0.37, random routing
#   trace    ft bench serve hybrid, --route-trace shared, W1 and W3 (sub-agents: batch 2)
#   gputests (not in the default) the family/format GPU tests (gpt-oss, Triton MoE, MLA/KDA, FP8)
#   dec-hybrid dec-offload dec-auto dec-fused dec-trace dec-trace-offload dec-uhybrid
#            dec-uoffload dec-uauto (not in the default; trace: the replayed trained router,
#            batch 1, 2 and 4; u*: uniform routing, the bench's `random` case) scripts/serve_decode_check.py: forced
#            256-token streams at batch 1 and 2 through the HTTP API, expert counters, the
#            re-profiler's bw_reprofile lines
#   bench    (not in the default) ft bench decode, the same shape and cache rate, offload and
#            hybrid, random routing, batch 1 and 2: the figure the served rate is held to
#   bench-diag (not in the default) offload batch 1 graphs on/off and through EngineCore: the
#            byte counters of each path (fetched <= misses must hold)
#   elastic  (not in the default) ft bench elastic on the checkpoint: decode at batch 4 before,
#            during and after a 6 GB shrink of the expert cache (issue 24)
#   cold3    (not in the default) 3 first starts (each on empty kernel caches) of
#            COLD_BACKEND (default auto): ready, a first token, the idle warm-up to its end
#            with no failed task, alive and answering after it (issue #20 item 1)
#   trace-all (not in the default) ft bench serve W1-W4, TRACE_BACKEND (default hybrid) with
#            --route-trace shared: the stability table (issue #20: within 5 % of W1)
# FMT=ftw|random: the checkpoint (random: no weight files, the server makes them in memory;
# LAYERS=40 does not fit the disk otherwise)
# Every stage is skipped once the wall budget (BUDGET_S, default 530 s) would not hold it;
# each command runs under `timeout` of what is left. Logs and reports land under $OUT.
# Usage: OUT=/tmp/out LAYERS=20 scripts/gpu_serve_check.sh [stage ...]
# (SHAPE, SCALE=full|tiny, SERVE_EXTRA="--device=cpu ...", CHECK_XDG: for a dry run on a CPU)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/ft-out}; mkdir -p "$OUT"
LAYERS=${LAYERS:-20}; BUDGET_S=${BUDGET_S:-530}; RATE=${RATE:-0.37}
SHAPE=${SHAPE:-qwen3.6-35b-a3b}; SCALE=${SCALE:-full}; read -ra EXTRA <<< "${SERVE_EXTRA:-}"
stages=" ${*:-ckpt start hybrid offload auto trace} "
T0=$(date +%s)
# a device call brings back at most 8 files: at exit everything but the summary and the
# machine description goes into one archive, logs.tgz (session 17 lost the summary itself)
pack() { ( cd "$OUT" && mapfile -t f < <(ls -A | grep -vxE "summary.txt|machine.txt|logs.tgz")
  [ "${#f[@]}" -gt 0 ] && tar -czf logs.tgz "${f[@]}" && rm -rf "${f[@]}" ) 2>/dev/null; }
trap pack EXIT
left() { local l=$((BUDGET_S - ($(date +%s) - T0))); [ "$l" -gt 5 ] && echo "$l" || echo 5; }
stage() {  # stage NAME MIN_SECONDS: whether to run it (selected, and time left)
  [[ "$stages" == *" $1 "* ]] || return 1
  local l; l=$(left)
  if [ "$l" -lt "$2" ]; then echo "[gpu_serve_check] skip $1: ${l}s left < $2s" | tee -a "$OUT/summary.txt"; return 1; fi
  echo "[gpu_serve_check] $1 at +$(( $(date +%s) - T0 ))s (${l}s left)" | tee -a "$OUT/summary.txt"
}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if [ -d .whl ]; then  # the `gpu` extra's wheels (flashinfer, ...), carried with the checkout
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site
fi
# kernel caches, bandwidth profiles: one root; emptied when the `start` stage runs (its first
# start is a first start on this machine), every later server reuses what that one compiled
export XDG_CACHE_HOME=${CHECK_XDG:-/tmp/ft-xdg}
[[ "$stages" == *" start "* ]] && rm -rf "$XDG_CACHE_HOME"
mkdir -p "$XDG_CACHE_HOME"
unset TRITON_CACHE_DIR FLASHINFER_WORKSPACE_BASE TORCHINDUCTOR_CACHE_DIR TORCH_EXTENSIONS_DIR
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  git log -1 --oneline 2>/dev/null; free -g | head -2; df -h /tmp | tail -1
} > "$OUT/machine.txt" 2>&1
FT="python3 -m freetoken.cli"
if stage tests 200; then
  timeout 150 python3 -m pytest -q -p no:cacheprovider --tb=short tests/engine/test_warm_up_gpu.py \
    tests/engine/test_graph_runner_gpu.py > "$OUT/gpu_tests.log" 2>&1
  tail -4 "$OUT/gpu_tests.log" | tee -a "$OUT/summary.txt"
fi
if stage gputests 180; then
  timeout 170 python3 -m pytest -q -p no:cacheprovider --tb=short \
    tests/kernels/triton/moe/test_gpt_oss_moe_gpu.py \
    tests/kernels/triton/moe/test_triton_moe_gpu.py \
    tests/kernels/triton/attn/test_mla_kda_gpu.py tests/models/test_fp8_gpu.py \
    > "$OUT/gpu_family_tests.log" 2>&1
  tail -12 "$OUT/gpu_family_tests.log" | tee -a "$OUT/summary.txt"
fi
FMT=${FMT:-ftw}
CK=/tmp/ft-ck-$SHAPE-$LAYERS-$FMT
if stage ckpt 60 && [ ! -f "$CK/config.json" ]; then
  timeout "$(left)" $FT bench checkpoint --shape "$SHAPE" --layers "$LAYERS" \
    --format "$FMT" --no-progress "$CK" > "$OUT/checkpoint.log" 2>&1
  echo "[gpu_serve_check] checkpoint written at +$(( $(date +%s) - T0 ))s: $(du -sh "$CK" | cut -f1)" \
    | tee -a "$OUT/summary.txt"; tail -3 "$OUT/checkpoint.log"
fi
[ -f "$CK/config.json" ] || { echo "no checkpoint at $CK" | tee -a "$OUT/summary.txt"; exit 1; }
SERVE=(--moe-backend hybrid --moe-cache-rate "$RATE" "${EXTRA[@]}")
if stage start 150; then
  for label in cold restart; do
    timeout "$(left)" python3 scripts/serve_start_check.py "$CK" "$OUT" "$label" "${SERVE[@]}" \
      2>&1 | grep "^\[start\|Error\|error" | tee -a "$OUT/summary.txt"
  done
  ls "$XDG_CACHE_HOME"/freetoken/kernels/*/ 2>/dev/null | head -8 >> "$OUT/summary.txt"
  python3 scripts/compile_inventory.py "$XDG_CACHE_HOME" > "$OUT/compile_inventory.txt" 2>&1
  head -40 "$OUT/compile_inventory.txt" >> "$OUT/summary.txt"
fi
if stage cold3 150; then  # issue #20 item 1: 3 first starts (empty kernel caches) of a backend
  for i in 1 2 3; do
    [ "$(left)" -lt 140 ] && { echo "[gpu_serve_check] cold3: no time for start $i" \
      | tee -a "$OUT/summary.txt"; break; }
    XDG_CACHE_HOME=/tmp/ft-xdg-cold-$i START_QUICK=1 timeout "$(left)" python3 \
      scripts/serve_start_check.py "$CK" "$OUT" "cold-${COLD_BACKEND:-auto}-$i" \
      --moe-backend "${COLD_BACKEND:-auto}" --moe-cache-rate "$RATE" "${EXTRA[@]}" 2>&1 \
      | grep "^\[start\|Error\|error" | tee -a "$OUT/summary.txt"
    rm -rf "/tmp/ft-xdg-cold-$i"
  done
fi
bench_serve() {  # NAME MIN_SECONDS ft-bench-serve-args...
  local name=$1 min=$2; shift 2
  stage "$name" "$min" || return 0
  local extra=(); for a in "${EXTRA[@]}"; do extra+=("--serve-arg=$a"); done
  timeout "$(left)" $FT bench serve --model "$CK" --moe-cache-rate "$RATE" --scale "$SCALE" \
    --out "$OUT/serve-$name" "${extra[@]}" "$@" > "$OUT/serve-$name.log" 2>&1
  echo "[gpu_serve_check] $name rc=$?" | tee -a "$OUT/summary.txt"
  grep -E "^\[bench serve\] ready|auto_(keep|fallback)" "$OUT/serve-$name.log" \
    "$OUT/serve-$name/serve.log" 2>/dev/null | cut -c1-300 | tee -a "$OUT/summary.txt"
  sed -n '/## Start to ready/,/## Expert cache/p' "$OUT/serve-$name/serve_report.md" \
    2>/dev/null | tee -a "$OUT/summary.txt"
  grep -E "ft\.warmup: (done|plan)|captured .*where=step" "$OUT/serve-$name/serve.log" \
    2>/dev/null | cut -c1-200 | tail -6 | tee -a "$OUT/summary.txt"
}
for b in hybrid offload auto fused trace trace-offload uhybrid uoffload uauto; do
  stage "dec-$b" 100 || continue
  be=$b; tr=(); rows=1,2
  [ "$b" = trace ] && { be=hybrid; tr=(--route-trace shared); rows=1,2,4; }
  [ "$b" = trace-offload ] && { be=offload; tr=(--route-trace shared); rows=1,2,4; }
  # u*: uniform routing, the bench's `random` case served (the same hit rate as the bench)
  [[ "$b" == u* ]] && { be=${b#u}; tr=(--route-trace uniform); }
  ROWS=$rows timeout "$(left)" python3 scripts/serve_decode_check.py "$CK" "$OUT" "$b" "${DEC_TOKENS:-256}" \
    --moe-backend "$be" --moe-cache-rate "$RATE" "${tr[@]}" "${EXTRA[@]}" 2>&1 | grep "^\[decode\|Error" \
    | cut -c1-600 | tee -a "$OUT/summary.txt"
  grep -E "bw_reprofile|auto_(keep|fallback)|split=|graphs_dropped|capture_failed" \
    "$OUT/serve-$b.log" 2>/dev/null | cut -c1-300 | tail -12 | tee -a "$OUT/summary.txt"
done
if stage bench 150; then
  timeout "$(left)" $FT bench decode --shape "$SHAPE" --layers "$LAYERS" --random-weights \
    --moe-cache-rate "$RATE" --prompt-tokens 32 --decode-tokens 128 --repeats 1 \
    --backends "${BENCH_BACKENDS:-offload,hybrid}" --route-trace random --batch 1,2 2>&1 \
    | grep -v "random weights:" > "$OUT/bench_decode.log"
  tail -20 "$OUT/bench_decode.log" | tee -a "$OUT/summary.txt"
fi
if stage bench-diag 120; then
  for extra in "--graphs both" "--path engine"; do
    # shellcheck disable=SC2086
    timeout "$(left)" $FT bench decode --shape "$SHAPE" --layers "$LAYERS" --random-weights \
      --moe-cache-rate "$RATE" --prompt-tokens 32 --decode-tokens 128 --repeats 1 \
      --backends offload --route-trace random --batch 1 $extra 2>&1 \
      | grep -v "random weights:" | grep -v "^[0-9:]* ft\." >> "$OUT/bench_diag.log"
  done
  tail -24 "$OUT/bench_diag.log" | tee -a "$OUT/summary.txt"
fi
if stage elastic 120; then
  timeout "$(left)" $FT bench elastic --model "$CK" --moe-backend offload --moe-cache-rate "$RATE" \
    --batch 4 --shrink 6G > "$OUT/elastic.log" 2>&1
  grep -v "^[0-9:]* ft\.sched" "$OUT/elastic.log" | tail -20 | tee -a "$OUT/summary.txt"
fi
bench_serve hybrid 120 --moe-backend hybrid --workloads W1
bench_serve offload 150 --moe-backend offload --workloads W1
bench_serve auto 120 --moe-backend auto --workloads W1
bench_serve trace 150 --moe-backend hybrid --route-trace shared --workloads W1,W3
# issue #20's stability goal: W2-W4 within 5 % of W1 with replayed routing (not in the default)
bench_serve trace-all 200 --moe-backend "${TRACE_BACKEND:-hybrid}" --route-trace shared \
  --workloads W1,W2,W3,W4
echo "[gpu_serve_check] done at +$(( $(date +%s) - T0 ))s" | tee -a "$OUT/summary.txt"
