"""Benchmark of the CUDA transport on 4 GPUs (a program, not a test: it never fails on speed).

Usage (GPU machine, after building jax_m2n/_ffi_cuda.so):
  NCCL_NVLS_ENABLE=0 python3 tests/gpu_bench.py [--mib 1024] [--iters 10] [--warmup 3]
      [--chunks-mib 16,64,256,1024] [--json OUT.json] [--no-device-put]
  python3 tests/gpu_bench.py --convert-probe   # where XLA GPU's convert differs from CPU's

Cases (bf16 [rows, 32768], --mib MiB in all; docs/bench_reference.md, "Method"), with 4 GPUs:
  A  2 GPUs P('x', None) -> 2 other GPUs replicated           bound 2.75 ms/GiB
  B  1 GPU -> 3 GPUs replicated                               bound 2.75 ms/GiB
  C  2 GPUs P('x', None) -> 2 other GPUs P(None, 'x')         bound 1.37 ms/GiB
with 2 GPUs: D 1 -> 1 copy, E 2 P('x', None) -> the same 2 replicated, F -> P(None, 'x').
Engines: jax.device_put, XLA's own reshard in jit (colocated cases), and per CUDA engine
(`_ffi_cuda.set_engine`: auto = the direct peer path in one process, nccl) jax_m2n
hierarchical / flat / gather_bcast eager, in jit (colocated), the chunk-size sweep; then
the fixed cost of a 4.5 KiB reshard against device_put, with where its time goes. Time = wall clock around reshard + block_until_ready (min and mean of
--iters after --warmup); every engine's output is checked bitwise once against device_put.
JSON: {"version": 1, "rows": [{case, engine, chunk_mib, min_ms, mean_ms, bound_ms}, ...]}.
"""

import argparse
import json
import os
import sys
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jax_m2n  # noqa: E402
from jax_m2n.bench import timing  # noqa: E402
from jax_m2n._src import planner as m2n_planner  # noqa: E402
from jax_m2n._src import eager as m2n_eager  # noqa: E402

GBPS = 391.0  # measured copy-engine bandwidth per direction (docs/benchmarks.md)


def sharding(ids, spec):
  g = jax.devices("gpu")
  return NamedSharding(Mesh(np.array([g[i] for i in ids]), ("x",)), spec)


def timed(fn, iters, warmup):
  """(min, mean) ms of `iters` calls after `warmup`, each waited for."""
  ms = np.array(timing.time_calls(fn, jax.block_until_ready, warmup, iters).times_s) * 1e3
  return float(ms.min()), float(ms.mean())


def same(a, b):
  for s, r in zip(sorted(a.addressable_shards, key=lambda s: s.device.id),
                  sorted(b.addressable_shards, key=lambda s: s.device.id)):
    if not np.array_equal(np.asarray(s.data).view(np.uint16), np.asarray(r.data).view(np.uint16)):
      return False
  return True


def convert_probe():
  """Where XLA GPU's `convert` differs from XLA CPU's (convert.h follows CPU): every pair
  of f32/f16/bf16/f8_e4m3fn/f8_e5m2, every 8/16-bit source pattern, f32 specials plus
  random bits. Prints per pair the count and the first differing inputs."""
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import gpu_test  # noqa: PLC0415 - the case tables (inputs with every special value)
  gpu, cpu = jax.devices("gpu")[0], jax.devices("cpu")[0]
  for a, b in gpu_test.CONVERT_PAIRS:
    host = gpu_test._convert_input(a, (256, 320), seed=31)
    g = np.asarray(jax.device_put(host, gpu).astype(b))
    c = np.asarray(jax.device_put(host, cpu).astype(b))
    gb, cb, hb = gpu_test._bits(g).ravel(), gpu_test._bits(c).ravel(), gpu_test._bits(host).ravel()
    bad = np.flatnonzero(gb != cb)
    nan_in = np.isnan(host.astype(np.float32)).ravel()
    ex = ", ".join(f"{int(hb[i]):#x}->gpu {int(gb[i]):#x} cpu {int(cb[i]):#x}" for i in bad[:6])
    print(f"probe {gpu_test._pair_id((a, b))}: {len(bad)} differ ({int(nan_in[bad].sum())} "
          f"NaN inputs) {ex}", flush=True)


