#!/usr/bin/env bash
# A/B on the GPU machine: the fused decode and the prefill rows of an older tree and of this
# one, in the same call (same machine, clocks and tenants), to tell a code regression from a
# machine's. The older tree is made here first (the device copy has no git history):
#   scripts/gpu_ab.sh --make REV      # git archive REV -> .ab/old (code only, ~3 MB)
# then on the device (carry [".ab"]: the tree's 20 MB and all of .whl/ exceed a carry beside
# it, so .ab/whl holds the wheels without flashinfer, tvm-ffi, transformers and the tokenizer
# stacks, which the benches' --shape runs never import; both trees then decode on the same
# Triton attention):
#   OUT=$OUT scripts/gpu_ab.sh [decode] [prefill]   (default both; AB_BACKENDS for decode,
#   default fused,offload,hybrid: the 2026-11-30 table's rows, on its routing)
# Each tree runs with only its own directory on PYTHONPATH (plus the carried wheels).
# Session 17: prefill fused 0.299 s / stream 0.543 s a chunk against the 2026-11-30 table's
# 0.261 / 0.447 (6da0b8d), fused decode 509.9 against 538.9: which side moved?
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--make" ]; then
  rev=${2:?usage: gpu_ab.sh --make REV}
  rm -rf .ab && mkdir -p .ab/old
  git archive "$rev" freetoken kernels workloads harness_adapters pyproject.toml 2>/dev/null \
    | tar -x -C .ab/old || git archive "$rev" freetoken workloads harness_adapters \
    pyproject.toml | tar -x -C .ab/old
  git rev-parse --short "$rev" > .ab/old/REV
  [ -d .whl ] || scripts/device_wheels.sh > /dev/null
  mkdir -p .ab/whl && find .whl -type f -name "*.whl" ! -name "flashinfer*" ! -name "apache_tvm*" \
    ! -name "transformers*" ! -name "tokenizers*" ! -name "qwen_token*" \
    -exec cp {} .ab/whl/ \;
  du -sh .ab .ab/whl; exit 0
fi
OUT=${OUT:-/tmp/ft-out}; mkdir -p "$OUT"
[ -d .ab/old ] || { echo "no .ab/old: run scripts/gpu_ab.sh --make REV here first" >&2; exit 2; }
stages=" ${*:-decode prefill} "
SITE=""
if [ -d .ab/whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site-ab .ab/whl/*.whl && SITE=:/tmp/site-ab
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
read -ra SHAPE <<< "${AB_SHAPE:---shape qwen3.6-35b-a3b --layers 20} --random-weights --moe-cache-rate 0.37"
run() {  # LABEL DIR ft-args...
  local label=$1 dir=$2; shift 2
  echo "== $label ($(cat "$dir/REV" 2>/dev/null || git log -1 --format=%h 2>/dev/null))" \
    | tee -a "$OUT/ab.log"
  ( cd "$dir" && PYTHONPATH=$PWD$SITE timeout 280 python3 -m freetoken.cli "$@" 2>&1 ) \
    | grep -v "random weights:" | grep -vE "^[0-9:]{8} ft\.(sched|warmup)" >> "$OUT/ab.log"
  tail -8 "$OUT/ab.log"
}
for tree in old new; do
  # routing by the model's own random router in both (the old tree's only routing)
  dir=.ab/old route=(); [ $tree = new ] && { dir=.; route=(--route-trace model); }
  if [[ "$stages" == *" decode "* ]]; then
    # each tree's own bandwidth profile first (hybrid's q* and every floor read it)
    run "bw $tree" "$dir" bench bw --pool-gb 3 --seconds 1
    run "decode $tree" "$dir" bench decode "${SHAPE[@]}" --prompt-tokens 32 \
      --decode-tokens 128 --repeats 2 --backends "${AB_BACKENDS:-fused,offload,hybrid}" \
      --graphs on --batch 1 "${route[@]}"
  fi
  if [[ "$stages" == *" prefill "* ]]; then
    run "prefill $tree" "$dir" bench prefill "${SHAPE[@]}" --tokens 8192 \
      --rows stream,fused --repeats 2
  fi
done
