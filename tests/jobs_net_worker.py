"""The serving process of tests/jobs_net_test.py and scripts/net_transport_bench.py: one
transport (kind "net", optionally with CurveZMQ keys, or "transfer_server") that offers
arrays when told to.

Not a test by itself. Usage:
  python3 tests/jobs_net_worker.py [--kind net|transfer_server] [--curve KEYS]
It prints "address HOST:PORT", then reads commands from stdin, one per line, and
answers each with "ok" (or "error ..."):
  offer TICKET NBYTES SEED [COUNT]  offers `values(NBYTES, SEED)` (uint8, on CPU) under
                                    tickets TICKET .. TICKET+COUNT-1 (default 1), each
                                    for 600 s
  exit                              closes the transport and exits
KEYS: the four z85 keys of CurveKeys joined by ",". It exits when stdin closes.
"""

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def values(nbytes, seed):
  """The bytes both sides expect for (NBYTES, SEED)."""
  import numpy as np
  return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--kind", default="net")
  parser.add_argument("--curve", default="")
  args = parser.parse_args()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax
  from jax_m2n._src.jobs import net, transport
  options = {}
  if args.curve:
    options["curve"] = net.CurveKeys(*args.curve.split(","))
  t = transport.acquire("127.0.0.1", args.kind, **options)
  print("address", t.address, flush=True)
  arrays = {}
  for line in sys.stdin:
    words = line.split()
    if not words:
      continue
    if words[0] == "exit":
      break
    try:
      ticket, nbytes, seed = (int(w) for w in words[1:4])
      count = int(words[4]) if len(words) > 4 else 1
      if (nbytes, seed) not in arrays:
        arrays[(nbytes, seed)] = jax.device_put(values(nbytes, seed), jax.devices()[0])
      for k in range(count):
        t.offer([arrays[(nbytes, seed)]], 600.0, ticket=ticket + k)
      print("ok", flush=True)
    except Exception as e:  # noqa: BLE001 - the test reads it
      print("error", type(e).__name__, e, flush=True)
  transport.release(t)


if __name__ == "__main__":
  main()
