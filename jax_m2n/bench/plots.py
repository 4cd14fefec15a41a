"""Plots (PNG, matplotlib Agg): time and effective bandwidth by case and engine.

Owns the figures of a run: per data-movement suite, mean time (log scale, min-max as error
bars) and effective bandwidth (payload / mean) by case, one bar per engine, with the
planner's data-movement bound drawn as a line over each case; for the planner suite, cold
and cached planning time against the targets; with `--docs`, the figures of
docs/benchmarks.md (docs_figures.py). Reads result records only.
"""

from __future__ import annotations

import os
from typing import Sequence


def _pyplot():
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt


def _engines_in(rows: Sequence[dict]) -> list[str]:
  return list(dict.fromkeys(r["engine"] for r in rows))  # in order of appearance


def suite_figure(rows: Sequence[dict], suite: str, path: str, subtitle: str = "") -> bool:
  """Time and bandwidth bars of one suite; False when it has nothing to draw."""
  rows = [r for r in rows if r.get("kind") == "move"]
  ok = [r for r in rows if r["suite"] == suite and r["status"] == "ok"]
  if not ok:
    return False
  plt = _pyplot()
  cases = []
  for r in rows:
    if r["suite"] == suite and r["case"] not in cases and r["status"] != "skipped":
      cases.append(r["case"])
  engines = _engines_in(ok)
  width = 0.8 / max(1, len(engines))
  colors = plt.get_cmap("tab10")
  fig, (ax_t, ax_b) = plt.subplots(2, 1, figsize=(max(9, 1.6 * len(cases) + 5), 9),
                                   sharex=True)
  for k, eng in enumerate(engines):
    xs, ts, lo, hi, bw = [], [], [], [], []
    for i, case in enumerate(cases):
      r = next((r for r in ok if r["case"] == case and r["engine"] == eng), None)
      if r is None:
        continue
      xs.append(i - 0.4 + width * (k + 0.5))
      ts.append(r["mean_ms"])
      lo.append(r["mean_ms"] - r["min_ms"])
      hi.append(r["max_ms"] - r["mean_ms"])
      bw.append(r["gbps"])
    ax_t.bar(xs, ts, width, yerr=[lo, hi], label=eng, color=colors(k % 10), capsize=2)
    ax_b.bar(xs, bw, width, label=eng, color=colors(k % 10))
  bound_label = "data-movement bound"
  for i, case in enumerate(cases):
    r = next((r for r in rows if r["suite"] == suite and r["case"] == case
              and r.get("bound_ms")), None)
    if r is None:
      continue
    ax_t.hlines(r["bound_ms"], i - 0.45, i + 0.45, colors="black", linewidth=2,
                label=bound_label)
    ax_b.hlines(r["payload_bytes"] / (r["bound_ms"] / 1e3) / 1e9, i - 0.45, i + 0.45,
                colors="black", linewidth=2, label=bound_label)
    bound_label = None
  ax_t.set_yscale("log")
  ax_t.set_ylabel("mean time per call (ms, log)")
  ax_t.set_title(f"{suite}: time per reshard {subtitle}".strip())
  ax_t.grid(axis="y", which="both", alpha=0.3)
  ax_t.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
  ax_b.set_yscale("log")
  ax_b.set_ylabel("effective bandwidth (GB/s = payload / time)")
  ax_b.set_title(f"{suite}: effective bandwidth (higher is better)")
  ax_b.grid(axis="y", which="both", alpha=0.3)
  ax_b.set_xticks(range(len(cases)))
  ax_b.set_xticklabels(cases, rotation=20, ha="right", fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return True


def planner_figure(rows: Sequence[dict], path: str) -> bool:
  ok = [r for r in rows if r.get("kind") == "planner" and r["status"] == "ok"
        and r["suite"] == "planner"]
  if not ok:
    return False
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(8, 4))
  names = [f"{r['case']}\n{r['engine']}" for r in ok]
  ax.barh(names, [r["mean_ms"] for r in ok], color="tab:blue", label="mean")
  for i, r in enumerate(ok):
    if r.get("target_ms"):
      ax.vlines(r["target_ms"], i - 0.4, i + 0.4, colors="red", linewidth=2,
                label="target" if i == 0 or not any(
                    o.get("target_ms") for o in ok[:i]) else None)
  ax.set_xscale("log")
  ax.set_xlabel("ms (log)")
  ax.set_title("planner: planning cost")
  ax.legend(fontsize=8)
  ax.tick_params(axis="y", labelsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return True


def write_all(rows: Sequence[dict], out_dir: str, subtitle: str = "") -> list[str]:
  """Every figure of a run into out_dir; returns the paths written."""
  os.makedirs(out_dir, exist_ok=True)
  written = []
  suites = []
  for r in rows:
    if r["suite"] not in suites:
      suites.append(r["suite"])
  for suite in suites:
    path = os.path.join(out_dir, f"{suite}.png")
    if suite == "planner":
      if planner_figure(rows, path):
        written.append(path)
    elif suite_figure(rows, suite, path, subtitle):
      written.append(path)
  return written


def main(argv: list[str]) -> int:
  """`python -m jax_m2n.bench.plots RESULTS.json [OUT_DIR]`: (re)draw a run's plots, e.g.
  on a machine with matplotlib, from the JSON of a GPU run made without it.
  `python -m jax_m2n.bench.plots --docs [OUT_DIR]`, in a checkout: the figures of
  docs/benchmarks.md from docs/bench_results (docs_figures.py) into docs/figures."""
  import json
  import sys
  if len(argv) > 1 and argv[1] == "--docs":
    from jax_m2n.bench import docs_figures
    return docs_figures.main(argv[2:])
  if len(argv) not in (2, 3):
    print(main.__doc__, file=sys.stderr)
    return 2
  with open(argv[1]) as f:
    doc = json.load(f)
  if doc.get("schema") != 1:
    print(f"plots: {argv[1]} must be a jax_m2n.bench results.json with schema 1; got "
          f"schema {doc.get('schema')!r}.", file=sys.stderr)
    return 2
  out_dir = argv[2] if len(argv) == 3 else os.path.dirname(os.path.abspath(argv[1]))
  env = doc.get("environment", {})
  for path in write_all(doc["results"], out_dir,
                        f"({env.get('device_count')} x {env.get('device_kind')})"):
    print(path)
  return 0


if __name__ == "__main__":
  import sys
  sys.exit(main(sys.argv))
