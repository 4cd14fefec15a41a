"""Reports: the versioned JSON document, the terminal tables (rich) and the markdown.

Owns the output formats of a run: `results.json` (`"schema": 1`, every raw time, the
environment), `results.md` (the tables docs/benchmarks.md quotes), and what the terminal
shows. Derives the CPU requirement table from result records; never measures anything.
"""

from __future__ import annotations

import json
import math
import os
from typing import Callable, Sequence

SCHEMA = 1
MIB = 1 << 20

# The CPU requirement (the CPU issue): on layout-changing eager cases, jax_m2n within 2x
# of copying each destination's bytes with numpy, and faster than jax.device_put.
NUMPY_FACTOR = 2.0
PRODUCT = "m2n_hierarchical"


def _fmt(v, digits: int = 3) -> str:
  if v is None or (isinstance(v, float) and math.isnan(v)):
    return "-"
  if isinstance(v, float):
    if v == 0:
      return "0"
    if abs(v) >= 100:
      return f"{v:.0f}"
    return f"{v:.{digits}g}"
  return str(v)


def _mib(n: int) -> str:
  return f"{n / MIB:.3g}" if n >= MIB // 100 else f"{n / 1024:.3g} KiB"


def cpu_requirement(rows: Sequence[dict]) -> list[dict]:
  """Per eager case with numpy_copy, device_put and jax_m2n results: the two ratios."""
  by_case: dict[tuple[str, str], dict[str, dict]] = {}
  for r in rows:
    if (r.get("status") == "ok" and r.get("kind") == "move"
        and r["suite"] not in ("smoke",)):
      by_case.setdefault((r["suite"], r["case"]), {})[r["engine"]] = r
  out = []
  for (suite, case), engines in by_case.items():
    product, npc, dput = engines.get(PRODUCT), engines.get("numpy_copy"), engines.get(
        "device_put")
    if product is None or npc is None or dput is None:
      continue
    eager = {k: v for k, v in engines.items()
             if k.startswith("m2n_") and not k.startswith("m2n_jit_")}
    best = min(eager.values(), key=lambda r: r["mean_ms"])
    npc4k = engines.get("numpy_copy_4k")
    row = {"suite": suite, "case": case, "payload_bytes": product["payload_bytes"],
           "layout_change": product["layout_change"],
           "m2n_ms": product["mean_ms"], "best_route": best["engine"][4:],
           "best_ms": best["mean_ms"], "numpy_copy_ms": npc["mean_ms"],
           "device_put_ms": dput["mean_ms"],
           "vs_numpy": product["mean_ms"] / npc["mean_ms"],
           "vs_device_put": product["mean_ms"] / dput["mean_ms"],
           "device_put_aliased_calls": dput.get("calls_with_aliased_shards", 0),
           "numpy_copy_4k_ms": npc4k["mean_ms"] if npc4k else None,
           "vs_numpy_4k": product["mean_ms"] / npc4k["mean_ms"] if npc4k else None}
    row["meets_numpy"] = row["vs_numpy"] <= NUMPY_FACTOR
    row["meets_device_put"] = row["vs_device_put"] < 1.0 if row["layout_change"] else None
    out.append(row)
  return out


def document(settings: dict, env: dict, link: dict, rows: Sequence[dict],
             planner: dict | None, torch_info: dict | None) -> dict:
  """The JSON document of a run (schema 1)."""
  counts: dict[str, int] = {}
  for r in rows:
    counts[r["status"]] = counts.get(r["status"], 0) + 1
  return {"schema": SCHEMA, "kind": "jax_m2n.bench", "settings": settings,
          "environment": env, "link": link, "status_counts": counts,
          "results": list(rows), "planner": planner, "torch": torch_info,
          "cpu_requirement": cpu_requirement(rows)}


def write_json(doc: dict, path: str) -> None:
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(doc, f, indent=1, default=str)
  os.replace(tmp, path)


def write_text(text: str, path: str) -> None:
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    f.write(text)
  os.replace(tmp, path)


