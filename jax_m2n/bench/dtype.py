"""The `dtype` suite: fp32 -> bf16 refit with the conversion in flight, against casting first.

Owns one comparison (issue 15 item 2), on whatever devices exist: an fp32 array of a
given size moved as bf16 (or --dtype_target: float8_e4m3fn, ...) (a) from device 0
to device 1 (on a single device: converted where it is, no transfer) and (b) sharded,
from the first half of the devices to the second half in another layout (one device set
in a new layout when there are fewer than 4 devices), three ways: `jax_m2n.reshard(x,
dst, dtype=bf16)` (converted inside the copies), `jax.device_put(x.astype(bf16), dst)`
and `jax_m2n.reshard(x.astype(bf16), dst)`. Reports the median time, the bytes on the wire
(jax_m2n's plan: bytes over links between devices) and the peak extra memory: on GPU
the source device's `memory_stats()` peak over its use before the call, on CPU the
process's peak RSS over its RSS before (the devices share the host's memory; it includes
the destination's output, the same for every method), each in a fresh process.

Usage:
  python -m jax_m2n.bench --suite dtype [--size_mib 256] [--iters 10] [--out_dir DIR]
  python -m jax_m2n.bench --suite dtype --dtype_target float8_e4m3fn   # another target
  python -m jax_m2n.bench.dtype --memory reshard_dtype --case single --size_mib 64
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Callable

from jax_m2n.bench import report
from jax_m2n.bench import timing

MIB = 1 << 20
METHODS = ("reshard_dtype", "astype_device_put", "astype_reshard")
CASES = ("single", "sharded")
DEFAULT_SIZE_MIB = 256
DEFAULT_TARGET = "bfloat16"


def _case(jax, name: str, size_bytes: int):
  """(fp32 source array, destination sharding, title) of one case."""
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  devs = jax.devices()
  n = size_bytes // 4
  if name == "single":
    x = jax.device_put(np.ones(n, np.float32), devs[0])
    if len(devs) == 1:
      return (x, jax.sharding.SingleDeviceSharding(devs[0]),
              "fp32 on device 0, converted where it is (one device: no transfer)")
    return x, jax.sharding.SingleDeviceSharding(devs[1]), "fp32 device 0 -> device 1"
  k = len(devs) // 2 if len(devs) >= 4 else len(devs)
  rows = max(k, (n // 4096) // k * k)
  src = NamedSharding(Mesh(np.array(devs[:k]), ("x",)), P("x", None))
  dst_devs = devs[k:2 * k] if len(devs) >= 4 else devs[:k]
  dst = NamedSharding(Mesh(np.array(dst_devs), ("x",)), P(None, "x"))
  x = jax.device_put(np.ones((rows, 4096), np.float32), src)
  title = (f"fp32 P(x, None) on devices 0-{k - 1} -> P(None, x) on "
           f"{dst_devs[0].id}-{dst_devs[-1].id}")
  return x, dst, title


def _method(jax, name: str, target: str = DEFAULT_TARGET) -> Callable:
  import jax_m2n
  t = jax.numpy.dtype(target)
  if name == "reshard_dtype":
    return lambda x, dst: jax_m2n.reshard(x, dst, dtype=t)
  if name == "astype_device_put":
    return lambda x, dst: jax.device_put(x.astype(t), dst)
  return lambda x, dst: jax_m2n.reshard(x.astype(t), dst)


def _wire_bytes(jax, x, dst, method: str, target: str = DEFAULT_TARGET) -> int | None:
  """Bytes over links between devices, from jax_m2n's plan (None for device_put)."""
  import jax_m2n
  if method == "astype_device_put":
    return None
  plan = jax_m2n.plan(x, dst, dtype=jax.numpy.dtype(target))
  return sum(v for k, v in plan.bytes_by_link.items() if k != "local")


def _rss() -> int:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure_memory(case: str, method: str, size_bytes: int,
                   target: str = DEFAULT_TARGET) -> dict:
  """In this (fresh) process: the peak extra memory of one call of `method`."""
  import jax
  x, dst, _ = _case(jax, case, size_bytes)
  fn = _method(jax, method, target)
  jax.block_until_ready(x)
  src_dev = next(iter(x.sharding.device_set))
  stats = src_dev.memory_stats()
  if stats and "peak_bytes_in_use" in stats:
    before = stats["bytes_in_use"]
    jax.block_until_ready(fn(x, dst))
    peak = src_dev.memory_stats()["peak_bytes_in_use"]
    return {"what": "source device peak_bytes_in_use - bytes_in_use before",
            "extra_bytes": int(peak - before)}
  import threading
  before = _rss()
  peak = [before]
  done = threading.Event()

  def sample():  # RSS every ~0.2 ms while the call runs (ru_maxrss never falls)
    while not done.is_set():
      peak[0] = max(peak[0], _rss())
      time.sleep(2e-4)
  sampler = threading.Thread(target=sample, daemon=True)
  sampler.start()
  jax.block_until_ready(fn(x, dst))
  peak[0] = max(peak[0], _rss())
  done.set()
  sampler.join()
  return {"what": "process peak RSS (sampled) - RSS before; includes the output",
          "extra_bytes": int(peak[0] - before)}


