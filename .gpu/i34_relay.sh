#!/usr/bin/env bash
# Issue 34 on the 16-core GPU machine: relays among one-process subscriber jobs, K = 1,
# 2, 4, 8, relay against direct pulls in the same run, and the recovery when one of 4
# members dies mid-version (jax_m2n/bench/relay.py). CPU processes with CUDA hidden:
# the question is whether K = 8 stops being CPU-bound with 16 cores (on the 2-core
# development machine it is). The machine has no `ip`, so no emulated hosts: loopback
# only (no link shaping: the times are the transfer server's and the copies', not a
# NIC's; the trainer's egress is what the subscribers counted from it).
#   OUT=/path/to/out bash .gpu/i34_relay.sh        # about 6 min
# From the repository root, the extension built as for .gpu/jobs.sh; pyzmq as there
# (WHEELS: a folder with a cp312 pyzmq wheel, if the machine lacks it).
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=${OUT:-${1:-$ROOT/bench_out/i34}}
mkdir -p "$OUT"
cd "$ROOT"
python3 -c "import zmq" 2>/dev/null || \
  python3 -m pip install --no-index --find-links "${WHEELS:-wheels}" 'pyzmq>=26,<28'
export CUDA_VISIBLE_DEVICES="" JAX_PLATFORMS=cpu PYTHONPATH=$ROOT
{
  echo "cores: $(nproc)  load: $(cut -d' ' -f1-3 /proc/loadavg)  date: $(date -u +%FT%TZ)"
  python3 -c "import jax, jax_m2n; print('jax', jax.__version__, 'jax_m2n', jax_m2n.__file__)"
} | tee "$OUT/environment.txt"
rc=0
# 1. the table (chain, 1 MiB chunks) and the recovery
timeout 600 python3 -m jax_m2n.bench.relay --loopback --ks 1,2,4,8 --iters 3 \
  --out_dir "$OUT/chain" 2>&1 | grep -v Warning | tee "$OUT/chain.log" || rc=1
# 2. the choices: a tree of fanout 2, and 4 MiB chunks, at K = 1 and 8
timeout 400 python3 -m jax_m2n.bench.relay --loopback --ks 1,8 --iters 3 --fanout 2 \
  --no_recovery --out_dir "$OUT/tree" 2>&1 | grep -v Warning | tee "$OUT/tree.log" || rc=1
timeout 400 python3 -m jax_m2n.bench.relay --loopback --ks 1,8 --iters 3 \
  --chunk_kib 4096 --no_recovery --out_dir "$OUT/chunk4" 2>&1 | grep -v Warning \
  | tee "$OUT/chunk4.log" || rc=1
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$OUT/environment.txt"
exit $rc
