#!/usr/bin/env bash
# One call on the GPU machine (device tool): GPU tests, then the benchmarks of
# docs/benchmarks.md. Writes logs under $OUT.
# Usage: OUT=/tmp/out scripts/gpu_run.sh [stage ...]
#   stages: tests gtests bwshort gputests fast batch prefill pbisect msweep handoff decode2 bridge kprof kernel kdiag kunbound ksweep linear bw decode profile
# (default: gputests kernel linear bw, about 6 min; `decode` alone takes about 5 min more)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/ft-out}; mkdir -p "$OUT"
stages=" ${*:-gputests kernel linear bw} "
has() { [[ "$stages" == *" $1 "* ]]; }
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site
fi
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; lscpu | grep -E "Model name|^CPU\(s\)|Thread|Core|Socket|NUMA|L3|MHz|Flags" | cut -c1-200;
  echo "THP: $(cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null)"; free -g;
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"; } > "$OUT/machine.txt" 2>&1
FT="python3 -m freetoken.cli"
# kernel JIT caches (flashinfer's nvcc builds, triton) travel between calls as one archive
# under $OUT; bring the previous call's back with `carry: [.jitcache]`
export FLASHINFER_WORKSPACE_BASE=/tmp/ft-jit/flashinfer TRITON_CACHE_DIR=/tmp/ft-jit/triton
mkdir -p /tmp/ft-jit
[ -f .jitcache/jit_cache.tgz ] && tar -xzf .jitcache/jit_cache.tgz -C /tmp/ft-jit 2>/dev/null
save_jit() { tar -czf "$OUT/jit_cache.tgz" -C /tmp/ft-jit . 2>/dev/null
  [ "$(stat -c %s "$OUT/jit_cache.tgz")" -lt 16000000 ] || rm -f "$OUT/jit_cache.tgz"; }
trap save_jit EXIT
if has tests; then
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu tests/experts tests/engine \
    tests/kernels_cpu 2>&1 | tail -40 | tee "$OUT/gpu_tests.log"
fi
if has fast; then
  # the decode fast path: a short bandwidth profile (q* and the floors), the GPU tests of the
  # graph runner and kernels, then decode tok/s per backend (20 layers, both routings)
  timeout 120 $FT bench bw --pool-gb 3 --seconds 1 2>&1 | tail -8 | tee "$OUT/bw_short.log"
  timeout 300 python3 -m pytest -q -p no:cacheprovider -x tests/gpu 2>&1 | tail -30 \
    | tee "$OUT/gpu_only_tests.log"
  for trace in ${FT_TRACES:-random shared}; do
    extra=(); [ "$trace" = shared ] && extra=(--route-trace shared)
    timeout 280 $FT bench decode --shape qwen3.6-35b-a3b --layers 20 --random-weights \
      --moe-cache-rate 0.37 --prompt-tokens 32 --decode-tokens 128 --repeats 1 \
      --backends ${FT_BACKENDS:-fused,offload} --graphs ${FT_GRAPHS:-both} "${extra[@]}" 2>&1 \
      | grep -v "random weights:" | tee "$OUT/decode_fast_$trace.log"
  done