def write_suite(doc: dict, text: str, out_dir: str, name: str,
                print_fn: Callable[[str], object] | None = None) -> None:
  """A small suite's outputs: `<name>.json` (doc) and `<name>.md` (text) in out_dir;
  the text also through `print_fn` when given."""
  os.makedirs(out_dir, exist_ok=True)
  write_json(doc, os.path.join(out_dir, name + ".json"))
  write_text(text, os.path.join(out_dir, name + ".md"))
  if print_fn is not None:
    print_fn(text)


# ---------------------------------------------------------------------------------------
# Tables (shared by markdown and the terminal)
# ---------------------------------------------------------------------------------------

MOVE_COLUMNS = ("case", "engine", "MiB", "mean ms", "min ms", "median ms", "bound ms",
                "mean/bound", "estimate ms", "GB/s", "first ms", "valid")
PLANNER_COLUMNS = ("what", "mean ms", "min ms", "median ms", "n", "target ms", "meets")
REQUIREMENT_COLUMNS = ("case", "MiB", "m2n ms", "best route (ms)", "numpy_copy ms",
                       "m2n/numpy (<=2)", "numpy_copy_4k ms", "m2n/numpy_4k",
                       "device_put ms", "m2n/device_put (<1)")


def _valid_mark(r: dict) -> str:
  mark = {"ok": "yes", "invalid": "NO (wrong bytes)", "failed": "failed"}.get(
      r["status"], r["status"])
  if r["status"] == "ok" and r.get("calls_with_aliased_shards"):
    calls = 1 + len(r.get("warmup_s", [])) + len(r.get("times_s", []))
    mark += f" (shards aliased in {r['calls_with_aliased_shards']}/{calls} calls)"
  return mark


def move_table(rows: Sequence[dict], suite: str) -> list[list[str]]:
  out = []
  for r in rows:
    if r["suite"] != suite or r["status"] == "skipped" or r.get("kind") != "move":
      continue
    ok = r["status"] == "ok"
    out.append([
        r["case"], r["engine"], _mib(r["payload_bytes"]),
        _fmt(r.get("mean_ms")) if ok else "-", _fmt(r.get("min_ms")) if ok else "-",
        _fmt(r.get("median_ms")) if ok else "-", _fmt(r.get("bound_ms")),
        _fmt(r.get("ratio_to_bound")) if ok else "-", _fmt(r.get("estimate_ms")),
        _fmt(r.get("gbps")) if ok else "-",
        _fmt(r["first_s"] * 1e3) if r.get("first_s") is not None else "-",
        _valid_mark(r)])
  return out


def problems(rows: Sequence[dict], suite: str) -> list[str]:
  """Why rows failed, were invalid or skipped (one line each, skipped grouped)."""
  lines, skipped = [], {}
  for r in rows:
    if r["suite"] != suite:
      continue
    if r["status"] in ("failed", "invalid"):
      lines.append(f"{r['case']} / {r['engine']}: {r['status']}: {r['reason']}")
    elif r["status"] == "skipped":
      skipped.setdefault((r["engine"], r["reason"]), []).append(r["case"])
    elif r.get("calls_with_aliased_shards"):
      lines.append(f"{r['case']} / {r['engine']}: some calls returned replicas sharing one "
                   "buffer (zero-copy on CPU): fewer bytes written than the other engines")
  for (engine, reason), cases in skipped.items():
    lines.append(f"{engine}: skipped ({reason}) on {len(cases)} case(s)")
  return lines


def planner_table(rows: Sequence[dict], suite: str = "planner") -> list[list[str]]:
  out = []
  for r in rows:
    if r["suite"] != suite or r.get("kind") != "planner":
      continue
    if r["status"] != "ok":
      out.append([f"{r['case']} {r['engine']}", "-", "-", "-", "0", "-",
                  f"{r['status']}: {r.get('reason')}"])
      continue
    meets = r.get("meets_target")
    out.append([f"{r['case']} {r['engine']}", _fmt(r["mean_ms"]), _fmt(r["min_ms"]),
                _fmt(r["median_ms"]), str(len(r["times_s"])), _fmt(r.get("target_ms")),
                "-" if meets is None else ("yes" if meets else "NO")])
  return out


