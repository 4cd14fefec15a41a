#!/usr/bin/env bash
# The 16-core loopback table of docs/benchmarks.md ("Across processes, over a network"):
# jax_m2n across CPU processes on 127.0.0.1 with CUDA hidden, on the GPU machine
# (16 cores; it has no `ip`, so no emulated hosts there: those rows come from
# `python -m jax_m2n.bench --suite network` as root elsewhere). Needs the package
# installed (`pip install --no-build-isolation --no-deps .`); runs it from outside the
# checkout so that the installed copy (with its built extension) is the one imported.
#   .gpu/network_loopback.sh [OUT_DIR]      # default: $OUT, else /tmp/jax_m2n_loopback
# Writes OUT_DIR/multiprocess_cpu.{md,json}, the raw per-process numbers and the logs.
set -euo pipefail
OUT_DIR=${1:-${OUT:-/tmp/jax_m2n_loopback}}
mkdir -p "$OUT_DIR"
cd "$OUT_DIR"
export CUDA_VISIBLE_DEVICES="" JAX_PLATFORMS=cpu
{
  echo "cores: $(nproc)  load: $(cut -d' ' -f1-3 /proc/loadavg)  date: $(date -u +%FT%TZ)"
  python -c "import jax, jax_m2n; print('jax', jax.__version__, 'jax_m2n', jax_m2n.__file__)"
} | tee "$OUT_DIR/environment.txt"
python -m jax_m2n.bench.multiprocess_cpu --out_dir "$OUT_DIR" --size_mib 16,64,256 \
  --iters 10 --warmup 3 --r_d 2,3,4 2>&1 | tee "$OUT_DIR/network_loopback.log"
