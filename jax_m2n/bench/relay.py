"""The relay part of the `jobs` suite: K one-process subscriber jobs pulling each
version relayed among themselves against each pulling it directly, in the same run.

Owns one comparison (issue 34): a trainer program (1 CPU device, or the first GPU)
and K = 1, 2, 4, 8 subscriber programs (1 device each), each on its own emulated host
(jax_m2n.testing.hosts: its own network namespace, a link shaped to `rate` each way)
where hosts can be made, else all on 127.0.0.1 (said in the table). The trainer
publishes a `size` int32 array per version (P(x) -> P(None, x) is not needed: one
device each side) once every subscriber has the previous one; odd versions are pulled
directly, even ones through the relay. Per version: the time from publish to the last
subscriber having it, and the trainer's egress (its interface's transmitted bytes in
its namespace; on loopback, the bytes subscribers counted from the trainer). Then the
recovery: K = 4 relaying, one member dies (os._exit) mid-version once it has forwarded
a few chunks; the time of that version against the others, and from the death to the
last survivor having it. Every pull is checked bitwise.

Usage:
  python -m jax_m2n.bench --suite jobs            # this table after the jobs table
  python -m jax_m2n.bench.relay [--size_mib 64] [--ks 1,2,4,8] [--iters 3]
      [--rate 1gbit] [--loopback] [--out_dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable

from jax_m2n.bench import timing
from jax_m2n.testing import workers

MIB = 1 << 20
KS = (1, 2, 4, 8)
TOKEN = "relay-bench-token-0123"
DEFAULT_SIZE_MIB = 64
# The member that dies in the recovery run, and when: from version DIE_VERSION on,
# once it has forwarded DIE_CHUNKS chunks to a child (a quarter of the version's
# chunks where that is fewer).
DIE_VERSION = 4
DIE_CHUNKS = 8


def _wait(path: str, timeout: float) -> str:
  return workers.wait_file(path, timeout, poll_s=0.005)


def _tx_bytes() -> int | None:
  """This network namespace's bytes sent on eth0 (an emulated host's link), or None
  (loopback: every process shares lo)."""
  with open("/proc/net/dev") as f:
    for line in f:
      name, _, rest = line.partition(":")
      if name.strip() == "eth0":
        return int(rest.split()[8])
  return None


def _values(n: int, version: int):
  import numpy as np
  return (np.arange(n, dtype=np.int32) * 7 + version).astype(np.int32)


def trainer_main(d: str, host: str, k: int, size: int, versions: int,
                 own_link: bool) -> None:
  """Publishes `versions` versions, each once every live subscriber has the previous;
  writes d/trainer.json with per version its publish time and the trainer's egress."""
  import jax
  import jax_m2n
  n = size // 4
  pub = jax_m2n.Publisher(f"{host}:0", token=TOKEN, keep=3)
  workers.write_file(os.path.join(d, "address"), pub.address)
  deadline = time.monotonic() + 300
  while len([f for f in os.listdir(d) if f.startswith("ready_")]) < k:
    if time.monotonic() > deadline:
      raise TimeoutError("relay bench: the subscribers did not start")
    time.sleep(0.05)
  device = jax.devices()[0]
  rows = []
  for v in range(1, versions + 1):
    x = jax.device_put(_values(n, v), device)
    x.block_until_ready()
    tx = _tx_bytes() if own_link else None
    t0 = time.time()
    pub.publish(x)
    wanted = [f"s{i}" for i in range(k)]
    done = {}
    limit = time.monotonic() + 300
    while len(done) < len(wanted):
      for name in wanted:
        if name in done:
          continue
        path = os.path.join(d, f"done_{name}_{v}")
        if os.path.exists(path):
          done[name] = json.loads(_wait(path, 1))
        elif os.path.exists(os.path.join(d, f"dead_{name}")):
          done[name] = {"dead": True}
      if time.monotonic() > limit:
        raise TimeoutError(f"relay bench: version {v} not pulled by all in 300 s")
      time.sleep(0.002)
    tx_after = _tx_bytes() if own_link else None
    rows.append({"version": v, "published": t0, "subscribers": done,
                 "tx_bytes": None if tx is None else tx_after - tx})
  workers.write_file(os.path.join(d, "trainer.json"), json.dumps(rows))
  _wait(os.path.join(d, "end"), 600)
  pub.close()


