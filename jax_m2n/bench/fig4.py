"""The `fig4` suite: the paper's Figure 4 in miniature, measured on the emulated network.

Owns the cases, the timing loop, the table and the plot of `--suite fig4`: on 8 CPU
devices in domains of 2 with `Topology(emulate_network=True)` (the CPU transport's NIC
emulator, docs/design.md "The emulated network"), a source group of 2 devices in domain 0
sends a [rows, cols] tensor to a TP2 x DP r_d generator spread over r_d domains, by the
routes hierarchical / flat / gather_bcast, at default arguments (the planner picks the
chunks). Reports measured time, the planner's estimate for the same bandwidths
(`Plan.estimate_ms`: the schedule that runs, step by step, with the transport's per-call
and per-step costs; the aggregate `route_estimate_ms` beside it), measured / estimate,
flat / hierarchical, gather_bcast / hierarchical, and whether the targets are met
(estimate within 25% of the fastest run in every case; flat / hierarchical >= 0.85 r_d
for r_d = 2, 3). Never fails on timing (the exit status says whether every case ran
and validated; the caller decides what a run means).

Usage:
  python -m jax_m2n.bench --suite fig4 [--size_mib 128] [--iters 10] [--out_dir DIR]
  python -m jax_m2n.bench --suite fig4 --size_mib 0.25   # the CI smoke form
  python -m jax_m2n.bench.fig4 --chunk_mib 2 [--size_mib 128] [--out_dir DIR]
      # the same with a fixed chunk size (the earlier 2 MiB run)
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any, Callable, Sequence

import numpy as np

ROUTES = ("hierarchical", "flat", "gather_bcast")
DOMAIN_SIZE = 2
# 1 Gbit/s Ethernet: slow enough that the emulated network term dominates the transfer
# on a 2-core machine (the memory-speed copies and per-step barriers of 8 device threads
# then add ~15%), fast enough for a run of a few minutes at the default payload.
DEFAULT_NIC_GBPS = 0.125
DEFAULT_SIZE_MIB = 128
# The targets the suite reports (issue 23): the estimate within this fraction of the
# fastest run, and flat / hierarchical at least this times r_d for r_d = 2, 3.
ESTIMATE_TOLERANCE = 0.25
FLAT_OVER_HIER = 0.85
SCHEMA = 1


@dataclasses.dataclass(frozen=True)
class Fig4Case:
  """One point of the figure: sources `src_devices` (TP over rows) -> TP2 x DP r_d."""

  name: str
  r_d: int
  src_devices: tuple[int, ...]
  dst_devices: tuple[int, ...]  # dp-major: replica k is dst_devices[2k:2k+2]
  title: str


def cases() -> list[Fig4Case]:
  """r_d = 1, 2, 3 on domains of 2 (sources in domain 0, generator in domains 1..r_d),
  and r_d = 4 over all 4 domains, generator replica 0 sharing the sources' domain."""
  out = []
  for r_d in (1, 2, 3):
    dst = tuple(range(2, 2 + 2 * r_d))
    out.append(Fig4Case(f"rd{r_d}", r_d, (0, 1), dst,
                        f"2 sources (domain 0) -> TP2 x DP{r_d} in domains 1..{r_d}"))
  out.append(Fig4Case("rd4_colocated", 4, (0, 1), tuple(range(8)),
                      "2 sources -> TP2 x DP4 on all 4 domains (replica 0 on the sources)"))
  return out


def shardings(jax, case: Fig4Case):
  """(source, destination) NamedShardings of `case` on the first 8 devices."""
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  devices = jax.devices()
  src_mesh = Mesh(np.array([devices[i] for i in case.src_devices]), ("tp",))
  dst_mesh = Mesh(np.array([devices[i] for i in case.dst_devices]).reshape(case.r_d, 2),
                  ("dp", "tp"))
  return NamedSharding(src_mesh, P("tp", None)), NamedSharding(dst_mesh, P("tp", None))


