#!/usr/bin/env bash
# Delta sync on the one-GPU machine (issue 33): `bash .gpu/i33_delta.sh` (about 2-4 min).
# Runs .gpu/i33_delta.py (the compiled, donated apply path and the publisher's compare
# through device-to-host copies, against full pulls, checked bitwise on every version)
# and tests/jobs_delta_test.py on the machine's 16 CPU cores (CUDA hidden).
# Needs the built extension and pyzmq (.gpu/setup.sh builds and installs them). Output: $OUT (default bench_out/i33).
set -uo pipefail
GPU_RUN=i33 . "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
build_inplace
rc=0
OUT=$OUT timeout 400 python3 .gpu/i33_delta.py 2>&1 | tee "$OUT/i33_delta.log" | grep -E "^\{|device|Error" || rc=1
JAX_PLATFORMS=cpu timeout 300 python3 -m pytest -q -p no:cacheprovider \
  tests/jobs_delta_test.py > "$OUT/delta_tests.log" 2>&1 || rc=1
echo "delta tests (CPU): $(tail -1 "$OUT/delta_tests.log")"
exit $rc
