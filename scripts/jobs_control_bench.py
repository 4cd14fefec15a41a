"""The jobs control channel's fixed costs on this machine: the token's key derivation,
a connection (connect + handshake + first call) and a small call's round trip, between
a `channel.Server` and a `channel.Client` in one process over 127.0.0.1.

  python scripts/jobs_control_bench.py                      # 50 connections, 2000 calls
  python scripts/jobs_control_bench.py --connects 200 --calls 10000
  python scripts/jobs_control_bench.py --json out.json      # versioned JSON metrics
  python scripts/jobs_control_bench.py --flood hello --rate 200 --seconds 10
  python scripts/jobs_control_bench.py --flood garbage --no-budget   # zmq alone
(From a checkout, with `PYTHONPATH=.` so that its jax_m2n is the one measured.)

Reported in ms, median / p90 / min: `derive` is `auth.as_key` for a token not seen
before (the KDF; later calls with the same token hit a cache), `connect` is
`channel.Client(...)` and its first call, `call` one small call on an open connection.

With --flood KIND, a second process (tests/jobs_attacks.py) opens --rate connections
per second from 127.0.0.2 for --seconds, each sending KIND (garbage: random bytes;
hello: a ZMTP greeting and a CURVE HELLO from a key nobody holds; halfopen: nothing,
held open; bigframe: a frame announcing 64 MiB), while this process connects and calls
from 127.0.0.1 as a legitimate client. Reported: the CPU time the server's threads used
per second of flood (server: the thread that runs the handler; gate: ZAP and the
per-address budget; io: the server's zmq I/O thread), the same for as long without a
flood, the gate's counts, and the legitimate client's connect and call times during
the flood, and the most file descriptors this process held (quiet, flood).
--no-budget lifts the per-address budget (what zmq alone costs).
"""

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import time

import zmq

from jax_m2n._src.jobs import auth, channel, handshake

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import jobs_attacks  # noqa: E402 - the attacker's side, shared with the tests

SCHEMA = 1


def _summary(seconds: list[float]) -> dict[str, float]:
  ms = sorted(s * 1000 for s in seconds)
  return {"median_ms": round(statistics.median(ms), 3),
          "p90_ms": round(ms[int(0.9 * (len(ms) - 1))], 3), "min_ms": round(ms[0], 3),
          "n": len(ms)}


def _legit(address: str, token: str, seconds: float
           ) -> tuple[list[float], list[float], int]:
  """(connect + first call, call) seconds of a legitimate client for `seconds`, and the
  most file descriptors this process held meanwhile."""
  connects, calls, fds = [], [], 0
  until = time.monotonic() + seconds
  while time.monotonic() < until:
    fds = max(fds, len(os.listdir("/proc/self/fd")))
    t0 = time.perf_counter()
    client = channel.Client("bench", address, auth.as_key("bench", token), 10.0,
                            "the bench server")
    client.call({"op": "ping", "n": 0}, 10.0, "a ping")
    connects.append(time.perf_counter() - t0)
    for i in range(20):
      t0 = time.perf_counter()
      client.call({"op": "ping", "n": i}, 10.0, "a ping")
      calls.append(time.perf_counter() - t0)
    client.close()
    time.sleep(0.05)
  return connects, calls, fds


