#!/usr/bin/env bash
# One batched run on the one-GPU machine (nvidia-h200: 16 cores, 1 x H200, jax 0.11.2,
# Python 3.12, no Bazel, no network, no `ip`). Two parts, each within one 10-minute call:
#   PART=gpu  bash .gpu/one_gpu_batch.sh   # CMake build, GPU tests, jobs on the GPU,
#                                          # nccl-extensions import check
#   PART=cpu  bash .gpu/one_gpu_batch.sh   # the 16-core loopback table (CUDA hidden)
#   PART=main bash .gpu/one_gpu_batch.sh   # the main job on the GPU, the eager fixed
#                                          # cost, the CPU bench with CUDA visible
# Wheels the machine lacks (pyzmq; nccl-extensions and nccl4py) travel in .whl/
# (see .gpu/jobs.sh); .gpu/setup.sh installs them into
# /tmp/site.
# Output: $OUT (logs, JSON), a short summary on stdout.
set -uo pipefail
PART=${PART:-gpu}
GPU_RUN=one_gpu . "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
rc=0
build_inplace
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
if [ "$PART" = main ]; then
  timeout 240 python3 -m examples.rl_refit --noprogress --json_out "$OUT/rl_refit_gpu.json" \
    > "$OUT/rl_refit.log" 2>&1 || rc=1
  echo "main job: $(tail -2 "$OUT/rl_refit.log" | tr '\n' ' ' | cut -c1-400)"
  # Issue 31 item 6: the CPU bench's workers stay on CPU with the GPU visible.
  timeout 150 python3 -m jax_m2n.bench.multiprocess_cpu --out_dir "$OUT/mp_cpu_gpu_visible" \
    --size_mib 16 --iters 3 --warmup 1 --r_d 2 > "$OUT/mp_cpu_gpu_visible.log" 2>&1
  mrc=$?; [ $mrc = 0 ] || rc=1
  echo "CPU bench with the GPU visible: rc=$mrc $(grep -c -i 'duplicate gpu' \
    "$OUT/mp_cpu_gpu_visible.log") 'Duplicate GPU' lines; $(grep '^| whole' \
    "$OUT/mp_cpu_gpu_visible/multiprocess_cpu.md" 2>/dev/null | head -1)"
  timeout 120 python3 scripts/eager_latency.py --iters 1000 > "$OUT/eager_latency.txt" 2>&1 \
    || rc=1
  grep -v "^[WIE][0-9]" "$OUT/eager_latency.txt" | tail -12
fi
exit $rc
