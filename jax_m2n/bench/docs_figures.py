"""The figures of docs/benchmarks.md, drawn from the JSON checked in under docs/bench_results.

Owns FIGURES (each figure's file name, the JSON files it reads, what it shows) and one
drawing function per figure; `python -m jax_m2n.bench.plots --docs [OUT_DIR]` (default:
this checkout's docs/figures) draws them all. A figure whose JSON is absent is skipped
with a line saying so, never an error. Reads result files only: measures nothing.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Callable, Sequence

# The checkout's docs/ (this file is jax_m2n/bench/docs_figures.py of the repository).
_DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "docs")
RESULTS_DIR = os.path.join(_DOCS, "bench_results")
OUT_DIR = os.path.join(_DOCS, "figures")

# One colour per thing compared, the same in every figure.
COLORS = {
    "jax_m2n": "tab:green", "jax_m2n in jit": "tab:olive", "device_put": "tab:blue",
    "XLA in jit": "tab:orange", "numpy copy": "tab:gray", "torch": "tab:purple",
    "bound": "black", "Ray object store": "tab:purple", "transfer server": "tab:red",
}


def _pyplot():
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt


def _load(results_dir: str, name: str) -> dict:
  with open(os.path.join(results_dir, name)) as f:
    return json.load(f)


def _commit(doc: dict, fallback: str) -> str:
  env = doc.get("environment") or {}
  commit = str(env.get("git_commit") or "")
  return commit[:7] if commit and "unknown" not in commit and commit != "HEAD" else fallback


def _fmt(v: float) -> str:
  return f"{v:.0f}" if v >= 100 else f"{v:.3g}"


def _log_x(ax) -> None:
  """A log x axis labelled at the decades only, with room right of the longest bar."""
  from matplotlib.ticker import NullFormatter
  ax.set_xscale("log")
  ax.xaxis.set_minor_formatter(NullFormatter())
  lo, hi = ax.get_xlim()
  ax.set_xlim(lo, hi * 2.5)


def _legend_below(ax, ncol: int = 3) -> None:
  ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=ncol,
            frameon=False)


def _save(fig, path: str) -> None:
  fig.tight_layout()
  fig.savefig(path, dpi=110, bbox_inches="tight")
  _pyplot().close(fig)


def _grouped_barh(ax, groups: Sequence[str], series: dict[str, list], xlabel: str,
                  bound: Sequence | None = None, colors: Sequence[str] = ()) -> None:
  """Horizontal bars on a log axis: one group per label (top to bottom), one bar per
  series key (None = not measured), the bound as a black tick across each group."""
  n = max(1, len(series))
  h = 0.8 / n
  for k, (name, vals) in enumerate(series.items()):
    ys = [i - 0.4 + h * (k + 0.5) for i, v in enumerate(vals) if v is not None]
    xs = [v for v in vals if v is not None]
    color = colors[k] if k < len(colors) else COLORS.get(name.split(" (")[0])
    ax.barh(ys, xs, h, label=name, color=color)
    for y, x in zip(ys, xs):
      ax.annotate(_fmt(x), (x, y), xytext=(3, 0), textcoords="offset points",
                  va="center", fontsize=7)
  if bound is not None:
    label = "data-movement bound"
    for i, b in enumerate(bound):
      if b:
        ax.vlines(b, i - 0.45, i + 0.45, colors="black", linewidth=2, label=label)
        label = None
  ax.set_yticks(range(len(groups)))
  ax.set_yticklabels(groups, fontsize=8)
  ax.invert_yaxis()
  _log_x(ax)
  ax.set_xlabel(xlabel)
  ax.grid(axis="x", which="both", alpha=0.3)
  _legend_below(ax, ncol=min(3, n + (bound is not None)))


def _bench_rows(doc: dict) -> list[dict]:
  return [r for r in doc["results"] if r.get("kind") == "move" and r["status"] == "ok"]


def _injob(doc: dict, engines: dict[str, str], title: str, path: str) -> None:
  rows = _bench_rows(doc)
  cases = list(dict.fromkeys(f"{r['suite']}/{r['case']}" for r in rows
                             if r["payload_bytes"] >= 1 << 20))
  def get(case, eng):
    r = next((r for r in rows if f"{r['suite']}/{r['case']}" == case
              and r["engine"] == eng), None)
    return r
  series = {label: [(get(c, e) or {}).get("median_ms") for c in cases]
            for e, label in engines.items()}
  series = {k: v for k, v in series.items() if any(x is not None for x in v)}
  bound = [next((r["bound_ms"] for r in rows if f"{r['suite']}/{r['case']}" == c
                 and r.get("bound_ms")), None) for c in cases]
  mib = {c: next(r["payload_bytes"] for r in rows if f"{r['suite']}/{r['case']}" == c)
         / 2**20 for c in cases}
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(9, 0.2 * len(cases) * (len(series) + 1) + 1.6))
  _grouped_barh(ax, [f"{c} ({mib[c]:.0f} MiB)" for c in cases], series,
                "median time of 10 calls (ms, log scale; shorter is better)", bound)
  ax.set_title(title, fontsize=9)
  _save(fig, path)


def injob_cpu(results_dir: str, path: str, src: Sequence[str]) -> None:
  doc = _load(results_dir, src[0])
  env = doc["environment"]
  _injob(doc, {"m2n_hierarchical": "jax_m2n", "device_put": "device_put",
               "numpy_copy": "numpy copy (same bytes)"},
         f"In-job reshard on CPU: {env['device_count']} host devices on {env['cpu_count']} "
         f"shared cores (load {env['loadavg_start'][0]:.0f}), "
         f"{doc['settings']['dtype']}; commit {_commit(doc, '?')}, {env['date_utc'][:10]}\n"
         f"`python -m jax_m2n.bench --suite refit,colocated --engines "
         f"m2n_hierarchical,device_put,numpy_copy`", path)


def injob_gpu(results_dir: str, path: str, src: Sequence[str]) -> None:
  doc = _load(results_dir, src[0])
  env = doc["environment"]
  _injob(doc, {"m2n_hierarchical": "jax_m2n", "m2n_jit_hierarchical": "jax_m2n in jit",
               "device_put": "device_put", "jit_identity": "XLA in jit",
               "torch_gather_bcast": "torch (copy_ / collectives)"},
         f"In-job reshard on {env['device_count']} x {env['device_kind']} (NVLink), "
         f"bfloat16; commit 0805d53, {env['date_utc'][:10]}\nbound: 391 GB/s per GPU "
         f"and direction; `python -m jax_m2n.bench --suite refit,colocated,model`", path)


def _by_size(docs: Sequence[dict], pairs: Sequence[tuple[str, str]]) -> dict:
  """{engine: [(MiB, median ms)]} and the bound over the runs' cases named in pairs
  ((small case, sized case): the 4.5 KiB case stands for the same move at its size; a
  size measured in several runs: the median of their medians)."""
  import statistics
  points: dict[tuple[str, float], list] = {}
  for doc in docs:
    for r in _bench_rows(doc):
      if f"{r['suite']}/{r['case']}" in {c for pair in pairs for c in pair}:
        mib = r["payload_bytes"] / 2**20
        points.setdefault((r["engine"], mib), []).append(r["median_ms"])
        points.setdefault(("bound", mib), []).append(r["bound_ms"])
  out: dict[str, list] = {}
  for (eng, mib), ms in sorted(points.items(), key=lambda kv: kv[0][1]):
    out.setdefault(eng, []).append((mib, statistics.median(ms)))  # a size in several runs
  return out


def injob_by_size(results_dir: str, path: str, src: Sequence[str]) -> None:
  """Median time against size, CPU (the runs of src but the last) and 2 x H200 (the
  last): where the fixed cost ends and the bytes begin."""
  plt = _pyplot()
  cpu = [_load(results_dir, name) for name in src[:-1]]
  gpu = _load(results_dir, src[-1])
  panels = [(cpu, [("refit/tiny_1to1", "refit/1to1_copy")], "CPU: device 0 -> 1"),
            (cpu, [("refit/tiny_2to2_replicate", "refit/2to2_replicate")],
             "CPU: 2 devices P(x,None) -> 2 others P()"),
            ([gpu], [("refit/tiny_1to1", "refit/1to1_copy")], "2 x H200: GPU 0 -> 1")]
  styles = {"m2n_hierarchical": ("jax_m2n", "tab:green", "-o"),
            "device_put": ("device_put", "tab:blue", "-s"),
            "numpy_copy": ("numpy copy (same bytes)", "tab:gray", "-^"),
            "torch_gather_bcast": ("torch copy_", "tab:purple", "-v"),
            "bound": ("data-movement bound", "black", ":")}
  fig, axes = plt.subplots(1, 3, figsize=(13, 4.6))
  for ax, (docs, pairs, title) in zip(axes, panels):
    for eng, pts in _by_size(docs, pairs).items():
      if eng not in styles:
        continue
      label, color, style = styles[eng]
      ax.plot([p[0] for p in pts], [p[1] for p in pts], style, color=color, label=label,
              ms=4)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("MiB moved (log)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
  axes[0].set_ylabel("median ms per call (log; lower is better)")
  handles, labels = [], []
  for ax in axes:
    for h, l in zip(*ax.get_legend_handles_labels()):
      if l not in labels:
        handles.append(h)
        labels.append(l)
  fig.legend(handles, labels, fontsize=8, loc="lower center", ncol=5, frameon=False,
             bbox_to_anchor=(0.5, -0.06))
  env = cpu[0]["environment"]
  commits = ", ".join(dict.fromkeys(_commit(doc, "?") for doc in cpu))
  loads = [doc["environment"]["loadavg_start"][0] for doc in cpu]
  fig.suptitle(f"In-job reshard by size. CPU: 8 host devices, 2 shared cores (load "
               f"{min(loads):.0f}-{max(loads):.0f}), commits {commits} (the same code), "
               f"{env['date_utc'][:10]}; 2 x H200: commit 0805d53, 2026-11-29\n`python -m "
               "jax_m2n.bench --suite refit,colocated --size_mib N`", fontsize=10)
  _save(fig, path)


def multiprocess_cpu(results_dir: str, path: str, src: Sequence[str]) -> None:
  """reshard / the raw transfer of the same bytes, by size, per case."""
  doc = _load(results_dir, src[0])
  rows = [r for r in doc["engine"] if r["ok"]]
  sizes = sorted({r["size_mib"] for r in rows})
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(8, 4.4))
  for k, (case, color, what) in enumerate((
      ("whole", "tab:green", "whole: P(), 1 device -> 1"),
      ("sharded", "tab:olive", "sharded: P('x'), 2 devices -> 2"))):
    xs, ys, notes = [], [], []
    for i, size in enumerate(sizes):
      r = next((r for r in rows if r["case"] == case and r["size_mib"] == size), None)
      if r is not None:
        xs.append(i - 0.2 + 0.4 * k)
        ys.append(r["ratio"])
        notes.append(f"{_fmt(r['m2n_ms'])} /\n{_fmt(r['raw_ms'])} ms")
    ax.bar(xs, ys, 0.4, color=color, label=what)
    for x, y, note in zip(xs, ys, notes):
      ax.annotate(note, (x, y), xytext=(0, 3), textcoords="offset points", ha="center",
                  fontsize=7)
  ax.axhline(1.0, color="black", linewidth=0.8, label="as fast as the raw transfer")
  ax.set_xticks(range(len(sizes)))
  ax.set_xticklabels([f"{s:g} MiB" for s in sizes])
  ax.set_ylim(0, 1.6)
  ax.set_ylabel("reshard / the raw transfer (lower is better)")
  ax.grid(axis="y", alpha=0.3)
  ax.legend(fontsize=7, loc="upper right")
  ax.set_title("One job across 2 processes (jax.distributed, 2 CPU devices each), "
               "loopback, 16 cores, 2026-12-03:\njax_m2n.reshard against the transfer "
               "server's raw pull of the same arrays (mean ms above each bar);\n"
               "`python -m jax_m2n.bench.multiprocess_cpu`", fontsize=9)
  _save(fig, path)


def fig4_emulated(results_dir: str, path: str, src: Sequence[str]) -> None:
  """fig4.plot's figure, drawn on the fastest of each row's runs (the comparison on a
  loaded machine: the emulated link sets the floor, load only adds; medians: the table)."""
  doc = _load(results_dir, src[0])
  rows = doc["results"]
  colors = {"hierarchical": "tab:green", "flat": "tab:blue", "gather_bcast": "tab:red"}
  labels = {"hierarchical": "hierarchical", "flat": "flat direct sends",
            "gather_bcast": "gather + broadcast"}
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(8.5, 5.5))
  for route, color in colors.items():
    rs = sorted((r for r in rows if r["route"] == route and r["status"] == "ok"),
                key=lambda r: r["r_d"])
    xs = [r["r_d"] for r in rs]
    ax.plot(xs, [r["min_ms"] for r in rs], "-o", color=color,
            label=f"{labels[route]}, fastest of {doc.get('iters', 10)} runs")
    ax.plot(xs, [r["estimate_ms"] for r in rs], "--", color=color, alpha=0.6,
            label=f"{labels[route]}, the planner's estimate")
    if route == "flat":
      hier = {r["r_d"]: r["min_ms"] for r in rows if r["route"] == "hierarchical"
              and r["status"] == "ok"}
      for r in rs:
        if r["r_d"] in hier and r["r_d"] > 1:
          ax.annotate(f"{r['min_ms'] / hier[r['r_d']]:.2f}x hierarchical",
                      (r["r_d"], r["min_ms"]), xytext=(6, -12), textcoords="offset points",
                      fontsize=7, color=color)
  ax.set_xticks(sorted({r["r_d"] for r in rows}))
  ax.set_xticklabels([str(r) if r < 4 else "4 (one replica in\nthe sources' domain)"
                      for r in sorted({r["r_d"] for r in rows})])
  ax.set_xlabel("generator replicas r_d (TP2 each, one per NVLink domain)")
  ax.set_ylabel("ms per reshard of 128 MiB float32 (lower is better)")
  top = max(max(r["min_ms"], r["estimate_ms"]) for r in rows if r["status"] == "ok")
  ax.set_ylim(0, 1.45 * top)
  ax.grid(True, alpha=0.3)
  ax.legend(fontsize=7, loc="upper left", ncol=2)
  ax.set_title(f"The paper's Figure 4 on the emulated network: 2 source devices -> TP2 x "
               f"DP r_d,\nNIC {doc['nic_gbps']:g} GB/s per device, 8 CPU devices in domains "
               f"of 2, the 2-core machine (shared), commit {src[0].rsplit('_', 1)[-1][:-5]}, "
               f"{doc.get('date', '')[:10]}\n`python -m jax_m2n.bench --suite fig4`", fontsize=9)
  _save(fig, path)


def _jobs_rows(doc: dict, part: str) -> list[dict]:
  return doc["tables"][part]["rows"]


def jobs_throughput(results_dir: str, path: str, src: Sequence[str]) -> None:
  """256 MiB float32 pulls by path and transport against one copy, CPU and one GPU."""
  plt = _pyplot()
  fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
  kinds = [("copy", "memcpy_fresh", "one copy (numpy, fresh memory)", "tab:gray"),
           ("copy", "xla_copy", "one copy (XLA / device_put)", "tab:blue"),
           ("pull", "local/net", "pull, local path (same host)", "tab:green"),
           ("pull", "network/net", "pull, network path, net (ours)", "tab:olive"),
           ("pull", "network/net+curve", "pull, network path, net + CurveZMQ", "y"),
           ("pull", "network/transfer_server", "pull, network path, JAX transfer server",
            "tab:red"),
           ("raw", "raw/net", "raw fetch alone, net", "tab:olive"),
           ("raw", "raw/transfer_server", "raw fetch alone, transfer server",
            "tab:red")]
  def find(rows, tree, kind, spec):
    for r in rows:
      if r["tree"] != tree or r["dtype"] != "float32" or r["kind"] != kind:
        continue
      key = r["spec"] if kind == "copy" else f"{r['path'][0]}/{r['spec']}"
      if key == spec:
        return r["median_ms"]
    return None
  cpu = _load(results_dir, src[0])
  # GPU: the copy and local rows of the newer run, the network and raw rows of the other.
  gpu_rows = [r for r in _jobs_rows(_load(results_dir, src[1]), "throughput")
              if r["kind"] == "copy" or r["path"] == ["local"]]
  gpu_rows += [r for r in _jobs_rows(_load(results_dir, src[2]), "throughput")
               if r["kind"] != "copy" and r["path"] != ["local"]]
  panels = [(axes[0], _jobs_rows(cpu, "throughput"), "256MiB",
             f"CPU: 4 + 4 host devices, 2 shared cores, 127.0.0.1\ncommit "
             f"{_commit(cpu, '?')}, {cpu['environment']['date_utc'][:10]}"),
            (axes[1], gpu_rows, "1024MiB",
             "GPU: two programs sharing 1 x H200, 127.0.0.1\nlocal rows e4e1f0c, "
             "network rows 679c69b, 2026-12-05")]
  for ax, rows, tree, title in panels:
    labels, vals, cols = [], [], []
    for kind, spec, label, color in kinds:
      v = find(rows, tree, kind, spec)
      if v is not None:
        labels.append(label)
        vals.append(v)
        cols.append(color)
    ax.barh(range(len(vals)), vals, color=cols)
    for i, v in enumerate(vals):
      ax.annotate(f"{_fmt(v)} ms", (v, i), xytext=(3, 0), textcoords="offset points",
                  va="center", fontsize=7)
    ax.set_yticks(range(len(vals)))
    ax.set_yticklabels(labels, fontsize=8)
    ax.invert_yaxis()
    _log_x(ax)
    ax.set_xlabel(f"median ms per pull of {tree[:-3]} MiB float32 (log; shorter is better)")
    ax.set_title(title, fontsize=9)
    ax.grid(axis="x", which="both", alpha=0.3)
  fig.suptitle("Separate jobs: Subscriber.pull by path and transport against one copy "
               "(`python -m jax_m2n.bench.jobs --parts throughput`)", fontsize=10)
  _save(fig, path)


def jobs_latency(results_dir: str, path: str, src: Sequence[str]) -> None:
  doc = _load(results_dir, src[0])
  rows = _jobs_rows(doc, "latency")
  trees = list(dict.fromkeys(r["tree"] for r in rows))
  def med(tree, p):
    return next((r["median_ms"] for r in rows if r["tree"] == tree
                 and r["path"][0] == p), None)
  def size(tree):
    b = next(r["payload_bytes"] for r in rows if r["tree"] == tree)
    leaves = next(r["leaves"] for r in rows if r["tree"] == tree)
    return f"{tree}: {b / 1024:.0f} KiB, {leaves} leaf" + ("" if leaves == 1 else "s")
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(9, 4.2))
  _grouped_barh(ax, [size(t) for t in trees],
                {"local path (same host)": [med(t, "local") for t in trees],
                 "network path (net, 127.0.0.1)": [med(t, "network") for t in trees]},
                "median ms per steady pull (log; shorter is better)",
                colors=["tab:green", "tab:olive"])
  ax.set_title(f"Separate jobs: small pulls on CPU (2 shared cores), commit "
               f"{_commit(doc, '?')}, {doc['environment']['date_utc'][:10]}\n"
               "`python -m jax_m2n.bench.jobs --parts latency`", fontsize=9)
  _save(fig, path)


def jobs_relay(results_dir: str, path: str, src: Sequence[str]) -> None:
  plt = _pyplot()
  fig, (ax_t, ax_e) = plt.subplots(1, 2, figsize=(11, 4.3))
  styles = ["-", "--"]
  for name, style in zip(src, styles):
    doc = _load(results_dir, name)
    commit = name.rsplit("_", 1)[-1].split(".")[0]
    for mode, color in (("direct", COLORS["device_put"]), ("relay", COLORS["jax_m2n"])):
      rs = sorted((r for r in doc["rows"] if r["mode"] == mode), key=lambda r: r["k"])
      ks = [r["k"] for r in rs]
      ax_t.plot(ks, [r["seconds"] for r in rs], style, marker="o", color=color,
                label=f"{mode} ({commit})")
      if style == "-":
        ax_e.plot(ks, [r["egress_bytes"] / 2**20 for r in rs], style, marker="o",
                  color=color, label=mode)
  for ax in (ax_t, ax_e):
    ax.set_xscale("log", base=2)
    ax.set_xticks([1, 2, 4, 8])
    ax.set_xticklabels(["1", "2", "4", "8"])
    ax.set_xlabel("subscriber programs K (one emulated host each)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
  ax_t.set_ylabel("s per 64 MiB version, publish -> last subscriber")
  ax_t.set_title("time to reach every subscriber (1 Gbit/s links)", fontsize=9)
  ax_e.set_ylabel("trainer egress per version (MiB)")
  ax_e.set_title("bytes the trainer sends per version", fontsize=9)
  fig.suptitle("Relays among subscriber jobs: direct pulls against a relay chain, 2-core "
               "machine\n`python -m jax_m2n.bench.relay --ks 1,2,4,8 --iters 3`",
               fontsize=10)
  _save(fig, path)


def delta_by_change(results_dir: str, path: str, src: Sequence[str]) -> None:
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(8, 4.8))
  marks = {"loopback": ("o", "tab:green"), "1gbit": ("s", "tab:blue")}
  labelled = []
  for name in src:
    doc = _load(results_dir, name)
    for run in doc.get("runs", []):
      s = run["summary"]
      m, c = marks.get(run["rate"], ("^", "gray"))
      ax.scatter(100 * s["changed_fraction"], s["wire_ratio"], marker=m, color=c,
                 label=f"RL example, {run['rate']}", zorder=3)
      if run["rate"] == "loopback":
        labelled.append((s["changed_fraction"], s["wire_ratio"], run["lr"]))
    # The learning rate beside each point, alternately below and above (neighbours at
    # 76-85% changed would overlap).
    for k, (frac, ratio, lr) in enumerate(sorted(labelled)):
      ax.annotate(f"lr {lr:g}", (100 * frac, ratio), xytext=(-8, -12 if k % 2 else 8),
                  textcoords="offset points", fontsize=7, ha="right")
    labelled = []
    for run in doc.get("synthetic", []):
      rows = [r for r in run["rows"] if r.get("delta_bytes") and r.get("version", 0) > 1]
      if not rows:
        continue
      ratio = sum(r["full_bytes"] for r in rows) / sum(r["delta_bytes"] for r in rows)
      ax.scatter(100 * run["fraction"], ratio, marker="D", color="tab:orange",
                 label="synthetic 1 GiB, 8 leaves", zorder=3)
  xs = [x / 10 for x in range(10, 1001)]
  ax.plot(xs, [100 / x for x in xs], ":", color="gray", label="1 / changed fraction")
  ax.axhline(1, color="black", linewidth=0.8, label="no saving (full = delta)")
  ax.set_xscale("log")
  ax.set_yscale("log")
  ax.set_xlabel("elements changed per version (%, log)")
  ax.set_ylabel("wire bytes full / delta (log; higher is better)")
  ax.grid(True, which="both", alpha=0.3)
  handles, labels = ax.get_legend_handles_labels()
  seen = dict(zip(labels, handles))
  ax.legend(seen.values(), seen.keys(), fontsize=8)
  ax.set_title("Delta sync: bytes saved by change rate (CPU, 2-core machine)\nRL example "
               "63825e4 (bfloat16 wire), synthetic 16045fc; `python -m jax_m2n.bench.delta`",
               fontsize=9)
  _save(fig, path)


def ray_refit(results_dir: str, path: str, src: Sequence[str]) -> None:
  doc = _load(results_dir, src[0])
  run = doc.get("after_9e98007", doc)
  steps = run["steps"]
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(8, 4.4))
  xs = [s["step"] for s in steps]
  m2n = [s["sync_ms"] + s["publish_ms"] for s in steps]
  if "summary" in run and "first_jax_m2n_ms" in run["summary"]:
    m2n[0] = run["summary"]["first_jax_m2n_ms"]  # the first publish is timed apart
  ax.plot(xs, m2n, "-o", ms=3, color=COLORS["jax_m2n"],
          label="jax_m2n: the pull as the driver waits for it + the publish")
  ax.plot(xs, [s["numpy_ms"] for s in steps], "-s", ms=3, color=COLORS["Ray object store"],
          label="host numpy through Ray's object store")
  ax.set_yscale("log")
  ax.set_xlabel("RL step")
  ax.set_ylabel("weight sync per step, ms (log; lower is better)")
  ax.grid(True, which="both", alpha=0.3)
  ax.legend(fontsize=8)
  ax.set_title("Against Ray's object store: examples/ray_refit.py, 0.39 MiB policy as "
               "bfloat16, 2 actors x 4 CPU devices,\ncommit 9e98007, 2026-12-05; "
               "`JAX_M2N_EXAMPLE=ray_refit ./scripts/run_example.sh`", fontsize=9)
  _save(fig, path)


def rl_refit(results_dir: str, path: str, src: Sequence[str]) -> None:
  """The refit engines and the RL step, waited for and overlapped, on one H200."""
  import statistics
  plt = _pyplot()
  fig, (ax_e, ax_s) = plt.subplots(1, 2, figsize=(12, 5))
  runs = []
  for name in src:
    doc = _load(results_dir, name)
    cfg = doc["config"]
    to = {"bfloat16": "bf16", "float8_e4m3fn": "fp8"}.get(cfg["generator_dtype"],
                                                         cfg["generator_dtype"])
    runs.append((f"{cfg['layers']} layers, d {cfg['d_model']}: "
                 f"{doc['param_bytes'] / 2**20:.3g} MiB -> {to}\n"
                 f"({name.rsplit('_', 1)[-1][:-5]})", doc))
  # The engines in the examples' order: the fused call, astype + reshard, astype +
  # device_put (the first one's name carries the run's dtype).
  labels = ["jax_m2n.reshard(dtype=...)", "astype + jax_m2n.reshard",
            "astype + jax.device_put"]
  series = {label: [statistics.mean(list(doc["engine_ms"].values())[k]) for _, doc in runs]
            for k, label in enumerate(labels)}
  _grouped_barh(ax_e, [label for label, _ in runs], series,
                "refit, mean ms of 10 waited-for calls (log; shorter is better)",
                colors=["tab:green", "tab:olive", "tab:blue"])
  ax_e.set_title("the refit (trainer float32 -> the generator's dtype)", fontsize=9)
  series = {"waited for": [statistics.median(doc["step_ms"]["waited"]) for _, doc in runs],
            "overlapped": [statistics.median(doc["step_ms"]["overlapped"])
                           for _, doc in runs]}
  h = 0.38
  for k, (label, vals) in enumerate(series.items()):
    ys = [i - 0.2 + h * k for i in range(len(vals))]
    ax_s.barh(ys, vals, h, label=f"refit {label}",
              color=["tab:gray", "tab:green"][k])
    for y, v in zip(ys, vals):
      ax_s.annotate(f"{v:.3g}", (v, y), xytext=(3, 0), textcoords="offset points",
                    va="center", fontsize=7)
  ax_s.set_yticks(range(len(runs)))
  ax_s.set_yticklabels([label for label, _ in runs], fontsize=8)
  ax_s.invert_yaxis()
  _log_x(ax_s)
  ax_s.set_xlabel("RL step, median ms (log; shorter is better)")
  ax_s.grid(axis="x", which="both", alpha=0.3)
  _legend_below(ax_s, ncol=2)
  ax_s.set_title("the whole RL step (train, refit, rollout)", fontsize=9)
  fig.suptitle("The main job's refit on 1 x H200 (trainer and generator share it): "
               "`python -m examples.rl_refit`", fontsize=10)
  _save(fig, path)


@dataclasses.dataclass(frozen=True)
class Figure:
  name: str                   # file under docs/figures
  sources: tuple[str, ...]    # JSON under docs/bench_results, all needed
  draw: Callable[[str, str, Sequence[str]], None]
  shows: str


FIGURES = (
    Figure("injob_cpu.png", ("injob_cpu_20261206_49a45fd.json",), injob_cpu,
           "in-job reshard against device_put, a numpy copy and the bound, CPU"),
    Figure("injob_gpu.png", ("h200x2_run1_0805d53.json",), injob_gpu,
           "in-job reshard against device_put, XLA in jit, torch and the bound, 2 x H200"),
    Figure("injob_by_size.png", ("injob_cpu_20261206_1204a7a_1mib.json",
                                 "injob_cpu_20261206_1204a7a_4mib.json",
                                 "injob_cpu_20261206_1204a7a_16mib.json",
                                 "injob_cpu_20261206_49a45fd.json",
                                 "h200x2_run1_0805d53.json"), injob_by_size,
           "in-job reshard by size against device_put, a copy and the bound, CPU and GPU"),
    Figure("multiprocess_cpu.png", ("multiprocess_cpu_loopback_16core_20261203.json",),
           multiprocess_cpu, "one job across processes: reshard against the raw transfer"),
    Figure("fig4_emulated.png", ("fig4_cpu_20261206_49a45fd.json",), fig4_emulated,
           "the paper's Figure 4 on the emulated network: time against r_d per route"),
    Figure("jobs_throughput.png", ("jobs_cpu_c896311.json",
                                   "jobs_throughput_h200x1_e4e1f0c.json",
                                   "jobs_throughput_h200x1_679c69b.json"), jobs_throughput,
           "separate jobs: local / network / transfer server / raw against one copy"),
    Figure("jobs_latency.png", ("jobs_latency_cpu_f30d35e.json",), jobs_latency,
           "separate jobs: small pulls, local against network path"),
    Figure("jobs_relay.png", ("jobs_relay_cpu_edb6d22.json", "jobs_relay_cpu_c896311.json"),
           jobs_relay, "relays: time to every subscriber and trainer egress by K"),
    Figure("delta_by_change.png", ("delta_cpu_loopback_63825e4.json",
                                   "delta_cpu_1gbit_63825e4.json",
                                   "delta_synthetic_cpu_16045fc.json"), delta_by_change,
           "delta sync: wire bytes full / delta by the fraction changed"),
    Figure("ray_refit.png", ("ray_refit_cpu_9e98007.json",), ray_refit,
           "weight sync per RL step: jax_m2n against Ray's object store"),
    Figure("rl_refit.png", ("rl_refit_h200x1_bf16_d60906d.json",
                            "rl_refit_h200x1_fp8_939fc37.json",
                            "rl_refit_h200x1_large_939fc37.json"), rl_refit,
           "the main job's refit engines and RL step, waited for and overlapped, 1 x H200"),
)


def write_docs(results_dir: str = RESULTS_DIR, out_dir: str = OUT_DIR,
               print_fn: Callable[[str], object] = print) -> tuple[list[str], list[str]]:
  """Draws every figure of FIGURES whose JSON is in results_dir into out_dir; returns
  (paths written, names skipped for absent JSON)."""
  os.makedirs(out_dir, exist_ok=True)
  written, skipped = [], []
  for fig in FIGURES:
    missing = [s for s in fig.sources if not os.path.exists(os.path.join(results_dir, s))]
    if missing:
      print_fn(f"plots: {fig.name} skipped: {', '.join(missing)} not in {results_dir}")
      skipped.append(fig.name)
      continue
    path = os.path.join(out_dir, fig.name)
    fig.draw(results_dir, path, fig.sources)
    print_fn(f"{path}: {fig.shows}")
    written.append(path)
  return written, skipped


def main(argv: Sequence[str]) -> int:
  """`python -m jax_m2n.bench.plots --docs [OUT_DIR]` in a checkout: docs/bench_results
  -> OUT_DIR (default docs/figures)."""
  if len(argv) > 1:
    print(main.__doc__, file=sys.stderr)
    return 2
  write_docs(out_dir=argv[0] if argv else OUT_DIR)
  return 0
