"""The `quantize` suite: a quantized refit (FP8 values + scales on the wire) against
`jax.device_put` of the float32 weights followed by qwix's quantization on the destination.

Owns one comparison (issue 25), on whatever devices exist, for each size: a float32
matrix in P(x, None) on the first half of the devices moved to P(None, x) on the other
half (on 2 devices: device 0 -> device 1; on one: quantized where it is, in place) and
quantized to float8_e4m3fn with 128 x 128 tiles and float32 scales, two ways:
`jax_m2n.reshard(x, dst, dtype=jax_m2n.Quantize(...))` (quantized on the source, FP8 and
scales moved) and `jax.jit(qwix.quantize)(jax.device_put(x, dst))` (float32 moved, then
quantized on the destination). Every row is validated (values and scales bitwise equal
between the two) before it is timed; reports the median time and the bytes between
devices (jax_m2n's plan; device_put moves the float32 bytes).

Usage:
  python -m jax_m2n.bench --suite quantize [--size_mib 64] [--iters 10] [--out_dir DIR]
  (default sizes: 1, 16, 64, 256, 1024 MiB on CPU; 1, 16, 256, 1024 MiB on GPU)
"""

from __future__ import annotations

import statistics
from typing import Callable

from jax_m2n.bench import report
from jax_m2n.bench import timing

MIB = 1 << 20
METHODS = ("reshard_quantize", "device_put_qwix")
CPU_SIZES_MIB = (1, 16, 64, 256, 1024)
GPU_SIZES_MIB = (1, 16, 256, 1024)
TILE = 128


def _case(jax, size_bytes: int):
  """(float32 source, destination sharding, title) of one size."""
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  devs = jax.devices()
  cols = 4096 if size_bytes >= 4 * TILE * 4096 else 1024
  rows = max(TILE, (size_bytes // (4 * cols)) // TILE * TILE)
  host = np.random.default_rng(0).standard_normal((rows, cols), dtype=np.float32)
  if len(devs) == 1:
    sharding = jax.sharding.SingleDeviceSharding(devs[0])
    return (jax.device_put(host, sharding), sharding,
            "float32 on device 0, quantized where it is (one device: in place)")
  if len(devs) < 4:
    return (jax.device_put(host, devs[0]), jax.sharding.SingleDeviceSharding(devs[1]),
            "float32 device 0 -> device 1")
  k = len(devs) // 2
  src = NamedSharding(Mesh(np.array(devs[:k]), ("x",)), P("x", None))
  dst = NamedSharding(Mesh(np.array(devs[k:2 * k]), ("x",)), P(None, "x"))
  return (jax.device_put(host, src), dst,
          f"float32 P(x, None) on devices 0-{k - 1} -> P(None, x) on {k}-{2 * k - 1}")


def _spec():
  import jax_m2n
  return jax_m2n.Quantize("float8_e4m3fn", tiled_axes={0: TILE, 1: TILE},
                          scale_dtype="float32")


def _method(jax, name: str) -> Callable:
  import jax_m2n
  spec = _spec()
  if name == "reshard_quantize":
    return lambda x, dst: jax_m2n.reshard(x, dst, dtype=spec)
  import qwix
  quantize = jax.jit(lambda v: qwix.quantize(v, spec.qtype, tiled_axes=dict(
      spec.tiled_axes), scale_dtype=spec.scale_dtype))
  return lambda x, dst: quantize(jax.device_put(x, dst))


def _wire_bytes(jax, x, dst, method: str) -> int:
  """Bytes over links between devices, from jax_m2n's plan."""
  import jax_m2n
  plan = jax_m2n.plan(x, dst, dtype=_spec() if method == "reshard_quantize" else None)
  return sum(v for k, v in plan.bytes_by_link.items() if k != "local")


def _bits(q):
  import numpy as np
  return (np.asarray(q.qvalue).view(np.uint8), np.asarray(q.scale).view(np.uint32))


def run(jax, sizes_bytes, iters: int, warmup: int,
        print_fn: Callable[[str], object] = print) -> dict:
  """Every size x method: median ms and wire bytes, validated bitwise."""
  import numpy as np
  try:
    import qwix  # noqa: F401
    methods = METHODS
  except ImportError:
    methods = METHODS[:1]
    print_fn("  quantize: qwix is not installed: jax_m2n only (pip install qwix)")
  rows = []
  for size in sizes_bytes:
    x, dst, title = _case(jax, size)
    ref = None
    for method in methods:
      fn = _method(jax, method)
      for _ in range(max(1, warmup)):
        y = jax.block_until_ready(fn(x, dst))
      got = _bits(y)
      if ref is None:
        ref = got
      elif not all(np.array_equal(a, b) for a, b in zip(got, ref)):
        raise AssertionError(f"quantize/{size}: {method} differs from reshard_quantize")
      del y
      times = [t * 1e3 for t in timing.time_calls(
          lambda: fn(x, dst), jax.block_until_ready, 0, iters).times_s]
      rows.append({"size_bytes": int(x.size * 4), "title": title, "method": method,
                   "platform": next(iter(x.sharding.device_set)).platform,
                   "ms": statistics.median(times), "ms_min": min(times),
                   "wire_bytes": _wire_bytes(jax, x, dst, method)})
      print_fn(f"  quantize/{x.size * 4 / MIB:.0f}MiB/{method}: {rows[-1]['ms']:.2f} ms")
    del x
  return {"schema": 1, "suite": "quantize", "tile": TILE, "iters": iters, "rows": rows}


def markdown(doc: dict) -> str:
  lines = ["| float32 MiB | method | median ms | min ms | wire MiB |",
           "| ---: | --- | ---: | ---: | ---: |"]
  for r in doc["rows"]:
    lines.append(f"| {r['size_bytes'] / MIB:.0f} | {r['method']} | {r['ms']:.2f} | "
                 f"{r['ms_min']:.2f} | {r['wire_bytes'] / MIB:.2f} |")
  lines.append("")
  for title in dict.fromkeys(r["title"] for r in doc["rows"]):
    lines.append(f"- {title}; float8_e4m3fn, {doc['tile']} x {doc['tile']} tiles, "
                 "float32 scales; values and scales bitwise equal between the methods.")
  return "\n".join(lines) + "\n"


def main(jax, out_dir: str, size_mib: float | None, iters: int, warmup: int,
         print_fn: Callable[[str], object] = print) -> int:
  on_gpu = jax.devices()[0].platform != "cpu"
  sizes = ([size_mib] if size_mib else GPU_SIZES_MIB if on_gpu else CPU_SIZES_MIB)
  doc = run(jax, [int(s * MIB) for s in sizes], iters, warmup, print_fn)
  report.write_suite(doc, markdown(doc), out_dir, "quantize", print_fn)
  return 0
