"""Eager reshard fixed cost on CPU: the time for a 4.5 KiB reshard to return to Python
(nothing waits on it) and to completion (block_until_ready), median and min.

  JAX_M2N_CPU_ASYNC=1 python scripts/eager_latency.py --devices 8   # asynchronous
  python scripts/eager_latency.py --devices 8                       # default (blocking)

Each call starts with the devices idle (the previous call finished, then 0.5 ms sleep),
so "return" is the cost of a call nobody waits on. Cases: 1to1 (device 0 -> 1) and,
with 4+ devices, half the devices (dim-0 sharded) -> the other half (replicated).
"""

import argparse
import time

import jax
import numpy as np


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--devices", type=int, default=2)
  parser.add_argument("--iters", type=int, default=400)
  args = parser.parse_args()
  jax.config.update("jax_num_cpu_devices", args.devices)
  import jax_m2n  # noqa: PLC0415 - after the device count is set
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding
  d = jax.devices()
  n = len(d)
  host = np.arange(1152, dtype=np.float32)  # 4.5 KiB
  cases = {"1to1": (jax.device_put(host, d[0]), SingleDeviceSharding(d[1]))}
  if n >= 4:
    src = NamedSharding(Mesh(np.array(d[:n // 2]), ("a",)), P("a"))
    cases[f"{n // 2}to{n // 2}"] = (
        jax.device_put(host, src), NamedSharding(Mesh(np.array(d[n // 2:]), ("a",)), P()))
  for name, (x, dst) in cases.items():
    for _ in range(20):
      jax.block_until_ready(jax_m2n.reshard(x, dst))
    ret, done = [], []
    for _ in range(args.iters):
      t0 = time.perf_counter()
      y = jax_m2n.reshard(x, dst)
      t1 = time.perf_counter()
      jax.block_until_ready(y)
      t2 = time.perf_counter()
      ret.append(t1 - t0)
      done.append(t2 - t0)
      time.sleep(0.0005)
    ret.sort()
    done.sort()
    med = args.iters // 2
    print(f"{name} ({n} devices): return {ret[med] * 1e6:.0f} / {ret[0] * 1e6:.0f} us, "
          f"completion {done[med] * 1e6:.0f} / {done[0] * 1e6:.0f} us (median / min)")


if __name__ == "__main__":
  main()
