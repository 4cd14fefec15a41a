"""One-array fetches between two processes on 127.0.0.1, per transport: "net" (ours,
over ZeroMQ), "net" with CurveZMQ, and JAX's transfer server.

Usage:
  PYTHONPATH=$PWD .venv/bin/python scripts/net_transport_bench.py \
      [--sizes 4096,409600,67108864,268435456] [--reps 10] [--warmup 2] \
      [--kinds net,transfer_server,net_curve] [--platform cpu|cuda] [--json out.json]
A serving process (tests/jobs_net_worker.py) offers a uint8 array of each size under
warmup + reps tickets; this process fetches them one after another, each timed from
`fetch` until the array is ready on its first device (both processes on --platform:
on "cuda" the bytes cross host memory both ways), and checks the last bitwise. Prints
per transport and size the min and median of the `reps` timed fetches (ms) and the
min's throughput; --json writes them (format version 1).
"""

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FORMAT = 1


def bench(kind, sizes, reps, warmup):
  import jax
  import numpy as np
  sys.path.insert(0, os.path.join(ROOT, "tests"))
  import jobs_net_worker  # pylint: disable=import-outside-toplevel
  from jax_m2n._src.jobs import net, transports
  options, curve = {}, ""
  wire = kind
  if kind == "net_curve":
    keys = net.CurveKeys.generate()
    options["curve"] = keys
    curve = ",".join(k.decode() for k in (keys.server_secret, keys.server_public,
                                           keys.client_secret, keys.client_public))
    wire = "net"
  server = jobs_net_worker.Worker(wire, curve)
  local = transports.acquire("127.0.0.1", wire, **options)
  device = jax.devices()[0]
  rows = []
  try:
    ticket = 1000
    for seed, nbytes in enumerate(sizes):
      n = warmup + reps
      server.offer(ticket, nbytes, seed, n)
      spec = jax.ShapeDtypeStruct((nbytes,), np.uint8,
                                  sharding=jax.sharding.SingleDeviceSharding(device))
      times = []
      for k in range(n):
        start = time.perf_counter()
        [got] = local.fetch(server.address, ticket + k, [spec]).result()
        got.block_until_ready()
        times.append(time.perf_counter() - start)
      if got.devices() != {device} or not np.array_equal(
          np.asarray(got), jobs_net_worker.values(nbytes, seed)):
        raise AssertionError(f"{kind}: {nbytes} bytes arrived different or elsewhere")
      timed = times[warmup:]
      rows.append({"transport": kind, "bytes": nbytes, "min_ms": 1e3 * min(timed),
                   "median_ms": 1e3 * statistics.median(timed),
                   "gbps_at_min": nbytes / min(timed) / 1e9})
      ticket += n
      del got
  finally:
    transports.release(local)
    server.kill()
  return rows


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--sizes", default="4096,409600,67108864,268435456")
  parser.add_argument("--reps", type=int, default=10)
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--kinds", default="net,transfer_server,net_curve")
  parser.add_argument("--platform", default="cpu", choices=["cpu", "cuda"])
  parser.add_argument("--json", default="")
  args = parser.parse_args()
  os.environ["JAX_PLATFORMS"] = args.platform  # the serving process inherits it
  os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # two processes, one GPU
  sizes = [int(s) for s in args.sizes.split(",")]
  kinds = args.kinds.split(",")
  unknown = set(kinds) - {"net", "transfer_server", "net_curve"}
  if unknown or args.reps < 1 or args.warmup < 0 or min(sizes) < 1:
    parser.error(f"kinds must be among net, transfer_server, net_curve (got "
                 f"{sorted(unknown)}); reps >= 1, warmup >= 0, sizes >= 1.")
  rows = [row for kind in kinds for row in bench(kind, sizes, args.reps, args.warmup)]
  print(f"{'transport':<16}{'bytes':>12}{'min ms':>10}{'median ms':>11}{'GB/s':>8}")
  for r in rows:
    print(f"{r['transport']:<16}{r['bytes']:>12}{r['min_ms']:>10.3f}"
          f"{r['median_ms']:>11.3f}{r['gbps_at_min']:>8.2f}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"format": FORMAT, "platform": args.platform, "reps": args.reps,
                 "warmup": args.warmup, "cpus": os.cpu_count(), "rows": rows}, f,
                indent=1)


if __name__ == "__main__":
  main()
