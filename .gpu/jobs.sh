#!/usr/bin/env bash
# Issue 32 on the GPU machine (1 x H200, jax 0.11.2, Python 3.12, no network):
# Publisher / Subscriber between two programs sharing the one GPU, through JAX's
# transfer server (host-staged on CUDA).
#   OUT=/path/to/out bash .gpu/jobs.sh
# The machine has no pyzmq and no network: bring a cp312 wheel along, made where PyPI is
# reachable with
#   pip download 'pyzmq>=26,<28' --only-binary=:all: --python-version 3.12 \
#       --platform manylinux_2_28_x86_64 -d wheels
# and point WHEELS at that folder (default: ./wheels).
set -euo pipefail
OUT=${OUT:-${1:-gpu_out}}
mkdir -p "$OUT"
python3 -c "import zmq" 2>/dev/null || \
  python3 -m pip install --no-index --find-links "${WHEELS:-wheels}" 'pyzmq>=26,<28'
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.3   # two programs on one GPU
# 1. the bench: pull vs the transfer server's raw pull of the same bytes, 64 and 256 MiB
for mib in 64 256; do
  python3 -m jax_m2n.bench --suite jobs --size_mib "$mib" --iters 10 --warmup 3 \
      --out_dir "$OUT/jobs_${mib}" 2>&1 | tee "$OUT/jobs_${mib}.log"
done
# 2. a bitwise smoke: the trainer program publishes on the GPU, this one pulls onto it.
python3 - <<'PY' 2>&1 | tee "$OUT/jobs_smoke.log"
import subprocess, sys, tempfile, os, time, textwrap
import jax, jax.numpy as jnp, numpy as np, jax_m2n
from jax.sharding import SingleDeviceSharding
d = tempfile.mkdtemp()
trainer = textwrap.dedent(f"""
    import jax, numpy as np, jax_m2n, time, os
    pub = jax_m2n.Publisher(token="gpu-machine-token-0123", keep=2)
    x = jax.device_put(np.arange(1 << 24, dtype=np.float32).reshape(4096, 4096), jax.devices()[0])
    pub.publish({{"w": x}})
    open("{d}/addr", "w").write(pub.address)
    while not os.path.exists("{d}/done"): time.sleep(0.1)
""")
p = subprocess.Popen([sys.executable, "-c", trainer])
while not os.path.exists(f"{d}/addr"): time.sleep(0.1)
time.sleep(0.5)
sub = jax_m2n.Subscriber(open(f"{d}/addr").read(), token="gpu-machine-token-0123")
t = time.perf_counter()
out = sub.pull(SingleDeviceSharding(jax.devices()[0]), dtype=jnp.bfloat16)
jax.block_until_ready(out)
want = np.arange(1 << 24, dtype=np.float32).reshape(4096, 4096).astype(jnp.bfloat16)
ok = np.array_equal(np.asarray(out["w"]).view(np.uint16), want.view(np.uint16))
print(f"jobs smoke on {jax.devices()[0]}: 64 MiB float32 -> bfloat16 pulled in "
      f"{(time.perf_counter() - t) * 1e3:.0f} ms (first pull), bitwise={ok}")
open(f"{d}/done", "w").close(); p.wait(timeout=60)
sys.exit(0 if ok else 1)
PY
