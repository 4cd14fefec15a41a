#!/usr/bin/env bash
# The GPU benchmark run behind docs/benchmarks.md, "In-job reshard": one command.
#
#   pip install --no-build-isolation --no-deps . && scripts/gpu_bench.sh [OUT_DIR] [FLAGS...]
#
# OUT_DIR: where results.json ("schema": 1, every raw time and the environment),
# results.md, bench.log, nvidia-smi.txt and the PNG plots go; default $OUT (the device
# machine's output folder), else bench_out/gpu. FLAGS go to `python -m jax_m2n.bench`
# after the defaults (a later flag wins), e.g. --size_mib 256 --engines m2n_hierarchical.
#
# Environment:
#   PYTHON           interpreter (default: python3; on the GPU machine /opt/torch/.venv)
#   SUITES           default refit,colocated,planner,model (in that order); add
#                    multiprocess for the 2-4 process x 1 GPU suite (runs first, in its
#                    own processes, beside torch.distributed and over NCCL's sockets)
#   BENCH_TIMEOUT_S  bound on the whole run (default 540; the torch.distributed launch,
#                    first, is bounded at 180 s). results.json and results.md are
#                    rewritten after every result, so a run cut short keeps its numbers.
#
# Runs the installed jax_m2n (from OUT_DIR, not the source tree, whose jax_m2n/ has no
# built extension); falls back to the source tree when its jax_m2n/_ffi_cuda*.so was built
# in place (scripts/setup.sh with JAX_M2N_BUILDER=cmake). Keeps NVLink multicast off.
# Without rich or matplotlib it prints plain tables and skips the PNGs (draw them later:
# python -m jax_m2n.bench.plots OUT_DIR/results.json).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT_DIR=${OUT:-$ROOT/bench_out/gpu}
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then
  OUT_DIR=$1
  shift
fi
PY=${PYTHON:-python3}
SUITES=${SUITES:-refit,colocated,planner,model}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)

# Multicast stays off in every process (the torch ranks inherit it; docs/benchmarks.md,
# "Running").
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
export TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}
export NVSHMEM_DISABLE_NVLS=${NVSHMEM_DISABLE_NVLS:-1}
if [ -z "${JAX_M2N_BENCH_COMMIT:-}" ]; then
  JAX_M2N_BENCH_COMMIT=$(git -C "$ROOT" rev-parse HEAD 2>/dev/null || echo unknown)
fi
export JAX_M2N_BENCH_COMMIT

{ nvidia-smi -L; nvidia-smi topo -m; } >"$OUT_DIR/nvidia-smi.txt" 2>&1 || true

cd "$OUT_DIR"
check='import jax_m2n, jax_m2n._ffi_cuda as c; print(jax_m2n.__file__)'
if where=$("$PY" -c "$check" 2>/dev/null); then
  echo "gpu_bench: jax_m2n from $where"
elif where=$(PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PY" -c "$check" 2>/dev/null); then
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
  echo "gpu_bench: jax_m2n from the source tree ($where)"
else
  echo "gpu_bench: error: jax_m2n with its CUDA extension is not importable; run" \
       "'pip install --no-build-isolation --no-deps .' in $ROOT first. Python says:" >&2
  "$PY" -c "$check" >&2 || true
  exit 1
fi

echo "gpu_bench: commit $JAX_M2N_BENCH_COMMIT; suites $SUITES; output $OUT_DIR"
set +e
timeout -k 20 "${BENCH_TIMEOUT_S:-540}" "$PY" -m jax_m2n.bench --suite "$SUITES" \
  --out_dir "$OUT_DIR" --torch_timeout_s 180 "$@" 2>&1 | tee "$OUT_DIR/bench.log"
rc=${PIPESTATUS[0]}
set -e
if [ "$rc" = 124 ]; then
  echo "gpu_bench: stopped after ${BENCH_TIMEOUT_S:-540} s; $OUT_DIR/results.json holds" \
       "what was measured until then" >&2
fi
echo "gpu_bench: exit $rc; results in $OUT_DIR"
exit "$rc"