def _memory_in_fresh_process(case: str, method: str, size_bytes: int,
                             target: str) -> dict | None:
  env = dict(os.environ)
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in sys.path if p])
  proc = subprocess.run(
      [sys.executable, "-m", "jax_m2n.bench.dtype", "--memory", method, "--case", case,
       "--size_bytes", str(size_bytes), "--target", target], capture_output=True, text=True, env=env,
      check=False)
  if proc.returncode != 0:
    return {"what": "failed", "extra_bytes": None, "error": proc.stderr[-2000:]}
  return json.loads(proc.stdout.strip().splitlines()[-1])


def run(jax, size_bytes: int, iters: int, warmup: int, memory: bool = True,
        print_fn: Callable[[str], object] = print, target: str = DEFAULT_TARGET) -> dict:
  """Every case x method: median ms, wire bytes, peak extra memory (fresh processes),
  fp32 converted to `target`."""
  import numpy as np
  bits = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[
      jax.numpy.dtype(target).itemsize]
  rows = []
  for case in CASES:
    x, dst, title = _case(jax, case, size_bytes)
    ref = None
    for method in METHODS:
      fn = _method(jax, method, target)
      for _ in range(max(1, warmup)):
        y = jax.block_until_ready(fn(x, dst))
      if ref is None:
        ref = np.asarray(y)
      elif not np.array_equal(np.asarray(y).view(bits), ref.view(bits)):
        raise AssertionError(f"dtype/{case}: {method} differs from reshard(dtype=)")
      del y
      times = [t * 1e3 for t in timing.time_calls(
          lambda: fn(x, dst), jax.block_until_ready, 0, iters).times_s]
      row = {"case": case, "title": title, "method": method,
             "platform": next(iter(x.sharding.device_set)).platform,
             "payload_bytes": int(x.size * 4), "ms": statistics.median(times),
             "ms_min": min(times), "wire_bytes": _wire_bytes(jax, x, dst, method, target)}
      if memory:
        row["memory"] = _memory_in_fresh_process(case, method, size_bytes, target)
      rows.append(row)
      print_fn(f"  dtype/{case}/{method}: {row['ms']:.2f} ms")
    del x
  return {"schema": 1, "suite": "dtype", "size_bytes": size_bytes, "iters": iters,
          "target": target, "rows": rows}


def markdown(doc: dict) -> str:
  lines = ["| case | method | median ms | min ms | wire MiB | peak extra MiB |",
           "| --- | --- | --- | --- | --- | --- |"]
  for r in doc["rows"]:
    wire = "-" if r["wire_bytes"] is None else f"{r['wire_bytes'] / MIB:.1f}"
    mem = (r.get("memory") or {}).get("extra_bytes")
    mem = "-" if mem is None else f"{mem / MIB:.1f}"
    lines.append(f"| {r['case']} | {r['method']} | {r['ms']:.2f} | {r['ms_min']:.2f} | "
                 f"{wire} | {mem} |")
  titles = {r["case"]: r["title"] for r in doc["rows"]}
  lines.append("")
  for case, title in titles.items():
    lines.append(f"- {case}: {title}, {doc['size_bytes'] / MIB:.0f} MiB of fp32 as "
                 f"{doc.get('target', DEFAULT_TARGET)}.")
  whats = {(r.get("memory") or {}).get("what") for r in doc["rows"]} - {None}
  for w in sorted(whats):
    lines.append(f"- peak extra memory: {w}.")
  return "\n".join(lines) + "\n"


def main(jax, out_dir: str, size_bytes: int, iters: int, warmup: int,
         print_fn: Callable[[str], object] = print, target: str = DEFAULT_TARGET) -> int:
  doc = run(jax, size_bytes, iters, warmup, print_fn=print_fn, target=target)
  report.write_suite(doc, markdown(doc), out_dir, "dtype", print_fn)
  return 0


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--memory", choices=METHODS, required=True)
  parser.add_argument("--case", choices=CASES, required=True)
  parser.add_argument("--size_bytes", type=int, default=DEFAULT_SIZE_MIB * MIB)
  parser.add_argument("--target", default=DEFAULT_TARGET)
  args = parser.parse_args()
  if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8").strip()
  import jax as _jax
  print(json.dumps(measure_memory(args.case, args.memory, args.size_bytes, args.target)))
