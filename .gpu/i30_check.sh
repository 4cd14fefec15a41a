#!/usr/bin/env bash
# Issue 30's checks on a GPU machine (the CUDA code it changed cannot run on the CPU
# development machine): the in-place CMake build (no Bazel there), the GPU tests, the
# main job on the GPUs and the eager fixed cost. From the repository root:
#   bash .gpu/i30_check.sh                 # every step (about 8 min on nvidia-h200)
#   STEP=build|tests|bench bash .gpu/i30_check.sh   # one step (the build output is
#                                          # kept between calls on a warm machine)
# nvidia-h200 runs gpu_one_test; on nvidia-h200-x2/x4 gpu_test and
# multiprocess_gpu_test run too (they skip with fewer GPUs).
# Everything lands in $OUT (the device machine's output folder; default
# bench_out/i30): build.log, gpu_tests.log, rl_refit.log, rl_refit_gpu.json,
# eager_latency.txt.
# What changed on the CUDA side: one buffer-kind switch (BufferBase/BufferDims in
# xla_ffi/cuda/cuda_transport.cc) for the NCCL and peer transports, DecodeSchedule in
# sections (xla_ffi/schedule.cc), the device-to-device transfer guard on the eager
# path, tests/gpus.py and tests/launcher.py under the GPU tests.
set -uo pipefail
PY=${PYTHON:-python3}
STEP=${STEP:-all}
GPU_RUN=i30 . "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
nvidia-smi -L | tee "$OUT/gpus.txt"
rc=0
if [ "$STEP" = all ] || [ "$STEP" = build ]; then
  build_inplace always
fi
if [ "$STEP" = all ] || [ "$STEP" = tests ]; then
  timeout 420 "$PY" -m pytest -q -p no:cacheprovider tests/gpu_one_test.py \
    tests/gpu_test.py tests/multiprocess_gpu_test.py > "$OUT/gpu_tests.log" 2>&1 || rc=1
  tail -5 "$OUT/gpu_tests.log"
fi
if [ "$STEP" = all ] || [ "$STEP" = bench ]; then
  timeout 240 "$PY" -m examples.rl_refit --noprogress --json_out "$OUT/rl_refit_gpu.json" \
    > "$OUT/rl_refit.log" 2>&1 || rc=1
  tail -3 "$OUT/rl_refit.log"
  timeout 120 "$PY" scripts/eager_latency.py --iters 1000 > "$OUT/eager_latency.txt" 2>&1 \
    || rc=1
  grep -v "^[WIE][0-9]" "$OUT/eager_latency.txt"
fi
exit $rc