def planner_facts(planner: dict) -> list[str]:
  d = planner["details"]
  est = ", ".join(f"{k} {v:.4g} ms" for k, v in d["estimate_ms_sum_stages"].items())
  m = d["model"]
  return [
      f"model: {d['tensors']} tensors, {d['payload_bytes'] / (1 << 30):.1f} GiB, "
      f"{m['layers']} layers; trainer EP{m['ep']} x PP{m['pp']} (one plan per stage) -> "
      f"generator TP{m['tp']} x DP{m['dp']}; Topology(domain_size={m['domain_size']}, "
      f"nic {m['nic_gbps']:g} GB/s, nvlink {m['nvlink_gbps']:g} GB/s)",
      f"transfers (hierarchical, all stages): {d['transfers']}; cached call returned the "
      f"same plans: {d['cache_hit']}",
      f"bound: max over stages {d['sol_ms_max_stage']:.4g} ms, sum over stages "
      f"{d['sol_ms_sum_stages']:.4g} ms; route estimates, sum over stages: {est}",
  ]


def scale_facts(rows: Sequence[dict], suite: str = "planner") -> list[str]:
  """One line per large planning case (rows with `details` of `run_planner_scale`)."""
  out = []
  for r in rows:
    d = r.get("details")
    if r["suite"] != suite or not d or r["engine"] != "plan_cold_fresh_process":
      continue
    out.append(
        f"{r['case']}: {r['title']}; {d['transfers']} transfers (size bound from the "
        f"layouts {d['size_bound_transfers']}, computed in {d['size_check_s']:.3g} s); "
        + (f"planning {d['plan_cpu_s']:.2f} s of CPU; " if "plan_cpu_s" in d else "")
        + f"peak RSS {d['max_rss_bytes'] / 2**30:.2f} GiB, "
        f"{d['rss_bytes_per_transfer']:.0f} B per transfer")
  return out


def requirement_table(req: Sequence[dict]) -> list[list[str]]:
  out = []
  for r in req:
    def mark(ok):
      return "" if ok is None else (" ok" if ok else " MISSED")
    dp = _fmt(r["vs_device_put"]) + (mark(r["meets_device_put"]) if r["layout_change"]
                                      else " (no layout change)")
    out.append([f"{r['suite']}/{r['case']}", _mib(r["payload_bytes"]), _fmt(r["m2n_ms"]),
                f"{r['best_route']} ({_fmt(r['best_ms'])})", _fmt(r["numpy_copy_ms"]),
                _fmt(r["vs_numpy"]) + mark(r["meets_numpy"]), _fmt(r["numpy_copy_4k_ms"]),
                _fmt(r["vs_numpy_4k"]),
                _fmt(r["device_put_ms"]) + (" (aliased)" if r["device_put_aliased_calls"]
                                            else ""), dp])
  return out


def _md_table(columns: Sequence[str], body: Sequence[Sequence[str]]) -> str:
  lines = ["| " + " | ".join(columns) + " |",
           "| " + " | ".join("---" for _ in columns) + " |"]
  lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in body]
  return "\n".join(lines)


def suites_in(rows: Sequence[dict]) -> list[str]:
  return list(dict.fromkeys(r["suite"] for r in rows))  # in order of appearance


