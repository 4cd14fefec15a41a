"""The `status` control call: how a running publisher is, asked over its control channel.

Owns both ends: the answer a publisher process gives (`answer`: its PublisherStats and,
on process 0, the relays' trees: per version and group, its members and whom each
pulls from), the asking side (`ask`: an authenticated control connection, as a
Subscriber's, one call, closed) and the readable summary of an answer (`summary`),
which `python -m jax_m2n jobs status` prints. Counts nothing (counters.py) and moves
no data.
"""

from __future__ import annotations

import time
from typing import Any

from jax_m2n._src.errors import ReshardRuntimeError
from jax_m2n._src.jobs import auth, channel
from jax_m2n._src.jobs.counters import DATA_OPS
from jax_m2n._src.planner.plan import fmt_bytes

API = "jobs status"
# The answer's format (its "status" field); a reader refuses another.
FORMAT = 1


def answer(counters: Any, coordinator: Any) -> dict[str, Any]:
  """A publisher process's answer to `status`: {"status": FORMAT, "now": its clock,
  "stats": `counters.stats().to_json()`, "relays": `coordinator.tree()` (process 0;
  [] elsewhere)}."""
  return {"status": FORMAT, "now": time.time(), "stats": counters.stats().to_json(),
          "relays": coordinator.tree() if coordinator is not None else []}


def ask(address: str, token: Any, timeout_s: float = 10.0) -> dict[str, Any]:
  """The status of the publisher at `address` (its process 0: the one subscribers
  connect to), asked with `token` over an authenticated control connection.

  Raises:
    ReshardValueError: a malformed address, a bad or wrong token.
    ReshardRuntimeError: nothing answered within `timeout_s`, or an answer of another
      format (a publisher of another jax_m2n version).
  """
  key = auth.as_key(API, token)
  client = channel.Client(API, address, key, timeout_s, f"the publisher at {address}")
  try:
    reply = client.call({"op": "status"}, timeout_s, "the status")
  finally:
    client.close()
  if reply.get("status") != FORMAT or not isinstance(reply.get("stats"), dict) or (
      not isinstance(reply.get("relays"), list)):
    raise ReshardRuntimeError(f"{API}: the publisher at {address} must answer status "
                              f"format {FORMAT}; got another (format "
                              f"{reply.get('status')!r}).")
  return reply


def _ago(now: float, then: float | None) -> str:
  return "never" if not then else f"{max(0.0, now - then):.1f} s ago"


def _counts(counts: dict[str, int]) -> str:
  return ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "none"


def summary(reply: dict[str, Any]) -> str:
  """A readable summary of `ask`'s answer (several lines, no trailing newline)."""
  s, now = reply["stats"], reply["now"]
  lines = [f"publisher {s['address']} (trainer process {s['process']}, transport "
           f"{s['transport']})",
           f"versions: {len(s['versions'])} held, {fmt_bytes(s['held_bytes'])}; last "
           f"published {s['last_version']}, {_ago(now, s['last_published_at'])}"]
  for v in s["versions"]:
    lines.append(f"  version {v['version']}: {fmt_bytes(v['bytes'])}, published "
                 f"{_ago(now, v['published_at'])}, {fmt_bytes(v['offered_bytes'])} "
                 f"offered; {v.get('held_as', 'snapshot')}")
  held = s.get("device_bytes") or {}
  lines.append("device memory held for weight sync: " + (", ".join(
      f"{d} {fmt_bytes(n)}" for d, n in sorted(held.items())) or "none") + (
      f"; {s.get('lent_allocations', 0)} allocation(s) lent to local readers "
      f"({fmt_bytes(s.get('lent_allocation_bytes', 0))})"
      if s.get("lent_allocations") else ""))
  lines.append(f"subscribers: {s['subscribers']} connections heard from within "
               f"{s['window_s']:g} s (a relaying subscriber holds two)")
  for p in s["peers"]:
    lines.append(f"  {p['peer']}: version {p['version']}, last call {p['last_op']} "
                 f"{p['seen_s_ago']:.1f} s ago, {p['calls']} calls")
  served = "?" if s["served_bytes"] is None else fmt_bytes(s["served_bytes"])
  data = {op: n for op, n in s["answered"].items() if op in DATA_OPS}
  other = {op: n for op, n in s["answered"].items() if op not in DATA_OPS}
  lines += [f"pulls answered: {s['pulls_answered']} ({_counts(data)}); other requests: "
            f"{_counts(other)}",
            f"failures: {_counts(s['failures'])}",
            f"egress: {fmt_bytes(s['offered_bytes'])} offered, {served} served by the "
            "transport",
            f"local exports: {s['exports']} ({fmt_bytes(s['export_bytes'])})"]
  lines.append(f"relays: {len(reply['relays']) or 'none'}")
  for r in reply["relays"]:
    lines.append(f"  version {r['version']}, group {r['group']} (fanout {r['fanout']}"
                 f"{', closed' if r['closed'] else ''}):")
    for m in r["members"]:
      state = [w for w in ("done", "dead", "leaving") if m[w]]
      lines.append(f"    {m['member']} at {m['address']} <- "
                   f"{m['upstream'] or 'the trainer'}"
                   + (f" ({', '.join(state)})" if state else ""))
  return "\n".join(lines)
