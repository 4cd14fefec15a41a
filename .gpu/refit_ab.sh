#!/usr/bin/env bash
# The one-device refit (scale suite, case one_device_bf16) of two trees in turns on one
# GPU: the working tree and abbase/ (an earlier commit's jax_m2n, put there by
# `git archive REV jax_m2n | tar -x -C abbase`), the same built extension; then the
# one-GPU reshard and local suites on the working tree.
#   bash .gpu/refit_ab.sh
set -uo pipefail
GPU_RUN=refit_ab . "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
export JAX_M2N_CMAKE_ARGS=-DJAX_M2N_CUDA_ARCHITECTURES=90-real
build_inplace
cp jax_m2n/_ffi*.so abbase/jax_m2n/
nvidia-smi -L | tee "$OUT/gpus.txt"
SITE=${PYTHONPATH%%:*}
for round in 1 2 3; do
  for tree in base new; do
    if [ $tree = base ]; then P=$SITE:$ROOT/abbase; else P=$SITE:$ROOT; fi
    PYTHONPATH=$P timeout 150 python3 -m jax_m2n.bench.scale --worker --case one_device_bf16 \
      --devices 1 --leaves 856 --iters 20 > "$OUT/refit_${tree}_$round.json" 2> "$OUT/refit_${tree}_$round.err"
    python3 - "$OUT/refit_${tree}_$round.json" $tree $round <<'PY'
import json, sys
r = json.loads([l for l in open(sys.argv[1]) if l.startswith("{")][-1])
print(f"{sys.argv[2]} {sys.argv[3]}: reshard {r['reshard_first_s']*1e3:.0f} ms / {r['reshard_repeat_s']*1e3:.2f} ms, "
      f"astype {r['astype_first_s']*1e3:.0f} ms / {r['astype_repeat_s']*1e3:.2f} ms, "
      f"ratio {r['reshard_first_s']/r['astype_first_s']:.2f}x / {r['reshard_repeat_s']/r['astype_repeat_s']:.2f}x, bitwise {r['bitwise_equal']}")
PY
  done
done
for tree in base new; do
  if [ $tree = base ]; then P=$SITE:$ROOT/abbase; else P=$SITE:$ROOT; fi
  echo "phases $tree: $(PYTHONPATH=$P timeout 120 python3 .gpu/refit_phases.py 16 2>/dev/null | tr '\n' ';')"
done
echo "first call profiled: $(PYTHONPATH=$SITE:$ROOT timeout 120 python3 .gpu/refit_first.py 16 2>/dev/null)"
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu_one_test.py tests/gpu_local_test.py \
  > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests: $(tail -1 "$OUT/gpu_tests.log")"
