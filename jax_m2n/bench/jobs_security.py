"""The `jobs` suite's security rows (issue 44): what a stranger's bytes cost a running
publisher, and what many leaves cost a pull.

Owns three measurements on the trainer program of bench/jobs.py, on 127.0.0.1:
- junk: the publisher process's peak RSS (VmHWM, restarted before each) under 64 MiB
  sent unauthenticated to its control port, its "net" transport's port and its
  "net+curve" transport's port (raw bytes, and a ZMTP greeting and a frame announcing
  64 MiB followed by them); alive afterwards, and the next pull bitwise;
- flood: a legitimate Subscriber's connect and its 4 KiB network pulls, quiet and
  during a 200 connections/s flood from 127.0.0.2 (CURVE HELLOs from keys nobody holds
  to the control port; random bytes to the net transport's port);
- leaves: 20,000 leaves against 20 of the same bytes (19.5 MiB, one device each side),
  local and network: the first pull, the steady pull and the publish.
The attacker's side is tests/jobs_attacks.py (shared with the tests and
scripts/jobs_control_bench.py): these rows run from a checkout and are skipped
without it. Encryption's cost is the throughput table's net / net+curve rows.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from typing import Any

JUNK_BYTES = 64 << 20
FLOOD_RATE = 200.0
LEAVES = ("20_leaves", "20k_leaves")
LEAF_ITERS = 5
_TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "tests")


def attacks() -> Any:
  """tests/jobs_attacks.py of this checkout, or None (an installed package)."""
  path = os.path.join(_TESTS, "jobs_attacks.py")
  if not os.path.exists(path):
    return None
  spec = importlib.util.spec_from_file_location("jobs_attacks", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _port(address: str) -> int:
  return int(address.rsplit(":", 1)[1])


def junk(g: Any, atk: Any, warmup: int) -> list[dict[str, Any]]:
  """Peak RSS of the publisher's process under 64 MiB of junk to each of its ports."""
  host, dst = g.tree("4KiB", seed=200)
  g.connect(("net", "net+curve"))
  rows = []
  try:
    g.pulls("net", host, dst, None, "network", warmup, 1)  # every port in use
    g.pulls("net+curve", host, dst, None, "network", warmup, 1)
    data = os.urandom(JUNK_BYTES)
    ready = atk.frame(b"\x05READY\x0bSocket-Type" + (6).to_bytes(4, "big") + b"DEALER",
                      command=True)
    targets = (("control", g.publishers["net"]["address"], b"CURVE"),
               ("net transport", g.publishers["net"]["transport"], b"NULL"),
               ("net+curve transport", g.publishers["net+curve"]["transport"], b"CURVE"))
    for port_name, address, mechanism in targets:
      for what, payload in (
          ("64 MiB of random bytes", data),
          ("greeting + frame announcing 64 MiB + 64 MiB",
           atk.greeting(mechanism) + (ready if mechanism == b"NULL" else b"")
           + atk.frame(b"", size=JUNK_BYTES) + data)):
        base = g.channel.call("rss", reset=True)
        t0 = time.perf_counter()
        atk.send_and_close(_port(address), payload, read_s=0.3)
        sent_s = time.perf_counter() - t0
        time.sleep(0.2)
        after = g.channel.call("rss")
        after_pull = g.pulls("net" if port_name != "net+curve transport" else "net+curve",
                             host, dst, None, "network", 0, 1)
        rows.append({"kind": "junk", "port": port_name, "what": what,
                     "peak_before_mib": base["peak_mib"], "rss_before_mib": base["rss_mib"],
                     "peak_after_mib": after["peak_mib"],
                     "peak_growth_mib": after["peak_mib"] - base["peak_mib"],
                     "send_s": sent_s, "alive": all(after["alive"].values()),
                     "pull_after_ms": after_pull["median_ms"]})
        g.print(f"  jobs/security junk to {port_name} ({what}): peak "
                f"+{rows[-1]['peak_growth_mib']:.1f} MiB, alive {rows[-1]['alive']}")
  finally:
    g.close()
  return rows


