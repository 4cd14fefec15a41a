"""The `fig4` suite: the paper's Figure 4 in miniature, measured on the emulated network.

Owns the cases, the timing loop, the table and the plot of `--suite fig4`: on 8 CPU
devices in domains of 2 with `Topology(emulate_network=True)` (the CPU transport's NIC
emulator, docs/design.md "The emulated network"), a source group of 2 devices in domain 0
sends a [rows, cols] tensor to a TP2 x DP r_d generator spread over r_d domains, by the
routes hierarchical / flat / gather_bcast. Reports measured time, the planner's estimate
for the same bandwidths (`Plan.step_estimate_ms`: the schedule step by step, as the
transport runs it; the aggregate `route_estimate_ms` beside it), measured / estimate,
flat / hierarchical, gather_bcast / hierarchical. Never asserts on timing (the caller
decides what a run means).

Usage:
  python -m jax_m2n.bench --suite fig4 [--size_mib 128] [--iters 10] [--out_dir DIR]
  python -m jax_m2n.bench --suite fig4 --size_mib 0.25   # the CI smoke form
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
# 32 chunks per source: a pipeline of r_d forwarding hops fills in r_d - 1 extra steps.
CHUNK_BYTES = 2 << 20
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


def _shape(nbytes: int, itemsize: int) -> tuple[int, int]:
  cols = 1024
  rows = max(4, (nbytes // (itemsize * cols)) // 4 * 4)
  return rows, cols


def run(jax, size_bytes: int, iters: int, warmup: int, nic_gbps: float = DEFAULT_NIC_GBPS,
        on_row: Callable[[dict], None] | None = None) -> dict:
  """Runs every case and route; returns the result document (schema 1)."""
  import jax_m2n
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
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
    src_mesh = Mesh(np.array([devices[i] for i in case.src_devices]), ("tp",))
    dst_mesh = Mesh(np.array([devices[i] for i in case.dst_devices]).reshape(case.r_d, 2),
                    ("dp", "tp"))
    src = NamedSharding(src_mesh, P("tp", None))
    dst = NamedSharding(dst_mesh, P("tp", None))
    x = jax.device_put(host, src)
    for route in ROUTES:
      plan = jax_m2n.plan(x, dst, route=route, topology=topo, chunk_bytes=CHUNK_BYTES)
      # The planner's estimate of the schedule as the transport runs it (step by step:
      # pipeline fill and drain included), and its aggregate bound (Eqs. 3-9).
      estimate_ms = plan.step_estimate_ms()
      row = {"case": case.name, "title": case.title, "r_d": case.r_d, "route": route,
             "payload_bytes": int(host.nbytes), "estimate_ms": estimate_ms,
             "route_estimate_ms": plan.route_estimate_ms(), "steps": plan.chunks.n_steps,
             "network_bytes": plan.bytes_by_link["network"]}
      try:
        y = jax_m2n.reshard(x, dst, route=route, topology=topo, chunk_bytes=CHUNK_BYTES)
        ok = all(np.array_equal(np.asarray(s.data), host[s.index])
                 for s in y.addressable_shards)
        y.delete()
        if not ok:
          raise AssertionError("result is not bitwise equal to the source")
        times = timing.time_calls(
            lambda: jax_m2n.reshard(x, dst, route=route, topology=topo,
                                    chunk_bytes=CHUNK_BYTES),
            jax.block_until_ready, warmup, iters, release=lambda y: y.delete())
        row.update(status="ok", times_s=times.times_s, **timing.stats_ms(times.times_s))
        row["measured_over_estimate"] = row["median_ms"] / estimate_ms
        row["measured_over_route_estimate"] = row["median_ms"] / row["route_estimate_ms"]
      except Exception as e:  # noqa: BLE001 - reported as a failed row
        row.update(status="failed", reason=f"{type(e).__name__}: {e}"[:2000])
      rows.append(row)
      if on_row is not None:
        on_row(row)
    x.delete()
  _add_ratios(rows)
  return {"schema": SCHEMA, "suite": "fig4", "nic_gbps": nic_gbps,
          "chunk_bytes": CHUNK_BYTES,
          "nvlink_gbps": nvlink_gbps, "domain_size": DOMAIN_SIZE,
          "shape": list(shape), "dtype": np.dtype(dtype).name, "iters": iters,
          "memcpy": memcpy, "results": rows}


def _add_ratios(rows: list[dict]) -> None:
  """flat / hierarchical and gather_bcast / hierarchical, measured and estimated."""
  by = {(r["case"], r["route"]): r for r in rows}
  for r in rows:
    hier = by.get((r["case"], "hierarchical"))
    if hier is None:
      continue
    r["estimate_over_hier"] = r["estimate_ms"] / hier["estimate_ms"]
    if r["status"] == "ok" and hier["status"] == "ok":
      r["measured_over_hier"] = r["median_ms"] / hier["median_ms"]


def markdown(doc: dict) -> str:
  """The table of docs/benchmarks.md's "Figure 4, measured on the emulator"."""
  lines = [
      f"NIC {doc['nic_gbps']:g} GB/s per device and direction (emulated), intra-domain "
      f"copies at memory speed (estimate uses {doc['nvlink_gbps']:.3g} GB/s), domains of "
      f"{doc['domain_size']}; tensor {doc['dtype']}{doc['shape']} "
      f"({doc['results'][0]['payload_bytes'] / 2**20:.4g} MiB, chunks of {doc.get('chunk_bytes', 0) / 2**20:.3g} MiB); median of {doc['iters']}.",
      "",
      "| case | r_d | route | steps | measured ms (median) | min ms | estimate ms (steps) | "
      "aggregate estimate ms | measured / estimate | min / estimate | measured / aggregate | "
      "route / hier (measured) | route / hier (estimate) |",
      "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
  ]
  for r in doc["results"]:
    if r["status"] != "ok":
      lines.append(f"| {r['case']} | {r['r_d']} | {r['route']} | {r.get('steps', '')} | "
                   f"failed: {r['reason'][:80]} | | {r['estimate_ms']:.4g} | "
                   f"{r.get('route_estimate_ms', float('nan')):.4g} | | | | | |")
      continue
    lines.append(
        f"| {r['case']} | {r['r_d']} | {r['route']} | {r.get('steps', '')} | "
        f"{r['median_ms']:.4g} | {r['min_ms']:.4g} | {r['estimate_ms']:.4g} | "
        f"{r.get('route_estimate_ms', float('nan')):.4g} | "
        f"{r['measured_over_estimate']:.3f} | {r['min_ms'] / r['estimate_ms']:.3f} | "
        f"{r.get('measured_over_route_estimate', float('nan')):.3f} | "
        f"{r.get('measured_over_hier', float('nan')):.2f} | "
        f"{r.get('estimate_over_hier', float('nan')):.2f} |")
  return "\n".join(lines) + "\n"


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
         print_fn: Callable[[str], Any] = print, plots: bool = True) -> int:
  """The `--suite fig4` entry point: runs, prints rows and the table, writes files.
  Returns 0 when every case ran and validated, else 1."""
  def on_row(r: dict) -> None:
    if r["status"] == "ok":
      print_fn(f"  fig4/{r['case']} {r['route']}: {r['median_ms']:.4g} ms (estimate "
               f"{r['estimate_ms']:.4g} ms, x{r['measured_over_estimate']:.3f})")
    else:
      print_fn(f"  fig4/{r['case']} {r['route']}: failed: {r['reason']}")

  doc = run(jax, size_bytes, iters, warmup, on_row=on_row)
  written = write(doc, out_dir, plots)
  print_fn(markdown(doc))
  print_fn("wrote " + ", ".join(written))
  return 0 if all(r["status"] == "ok" for r in doc["results"]) else 1
