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
`Worker` starts one from the test or the bench and speaks this protocol, bounded.
"""

import argparse
import os
import signal
import subprocess
import sys
import threading

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def values(nbytes, seed):
  """The bytes both sides expect for (NBYTES, SEED)."""
  import numpy as np
  return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


class Worker:
  """A serving process started from another (the test, the bench): every answer
  within its timeout, killed at `kill`. JAX_PLATFORMS comes from the environment."""

  def __init__(self, kind="net", curve=""):
    argv = [sys.executable, os.path.abspath(__file__), "--kind", kind]
    env = dict(os.environ, XLA_FLAGS="")
    self.proc = subprocess.Popen(argv + (["--curve", curve] if curve else []), env=env,
                                 text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    self.address = self._line(120.0).split()[1]

  def _line(self, timeout):
    got = []
    reader = threading.Thread(target=lambda: got.append(self.proc.stdout.readline()),
                              daemon=True)
    reader.start()
    reader.join(timeout)
    if not got or not got[0]:
      raise RuntimeError(f"the serving process said nothing within {timeout} s")
    return got[0]

  def offer(self, ticket, nbytes, seed, count=1):
    self.proc.stdin.write(f"offer {ticket} {nbytes} {seed} {count}\n")
    self.proc.stdin.flush()
    answer = self._line(300.0)
    if not answer.startswith("ok"):
      raise RuntimeError(f"the serving process refused the offer: {answer}")

  def kill(self):
    if self.proc.poll() is None:
      self.proc.send_signal(signal.SIGKILL)
    self.proc.wait(timeout=10.0)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--kind", default="net")
  parser.add_argument("--curve", default="")
  args = parser.parse_args()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax
  from jax_m2n._src.jobs import net, transports
  options = {}
  if args.curve:
    options["curve"] = net.CurveKeys(*args.curve.split(","))
  t = transports.acquire("127.0.0.1", args.kind, **options)
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
  transports.release(t)


if __name__ == "__main__":
  main()
