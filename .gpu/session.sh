#!/usr/bin/env bash
# Everything one GPU runs for the lend, torch and scale work, in one call (the device
# tool allows about 10 minutes a call): the CMake build, the one-GPU reshard and local
# suites, the lend suite, the torch GPU tests, the scale suite's one-device bf16 refit,
# then the lend and torch bench rows. Each step is bounded; a step's log lands in $OUT
# and one line per step on stdout. STEPS picks a subset (default: all, in this order).
#   STEPS="one lend torch scale lend_bench torch_bench" bash .gpu/session.sh
set -uo pipefail
GPU_RUN=session . "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
export JAX_M2N_CMAKE_ARGS=${JAX_M2N_CMAKE_ARGS:--DJAX_M2N_CUDA_ARCHITECTURES=90-real}
STEPS=${STEPS:-one lend torch scale lend_bench torch_bench}
t0=$(date +%s)
build_inplace
nvidia-smi -L | tee "$OUT/gpus.txt"
rc=0
step() {  # step NAME SECONDS command...: runs it bounded, logs to $OUT/NAME.log
  local name=$1 limit=$2
  shift 2
  local s=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1 || rc=1
  echo "$name ($(( $(date +%s) - s )) s, at $(( $(date +%s) - t0 )) s): $(tail -1 "$OUT/$name.log" | cut -c1-200)"
  grep -E "^(FAILED|ERROR)" "$OUT/$name.log" | head -8
}
pytest_q="python3 -m pytest -q -p no:cacheprovider"
for s in $STEPS; do
  case $s in
    one) step one 150 $pytest_q tests/gpu_one_test.py tests/gpu_local_test.py ;;
    lend) step lend 200 $pytest_q -s tests/gpu_lend_test.py ;;
    torch) JAX_PLATFORMS=cpu step torch 100 $pytest_q -s tests/torch_gpu_test.py ;;
    scale) step scale 90 python3 -m jax_m2n.bench --suite scale --case one_device_bf16 \
             --out_dir "$OUT/scale"; cat "$OUT"/scale/*.md 2>/dev/null | head -20 ;;
    lend_bench) step lend_bench 130 python3 -m jax_m2n.bench.lend --out_dir "$OUT/lend" \
                  ${LEND_ARGS:-}; cat "$OUT/lend/lend.md" 2>/dev/null | head -30 ;;
    torch_bench) JAX_PLATFORMS=cpu step torch_bench 120 python3 -m jax_m2n.bench.torch_jobs \
                   --parts gpu --iters 10 --warmup 2 --out_dir "$OUT/torch"
                 cat "$OUT"/torch/*.md 2>/dev/null | head -12 ;;
  esac
done
exit $rc