def main():
  if "--convert-probe" in sys.argv:
    convert_probe()
    return
  ap = argparse.ArgumentParser()
  ap.add_argument("--mib", type=int, default=1024)
  ap.add_argument("--iters", type=int, default=10)
  ap.add_argument("--warmup", type=int, default=3)
  ap.add_argument("--chunks-mib", default="16,64,256,1024")
  ap.add_argument("--json", default="")
  ap.add_argument("--no-device-put", action="store_true")
  ap.add_argument("--cases", default="", help="letters of the cases to run (default all)")
  ap.add_argument("--routes", default="hierarchical,flat,gather_bcast")
  ap.add_argument("--engines", default="auto,nccl",
                  help="_ffi_cuda.set_engine values to compare (auto = the peer path in one "
                       "process)")
  a = ap.parse_args()

  cols = 32768
  rows = a.mib * (1 << 20) // (2 * cols)
  shape = (rows, cols)
  gib = rows * cols * 2 / (1 << 30)
  bound_full = gib * (1 << 30) / (GBPS * 1e9) * 1e3
  if len(jax.devices("gpu")) >= 4:
    cases = {
        "A 2xP(x)->2 repl": ([0, 1], P("x", None), [2, 3], P(), bound_full),
        "B 1->3 repl": ([0], P(), [1, 2, 3], P(), bound_full),
        "C 2xP(x)->2xP(None,x)": ([0, 1], P("x", None), [2, 3], P(None, "x"),
                                  bound_full / 2),
    }
  else:  # 2 GPUs: a point-to-point copy and the two colocated reshards
    cases = {
        "D 1->1": ([0], P(), [1], P(), bound_full),
        "E 2xP(x)->same 2 repl": ([0, 1], P("x", None), [0, 1], P(), bound_full / 2),
        "F 2xP(x)->same 2xP(None,x)": ([0, 1], P("x", None), [0, 1], P(None, "x"),
                                       bound_full / 4),
    }
  cases = {k: v for k, v in cases.items() if not a.cases or k[0] in a.cases}
  host = np.random.default_rng(0).integers(1, 1 << 15, size=shape, dtype=np.uint16)
  host = host.view(ml_dtypes.bfloat16)
  out_rows = []

  def record(case, engine, chunk, t, bound, ok):
    row = dict(case=case, engine=engine, chunk_mib=chunk, min_ms=round(t[0], 3),
               mean_ms=round(t[1], 3), bound_ms=round(bound, 3), bitwise_ok=ok)
    out_rows.append(row)
    print(f"{case:24s} {engine:22s} chunk={str(chunk):>5s}  min {t[0]:8.2f} ms  "
          f"mean {t[1]:8.2f} ms  bound {bound:6.2f} ms  x{t[0] / bound:5.2f}  ok={ok}",
          flush=True)

  default_chunk = m2n_planner.GPU_MAX_CHUNK_BYTES
  cuda = __import__("jax_m2n._ffi_cuda", fromlist=["_"])
  engines = [e for e in a.engines.split(",") if e]
  for case, (si, ss, di, ds, bound) in cases.items():
    src, dst = sharding(si, ss), sharding(di, ds)
    x = jax.device_put(host, src)
    ref = jax.device_put(x, dst)
    if not a.no_device_put:
      record(case, "device_put", None, timed(lambda: jax.device_put(x, dst), a.iters, a.warmup),
             bound, True)
    colocated = si == di or sorted(si) == sorted(di)
    if colocated:
      xla = jax.jit(lambda v: v, out_shardings=dst)
      ok = same(xla(x), ref)
      record(case, "xla-jit", None, timed(lambda: xla(x), a.iters, a.warmup), bound, ok)
    for engine in engines:
      jax_m2n.reshard(x, dst)  # the plan exists: set_engine applies to the next calls
      cuda.set_engine(engine)
      for route in a.routes.split(","):
        ok = same(jax_m2n.reshard(x, dst, route=route), ref)
        t = timed(lambda: jax_m2n.reshard(x, dst, route=route), a.iters, a.warmup)
        record(case, f"m2n-{engine}-{route}", default_chunk >> 20, t, bound, ok)
      if colocated:
        f = jax.jit(lambda v: jax_m2n.reshard(v, dst, src_sharding=src))
        ok = same(f(x), ref)
        record(case, f"m2n-{engine}-jit", default_chunk >> 20,
               timed(lambda: f(x), a.iters, a.warmup), bound, ok)
      for c in [int(v) for v in a.chunks_mib.split(",") if v]:
        if (c << 20) == default_chunk:
          continue
        ok = same(jax_m2n.reshard(x, dst, chunk_bytes=c << 20), ref)
        t = timed(lambda: jax_m2n.reshard(x, dst, chunk_bytes=c << 20), a.iters, a.warmup)
        record(case, f"m2n-{engine}-hierarchical", c, t, bound, ok)
      cuda.set_engine("auto")
    del x, ref

  # Fixed cost: 4.5 KiB bf16 from GPU 0 to GPU 1 (two per-device programs), and where the
  # time goes: each device's program (dispatch until its outputs are ready) is timed
  # inside the reshard by wrapping ops._run_device; the rest is Python on the caller.
  small = jax.device_put(np.arange(2304, dtype=np.uint16).view(ml_dtypes.bfloat16),
                         sharding([0], P()))
  d1 = sharding([1], P())
  record("4.5KiB 0->1", "device_put", None,
         timed(lambda: jax.device_put(small, d1), 200, 20), 1e-3, True)
  ident = jax.jit(lambda v: v + 0)
  record("4.5KiB 0->1", "jit-1dev-noop", None, timed(lambda: ident(small), 200, 20), 1e-3,
         True)
  for engine in engines:
    jax_m2n.reshard(small, d1)
    cuda.set_engine(engine)
    ok = same(jax_m2n.reshard(small, d1), jax.device_put(small, d1))
    record("4.5KiB 0->1", f"m2n-{engine}", None,
           timed(lambda: jax_m2n.reshard(small, d1), 200, 20), 1e-3, ok)
    spans = []
    inner = m2n_eager.dispatch.run_device

    def run_device(prog, args, inner=inner):
      t0 = time.perf_counter()
      out = inner(prog, args)
      spans.append((time.perf_counter() - t0) * 1e3)
      return out

    m2n_eager.dispatch.run_device = run_device
    try:
      total = []
      for _ in range(200):
        spans.clear()
        t0 = time.perf_counter()
        jax.block_until_ready(jax_m2n.reshard(small, d1))
        total.append(((time.perf_counter() - t0) * 1e3, max(spans)))
    finally:
      m2n_eager.dispatch.run_device = inner
    total.sort()
    med = total[len(total) // 2]
    print(f"4.5KiB breakdown ({engine}): median total {med[0]:.3f} ms, of which the slowest "
          f"device program (dispatch -> ready) {med[1]:.3f} ms, Python around it "
          f"{med[0] - med[1]:.3f} ms", flush=True)
    cuda.set_engine("auto")
  print("peer_stats", cuda.peer_stats())
  if a.json:
    with open(a.json, "w") as f:
      json.dump({"version": 1, "shape": shape, "dtype": "bfloat16", "rows": out_rows}, f,
                indent=1)


if __name__ == "__main__":
  main()
