#!/usr/bin/env bash
# Lending XLA's own buffers, where a pull's time goes (one-GPU machine: nvidia-h100-x1 /
# nvidia-h200, jax 0.11.2, Python 3.12, no Bazel, no network): the CMake build in place
# (sm_90 only unless JAX_M2N_CMAKE_ARGS says otherwise; reused from /tmp on a warm
# machine), the one-GPU lend suite (tests/gpu_lend_test.py, two programs on one GPU),
# then the lend bench with its breakdown (jax_m2n/bench/lend.py: per row the pull's
# phases and local steps, a pull once its version surely committed, and the copy alone
# in one process). pyzmq travels in .whl/ (.gpu/setup.sh installs it).
#   PART=all|tests|bench BENCH_ARGS="--iters 10 --warmup 3" bash .gpu/lend2.sh
# Output: $OUT (build.log, gpu_lend_test.log, bench.log, bench/lend.json, bench/lend.md),
# a short summary on stdout. About 5-7 minutes on a fresh machine (build 2-3 min).
set -uo pipefail
PART=${PART:-all}
export JAX_M2N_CMAKE_ARGS=${JAX_M2N_CMAKE_ARGS:--DJAX_M2N_CUDA_ARCHITECTURES=90-real}
GPU_RUN=lend2 . "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
rc=0
t0=$(date +%s)
CACHE=/tmp/jax_m2n_lend_so
key=$(cat CMakeLists.txt $(find xla_ffi -type f | sort) | sha1sum | cut -c1-16)
if [ -f "$CACHE/key" ] && [ "$(cat "$CACHE/key")" = "$key" ]; then
  cp "$CACHE"/_ffi*.so jax_m2n/ && echo "extensions: reused from $CACHE"
fi
build_inplace
mkdir -p "$CACHE" && cp jax_m2n/_ffi*.so "$CACHE"/ && echo "$key" > "$CACHE/key"
nvidia-smi -L | tee "$OUT/gpus.txt"
echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo '?')" | tee "$OUT/commit.txt"
if [ "$PART" = all ] || [ "$PART" = tests ]; then
  timeout 220 python3 -m pytest -q -s -p no:cacheprovider tests/gpu_lend_test.py \
    > "$OUT/gpu_lend_test.log" 2>&1 || rc=1
  echo "gpu_lend_test: $(tail -1 "$OUT/gpu_lend_test.log")"
  grep -E "^(race|memory)|FAILED|Error" "$OUT/gpu_lend_test.log" | head -20
fi
if [ "$PART" = all ] || [ "$PART" = bench ]; then
  timeout 240 python3 -m jax_m2n.bench.lend --out_dir "$OUT/bench" \
    ${BENCH_ARGS:---iters 10 --warmup 3} > "$OUT/bench.log" 2>&1 || rc=1
  cat "$OUT/bench/lend.md" 2>/dev/null || tail -20 "$OUT/bench.log"
fi
echo "lend2.sh: rc=$rc in $(( $(date +%s) - t0 )) s"
exit $rc