def flood(args) -> dict:
  if args.no_budget:
    handshake.BURST = 1 << 30
  zmq.Context.instance().socket(zmq.PAIR).close(0)  # its I/O thread is not the server's
  before = jobs_attacks.thread_ids("ZMQbg/IO")
  token = secrets.token_hex(32)
  server = channel.Server("bench", "127.0.0.1:0", auth.as_key("bench", token),
                          lambda caller, body: caller.reply({"echo": body.get("n")}))
  threads = {"server": [server._thread.native_id], "gate": [server.gate._thread.native_id],
             "io": sorted(jobs_attacks.thread_ids("ZMQbg/IO") - before)}
  tids = [t for ts in threads.values() for t in ts]

  def cpu_per_s(run):
    c0, t0 = jobs_attacks.thread_cpu_s(tids), time.monotonic()
    extra = run()
    c1, dt = jobs_attacks.thread_cpu_s(tids), time.monotonic() - t0
    return {k: round(1000 * sum(c1[t] - c0[t] for t in ts) / dt, 2)
            for k, ts in threads.items()}, extra

  try:
    quiet, (_, _, quiet_fds) = cpu_per_s(lambda: _legit(server.address, token,
                                                         args.seconds))
    gate0 = dict(server.gate.stats)

    def attacked():
      attacker = subprocess.Popen(
          [sys.executable, jobs_attacks.__file__, "--port", str(server.port), "--kind",
           args.flood, "--rate", str(args.rate), "--seconds", str(args.seconds)],
          stdout=subprocess.PIPE, text=True)
      try:
        legit = _legit(server.address, token, args.seconds)
        out, _ = attacker.communicate(timeout=args.seconds + 60)
      finally:
        if attacker.poll() is None:
          attacker.kill()
      return legit, json.loads(out)

    loud, ((connects, calls, fds), sent) = cpu_per_s(attacked)
    gate = {k: v - gate0.get(k, 0) for k, v in server.gate.stats.items()}
  finally:
    server.close()
  return {"schema": SCHEMA, "flood": args.flood, "rate": args.rate,
          "seconds": args.seconds, "budget": not args.no_budget,
          "cpu_ms_per_s_quiet": quiet, "cpu_ms_per_s_flood": loud, "attacker": sent,
          "gate": gate, "peak_fds_quiet": quiet_fds, "peak_fds_flood": fds,
          "legit_connect": _summary(connects), "legit_call": _summary(calls)}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--connects", type=int, default=50)
  parser.add_argument("--calls", type=int, default=2000)
  parser.add_argument("--derives", type=int, default=10)
  parser.add_argument("--json", default=None, help="write the metrics here too")
  parser.add_argument("--flood", choices=jobs_attacks.KINDS, default=None)
  parser.add_argument("--rate", type=float, default=200.0)
  parser.add_argument("--seconds", type=float, default=10.0)
  parser.add_argument("--no-budget", action="store_true")
  args = parser.parse_args()
  if args.flood:
    out = flood(args)
    print(json.dumps(out, indent=1))
    if args.json:
      with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    return

  derive = []
  for _ in range(args.derives):
    token = secrets.token_hex(32)
    t0 = time.perf_counter()
    auth.as_key("bench", token)
    derive.append(time.perf_counter() - t0)
  token = secrets.token_hex(32)
  key = auth.as_key("bench", token)
  server = channel.Server("bench", "127.0.0.1:0", key,
                          lambda caller, body: caller.reply({"echo": body.get("n")}))
  try:
    connect = []
    for i in range(args.connects):
      t0 = time.perf_counter()
      client = channel.Client("bench", server.address, auth.as_key("bench", token), 10.0,
                              "the bench server")
      client.call({"op": "ping", "n": i}, 10.0, "a ping")
      connect.append(time.perf_counter() - t0)
      client.close()
    client = channel.Client("bench", server.address, key, 10.0, "the bench server")
    calls = []
    for i in range(args.calls):
      t0 = time.perf_counter()
      assert client.call({"op": "ping", "n": i}, 10.0, "a ping")["echo"] == i
      calls.append(time.perf_counter() - t0)
    client.close()
  finally:
    server.close()
  out = {"schema": SCHEMA, "derive": _summary(derive), "connect": _summary(connect),
         "call": _summary(calls)}
  for name in ("derive", "connect", "call"):
    s = out[name]
    print(f"{name:8s} {s['median_ms']:9.3f} ms median  {s['p90_ms']:9.3f} p90  "
          f"{s['min_ms']:9.3f} min  (n={s['n']})")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(out, f, indent=1)


if __name__ == "__main__":
  main()