fi
if has gtests; then
  # chosen GPU test files (FT_GPU_TESTS), short tracebacks kept whole under $OUT
  timeout ${FT_TESTS_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider --tb=short \
    ${FT_GPU_TESTS:-tests/gpu/test_graph_runner.py} > "$OUT/gtests.log" 2>&1
  tail -15 "$OUT/gtests.log"
fi
if has gputests; then
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tail -30 \
    | tee "$OUT/gpu_only_tests.log"
fi
KB="python3 scripts/bench_cpu_kernel.py --seconds 1.5 --rounds 3"
if has kernel; then
  OMP_PROC_BIND=close OMP_PLACES=cores timeout 240 $KB \
    --threads 16,12,8 --tokens 1,2,4,8 --interleaved-rows --steal-rows \
    --json "$OUT/cpu_kernel.json" 2>&1 | tee "$OUT/cpu_kernel.log"
fi
if has kdiag; then
  # where a decode-size call's time goes: thread entry, median and last thread end, stealing
  OMP_PROC_BIND=close OMP_PLACES=cores timeout 120 $KB --threads 16 --tokens 1,2 --no-torch \
    --no-prefetch-rows --steal-rows --timing 2>&1 | tee "$OUT/cpu_kernel_timing.log"
fi
if has kunbound; then
  # the same kernel without thread binding (as `ft serve` runs unless the user binds)
  timeout 150 $KB --threads 16,12 --tokens 1,4 --no-torch --no-prefetch-rows --steal-rows \
    --json "$OUT/cpu_kernel_unbound.json" 2>&1 | tee "$OUT/cpu_kernel_unbound.log"
fi
if has ksweep; then
  # prefetch distance x target x threads at T=1; then huge pages; then a pinned pool
  { OMP_PROC_BIND=close OMP_PLACES=cores timeout 200 $KB --threads 16,12 --tokens 1 --no-torch \
      --no-prefetch-rows --pf-sweep 0,16384,32768,65536,131072 --hint-sweep t1,t2,t0
    THP_MEM_ALLOC_ENABLE=1 OMP_PROC_BIND=close OMP_PLACES=cores timeout 100 $KB --threads 16 \
      --tokens 1,4 --no-torch --no-prefetch-rows --pf-sweep 0,32768,131072
    OMP_PROC_BIND=close OMP_PLACES=cores timeout 100 $KB --threads 16 --tokens 1,4 --no-torch \
      --no-prefetch-rows --pin --pf-sweep 0,32768,131072; } 2>&1 | tee "$OUT/cpu_kernel_sweep.log"
fi
if has linear; then
  { OMP_PROC_BIND=close OMP_PLACES=cores timeout 120 python3 scripts/bench_cpu_linear.py
    OMP_PROC_BIND=close OMP_PLACES=cores timeout 120 python3 scripts/bench_cpu_attention.py \
      --lengths 8192,57344,131072
    OMP_PROC_BIND=close OMP_PLACES=cores timeout 120 python3 scripts/bench_cpu_attention.py \
      --heads 16,2,256 --dtype bfloat16 --lengths 8192,57344; } 2>&1 | tee "$OUT/cpu_linear.log"
fi
if has bwshort; then
  # the bandwidth profile q* and the floors use (cached for the later stages of this call)
  timeout 150 $FT bench bw --pool-gb 3 --seconds 1 2>&1 | tail -12 | tee "$OUT/bw_short.log"
fi
if has bw; then
  timeout 180 $FT bench bw --pool-gb 6 --seconds 2 2>&1 | tee "$OUT/bw.log"
fi
if has decode; then
  for trace in random shared; do
    extra=(); [ "$trace" = shared ] && extra=(--route-trace shared)
    timeout 300 $FT bench decode --shape qwen3.6-35b-a3b --layers 20 --random-weights \
      --moe-cache-rate 0.37 --prompt-tokens 32 --decode-tokens 64 \
      --backends fused,offload,cpu,hybrid "${extra[@]}" 2>&1 | grep -v "random weights:" \
      | tee "$OUT/decode_$trace.log"
  done
fi
if has batch; then
  # sub-agents decoding together: batch 1, 4 and 16 through the engine's batch path
  timeout 330 $FT bench decode --shape qwen3.6-35b-a3b --layers 20 --random-weights \
    --moe-cache-rate 0.37 --prompt-tokens 32 --decode-tokens 64 --repeats 1 \
    --backends ${FT_BACKENDS:-fused,offload,hybrid} --graphs on --batch ${FT_BATCH:-1,4,16} \
    2>&1 | grep -v "random weights:" | tee "$OUT/decode_batch.log"
fi
if has prefill; then
  # prefill streaming: seconds per chunk at 4k/8k/16k beside the link floor, the overlap off,
  # every expert over the link, the per-expert path and fused; then TTFT of a 32k prompt
  timeout 420 $FT bench prefill --shape qwen3.6-35b-a3b --layers 20 --random-weights \
    --moe-cache-rate 0.37 --tokens ${FT_PREFILL_TOKENS:-4096,8192,16384} --repeats 2 \
    --rows ${FT_PREFILL_ROWS:-stream,stream/serial,stream/all-link,experts,fused} \
    --ttft ${FT_TTFT:-32768} 2>&1 | grep -v "random weights:" | tee "$OUT/prefill.log"
fi
if has decode2; then
  # decode per backend, both routings and batch sizes in one process (one model build)
  timeout ${FT_DECODE_TIMEOUT:-400} $FT bench decode --shape qwen3.6-35b-a3b --layers 20 \
    --random-weights --moe-cache-rate 0.37 --prompt-tokens 32 --decode-tokens 128 --repeats 1 \
    --backends ${FT_BACKENDS:-fused,offload,hybrid} --graphs on \
    --route-trace ${FT_TRACES:-random,shared} --batch ${FT_BATCH:-1} \
    --path ${FT_DECODE_PATH:-generate} 2>&1 \
    | grep -v "random weights:\|ft.engine: finish\|ft.sched: admit" | tee "$OUT/decode2.log"
fi
if has bridge; then
  # the hybrid CPU branch's per-layer hand-off: Python worker vs the native step loop
  { timeout 120 python3 scripts/bench_bridge.py --threads 15 --experts 2,4,0
    timeout 60 python3 scripts/bench_bridge.py --threads 15 --experts 2 --rows 4; } 2>&1 \
    | tee "$OUT/bridge.log"
fi
if has msweep; then
  # the decode MoE tiles swept (each checked against torch), then fused decode with the best
  # (FT_MOE_DECODE_CONFIG) on both routings; the default tiles' rate is decode2's fused row
  timeout 170 python3 scripts/bench_triton_moe.py --tokens 1,4 --prefill "" --sweep \
    --no-grouped 2>&1 | tee "$OUT/moe_sweep.log"
  cfg=$(grep "^FT_MOE_DECODE_CONFIG=" "$OUT/moe_sweep.log" | tail -1 \
    | sed "s/^FT_MOE_DECODE_CONFIG=//; s/^'//; s/'\$//")
  if [ -n "$cfg" ]; then
    FT_MOE_DECODE_CONFIG="$cfg" timeout 220 $FT bench decode --shape qwen3.6-35b-a3b \
      --layers 20 --random-weights --moe-cache-rate 0.37 --prompt-tokens 32 \
      --decode-tokens 128 --repeats 1 --backends fused --graphs on \
      --route-trace random,shared --batch 1 2>&1 | grep -v "random weights:" \
      | tee "$OUT/decode_swept.log"
  fi
fi
if has handoff; then
  # the hybrid hand-off's mechanisms side by side: spin-wait on mapped flags, host-function
  # nodes, one graph per layer (per-layer cost over a no-hand-off baseline)
  timeout 150 python3 scripts/bench_handoff.py --layers 20 --steps 300 --host-us 0,30,100 2>&1 \
    | tee "$OUT/handoff.log"
fi
if has pbisect; then
  # prefill compute: fused with the torch chunk loop vs the scan kernel, streamed 8k, and the
  # kernels of one fused 8k chunk (4 layers) by device time
  timeout 300 $FT bench prefill --shape qwen3.6-35b-a3b --layers 20 --random-weights \
    --moe-cache-rate 0.37 --tokens ${FT_PREFILL_TOKENS:-8192} --repeats 2 \
    --rows ${FT_PREFILL_ROWS:-fused,fused/scan-triton,stream} 2>&1 | grep -v "random weights:" \
    | tee "$OUT/prefill_bisect.log"
  timeout 200 python3 scripts/profile_decode.py --layers 4 --backends fused \
    --prefill-tokens ${FT_PREFILL_TOKENS:-8192} --sort device --rows 30 2>&1 \
    | grep -v "^USDT\|^STAGE" | tee "$OUT/profile_prefill.log"
fi
if has kprof; then
  # GPU kernels of one decode step by device time (the runner run eagerly, fused, 8 layers)
  timeout 200 python3 scripts/profile_decode.py --layers 8 --backends fused --tokens 32 \
    --sort device --rows 30 2>&1 | grep -v "^USDT\|^STAGE" | tee "$OUT/profile_kernels.log"
fi
if has profile; then
  timeout 240 python3 scripts/profile_decode.py --layers 8 --backends fused,offload,hybrid \
    --tokens 16 2>&1 | grep -v "^USDT\|^STAGE" | tee "$OUT/profile_decode.log"
fi
