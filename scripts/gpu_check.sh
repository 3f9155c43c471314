#!/usr/bin/env bash
# One call on the GPU machine: the GPU tests and the reference benchmarks of docs/benchmarks.md.
# Usage: OUT=/tmp/out scripts/gpu_check.sh [tests] [bw] [decode] [prefill] [auto]
#   (default: the first four)
#   tests    every `gpu`-marked test (they sit next to their package's CPU tests) and the
#            CPU-bridge / slot-decision tests on CUDA
#   bw       ft bench bw --pool-gb 3 --seconds 1 (the bandwidth profile q* and the floors read)
#   decode   ft bench decode, Qwen3.6-35B-A3B shape cut to 20 layers, cache 37 %, both routings
#   prefill  ft bench prefill, the same shape, an 8192-token chunk, TTFT of 32k tokens
#   auto     ft bench decode, auto beside offload and hybrid, both routings, batch 1 and 4
#            (issue #20 item 4: auto within 5 % of the best fixed backend)
# Lab conventions (wheels carried in .whl/, the JIT cache in .jitcache/, results under $OUT):
# docs/testing.md.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/ft-out}; mkdir -p "$OUT"
stages=" ${*:-tests bw decode prefill} "
has() { [[ "$stages" == *" $1 "* ]]; }
for s in $stages; do
  case $s in tests|bw|decode|prefill|auto) ;; *) echo "gpu_check.sh: unknown stage $s" >&2; exit 2;; esac
done
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if [ -d .whl ]; then  # the `gpu` extra's wheels (flashinfer, ...), carried with the checkout
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site
fi
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  lscpu | grep -E "Model name|^CPU\(s\)|Core|Socket|L3" | cut -c1-200; free -g
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} > "$OUT/machine.txt" 2>&1
FT="python3 -m freetoken.cli"
# kernel JIT caches travel between calls as one archive: $OUT/jit_cache.tgz, carried back as
# .jitcache/jit_cache.tgz
export FLASHINFER_WORKSPACE_BASE=/tmp/ft-jit/flashinfer TRITON_CACHE_DIR=/tmp/ft-jit/triton
mkdir -p /tmp/ft-jit
[ -f .jitcache/jit_cache.tgz ] && tar -xzf .jitcache/jit_cache.tgz -C /tmp/ft-jit 2>/dev/null
save_jit() { tar -czf "$OUT/jit_cache.tgz" -C /tmp/ft-jit . 2>/dev/null
  [ "$(stat -c %s "$OUT/jit_cache.tgz")" -lt 16000000 ] || rm -f "$OUT/jit_cache.tgz"; }
trap save_jit EXIT
SHAPE=(--shape qwen3.6-35b-a3b --layers 20 --random-weights --moe-cache-rate 0.37)
if has tests; then
  # `-m gpu` over the files that name the marker: what `-m gpu tests` selects, without
  # importing every other test module (peers, reliability) on this machine
  mapfile -t GPU_FILES < <(grep -rlE "pytest\.mark\.gpu" tests --include="test_*.py" \
    --exclude-dir=structure | sort)
  # SIGINT, not TERM, at the limit: pytest then prints its summary (what passed, where it
  # stopped); a test stuck over 100 s dumps every thread's stack (session 15: the FP8 hybrid
  # start's bandwidth measurement); a cold JIT cache needs ~400 s for the whole set
  # A set cut short resumes: the tests that passed are listed in $OUT/gpu_passed.txt (carried
  # back as .jitcache/gpu_passed.txt with the JIT cache) and the next call deselects them
  DONE=()
  if [ -f .jitcache/gpu_passed.txt ]; then
    while IFS= read -r t; do [ -n "$t" ] && DONE+=(--deselect "$t"); done \
      < .jitcache/gpu_passed.txt
    cp .jitcache/gpu_passed.txt "$OUT/gpu_passed.txt"
    echo "resuming: $(( ${#DONE[@]} / 2 )) gpu tests passed in an earlier call are left out"
  fi
  # first in JOBS workers (xdist, a file per worker: the cold JIT compiles spread over the
  # host's cores), then once more serially for what did not pass there (a test that is
  # sensitive to a shared device gets its own run)
  PYT=(python3 -m pytest -v -rA -p no:cacheprovider --tb=short -o faulthandler_timeout=100 -m gpu)
  passed() { grep -oE "(^tests/[^ ]+ PASSED|PASSED tests/[^ ]+)" "$1" \
    | sed -E 's/ PASSED$//; s/^PASSED //' >> "$OUT/gpu_passed.txt"
    sort -u -o "$OUT/gpu_passed.txt" "$OUT/gpu_passed.txt"; }
  touch "$OUT/gpu_passed.txt"
  JOBS=${GPU_JOBS:-4}
  if [ "$JOBS" -gt 1 ]; then
    timeout -s INT "${PAR_S:-300}" "${PYT[@]}" -n "$JOBS" --dist loadfile "${DONE[@]}" \
      "${GPU_FILES[@]}" > "$OUT/gpu_tests_par.log" 2>&1
    passed "$OUT/gpu_tests_par.log"
    grep -E " (passed|failed|error)" "$OUT/gpu_tests_par.log" | tail -2
    DONE=(); while IFS= read -r t; do [ -n "$t" ] && DONE+=(--deselect "$t"); done \
      < "$OUT/gpu_passed.txt"
  fi
  { timeout -s INT "${SER_S:-440}" "${PYT[@]}" "${DONE[@]}" "${GPU_FILES[@]}"
    timeout 90 python3 -m pytest -q -p no:cacheprovider --tb=short -m "not gpu" \
      tests/experts/test_cpu_bridge.py tests/experts/test_slot_decide_kernel.py
  } > "$OUT/gpu_tests.log" 2>&1
  passed "$OUT/gpu_tests.log"
  sort -u -o "$OUT/gpu_passed.txt" "$OUT/gpu_passed.txt"
  grep -E " (passed|failed|error)" "$OUT/gpu_tests.log" | tail -4
  grep -E "FAILED|ERROR|Timeout" "$OUT/gpu_tests.log" | head -20
fi
if has bw; then
  timeout 120 $FT bench bw --pool-gb 3 --seconds 1 2>&1 | tail -12 | tee "$OUT/bw.log"
fi
if has decode; then
  timeout 420 $FT bench decode "${SHAPE[@]}" --prompt-tokens 32 --decode-tokens 128 \
    --repeats 1 --backends fused,offload,hybrid --graphs on --route-trace random,shared \
    --batch 1 2>&1 | grep -v "random weights:" | tee "$OUT/decode.log"
fi
if has prefill; then
  timeout 300 $FT bench prefill "${SHAPE[@]}" --tokens 8192 --rows stream,stream/serial,fused \
    --repeats 2 --ttft 32768 2>&1 | grep -v "random weights:" | tee "$OUT/prefill.log"
fi
if has auto; then
  timeout 420 $FT bench decode "${SHAPE[@]}" --prompt-tokens 32 --decode-tokens 128 \
    --repeats 1 --backends offload,hybrid,auto --graphs on --route-trace random,shared \
    --batch 1,4 2>&1 | grep -v "random weights:" | tee "$OUT/auto.log"
fi
