"""The jobs control channel's fixed costs on this machine: the token's key derivation,
a connection (connect + handshake + first call) and a small call's round trip, between
a `channel.Server` and a `channel.Client` in one process over 127.0.0.1.

  python scripts/jobs_control_bench.py                      # 50 connections, 2000 calls
  python scripts/jobs_control_bench.py --connects 200 --calls 10000
  python scripts/jobs_control_bench.py --json out.json      # versioned JSON metrics
(From a checkout, with `PYTHONPATH=.` so that its jax_m2n is the one measured.)

Reported in ms, median / p90 / min: `derive` is `auth.as_key` for a token not seen
before (the KDF; later calls with the same token hit a cache), `connect` is
`channel.Client(...)` and its first call, `call` one small call on an open connection.
"""

import argparse
import json
import secrets
import statistics
import time

from jax_m2n._src.jobs import auth, channel

SCHEMA = 1


def _summary(seconds: list[float]) -> dict[str, float]:
  ms = sorted(s * 1000 for s in seconds)
  return {"median_ms": round(statistics.median(ms), 3),
          "p90_ms": round(ms[int(0.9 * (len(ms) - 1))], 3), "min_ms": round(ms[0], 3),
          "n": len(ms)}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--connects", type=int, default=50)
  parser.add_argument("--calls", type=int, default=2000)
  parser.add_argument("--derives", type=int, default=10)
  parser.add_argument("--json", default=None, help="write the metrics here too")
  args = parser.parse_args()

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
