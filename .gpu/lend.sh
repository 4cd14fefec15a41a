#!/usr/bin/env bash
# Lending XLA's own buffers on the one-GPU machine (nvidia-h100-x1 / nvidia-h200: jax
# 0.11.2, Python 3.12, no Bazel, no network): the CMake build in place, a probe of XLA's
# allocations, the one-GPU lend suite (tests/gpu_lend_test.py, two programs on one GPU),
# the GPU delta test (a Publisher on the GPU), and the lend bench (jax_m2n/bench/lend.py:
# lend against snapshot, time and memory). pyzmq travels in .whl/ (.gpu/jobs.sh says how
# to fetch a cp312 wheel); .gpu/setup.sh installs it.
#   PART=all|tests|bench BENCH_ARGS="--sizes_mib 256 1024" bash .gpu/lend.sh
# Output: $OUT (logs, lend.json, lend.md), a short summary on stdout. The built
# extensions are kept in /tmp between calls on a warm machine (same C++ sources).
set -uo pipefail
PART=${PART:-all}
GPU_RUN=lend . "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
rc=0
CACHE=/tmp/jax_m2n_lend_so
key=$(cat CMakeLists.txt $(find xla_ffi -type f | sort) | sha1sum | cut -c1-16)
if [ -f "$CACHE/key" ] && [ "$(cat "$CACHE/key")" = "$key" ]; then
  cp "$CACHE"/_ffi*.so jax_m2n/ && echo "extensions: reused from $CACHE"
fi
build_inplace
mkdir -p "$CACHE" && cp jax_m2n/_ffi*.so "$CACHE"/ && echo "$key" > "$CACHE/key"
nvidia-smi -L | tee "$OUT/gpus.txt"
timeout 120 python3 - > "$OUT/probe.log" 2>&1 <<'PY' || rc=1
# XLA's allocations as lent_memory sees them (no preallocation; then preallocated).
import jax, jax.numpy as jnp
from jax_m2n._src import lent_memory
xs = [jnp.zeros(n, jnp.float32) + 1 for n in (1 << 10, 1 << 20, 1 << 26, 1 << 28, 1 << 28)]
jax.block_until_ready(xs)
for x in xs:
  a = lent_memory.allocation_of(x.unsafe_buffer_pointer(), 0)
  print(f"array {x.nbytes >> 10} KiB at +{x.unsafe_buffer_pointer() - a.base} of an "
        f"allocation of {a.nbytes >> 20} MiB (handle {a.handle:#x})")
  lent_memory.release(a)
print("memory_stats keys:", sorted((jax.devices()[0].memory_stats() or {}).keys()))
PY
echo "probe: $(tr '\n' ';' < "$OUT/probe.log" | cut -c1-700)"
if [ "$PART" = all ] || [ "$PART" = tests ]; then
  timeout 200 python3 -m pytest -q -s -p no:cacheprovider tests/gpu_lend_test.py \
    > "$OUT/gpu_lend_test.log" 2>&1 || rc=1
  echo "gpu_lend_test: $(tail -1 "$OUT/gpu_lend_test.log")"
  grep -E "^(race|memory)|FAILED|Error" "$OUT/gpu_lend_test.log" | head -20
  if [ -n "${DELTA:-}" ]; then
    timeout 60 python3 -m pytest -q -p no:cacheprovider tests/gpu_delta_test.py \
      -k delta_pull > "$OUT/gpu_delta_test.log" 2>&1 || rc=1
    echo "gpu_delta_test (a Publisher on the GPU): $(tail -1 "$OUT/gpu_delta_test.log")"
  fi
fi
if [ "$PART" = all ] || [ "$PART" = bench ]; then
  timeout 130 python3 -m jax_m2n.bench.lend --out_dir "$OUT/bench" ${BENCH_ARGS:-} \
    > "$OUT/bench.log" 2>&1 || rc=1
  cat "$OUT/bench/lend.md" 2>/dev/null || tail -20 "$OUT/bench.log"
fi
exit $rc