def flood(g: Any, atk: Any, warmup: int, iters: int) -> list[dict[str, Any]]:
  """4 KiB network pulls and a Subscriber's connect, quiet and during a flood."""
  import jax_m2n
  from jax_m2n.bench import jobs_trainer
  host, dst = g.tree("4KiB", seed=201)
  rows = []
  for port_name, kind in (("control", "hello"), ("net transport", "garbage")):
    g.connect(("net",))
    try:
      address = (g.publishers["net"]["address"] if port_name == "control"
                 else g.publishers["net"]["transport"])
      t0 = time.perf_counter()
      quiet = g.pulls("net", host, dst, None, "network", warmup, iters)
      seconds = max(10.0, 3 * (time.perf_counter() - t0) + 5)
      attacker = subprocess.Popen(
          [sys.executable, atk.__file__, "--port", str(_port(address)), "--kind", kind,
           "--rate", str(FLOOD_RATE), "--seconds", str(seconds), "--source", "127.0.0.2"],
          stdout=subprocess.PIPE, text=True)
      try:
        time.sleep(1.0)  # the flood under way
        t0 = time.perf_counter()
        sub = jax_m2n.Subscriber(g.publishers["net"]["address"], token=jobs_trainer.TOKEN)
        connect_ms = (time.perf_counter() - t0) * 1e3
        sub.close()
        t0 = time.perf_counter()
        loud = g.pulls("net", host, dst, None, "network", warmup, iters)
        within = time.perf_counter() - t0 + 1.0 < seconds
        out, _ = attacker.communicate(timeout=seconds + 60)
        counts = json.loads(out)
      finally:
        if attacker.poll() is None:
          attacker.kill()
          attacker.wait(10)
    finally:
      g.close()
    rows.append({"kind": "flood", "port": port_name, "flood": kind, "rate": FLOOD_RATE,
                 "seconds": seconds, "attacker": counts, "pulls_within_flood": within,
                 "connect_ms": connect_ms, "quiet_min_ms": quiet["min_ms"],
                 "quiet_median_ms": quiet["median_ms"], "flood_min_ms": loud["min_ms"],
                 "flood_median_ms": loud["median_ms"], "path": loud["path"]})
    g.print(f"  jobs/security {kind} flood at {port_name}: pull "
            f"{quiet['median_ms']:.2f} -> {loud['median_ms']:.2f} ms, connect "
            f"{connect_ms:.0f} ms")
  return rows


def leaves(g: Any, warmup: int) -> list[dict[str, Any]]:
  """20,000 leaves against 20 of the same bytes: first and steady pulls, publish."""
  rows = []
  for s, name in enumerate(LEAVES):
    host, dst = g.tree(name, seed=300 + s)
    g.connect(("net",))
    try:
      for path in ("auto", "network"):
        row = {**g.pulls("net", host, dst, None, path, min(warmup, 1), LEAF_ITERS),
               "kind": "leaves", "tree": name, "leaves": len(host),
               "payload_bytes": sum(h.nbytes for h in host)}
        rows.append(row)
        g.print(f"  jobs/security {name} {path}: first {row['first_ms']:.0f} ms, pull "
                f"{row['median_ms']:.1f} ms, publish {row['publish_median_ms']:.1f} ms")
    finally:
      g.close()
  return rows


def run(g: Any, warmup: int, iters: int) -> list[dict[str, Any]]:
  """Every security row (none where tests/jobs_attacks.py is not there: one row
  saying so)."""
  atk = attacks()
  if atk is None:
    return [{"kind": "skipped", "why": f"no {_TESTS}/jobs_attacks.py (not a checkout)"}]
  return junk(g, atk, warmup) + flood(g, atk, warmup, max(iters, 20)) + leaves(g, warmup)


def markdown(rows: list[dict[str, Any]]) -> str:
  out = []
  skipped = [r for r in rows if r["kind"] == "skipped"]
  if skipped:
    return f"security rows skipped: {skipped[0]['why']}\n"
  out += ["| junk to | what | peak RSS before MiB | growth MiB | alive | next pull ms |",
          "| --- | --- | ---: | ---: | --- | ---: |"]
  for r in rows:
    if r["kind"] == "junk":
      out.append(f"| {r['port']} | {r['what']} | {r['peak_before_mib']:.0f} | "
                 f"{r['peak_growth_mib']:.1f} | {r['alive']} | {r['pull_after_ms']:.2f} |")
  out += ["", "| flood at | kind | rate /s | attacker attempts (refused, closed early) | "
          "connect ms during | 4 KiB pull quiet min / median ms | during flood min / "
          "median ms |", "| --- | --- | ---: | --- | ---: | ---: | ---: |"]
  for r in rows:
    if r["kind"] == "flood":
      a = r["attacker"]
      out.append(f"| {r['port']} | {r['flood']} | {r['rate']:.0f} | {a['attempts']} "
                 f"({a['refused']}, {a['closed_early']}) | {r['connect_ms']:.0f} | "
                 f"{r['quiet_min_ms']:.2f} / {r['quiet_median_ms']:.2f} | "
                 f"{r['flood_min_ms']:.2f} / {r['flood_median_ms']:.2f}"
                 f"{'' if r['pulls_within_flood'] else ' (outlasted the flood)'} |")
  out += ["", "| tree | leaves | path | first pull ms | pull median ms | publish median "
          "ms | goal: <= 2 x 20 leaves + 1 s |",
          "| --- | ---: | --- | ---: | ---: | ---: | --- |"]
  few = {r["path_asked"]: r for r in rows if r.get("tree") == LEAVES[0]}
  for r in rows:
    if r["kind"] == "leaves":
      ref = few.get(r["path_asked"])
      goal = "-"
      if r["tree"] != LEAVES[0] and ref is not None:
        bound = 2 * ref["median_ms"] + 1000
        goal = f"{'met' if r['median_ms'] <= bound else 'missed'} ({bound:.0f} ms)"
      out.append(f"| {r['tree']} | {r['leaves']} | {','.join(r['path'])} | "
                 f"{r['first_ms']:.0f} | {r['median_ms']:.1f} | "
                 f"{r['publish_median_ms']:.1f} | {goal} |")
  return "\n".join(out) + "\n"
