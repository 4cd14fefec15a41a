#!/usr/bin/env bash
# One batched run on the one-GPU machine (nvidia-h200: 16 cores, 1 x H200, jax 0.11.2,
# Python 3.12, no Bazel, no network, no `ip`). Two parts, each within one 10-minute call:
#   PART=gpu  bash .gpu/one_gpu_batch.sh   # CMake build, GPU tests, jobs on the GPU,
#                                          # nccl-extensions import check
#   PART=cpu  bash .gpu/one_gpu_batch.sh   # the 16-core loopback table (CUDA hidden)
# Wheels the machine lacks (pyzmq; nccl-extensions and nccl4py) travel in .whl/
# (see the device notes in docs/benchmarks.md) and are installed into /tmp/site.
# Output: $OUT (logs, JSON), a short summary on stdout.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=${OUT:-$ROOT/bench_out/one_gpu}
PART=${PART:-gpu}
mkdir -p "$OUT"
cd "$ROOT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl > "$OUT/wheels.log" 2>&1 || echo "wheels: failed (wheels.log)"
  export PYTHONPATH=/tmp/site:$ROOT
else
  export PYTHONPATH=$ROOT
fi
rc=0
if [ ! -f jax_m2n/_ffi.so ] || [ ! -f jax_m2n/_ffi_cuda.so ]; then
  t0=$(date +%s)
  cmake -S . -B build/inplace -G Ninja -DPython_EXECUTABLE=python3 -DJAX_M2N_INPLACE=ON \
    -DJAX_M2N_CUDA=ON > "$OUT/build.log" 2>&1 \
    && cmake --build build/inplace -j 16 >> "$OUT/build.log" 2>&1 \
    || { echo "build failed: $OUT/build.log"; tail -30 "$OUT/build.log"; exit 1; }
  echo "built in $(( $(date +%s) - t0 )) s: $(ls jax_m2n/_ffi*.so | tr '\n' ' ')"
fi
if [ "$PART" = gpu ]; then
  nvidia-smi -L | tee "$OUT/gpus.txt"
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu_one_test.py \
    tests/gpu_test.py > "$OUT/gpu_tests.log" 2>&1 || rc=1
  echo "gpu tests: $(tail -1 "$OUT/gpu_tests.log")"
  OUT="$OUT/jobs" WHEELS=.whl timeout 200 bash .gpu/jobs.sh > "$OUT/jobs.log" 2>&1 || rc=1
  grep -E "smoke|pull/raw|ratio|MiB" "$OUT/jobs.log" | tail -8
  timeout 60 python3 - > "$OUT/nccl_m2n_import.log" 2>&1 <<'PY' || rc=1
import importlib.metadata as md
for name in ("nccl-extensions", "nccl4py", "cuda-core", "nvidia-nccl-cu13"):
  try:
    print(name, md.version(name))
  except md.PackageNotFoundError:
    print(name, "missing")
import nccl.m2n as m2n
print("nccl.m2n:", [n for n in dir(m2n) if not n.startswith("_")])
PY
  echo "nccl-extensions: $(tail -2 "$OUT/nccl_m2n_import.log" | tr '\n' ' ')"
fi
if [ "$PART" = cpu ]; then
  CUDA_VISIBLE_DEVICES= timeout 540 bash .gpu/network_loopback.sh "$OUT/loopback" \
    > "$OUT/loopback.log" 2>&1 || rc=1
  cat "$OUT/loopback/multiprocess_cpu.md" 2>/dev/null | head -40 || tail -20 "$OUT/loopback.log"
fi
exit $rc
