#!/usr/bin/env bash
# Issue 42 on the one-GPU machine (1 x H200, jax 0.11.2, Python 3.12, no network):
# the CMake build, the GPU tests of the local data plane and of delta on the device,
# the jobs throughput table on the GPU (the local path through CUDA IPC beside the
# network paths and one device copy), and the device encode alone.
#   OUT=/path/to/out bash .gpu/i42_gpu.sh
# .whl/ must hold a cp312 pyzmq wheel (.gpu/jobs.sh says how to fetch one).
set -uo pipefail
GPU_RUN=i42_gpu . "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
export JAX_M2N_CMAKE_ARGS=${JAX_M2N_CMAKE_ARGS:--DJAX_M2N_CUDA_ARCHITECTURES=90-real}
rc=0
build_inplace
nvidia-smi -L | tee "$OUT/gpus.txt"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu_local_test.py \
  tests/gpu_delta_test.py tests/gpu_one_test.py > "$OUT/gpu_tests.log" 2>&1 || rc=1
echo "gpu tests: $(tail -1 "$OUT/gpu_tests.log")"
grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -10
timeout 200 python3 -m jax_m2n.bench.jobs --parts throughput --sizes_mib 256,1024 \
  --iters 10 --warmup 3 --out_dir "$OUT/jobs" > "$OUT/jobs.log" 2>&1 || rc=1
grep -E "^\| (256|1024)MiB" "$OUT/jobs/jobs.md" 2>/dev/null | head -30 || tail -20 "$OUT/jobs.log"
timeout 60 python3 -m jax_m2n.bench.delta --workloads encode --bytes 1GiB --repeats 5 \
  --out_dir "$OUT/delta" > "$OUT/delta.log" 2>&1 || rc=1
grep -E "encode|^\|" "$OUT/delta.log" | tail -6
exit $rc