def markdown(doc: dict) -> str:
  env, link = doc["environment"], doc["link"]
  rows = doc["results"]
  device = f"{env.get('device_count')} x {env.get('device_kind')} ({env.get('platform')})"
  head = [
      "# jax_m2n benchmark results",
      "",
      f"- command: `{env['command']}`",
      f"- date (UTC): {env['date_utc']}; commit: {env.get('git_commit') or 'unknown'}"
      f"{' (dirty tree)' if env.get('git_dirty') else ''}",
      f"- devices: {device}; CPUs: {env['cpu_count']}; load average at start: "
      f"{', '.join(f'{v:.1f}' for v in env.get('loadavg_start') or [])}",
      f"- jax {env['versions'].get('jax')}, jaxlib {env['versions'].get('jaxlib')}"
      + (f", NCCL {env['nccl_version']}" if env.get("nccl_version") else "")
      + (f", torch {env['versions']['torch']}" if env["versions"].get("torch") else ""),
      f"- method: {doc['settings']['warmup']} warm-ups then {doc['settings']['iters']} "
      "timed calls after one validating call; time = wall clock until every output is "
      "ready (max over devices); bound = the planner's data-movement bound (`sol_ms`) "
      f"with {link['gbps']:.4g} GB/s per device and direction ({link['source']}); "
      "estimate = the planner's cost model of that engine's route; GB/s = payload / mean.",
      "",
  ]
  parts = head
  for suite in suites_in(rows):
    parts.append(f"## {suite}")
    parts.append("")
    moves = move_table(rows, suite)
    if moves:
      titles = []
      for r in rows:
        if (r["suite"] == suite and r.get("kind") == "move"
            and (r["case"], r["title"]) not in titles):
          titles.append((r["case"], r["title"]))
      parts += [f"- `{c}`: {t}" for c, t in titles]
      parts.append("")
      parts.append(_md_table(MOVE_COLUMNS, moves))
      parts.append("")
    plans = planner_table(rows, suite)
    if plans:
      parts.append(_md_table(PLANNER_COLUMNS, plans))
      if suite == "planner" and doc.get("planner"):
        parts.append("")
        parts += [f"- {line}" for line in planner_facts(doc["planner"])]
      parts += [f"- {line}" for line in scale_facts(rows, suite)]
    notes = problems(rows, suite)
    if notes:
      parts.append("")
      parts += [f"- {n}" for n in notes]
    parts.append("")
  req = doc.get("cpu_requirement") or []
  if req:
    parts.append("## CPU requirement: jax_m2n (hierarchical, eager) vs numpy copy and "
                 "jax.device_put")
    parts.append("")
    parts.append(_md_table(REQUIREMENT_COLUMNS, requirement_table(req)))
    parts.append("")
  return "\n".join(parts)


def print_tables(doc: dict, console) -> None:
  """The same tables on the terminal (rich; the markdown text when rich is missing)."""
  try:
    from rich.table import Table
  except ImportError:
    console.print(markdown(doc))
    return
  rows = doc["results"]
  for suite in suites_in(rows):
    moves = move_table(rows, suite)
    if moves:
      table = Table(title=suite, title_justify="left")
      for c in MOVE_COLUMNS:
        table.add_column(c, justify="left" if c in ("case", "engine", "valid") else "right")
      for line in moves:
        style = None if line[-1].startswith("yes") else "bold red"
        table.add_row(*line, style=style)
      console.print(table)
    plans = planner_table(rows, suite)
    if plans:
      table = Table(title=f"{suite}: planning", title_justify="left")
      for c in PLANNER_COLUMNS:
        table.add_column(c, justify="left" if c == "what" else "right")
      for line in plans:
        table.add_row(*line)
      console.print(table)
      if suite == "planner" and doc.get("planner"):
        for line in planner_facts(doc["planner"]):
          console.print("  " + line, highlight=False)
      for line in scale_facts(rows, suite):
        console.print("  " + line, highlight=False)
    for n in problems(rows, suite):
      console.print("  " + n, highlight=False)
  req = doc.get("cpu_requirement") or []
  if req:
    table = Table(title="CPU requirement (m2n = m2n_hierarchical, eager)",
                  title_justify="left")
    for c in REQUIREMENT_COLUMNS:
      table.add_column(c, justify="left" if c == "case" else "right")
    for line in requirement_table(req):
      table.add_row(*line)
    console.print(table)