def _shape(nbytes: int, itemsize: int) -> tuple[int, int]:
  cols = 1024
  rows = max(4, (nbytes // (itemsize * cols)) // 4 * 4)
  return rows, cols


def run(jax, size_bytes: int, iters: int, warmup: int, nic_gbps: float = DEFAULT_NIC_GBPS,
        on_row: Callable[[dict], None] | None = None,
        chunk_bytes: int | None = None) -> dict:
  """Runs every case and route; returns the result document (schema 1).
  `chunk_bytes`: None (the default chunking, chosen per plan) or a fixed chunk size."""
  import jax_m2n
  from jax_m2n.bench import timing

  devices = jax.devices()
  if len(devices) < 8 or devices[0].platform != "cpu":
    raise RuntimeError(f"fig4: needs 8 CPU devices; got {len(devices)} "
                       f"{devices[0].platform} devices.")
  memcpy = timing.memcpy_gbps(min(size_bytes, 64 << 20) or 1 << 20, reps=3)
  # The estimate's intra-domain bandwidth: what one thread copies (the emulator's
  # intra-domain copies run at memory speed).
  nvlink_gbps = memcpy["best_gbps"]
  topo = jax_m2n.Topology(domain_size=DOMAIN_SIZE, nic_gbps=nic_gbps,
                          nvlink_gbps=nvlink_gbps, emulate_network=True)
  dtype = np.float32
  shape = _shape(size_bytes, np.dtype(dtype).itemsize)
  host = np.arange(np.prod(shape), dtype=np.uint32).reshape(shape).view(dtype)
  rows: list[dict] = []
  for case in cases():
    src, dst = shardings(jax, case)
    x = jax.device_put(host, src)
    kw = {} if chunk_bytes is None else {"chunk_bytes": chunk_bytes}
    for route in ROUTES:
      plan = jax_m2n.plan(x, dst, route=route, topology=topo, **kw)
      # The planner's estimate of the schedule that runs (step by step: pipeline fill
      # and drain, per-call and per-step costs included), its steps' bytes alone, and
      # its aggregate (Eqs. 3-9).
      estimate_ms = plan.estimate_ms[route]
      row = {"case": case.name, "title": case.title, "r_d": case.r_d, "route": route,
             "payload_bytes": int(host.nbytes), "estimate_ms": estimate_ms,
             "step_estimate_ms": plan.step_estimate_ms(),
             "route_estimate_ms": plan.route_estimate_ms(), "steps": plan.chunks.n_steps,
             "chunk_bytes": plan.chunk_bytes, "chunks": len(plan.chunks),
             "network_bytes": plan.bytes_by_link["network"]}
      try:
        y = jax_m2n.reshard(x, dst, route=route, topology=topo, **kw)
        ok = all(np.array_equal(np.asarray(s.data), host[s.index])
                 for s in y.addressable_shards)
        y.delete()
        if not ok:
          raise AssertionError("result is not bitwise equal to the source")
        times = timing.time_calls(
            lambda: jax_m2n.reshard(x, dst, route=route, topology=topo, **kw),
            jax.block_until_ready, warmup, iters, release=lambda y: y.delete())
        row.update(status="ok", times_s=times.times_s, **timing.stats_ms(times.times_s))
        row["measured_over_estimate"] = row["median_ms"] / estimate_ms
        row["min_over_estimate"] = row["min_ms"] / estimate_ms
        row["estimate_within_tolerance"] = (
            abs(row["min_over_estimate"] - 1) <= ESTIMATE_TOLERANCE)
        row["measured_over_route_estimate"] = row["median_ms"] / row["route_estimate_ms"]
      except Exception as e:  # noqa: BLE001 - reported as a failed row
        row.update(status="failed", reason=f"{type(e).__name__}: {e}"[:2000])
      rows.append(row)
      if on_row is not None:
        on_row(row)
    x.delete()
  _add_ratios(rows)
  return {"schema": SCHEMA, "suite": "fig4", "nic_gbps": nic_gbps,
          "chunk_bytes": chunk_bytes, "targets": targets(rows),
          "nvlink_gbps": nvlink_gbps, "domain_size": DOMAIN_SIZE,
          "shape": list(shape), "dtype": np.dtype(dtype).name, "iters": iters,
          "memcpy": memcpy, "results": rows}


def _add_ratios(rows: list[dict]) -> None:
  """flat / hierarchical and gather_bcast / hierarchical, measured (medians and fastest
  runs) and estimated."""
  by = {(r["case"], r["route"]): r for r in rows}
  for r in rows:
    hier = by.get((r["case"], "hierarchical"))
    if hier is None:
      continue
    r["estimate_over_hier"] = r["estimate_ms"] / hier["estimate_ms"]
    if r["status"] == "ok" and hier["status"] == "ok":
      r["measured_over_hier"] = r["median_ms"] / hier["median_ms"]
      r["min_over_hier"] = r["min_ms"] / hier["min_ms"]


def targets(rows: list[dict]) -> dict:
  """Whether the issue's targets are met: every case's estimate within
  ESTIMATE_TOLERANCE of its fastest run (medians are the machine's as much as the
  transport's on a shared 2-core host), and flat / hierarchical (fastest runs) at
  least FLAT_OVER_HIER x r_d for r_d = 2, 3. Reported, never asserted."""
  ok = [r for r in rows if r["status"] == "ok"]
  flat = [r for r in ok
          if r["route"] == "flat" and r["r_d"] in (2, 3) and "min_over_hier" in r]
  ratios = {r["case"]: r["min_over_hier"] for r in flat}
  return {
      "estimate_within_tolerance": bool(ok) and len(ok) == len(rows) and all(
          r["estimate_within_tolerance"] for r in ok),
      "estimate_misses": [f"{r['case']}/{r['route']}" for r in ok
                          if not r["estimate_within_tolerance"]],
      "flat_over_hier": ratios,
      "flat_over_hier_met": bool(flat) and all(
          r["min_over_hier"] >= FLAT_OVER_HIER * r["r_d"] for r in flat),
  }


def markdown(doc: dict) -> str:
  """The table of docs/benchmarks.md's "Figure 4, measured on the emulator"."""
  chunk = doc.get("chunk_bytes")
  chunking = ("chunks chosen per plan (default arguments)" if chunk is None else
              f"chunks of {chunk / 2**20:.3g} MiB")
  lines = [
      f"NIC {doc['nic_gbps']:g} GB/s per device and direction (emulated), intra-domain "
      f"copies at memory speed (estimate uses {doc['nvlink_gbps']:.3g} GB/s), domains of "
      f"{doc['domain_size']}; tensor {doc['dtype']}{doc['shape']} "
      f"({doc['results'][0]['payload_bytes'] / 2**20:.4g} MiB), {chunking}; "
      f"{doc['iters']} runs.",
      "",
      "| case | r_d | route | chunk | steps | measured ms (median) | min ms | estimate ms | "
      "steps' bytes ms | aggregate ms | min / estimate | median / estimate | "
      "route / hier (min) | route / hier (estimate) |",
      "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
  ]
  for r in doc["results"]:
    head = (f"| {r['case']} | {r['r_d']} | {r['route']} | "
            f"{_fmt_chunk(r.get('chunk_bytes'))} | {r.get('steps', '')} | ")
    if r["status"] != "ok":
      lines.append(head + f"failed: {r['reason'][:80]} | | {r['estimate_ms']:.4g} | "
                   f"{r.get('step_estimate_ms', float('nan')):.4g} | "
                   f"{r.get('route_estimate_ms', float('nan')):.4g} | | | | |")
      continue
    lines.append(
        head + f"{r['median_ms']:.4g} | {r['min_ms']:.4g} | {r['estimate_ms']:.4g} | "
        f"{r.get('step_estimate_ms', float('nan')):.4g} | "
        f"{r.get('route_estimate_ms', float('nan')):.4g} | "
        f"{r['min_ms'] / r['estimate_ms']:.3f} | {r['measured_over_estimate']:.3f} | "
        f"{r.get('min_over_hier', float('nan')):.2f} | "
        f"{r.get('estimate_over_hier', float('nan')):.2f} |")
  t = doc.get("targets")
  if t:
    lines += ["", f"Targets: estimate within {ESTIMATE_TOLERANCE:.0%} of the fastest run "
              f"in every case: {'met' if t['estimate_within_tolerance'] else 'NOT met'}"
              + (f" (misses: {', '.join(t['estimate_misses'])})" if t["estimate_misses"]
                 else "")
              + f"; flat / hierarchical >= {FLAT_OVER_HIER} x r_d (fastest runs): "
              + ", ".join(f"{c} {v:.2f}" for c, v in t["flat_over_hier"].items())
              + f": {'met' if t['flat_over_hier_met'] else 'NOT met'}."]
  return "\n".join(lines) + "\n"


def _fmt_chunk(n) -> str:
  if not n:
    return ""
  return f"{n / 2**20:.3g} MiB" if n >= 1 << 20 else f"{n / 2**10:.3g} KiB"


def plot(doc: dict, path: str) -> None:
  """Fig. 4's style: latency against r_d, measured markers + solid lines per route,
  the planner's estimate dashed, the hierarchical speedup over flat annotated."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  rows = doc["results"]
  colors = {"hierarchical": "tab:green", "flat": "tab:blue", "gather_bcast": "tab:red"}
  labels = {"hierarchical": "Hierarchical", "flat": "Flat direct sends",
            "gather_bcast": "Gather + bcast"}
  fig, ax = plt.subplots(figsize=(7.5, 5.6))
  for route in ROUTES:
    rs = sorted((r for r in rows if r["route"] == route), key=lambda r: r["r_d"])
    xs = [r["r_d"] for r in rs]
    ax.plot(xs, [r["estimate_ms"] for r in rs], "--", color=colors[route], alpha=0.7,
            label=f"{labels[route]} (estimate)")
    ok = [r for r in rs if r["status"] == "ok"]
    ax.plot([r["r_d"] for r in ok], [r["median_ms"] for r in ok], "-o",
            color=colors[route], label=f"{labels[route]} (measured)")
  for r in rows:
    if r["route"] == "flat" and r["status"] == "ok" and "measured_over_hier" in r:
      ax.annotate(f"{r['measured_over_hier']:.2f}x", (r["r_d"], r["median_ms"]),
                  textcoords="offset points", xytext=(6, 4), fontsize=8,
                  color=colors["flat"])
  ax.set_xlabel("destination replicas r_d (one per domain)")
  ax.set_ylabel("transfer time, ms")
  ax.set_xticks(sorted({r["r_d"] for r in rows}))
  ax.set_title(f"Figure 4 in miniature: 2 sources -> TP2 x DP r_d, emulated NIC "
               f"{doc['nic_gbps']:g} GB/s\n(8 CPU devices, domains of 2; r_d = 4: "
               "generator replica 0 shares the sources' domain)", fontsize=9)
  ax.grid(True, alpha=0.3)
  ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.13))
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def write(doc: dict, out_dir: str, plots: bool = True) -> list[str]:
  """Writes fig4.json, fig4.md and (if matplotlib is there) fig4.png; returns paths."""
  os.makedirs(out_dir, exist_ok=True)
  written = []
  path = os.path.join(out_dir, "fig4.json")
  doc = dict(doc, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
  with open(path, "w") as f:
    json.dump(doc, f, indent=1)
  written.append(path)
  path = os.path.join(out_dir, "fig4.md")
  with open(path, "w") as f:
    f.write(markdown(doc))
  written.append(path)
  if plots:
    try:
      path = os.path.join(out_dir, "fig4.png")
      plot(doc, path)
      written.append(path)
    except ImportError:
      pass
  return written


def main(jax, out_dir: str, size_bytes: int, iters: int, warmup: int,
         print_fn: Callable[[str], Any] = print, plots: bool = True,
         chunk_bytes: int | None = None) -> int:
  """The `--suite fig4` entry point: runs, prints rows and the table, writes files.
  Returns 0 when every case ran and validated, else 1."""
  def on_row(r: dict) -> None:
    if r["status"] == "ok":
      print_fn(f"  fig4/{r['case']} {r['route']}: {r['median_ms']:.4g} ms, min "
               f"{r['min_ms']:.4g} ms (estimate {r['estimate_ms']:.4g} ms, min x"
               f"{r['min_over_estimate']:.3f}; chunks of {_fmt_chunk(r['chunk_bytes'])}, "
               f"{r['steps']} steps)")
    else:
      print_fn(f"  fig4/{r['case']} {r['route']}: failed: {r['reason']}")

  doc = run(jax, size_bytes, iters, warmup, on_row=on_row, chunk_bytes=chunk_bytes)
  written = write(doc, out_dir, plots)
  print_fn(markdown(doc))
  print_fn("wrote " + ", ".join(written))
  return 0 if all(r["status"] == "ok" for r in doc["results"]) else 1


if __name__ == "__main__":
  import argparse

  from jax_m2n.bench import timing
  parser = argparse.ArgumentParser(description="The fig4 suite with a fixed chunk size "
                                   "(python -m jax_m2n.bench --suite fig4 runs it at "
                                   "default arguments).")
  parser.add_argument("--chunk_mib", type=float, default=None,
                      help="fixed chunk size, MiB (default: chosen per plan)")
  parser.add_argument("--size_mib", type=float, default=DEFAULT_SIZE_MIB)
  timing.add_loop_flags(parser, iters=10, warmup=3)
  parser.add_argument("--out_dir", default="/tmp/jax_m2n_fig4")
  args = parser.parse_args()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax as _jax
  _jax.config.update("jax_num_cpu_devices", 8)
  chunk = None if args.chunk_mib is None else int(args.chunk_mib * 2**20)
  raise SystemExit(main(_jax, args.out_dir, int(args.size_mib * 2**20), args.iters,
                        args.warmup, chunk_bytes=chunk))
