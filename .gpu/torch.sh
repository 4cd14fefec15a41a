#!/usr/bin/env bash
# jax_m2n.torch on one GPU: a JAX publisher (the trainer program, 0.3 of the GPU's
# memory) and a torch subscriber sharing the GPU. From the repository root:
#   bash .gpu/torch.sh        # about 3 min on nvidia-h100-x1 / nvidia-h200
# Needs torch with CUDA (the device image has 2.11) and pyzmq (.whl/, setup.sh).
# Steps: the torch tests (tests/torch_gpu_test.py: a JAX publisher on the GPU, torch
# CUDA tensors; the CPU ones), then the bench's gpu
# rows: 1 GiB float32 published on the GPU, pulled into a torch CUDA tensor, against
# torch's own device copy, the first pull apart. What it measures today: the torch
# subscriber declines the GPU export (CUDA memory is read by the JAX Subscriber only)
# and crosses the host (the network path on loopback); the bench line says which path.
# Everything lands in $OUT (default bench_out/torch): torch_tests.log, jobs_torch.*.
set -uo pipefail
PY=${PYTHON:-python3}
GPU_RUN=torch . "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
build_inplace
nvidia-smi -L | tee "$OUT/gpus.txt"
"$PY" -c "import torch; print('torch', torch.__version__, torch.cuda.is_available())" \
  | tee "$OUT/torch.txt"
rc=0
JAX_PLATFORMS=cpu timeout 400 "$PY" -m pytest -q -s -p no:cacheprovider \
  tests/torch_gpu_test.py tests/torch_subscriber_test.py > "$OUT/torch_tests.log" 2>&1 \
  || rc=1
tail -3 "$OUT/torch_tests.log"
# The generator (this process) keeps its JAX on the CPU; the trainer program takes the GPU.
JAX_PLATFORMS=cpu timeout 400 "$PY" -m jax_m2n.bench.torch_jobs --parts gpu --iters 10 \
  --warmup 2 --out_dir "$OUT" 2>&1 | tee "$OUT/jobs_torch.log" || rc=1
exit "$rc"
