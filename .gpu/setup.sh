# The GPU machine's environment for the .gpu/ scripts (sourced, not run): ROOT (this
# checkout, unless set), OUT (unless set: bench_out/$GPU_RUN) made and the working
# folder ROOT; NVLink multicast off in every process, no GPU memory preallocated, the
# wheels it lacks (.whl/: pyzmq, nccl-extensions...) installed into /tmp/site, and
# build_inplace, the in-place CMake build (no Bazel there; $JAX_M2N_CMAKE_ARGS are passed
# on, e.g. -DJAX_M2N_CUDA_ARCHITECTURES=90-real for one architecture, a shorter build).
#   GPU_RUN=name . "$(dirname "${BASH_SOURCE[0]}")/setup.sh"; build_inplace
#                                                   # builds unless both .so are there
#   build_inplace always                            # builds whatever is there
ROOT=${ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
OUT=${OUT:-$ROOT/bench_out/${GPU_RUN:-gpu}}
mkdir -p "$OUT"
cd "$ROOT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false
if [ -d "$ROOT/.whl" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$ROOT"/.whl/*.whl > "$OUT/wheels.log" 2>&1 \
    || echo "wheels: failed ($OUT/wheels.log)"
  export PYTHONPATH=/tmp/site:$ROOT
else
  export PYTHONPATH=$ROOT
fi

build_inplace() {
  if [ "${1:-}" != always ] && [ -f "$ROOT/jax_m2n/_ffi.so" ] \
      && [ -f "$ROOT/jax_m2n/_ffi_cuda.so" ]; then
    return 0
  fi
  local t0
  t0=$(date +%s)
  cmake -S "$ROOT" -B "$ROOT/build/inplace" -G Ninja -DPython_EXECUTABLE="${PY:-python3}" \
    -DJAX_M2N_INPLACE=ON -DJAX_M2N_CUDA=ON ${JAX_M2N_CMAKE_ARGS:-} > "$OUT/build.log" 2>&1 \
    && cmake --build "$ROOT/build/inplace" -j 16 >> "$OUT/build.log" 2>&1 \
    || { echo "build failed: $OUT/build.log"; tail -30 "$OUT/build.log"; exit 1; }
  echo "built in $(( $(date +%s) - t0 )) s: $(ls "$ROOT"/jax_m2n/_ffi*.so | tr '\n' ' ')"
}
