"""Delta sync on one GPU (issue 33): the compiled apply path (in place, donated) and the
publisher's compare with device-to-host copies, against full pulls.

One program plays both jobs on GPU 0 (the publisher's devices are planned apart from
the subscriber's, so one device can be both): 8 float32 leaves [4096, 2048] (256 MiB,
128 MiB in bfloat16 on the wire); per change fraction, VERSIONS versions each changing
that fraction of the elements; every version pulled with delta=True (donating the last
result) and in full (another Subscriber), checked bitwise equal, both timed.
Prints one JSON line per fraction and writes $OUT/i33_delta.json.
"""

import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_m2n
from jax_m2n._src.jobs import delta

VERSIONS = 6
FRACTIONS = (0.0, 0.01, 0.1, 0.5, 1.0)


def main():
  dev = jax.devices()[0]
  print("device:", dev, "platform:", dev.platform, flush=True)
  sharding = NamedSharding(Mesh(np.array([dev]), ("x",)), P("x"))
  rng = np.random.default_rng(0)
  host = [rng.standard_normal((4096, 2048), dtype=np.float32) for _ in range(8)]
  out = []
  for fraction in FRACTIONS:
    pub = jax_m2n.Publisher(token="gpu-machine-token-0123", keep=2)
    sub = jax_m2n.Subscriber(pub.address, token="gpu-machine-token-0123")
    ref = jax_m2n.Subscriber(pub.address, token="gpu-machine-token-0123")
    prev = full = None
    rows = []
    for v in range(VERSIONS):
      for h in host:
        mask = rng.random(h.shape) < fraction
        h[mask] += 0.5
      pub.publish([jax.device_put(h, sharding) for h in host])
      before = dict(delta.stats)
      t0 = time.perf_counter()
      prev = jax.block_until_ready(sub.pull([sharding] * 8, dtype=jnp.bfloat16,
                                            delta=True, donate=prev))
      t1 = time.perf_counter()
      full = jax.block_until_ready(ref.pull([sharding] * 8, dtype=jnp.bfloat16,
                                            donate=full))
      t2 = time.perf_counter()
      same = all(bool(jnp.array_equal(jax.lax.bitcast_convert_type(a, jnp.uint16),
                                      jax.lax.bitcast_convert_type(b, jnp.uint16)))
                 for a, b in zip(prev, full))
      if not same:
        raise AssertionError(f"fraction {fraction} version {v}: delta != full")
      got = {k: delta.stats[k] - before.get(k, 0) for k in delta.stats}
      rows.append({"delta_ms": 1e3 * (t1 - t0), "full_ms": 1e3 * (t2 - t1),
                   "delta_bytes": got.get("subscriber_pulled_bytes", 0),
                   "encode_ms": 1e3 * got.get("publisher_encode_s", 0.0),
                   "apply_ms": 1e3 * got.get("subscriber_apply_s", 0.0)})
    steady = rows[2:]
    row = {"fraction": fraction, "bitwise_equal": True,
           **{k: statistics.median(r[k] for r in steady) for k in steady[0]},
           "first_delta_ms": rows[1]["delta_ms"], "full_bytes": 8 * 4096 * 2048 * 2}
    print(json.dumps(row), flush=True)
    out.append(row)
    sub.close(); ref.close(); pub.close()
  path = os.path.join(os.environ.get("OUT", "."), "i33_delta.json")
  with open(path, "w") as f:
    json.dump({"device": str(dev), "rows": out}, f, indent=1)


if __name__ == "__main__":
  main()
