"""The `memory` suite: process memory (RSS) over many distinct eager reshard layouts.

Owns one measurement (issue 14): RSS after N1 and after N2 distinct layouts, for jax_m2n's
eager reshard and for a plain-JAX control that compiles the same per-device programs'
worth of XLA executables (two small jitted copies per layout, compiled and dropped), each
in a fresh process.
jax_m2n's growth beyond the control's is what its own caches and retained objects cost;
the target is under 50 MB between 1,000 and 8,000 layouts. Never asserts on memory.

Usage:
  python -m jax_m2n.bench --suite memory [--memory_layouts 1000,8000] [--out_dir DIR]
  python -m jax_m2n.bench.memory --mode m2n --layouts 50,200   # one process, JSON out
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from typing import Callable, Sequence

from jax_m2n.bench import report

MB = 1e6


def rss_bytes() -> int:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _settle() -> None:
  """A full collection, then glibc hands freed pages back (RSS then counts live memory,
  not the allocator's free lists); the same for both runs."""
  gc.collect()
  try:
    import ctypes
    ctypes.CDLL("libc.so.6").malloc_trim(0)
  except (OSError, AttributeError):
    pass


def measure(mode: str, checkpoints: Sequence[int]) -> dict:
  """In this process: runs `max(checkpoints)` distinct layouts; RSS at each checkpoint.

  Layout k moves a float32 [k + 1, 8] array from device 0 to device 1 (row-sharded
  sources and replicated destinations alternate), so every k is a new plan, new schedule
  and new per-device programs.
  """
  import jax
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

  import jax_m2n

  devs = jax.devices()
  d0, d1 = SingleDeviceSharding(devs[0]), SingleDeviceSharding(devs[1])
  out = {"mode": mode, "checkpoints": [], "seconds": []}
  t0 = time.perf_counter()
  for k in range(max(checkpoints)):
    x = jax.device_put(np.full((k + 1, 8), k, np.float32), d0)
    if mode == "m2n":
      y = jax_m2n.reshard(x, d1)
    else:  # plain JAX: two freshly compiled programs of the same shapes, one per device,
      # dropped afterwards (what a layout's per-device programs are, minus jax_m2n)
      def copy(a, k=k):
        return a * 1
      y = jax.jit(copy, out_shardings=d0).lower(x).compile()(x)
      y = jax.device_put(y, d1)
      y = jax.jit(copy, out_shardings=d1).lower(y).compile()(y)
    jax.block_until_ready(y)
    del x, y
    if k + 1 in checkpoints:
      _settle()
      out["checkpoints"].append({"layouts": k + 1, "rss_bytes": rss_bytes()})
      out["seconds"].append(time.perf_counter() - t0)
  # What of the growth JAX's own caches hold: clear them (jax_m2n's caches stay).
  jax.clear_caches()
  _settle()
  out["rss_after_clear_caches"] = rss_bytes()
  if mode == "m2n":
    from jax.sharding import SingleDeviceSharding as S
    out["single_device_shardings"] = sum(1 for o in gc.get_objects() if type(o) is S)
  return out


def run(checkpoints: Sequence[int], print_fn: Callable[[str], object] = print) -> dict:
  """Both modes, each in a fresh process; the growth table."""
  results = {}
  env = dict(os.environ)
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in sys.path if p])
  for mode in ("control", "m2n"):
    print_fn(f"  memory/{mode}: {max(checkpoints)} distinct layouts in a fresh process ...")
    proc = subprocess.run(
        [sys.executable, "-m", "jax_m2n.bench.memory", "--mode", mode, "--layouts",
         ",".join(str(c) for c in checkpoints)], capture_output=True, text=True, env=env,
        check=False)
    if proc.returncode != 0:
      raise RuntimeError(f"memory/{mode} failed: {proc.stderr[-3000:]}")
    results[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
  lo, hi = min(checkpoints), max(checkpoints)

  def growth(mode):
    cps = {c["layouts"]: c["rss_bytes"] for c in results[mode]["checkpoints"]}
    return cps[hi] - cps[lo]

  doc = {"schema": 1, "suite": "memory", "from_layouts": lo, "to_layouts": hi,
         "growth_bytes": {m: growth(m) for m in results},
         "excess_bytes": growth("m2n") - growth("control"), "runs": results}
  return doc


def markdown(doc: dict) -> str:
  lines = [f"| run | RSS after {doc['from_layouts']} layouts, MB | RSS after "
           f"{doc['to_layouts']}, MB | growth, MB | after jax.clear_caches(), MB | seconds |",
           "| --- | --- | --- | --- | --- | --- |"]
  for mode, r in doc["runs"].items():
    cps = r["checkpoints"]
    lines.append(f"| {mode} | {cps[0]['rss_bytes'] / MB:.1f} | {cps[-1]['rss_bytes'] / MB:.1f}"
                 f" | {doc['growth_bytes'][mode] / MB:.1f} | "
                 f"{r['rss_after_clear_caches'] / MB:.1f} | {r['seconds'][-1]:.0f} |")
  lines.append("")
  m2n = doc["runs"]["m2n"]
  lines.append(f"jax_m2n's growth beyond the control: {doc['excess_bytes'] / MB:.1f} MB "
               f"(target < 50 MB). jax_m2n after jax.clear_caches() minus its RSS at "
               f"{doc['from_layouts']} layouts: "
               f"{(m2n['rss_after_clear_caches'] - m2n['checkpoints'][0]['rss_bytes']) / MB:.1f}"
               f" MB. SingleDeviceSharding objects alive at the end: "
               f"{m2n.get('single_device_shardings')}.")
  return "\n".join(lines) + "\n"


def main(out_dir: str, checkpoints: Sequence[int],
         print_fn: Callable[[str], object] = print) -> int:
  doc = run(checkpoints, print_fn)
  report.write_suite(doc, markdown(doc), out_dir, "memory", print_fn)
  return 0


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--mode", choices=("m2n", "control"), required=True)
  parser.add_argument("--layouts", default="1000,8000")
  args = parser.parse_args()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8").strip()
  marks = sorted({int(v) for v in args.layouts.split(",")})
  print(json.dumps(measure(args.mode, marks)))
