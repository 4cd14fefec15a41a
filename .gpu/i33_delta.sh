#!/usr/bin/env bash
# Delta sync on the one-GPU machine (issue 33): `bash .gpu/i33_delta.sh` (about 2-4 min).
# Runs .gpu/i33_delta.py (the compiled, donated apply path and the publisher's compare
# through device-to-host copies, against full pulls, checked bitwise on every version)
# and tests/jobs_delta_test.py on the machine's 16 CPU cores (CUDA hidden).
# Needs the built extension (builds it like .gpu/one_gpu_batch.sh when missing) and
# pyzmq (.whl/ as in one_gpu_batch.sh). Output: $OUT (default bench_out/i33).
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=${OUT:-$ROOT/bench_out/i33}
mkdir -p "$OUT"
cd "$ROOT"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl > "$OUT/wheels.log" 2>&1 || echo "wheels: failed"
  export PYTHONPATH=/tmp/site:$ROOT
else
  export PYTHONPATH=$ROOT
fi
if [ ! -f jax_m2n/_ffi.so ]; then
  cmake -S . -B build/inplace -G Ninja -DPython_EXECUTABLE=python3 -DJAX_M2N_INPLACE=ON \
    -DJAX_M2N_CUDA=ON > "$OUT/build.log" 2>&1 \
    && cmake --build build/inplace -j 16 >> "$OUT/build.log" 2>&1 \
    || { echo "build failed: $OUT/build.log"; tail -30 "$OUT/build.log"; exit 1; }
fi
rc=0
OUT=$OUT timeout 400 python3 .gpu/i33_delta.py 2>&1 | tee "$OUT/i33_delta.log" | grep -E "^\{|device|Error" || rc=1
JAX_PLATFORMS=cpu timeout 300 python3 -m pytest -q -p no:cacheprovider \
  tests/jobs_delta_test.py > "$OUT/delta_tests.log" 2>&1 || rc=1
echo "delta tests (CPU): $(tail -1 "$OUT/delta_tests.log")"
exit $rc
