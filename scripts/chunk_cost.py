"""Measures the CPU transport's fixed costs, which the planner's chunking rule and
estimates use (jax_m2n/_src/planner/chunking.py): per call, per step and per chunk, in
process (memory-speed copies) and with the emulated network (docs/design.md).

Usage:
  python scripts/chunk_cost.py [--reps 30]

Tiny tensors, so that bytes cost nothing: a call is one 2 -> 2 reshard of 4 KiB in one
step; a step is a reshard whose schedule has S steps (1-element chunks forwarded along a
ring of 3 domains); a chunk is a pytree of L leaves moved in one step. Prints medians
(ms) and the derived per-step and per-chunk costs (us). Numbers, not a test.
"""

import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jax_m2n  # noqa: E402
from jax_m2n.bench import timing  # noqa: E402


def median_ms(fn, reps):
  """(median, min) ms of `reps` calls after one warm-up, each waited for."""
  ms = np.array(timing.time_calls(fn, jax.block_until_ready, 1, reps).times_s) * 1e3
  return float(np.median(ms)), float(ms.min())


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--reps", type=int, default=30)
  args = parser.parse_args()
  devs = np.array(jax.devices()[:8])
  for emulate in (False, True):
    topo = jax_m2n.Topology(domain_size=2, nic_gbps=1000.0, emulate_network=emulate)
    src = NamedSharding(Mesh(devs[:2], ("x",)), P("x"))
    dst = NamedSharding(Mesh(devs[2:8].reshape(3, 2), ("dp", "tp")), P("tp"))
    x = jax.device_put(np.arange(1024, dtype=np.float32), src)
    out = {}
    for chunk in (1 << 20, 64):  # 1 step + fan-out; then 8 chunks per source: S steps
      plan = jax_m2n.plan(x, dst, topology=topo, chunk_bytes=chunk, route="hierarchical")
      f = lambda: jax_m2n.reshard(x, dst, topology=topo, chunk_bytes=chunk)  # noqa: E731
      out[chunk] = (plan.chunks.n_steps, len(plan.chunks), *median_ms(f, args.reps))
    (s1, c1, m1, b1), (s2, c2, m2, b2) = out[1 << 20], out[64]
    leaves = [jax.device_put(np.arange(16, dtype=np.float32) + i, src) for i in range(32)]
    g = lambda: jax_m2n.reshard(leaves, dst, topology=topo, route="flat")  # noqa: E731
    pl = jax_m2n.plan(leaves, dst, topology=topo, route="flat")
    m3, b3 = median_ms(g, args.reps)
    flat1 = jax_m2n.plan(x, dst, topology=topo, route="flat")
    m4, b4 = median_ms(lambda: jax_m2n.reshard(x, dst, topology=topo, route="flat"),
                       args.reps)
    per_step = (m2 - m1) / (s2 - s1) * 1e3
    per_chunk = (m3 - m4) / max(len(pl.chunks) - len(flat1.chunks), 1) * 1e3
    print(f"emulate_network={emulate}: call {m1:.3f} ms ({s1} steps, {c1} chunks; min "
          f"{b1:.3f}); {s2} steps {m2:.3f} ms (min {b2:.3f}): {per_step:.0f} us per step; "
          f"flat {len(flat1.chunks)} chunks {m4:.3f} ms, {len(pl.chunks)} chunks in "
          f"{pl.chunks.n_steps} steps {m3:.3f} ms: {per_chunk:.1f} us per chunk")


if __name__ == "__main__":
  main()