def subscriber_main(d: str, name: str, size: int, versions: int, die: bool,
                    fanout: int, chunk_bytes: int) -> None:
  """Pulls every version (odd: directly, even: through the relay), checks it bitwise,
  writes d/done_NAME_V with the time it had it and the bytes it got from whom."""
  import jax
  import numpy as np
  import jax_m2n
  from jax_m2n._src.jobs import engine, relay
  n = size // 4
  address = _wait(os.path.join(d, "address"), 300)
  direct = jax_m2n.Subscriber(address, token=TOKEN)
  relayed = jax_m2n.Subscriber(address, token=TOKEN, relay=True)
  relayed._state.relay.fanout = fanout  # noqa: SLF001 - the bench compares chains and trees
  relayed._state.relay.chunk_bytes = chunk_bytes  # noqa: SLF001
  if die:
    init = relay._Forwarder.__init__  # noqa: SLF001 - the bench kills a member
    die_after = max(1, min(DIE_CHUNKS, size // chunk_bytes // 4))  # mid-version

    def dying_forwarder(self, member, v, transport, timeout_s):
      count = [0]

      class Counting:
        def offer(self_, *a, **kw):
          ticket = transport.offer(*a, **kw)
          count[0] += 1
          if v.version >= DIE_VERSION and count[0] >= die_after:
            workers.write_file(os.path.join(d, f"dead_{name}"), json.dumps({"at": time.time(),
                                                                "version": v.version}))
            os._exit(9)
          return ticket

        def __getattr__(self_, attr):
          return getattr(transport, attr)
      init(self, member, v, Counting(), timeout_s)
    relay._Forwarder.__init__ = dying_forwarder  # noqa: SLF001
  dst = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  workers.write_file(os.path.join(d, f"ready_{name}"))
  for v in range(1, versions + 1):
    sub = relayed if v % 2 == 0 else direct
    before = (relay.stats["from_trainer_bytes"], relay.stats["from_peers_bytes"],
              engine.stats["pulled_bytes"], relay.stats["reroutes"])
    cpu = time.process_time()
    y = sub.pull(dst, version=v, timeout_s=120, path="network")
    y.block_until_ready()
    at = time.time()
    cpu = time.process_time() - cpu
    trainer = (relay.stats["from_trainer_bytes"] - before[0]
               + engine.stats["pulled_bytes"] - before[2])
    ok = bool(np.array_equal(np.asarray(y), _values(n, v)))
    workers.write_file(os.path.join(d, f"done_{name}_{v}"), json.dumps({
        "at": at, "ok": ok, "from_trainer": trainer, "cpu_s": cpu,
        "from_peers": relay.stats["from_peers_bytes"] - before[1],
        "reroutes": relay.stats["reroutes"] - before[3]}))
    del y
  _wait(os.path.join(d, "end"), 600)
  direct.close()
  relayed.close()


def _launch(hosts, i: int, argv: list[str], log) -> subprocess.Popen:
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
             PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
  env.pop("XLA_FLAGS", None)
  if hosts is None:
    return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
  return hosts.popen(i, argv, env=env, stdout=log, stderr=subprocess.STDOUT)


def _one_run(k: int, size: int, versions: int, hosts, die: bool, fanout: int,
             chunk_bytes: int) -> list[dict]:
  """One trainer and k subscribers (hosts 0..k, or loopback); the trainer's rows."""
  d = tempfile.mkdtemp(prefix="m2n_relay_bench_")
  code = "import sys; from jax_m2n.bench import relay; relay.{}(*sys.argv[1:])"
  host = "127.0.0.1" if hosts is None else hosts.address(0)
  procs, logs, ok = [], [], False
  try:
    logs += [open(os.path.join(d, f"{p}.log"), "w") for p in ["trainer"] + [
        f"s{i}" for i in range(k)]]
    procs.append(_launch(hosts, 0, [sys.executable, "-c", code.format("_trainer"), d,
                                    host, str(k), str(size), str(versions),
                                    "0" if hosts is None else "1"], logs[0]))
    for i in range(k):
      procs.append(_launch(hosts, 1 + i, [
          sys.executable, "-c", code.format("_subscriber"), d, f"s{i}", str(size),
          str(versions), "1" if (die and i == 1) else "0", str(fanout),
          str(chunk_bytes)], logs[1 + i]))
    path = os.path.join(d, "trainer.json")
    deadline = time.monotonic() + 900
    while not os.path.exists(path):
      if procs[0].poll() is not None or time.monotonic() > deadline:
        raise RuntimeError(f"relay bench: the trainer exited or hung; logs in {d}")
      time.sleep(0.1)
    with open(path) as f:
      rows = json.load(f)
    for r in rows:
      for name, s in r["subscribers"].items():
        if not s.get("dead") and not s["ok"]:
          raise AssertionError(f"relay bench: {name} pulled wrong bytes at version "
                               f"{r['version']}")
    dead = os.path.join(d, "dead_s1")
    if os.path.exists(dead):
      with open(dead) as f:
        rows.append({"death": json.load(f)})
    ok = True
    return rows
  finally:
    workers.write_file(os.path.join(d, "end"))
    for p in procs:
      try:
        p.wait(timeout=30)
      except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
    for log in logs:
      log.close()
    if ok:  # the logs are kept only where a run failed (its error names them)
      shutil.rmtree(d, ignore_errors=True)


def _trainer(d, host, k, size, versions, own_link):
  trainer_main(d, host, int(k), int(size), int(versions), own_link == "1")


def _subscriber(d, name, size, versions, die, fanout, chunk_bytes):
  subscriber_main(d, name, int(size), int(versions), die == "1", int(fanout),
                  int(chunk_bytes))


def run(size: int, ks=KS, iters: int = 3, warmup: int = 1, rate: str = "1gbit",
        loopback: bool = False, fanout: int = 1, chunk_bytes: int = 1 << 20,
        recovery_run: bool = True, echo: Callable[[str], object] = print) -> dict:
  from jax_m2n.testing import hosts as hosts_lib
  reason = "asked" if loopback else hosts_lib.EmulatedHosts.unavailable()
  versions = 2 * (warmup + iters)
  rows = []

  def timed(k, run_rows, mode):
    got = [r for r in run_rows if "version" in r and (r["version"] % 2 == 0) == (
        mode == "relay")][warmup:]
    times = [max(s["at"] for s in r["subscribers"].values() if "at" in s)
             - r["published"] for r in got]
    egress = [r["tx_bytes"] if r["tx_bytes"] is not None else sum(
        s.get("from_trainer", 0) for s in r["subscribers"].values()) for r in got]
    cpu = [statistics.mean(s["cpu_s"] for s in r["subscribers"].values() if "at" in s)
           for r in got]
    return {"k": k, "mode": mode, "seconds": statistics.median(times),
            "egress_bytes": statistics.median(egress),
            "subscriber_cpu_s": statistics.median(cpu)}

  def hosts_for(n):
    return None if reason else hosts_lib.EmulatedHosts(n, rate=rate)

  for k in ks:
    h = hosts_for(k + 1)
    try:
      if h is not None:
        h.start()
      run_rows = _one_run(k, size, versions, h, False, fanout, chunk_bytes)
    finally:
      if h is not None:
        h.close()
    for mode in ("direct", "relay"):
      rows.append(timed(k, run_rows, mode))
      echo(f"  relay/K={k} {mode}: {rows[-1]['seconds'] * 1e3:.0f} ms per version, "
           f"trainer egress {rows[-1]['egress_bytes'] / MIB:.1f} MiB, "
           f"{rows[-1]['subscriber_cpu_s']:.2f} CPU-s per subscriber")
  # Recovery: 4 members relaying, member s1 dies mid-version.
  recovery = None
  h = hosts_for(5) if recovery_run else None
  if not recovery_run:
    return dict(_doc(size, iters, warmup, rate, reason, fanout, chunk_bytes, rows, None),
                recovery_run=False)
  try:
    if h is not None:
      h.start()
    run_rows = _one_run(4, size, DIE_VERSION * 2 + 2, h, True, fanout, chunk_bytes)
  finally:
    if h is not None:
      h.close()
  death = next((r["death"] for r in run_rows if "death" in r), None)
  if death is not None:
    r = next(r for r in run_rows if r.get("version") == death["version"])
    others = [x for x in run_rows if "version" in x and x["version"] % 2 == 0
              and x["version"] != death["version"] and x["version"] > 2]
    normal = statistics.median(
        max(s["at"] for s in x["subscribers"].values() if "at" in s) - x["published"]
        for x in others) if others else float("nan")
    last = max(s["at"] for s in r["subscribers"].values() if "at" in s)
    recovery = {"version": death["version"], "seconds": last - r["published"],
                "normal_seconds": normal, "after_death_s": last - death["at"],
                "reroutes": sum(s.get("reroutes", 0) for s in r["subscribers"].values()
                                if "at" in s),
                "egress_bytes": r["tx_bytes"] if r["tx_bytes"] is not None else sum(
                    s.get("from_trainer", 0) for s in r["subscribers"].values())}
    echo(f"  relay/recovery: version {death['version']} in {recovery['seconds']:.2f} s "
         f"(others {normal:.2f} s); last survivor {recovery['after_death_s']:.2f} s "
         "after the death")
  return _doc(size, iters, warmup, rate, reason, fanout, chunk_bytes, rows, recovery)


def _doc(size, iters, warmup, rate, reason, fanout, chunk_bytes, rows, recovery):
  return {"schema": 1, "suite": "jobs_relay", "size_bytes": size, "iters": iters,
          "warmup": warmup, "links": "loopback" if reason else rate,
          "loopback_reason": reason, "fanout": fanout, "chunk_bytes": chunk_bytes,
          "rows": rows, "recovery": recovery}


def markdown(doc: dict) -> str:
  by = {(r["k"], r["mode"]): r for r in doc["rows"]}
  ks = sorted({r["k"] for r in doc["rows"]})
  base = by.get((ks[0], "relay"))
  shape = "a chain" if doc["fanout"] == 1 else f"a tree of fanout {doc['fanout']}"
  lines = [f"Relays: {doc['size_bytes'] / MIB:.0f} MiB per version, {shape}, chunks of "
           f"{doc['chunk_bytes'] / MIB:g} MiB, links: {doc['links']}"
           + (f" ({doc['loopback_reason']})" if doc["loopback_reason"] else ""), "",
           "| K | direct s/version | relay s/version | relay / relay at K=1 | "
           "trainer egress direct MiB | trainer egress relay MiB | CPU-s per "
           "subscriber direct / relay |",
           "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
  for k in ks:
    d, r = by[(k, "direct")], by[(k, "relay")]
    lines.append(f"| {k} | {d['seconds']:.3f} | {r['seconds']:.3f} | "
                 f"{r['seconds'] / base['seconds']:.2f} | "
                 f"{d['egress_bytes'] / MIB:.1f} | {r['egress_bytes'] / MIB:.1f} | "
                 f"{d['subscriber_cpu_s']:.2f} / {r['subscriber_cpu_s']:.2f} |")
  rec = doc.get("recovery")
  lines.append("")
  if rec:
    lines.append(f"- Recovery (K=4 relaying, one member dies mid-version while its "
                 f"child pulls from it): that version took {rec['seconds']:.2f} s "
                 f"(the others {rec['normal_seconds']:.2f} s); the last survivor had it "
                 f"{rec['after_death_s']:.2f} s after the death; {rec['reroutes']} "
                 f"re-route(s); trainer egress {rec['egress_bytes'] / MIB:.1f} MiB.")
  elif doc.get("recovery_run", True):
    lines.append("- Recovery: the member meant to die never forwarded its chunks (it "
                 "was the chain's tail every version): no recovery measured.")
  lines.append("- Per version: publish to the last subscriber having it (all "
               "subscribers wait for it; the trainer publishes the next once all have "
               "it); medians over the versions after the warm-up. Egress: the "
               "trainer's eth0 transmitted bytes (emulated hosts), or the bytes the "
               "subscribers counted from the trainer (loopback).")
  return "\n".join(lines) + "\n"


def main(out_dir: str, size_mib: float | None, iters: int, warmup: int,
         ks=KS, rate: str = "1gbit", loopback: bool = False, fanout: int = 1,
         chunk_kib: int = 1024, recovery_run: bool = True,
         print_fn: Callable[[str], object] = print) -> int:
  from jax_m2n.bench import report
  doc = run(int((size_mib or DEFAULT_SIZE_MIB) * MIB), ks, iters, warmup, rate, loopback,
            fanout, chunk_kib << 10, recovery_run, print_fn)
  report.write_suite(doc, markdown(doc), out_dir, "jobs_relay", print_fn)
  return 0


if __name__ == "__main__":
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--size_mib", type=float, default=DEFAULT_SIZE_MIB)
  p.add_argument("--ks", default=",".join(map(str, KS)))
  timing.add_loop_flags(p, iters=3, warmup=1)
  p.add_argument("--rate", default="1gbit")
  p.add_argument("--loopback", action="store_true")
  p.add_argument("--fanout", type=int, default=1)
  p.add_argument("--chunk_kib", type=int, default=1024)
  p.add_argument("--no_recovery", action="store_true")
  p.add_argument("--out_dir", default="bench_out")
  a = p.parse_args()
  sys.exit(main(a.out_dir, a.size_mib, a.iters, a.warmup,
                tuple(int(x) for x in a.ks.split(",")), a.rate, a.loopback, a.fanout,
                a.chunk_kib, not a.no_recovery))
