"""jax_m2n across CPU processes through JAX's transfer server: the workers and tables of
`--suite multiprocess` on a machine without 2 GPUs (loopback) and `--suite network`
(each process its own emulated host behind a shaped link: bench/network.py).

Owns the launch of CPU processes under jax.distributed (spawned by the bench itself,
on 127.0.0.1 or each in a host of a jax_m2n.testing.hosts.EmulatedHosts) and two parts,
every output checked bitwise before timing, at default reshard arguments:
  engine  2 processes x 2 devices: one reshard of S MiB from process 0 to process 1
          (whole tensor, and P('x') -> P('x') over each process's 2 devices) against
          the engine's raw transfer of the same arrays in the same run (offer, signal
          through the key-value store, pull, confirm: what any caller of the transfer
          server must do). Goal: reshard / raw <= 1.15 over shaped links, <= 1.25 on
          loopback, for >= 16 MiB.
  fig4    the paper's Figure 4 over real inter-process transfers: 2 source devices in
          process 0 (TP over rows) -> TP2 x DP r_d over r_d other processes (one replica
          each), routes hierarchical / flat / gather_bcast; measured time, the plan's
          step-by-step estimate (processes as domains, priced at the link rate: the
          shaped rate, or on loopback the raw bandwidth measured in the same run), and
          flat / hierarchical (the paper: about r_d where the source's link is the
          bottleneck; goal >= 0.85 r_d over shaped links).
  scale   (--scale 1,4 alone) a pytree of --layers layers per process, each process a
          pipeline stage of --devices devices, into one (dp, tp) mesh over every
          process, the same shard bytes per process at every process count: per-process
          CPU time of a repeated call. Goal: 4 processes within 1.5x of 1.
Both report the key-value operations each call makes on the calling thread (the
control plane per call: it grows with processes, never with chunks or leaves).
Latency = the maximum over processes of each one's mean over --iters timed calls after
--warmup, each call started behind a barrier. Usage by hand (the bench starts workers):
  python -m jax_m2n.bench.multiprocess_cpu --out_dir DIR [--size_mib 16,64,256]
      [--iters 10] [--warmup 3] [--r_d 2,3,4]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from typing import Sequence

from jax_m2n.bench import timing

MIB = 1 << 20
SCHEMA = 2
ROUTES = ("hierarchical", "flat", "gather_bcast")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def worker_env() -> dict:
  """The environment of a CPU worker: JAX on CPU from its first import (a machine with
  a GPU would otherwise start CUDA in every worker: NCCL "Duplicate GPU detected"),
  this checkout importable, no inherited device-count flags."""
  env = dict(os.environ, PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  return env


def launch(part: str, n: int, argv: list[str], timeout_s: float, log_dir: str,
           hosts=None) -> list[dict]:
  """Starts n workers of `part` (in hosts 0..n-1 of `hosts`, an EmulatedHosts, or on
  127.0.0.1); returns every MPRESULT dict they printed (or raises RuntimeError with the
  logs' tails). Children are killed on timeout."""
  if hosts is None:
    coordinator = f"127.0.0.1:{_free_port()}"
  else:  # a fresh port per launch: the last job's may linger in TIME_WAIT
    launch.count = getattr(launch, "count", 0) + 1
    coordinator = f"{hosts.address(0)}:{7000 + launch.count}"
  env = worker_env()
  where = "loopback" if hosts is None else "hosts"
  logs = [os.path.join(log_dir, f"multiprocess_cpu_{where}_{part}_{n}_{i}.log")
          for i in range(n)]
  procs = []
  for i in range(n):
    cmd = [sys.executable, "-m", "jax_m2n.bench.multiprocess_cpu", "--worker", part,
           "--pid", str(i), "--n", str(n), "--coordinator", coordinator, *argv]
    with open(logs[i], "w") as f:
      kw = dict(stdout=f, stderr=subprocess.STDOUT, env=env)
      procs.append(subprocess.Popen(cmd, **kw) if hosts is None else hosts.popen(i, cmd, **kw))
  deadline = time.monotonic() + timeout_s
  try:
    for p in procs:
      p.wait(timeout=max(1.0, deadline - time.monotonic()))
  except subprocess.TimeoutExpired:
    pass
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
      p.wait()
  out, tails = [], []
  for path, p in zip(logs, procs):
    text = open(path).read()
    out += [json.loads(line[len("MPRESULT "):]) for line in text.splitlines()
            if line.startswith("MPRESULT ")]
    if p.returncode:
      tails.append(f"{path} (rc {p.returncode}): {text[-1500:]}")
  if tails:
    raise RuntimeError("\n".join(tails))
  return out


# ---------------------------------------------------------------------------------------
# Workers
# ---------------------------------------------------------------------------------------

def _init(args):
  from jax_m2n.testing import workers
  jax = workers.start_jax(2, args.n, args.pid, args.coordinator)
  from jax_m2n._src import jax_compat
  return jax, jax_compat.distributed_client()


def _timed(jax, kv, tag: str, iters: int, warmup: int, fn) -> list[float]:
  """fn() timed `iters` times after `warmup`, each behind a barrier; ms per call."""
  times = []
  for i in range(warmup + iters):
    if kv is not None:  # None: one process, no job to wait for
      kv.wait_at_barrier(f"bench/{tag}/{i}", 120_000)
    t0 = time.perf_counter()
    fn(i)
    if i >= warmup:
      times.append((time.perf_counter() - t0) * 1e3)
  return times


def _emit(**row) -> None:
  print("MPRESULT " + json.dumps(row), flush=True)


def _check(y, host) -> bool:
  import numpy as np
  idx = y.sharding.addressable_devices_indices_map(host.shape)
  return all(np.array_equal(np.asarray(s.data), host[idx[s.device]])
             for s in y.addressable_shards)


def _per_call(fn, calls: int) -> tuple:
  """(fn's result, key-value operations per call it made on this thread)."""
  from jax_m2n._src.processes import store
  before = store.stats["kv_ops"]
  out = fn()
  return out, (store.stats["kv_ops"] - before) / max(1, calls)


def _raw(jax, kv, eng, tag, arrays_by_pid, specs_fn, iters, warmup):
  """The engine alone: process 0 offers `arrays`, tells process 1 through the store,
  process 1 pulls them and confirms. ms per transfer on this process."""
  pid = jax.process_index()
  if pid == 1:
    conn = eng.server.connect(eng.peer_address(0))

  def once(i):
    key = f"bench/raw/{tag}/{i}"
    if pid == 0:
      eng.server.await_pull(1_000_000 + i, arrays_by_pid)
      kv.key_value_set(key + "/offered", "1")
      kv.blocking_key_value_get(key + "/pulled", 120_000)
    elif pid == 1:
      kv.blocking_key_value_get(key + "/offered", 120_000)
      for a in conn.pull(1_000_000 + i, specs_fn()):
        a.block_until_ready()
      kv.key_value_set(key + "/pulled", "1")
  return _timed(jax, kv, f"raw/{tag}", iters, warmup, once)


def worker_engine(args) -> int:
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  jax, kv = _init(args)
  import jax_m2n
  from jax_m2n._src.processes import bootstrap
  eng = bootstrap.engine()
  pid = jax.process_index()
  mine = {p: [d for d in jax.devices() if d.process_index == p] for p in (0, 1)}
  for size_mib in [float(s) for s in args.size_mib.split(",")]:
    n = int(size_mib * MIB) // 4 // 2 * 2
    host = np.arange(n, dtype=np.float32)
    for case, src_devs, dst_devs, spec in (
        ("whole", mine[0][:1], mine[1][:1], P()),
        ("sharded", mine[0], mine[1], P("x"))):
      src = NamedSharding(Mesh(np.array(src_devs), ("x",)), spec)
      dst = NamedSharding(Mesh(np.array(dst_devs), ("x",)), spec)
      x = jax.make_array_from_callback(host.shape, src, lambda i: host[i], dtype=host.dtype)
      ok = _check(jax_m2n.reshard(x, dst), host)
      tag = f"{case}/{size_mib}"
      t_m2n, kv_ops = _per_call(lambda: _timed(
          jax, kv, f"m2n/{tag}", args.iters, args.warmup,
          lambda i: jax_m2n.reshard(x, dst).block_until_ready()), args.iters + args.warmup)
      shards = [s.data for s in x.addressable_shards]
      dst_boxes = dst.devices_indices_map(host.shape)
      specs = [jax.ShapeDtypeStruct(host[dst_boxes[d]].shape, host.dtype,
                                    sharding=jax.sharding.SingleDeviceSharding(d))
               for d in dst_devs]
      t_raw = _raw(jax, kv, eng, tag, shards, lambda: specs, args.iters, args.warmup)
      _emit(part="engine", case=case, size_mib=size_mib, pid=pid, ok=bool(ok),
            m2n_ms=float(np.mean(t_m2n)), m2n_min_ms=float(np.min(t_m2n)),
            raw_ms=float(np.mean(t_raw)), raw_min_ms=float(np.min(t_raw)),
            kv_ops=kv_ops, chunks=len(jax_m2n.plan(x, dst).chunks),
            bytes=int(host.nbytes))
  return 0


# The scale part's pytree, per process (a pipeline stage): per layer these leaves,
# (shape, source spec on the stage's (ep, tp) mesh, destination spec on the generator's
# (dp, tp) mesh over every process's devices). Every destination dim 0 is split over
# all of the generator's devices, so each process receives as many bytes whatever the
# processes: the same per-process shard bytes at 1 and at 4 processes.
_SCALE_LEAVES = (((128, 64), ("ep", "tp"), (("dp", "tp"), None)),
                 ((64, 32, 16), ("ep", None, "tp"), (("dp", "tp"), None, None)),
                 ((256,), (("ep", "tp"),), (("dp", "tp"),)),
                 ((64, 128), (None, ("ep", "tp")), (("dp", "tp"), None)))


def worker_scale(args) -> int:
  """`--layers` layers per process of _SCALE_LEAVES (float32), from each process's own
  (ep, tp) mesh into one (dp, tp) mesh over every process: per-process host time of a
  repeated call (process CPU time, every thread) and its key-value operations."""
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  from jax_m2n.testing import workers
  jax = workers.start_jax(args.devices, args.n, args.pid, args.coordinator)
  from jax_m2n._src import jax_compat
  kv = jax_compat.distributed_client()
  import jax_m2n
  pid, n = jax.process_index(), jax.process_count()
  stages = [Mesh(np.array([d for d in jax.devices() if d.process_index == p]
                          ).reshape(-1, 2), ("ep", "tp")) for p in range(n)]
  gen = Mesh(np.array(jax.devices()).reshape(-1, 2), ("dp", "tp"))
  rng = np.random.default_rng(0)
  hosts, xs, dsts = [], [], []
  for stage in stages:
    for _ in range(args.layers):
      for shape, sspec, dspec in _SCALE_LEAVES:
        h = rng.standard_normal(shape).astype(np.float32)
        src = NamedSharding(stage, P(*sspec))
        hosts.append(h)
        xs.append(jax.make_array_from_callback(shape, src, lambda i, h=h: h[i],
                                               dtype=h.dtype))
        dsts.append(NamedSharding(gen, P(*dspec)))
  t0 = time.perf_counter()
  ys = jax_m2n.reshard(xs, dsts)
  jax.block_until_ready(ys)
  first_s = time.perf_counter() - t0
  ok = all(_check(y, h) for y, h in zip(ys, hosts))
  cpu, wall = [], []

  def once(i):
    c0 = time.process_time()
    t = time.perf_counter()
    jax.block_until_ready(jax_m2n.reshard(xs, dsts))
    wall.append(time.perf_counter() - t)
    cpu.append(time.process_time() - c0)
  _, kv_ops = _per_call(lambda: _timed(jax, kv, f"scale/{n}", args.iters, args.warmup,
                                       once), args.iters + args.warmup)
  received = sum(s.data.nbytes for y in ys for s in y.addressable_shards)
  _emit(part="scale", processes=n, devices=args.devices, pid=pid, ok=bool(ok),
        leaves=len(xs), first_s=first_s, repeat_cpu_ms=1e3 * float(np.mean(cpu[args.warmup:])),
        repeat_wall_ms=1e3 * float(np.mean(wall[args.warmup:])),
        kv_ops=kv_ops, received_bytes=int(received))
  return 0


def run_scale(out_dir: str, processes: Sequence[int] = (1, 4), devices: int = 16,
              layers: int = 4, iters: int = 5, warmup: int = 2, timeout_s: float = 1200,
              echo=print) -> int:
  """The scale part alone: `worker_scale` at each process count (the same per-process
  devices, layers and shard bytes); writes OUT_DIR/multiprocess_scale.{json,md}."""
  os.makedirs(out_dir, exist_ok=True)
  rows, errors = [], []
  for n in processes:
    echo(f"multiprocess scale: {n} process(es) x {devices} devices ...")
    try:
      rows += launch("scale", n, ["--devices", str(devices), "--layers", str(layers),
                                  "--iters", str(iters), "--warmup", str(warmup)],
                     timeout_s, out_dir)
    except RuntimeError as e:
      errors.append(str(e))
  lines = ["| processes x devices | leaves | per-process repeat call: CPU ms (max over "
           "processes) / wall ms | first call s | KV ops per call | bytes received per "
           "process | bitwise |", "| --- | --- | --- | --- | --- | --- | --- |"]
  table = []
  for n in processes:
    mine = [r for r in rows if r["processes"] == n]
    if not mine:
      continue
    row = {"processes": n, "devices": devices, "leaves": mine[0]["leaves"],
           "repeat_cpu_ms": max(r["repeat_cpu_ms"] for r in mine),
           "repeat_wall_ms": max(r["repeat_wall_ms"] for r in mine),
           "first_s": max(r["first_s"] for r in mine),
           "kv_ops": max(r["kv_ops"] for r in mine),
           "received_bytes": max(r["received_bytes"] for r in mine),
           "ok": all(r["ok"] for r in mine)}
    table.append(row)
    lines.append(f"| {n} x {devices} | {row['leaves']} | {row['repeat_cpu_ms']:.1f} / "
                 f"{row['repeat_wall_ms']:.1f} | {row['first_s']:.2f} | "
                 f"{row['kv_ops']:.1f} | {row['received_bytes']} | {row['ok']} |")
  if len(table) >= 2:
    lines.append(f"\nper-process repeat CPU time, {table[-1]['processes']} processes "
                 f"against {table[0]['processes']}: "
                 f"{table[-1]['repeat_cpu_ms'] / table[0]['repeat_cpu_ms']:.2f}x")
  text = "\n".join(lines)
  echo(text)
  for e in errors:
    echo("multiprocess scale error: " + e[-3000:])
  with open(os.path.join(out_dir, "multiprocess_scale.json"), "w") as f:
    json.dump({"schema": SCHEMA, "rows": table, "raw": rows, "iters": iters,
               "warmup": warmup, "layers": layers, "errors": errors}, f, indent=1)
  with open(os.path.join(out_dir, "multiprocess_scale.md"), "w") as f:
    f.write(text + "\n")
  return 1 if errors or not all(r["ok"] for r in table) else 0


def worker_fig4(args) -> int:
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  jax, kv = _init(args)
  import jax_m2n
  from jax_m2n._src.processes import bootstrap, transfer_engine
  eng = bootstrap.engine()
  pid = jax.process_index()
  r_d = args.n - 1
  by_proc = [[d for d in jax.devices() if d.process_index == p] for p in range(args.n)]
  n = int(float(args.size_mib.split(",")[0]) * MIB) // 4
  cols = 1024
  host = np.arange(n // cols * cols, dtype=np.float32).reshape(-1, cols)
  src = NamedSharding(Mesh(np.array(by_proc[0]), ("x",)), P("x", None))
  gen = Mesh(np.array([d for p in by_proc[1:] for d in p]).reshape(r_d, 2), ("dp", "tp"))
  dst = NamedSharding(gen, P(None, "tp"))
  x = jax.make_array_from_callback(host.shape, src, lambda i: host[i], dtype=host.dtype)
  # The speeds of this run: the engine's raw bandwidth (process 0 -> 1, the whole
  # tensor) and an in-process copy.
  whole = jax.device_put(host, by_proc[0][0]) if pid == 0 else None
  spec = [jax.ShapeDtypeStruct(host.shape, host.dtype, sharding=jax.sharding.
                               SingleDeviceSharding(by_proc[1][0]))]
  t_raw = _raw(jax, kv, eng, "fig4", [whole] if pid == 0 else [], lambda: spec,
               args.iters, 1)
  raw_ms = float(np.mean(t_raw))
  t0 = time.perf_counter()
  for _ in range(3):
    jax.device_put(x.addressable_shards[0].data if pid == 0 else host,
                   jax.local_devices()[1]).block_until_ready()
  copy_ms = (time.perf_counter() - t0) / 3 * 1e3
  for route in ROUTES:
    ok = _check(jax_m2n.reshard(x, dst, route=route), host)
    before = transfer_engine.stats["sent_bytes"]
    calls = args.iters + args.warmup
    times, kv_ops = _per_call(lambda: _timed(
        jax, kv, f"fig4/{route}", args.iters, args.warmup,
        lambda i: jax_m2n.reshard(x, dst, route=route).block_until_ready()), calls)
    sent = (transfer_engine.stats["sent_bytes"] - before) // calls
    plan = jax_m2n.plan(x, dst, route=route)
    _emit(part="fig4", r_d=r_d, route=route, pid=pid, ok=bool(ok),
          ms=float(np.mean(times)), min_ms=float(np.min(times)), sent=int(sent),
          plan_network=int(plan.bytes_by_link["network"]), raw_ms=raw_ms,
          copy_ms=copy_ms, bytes=int(host.nbytes), kv_ops=kv_ops,
          chunks=len(plan.chunks))
  # The same hierarchical call cut into 8x more chunks: the key-value operations per
  # call stay the same (none per chunk).
  small = max(64 << 10, plan.chunk_bytes // 8)
  _, kv_small = _per_call(lambda: [jax_m2n.reshard(
      x, dst, chunk_bytes=small).block_until_ready() for _ in range(3)], 3)
  _emit(part="fig4_chunks", r_d=r_d, pid=pid, kv_ops=kv_small,
        chunks=len(jax_m2n.plan(x, dst, chunk_bytes=small).chunks), chunk_bytes=small)
  return 0


# ---------------------------------------------------------------------------------------
# The suite
# ---------------------------------------------------------------------------------------

def _estimate_ms(route: str, r_d: int, nbytes: int, nic_gbps: float, copy_gbps: float
                 ) -> float:
  """The plan's step-by-step estimate of the fig4 case (host-only: the plan over the
  same layouts, processes as domains, each process's link at `nic_gbps`, default
  chunking)."""
  from jax_m2n._src.layout import Layout
  from jax_m2n._src.planner import plan_reshard
  from jax_m2n._src.topology import Topology
  rows = nbytes // 4 // 1024
  src_boxes = [(d, ((d * rows // 2, (d + 1) * rows // 2), (0, 1024))) for d in range(2)]
  dst_boxes = []
  for k in range(r_d):
    for t in range(2):
      dst_boxes.append((2 + 2 * k + t, ((0, rows), (t * 512, (t + 1) * 512))))
  shape = (rows, 1024)
  src_l = Layout(shape, tuple(d for d, _ in src_boxes), tuple(b for _, b in src_boxes))
  dst_l = Layout(shape, tuple(d for d, _ in dst_boxes), tuple(b for _, b in dst_boxes))
  domains = [(0, 1)] + [(2 + 2 * k, 3 + 2 * k) for k in range(r_d)]
  # The model's NIC is per device; a process's 2 devices share its host's link.
  topo = Topology(domains=domains, nic_gbps=nic_gbps / 2, nvlink_gbps=copy_gbps)
  plan = plan_reshard([src_l], [dst_l], [4], topo, route)
  return float(plan.step_estimate_ms())


def run_suite(out_dir: str, size_mib: float | Sequence[float] = 64, iters: int = 5,
              warmup: int = 2,
              timeout_s: float = 900, echo=print, hosts=None, link_gbps: float | None = None,
              r_ds: tuple[int, ...] = (2, 3), name: str = "multiprocess_cpu",
              title: str = "multiprocess (CPU)", fig4_mib: float | None = None) -> int:
  """Runs both parts (over `hosts`, an EmulatedHosts with >= max(r_ds) + 1 hosts, or
  on loopback); writes OUT_DIR/<name>.{json,md}; 0, or 1 on a failure. `link_gbps`
  (GB/s): each host's link for the estimates (default: the raw bandwidth measured);
  `size_mib`: the engine part's largest size, or its sizes; `fig4_mib`: Figure 4's
  size (default: the smallest engine size, 16 MiB)."""
  os.makedirs(out_dir, exist_ok=True)
  if isinstance(size_mib, (int, float)):
    sizes = sorted({16.0, float(size_mib)})
  else:
    sizes = sorted({float(s) for s in size_mib})
  fig4_mib = fig4_mib or min(sizes)
  common = ["--iters", str(iters), "--warmup", str(warmup)]
  rows, fig4, errors = [], [], []
  try:
    echo(f"{title} suite: engine part, 2 processes x 2 devices ...")
    rows = launch("engine", 2, common + ["--size_mib", ",".join(map(str, sizes))],
                  timeout_s, out_dir, hosts)
    for r_d in r_ds:
      echo(f"{title} suite: fig4 part, r_d = {r_d} ...")
      fig4 += launch("fig4", 1 + r_d, common + ["--size_mib", str(fig4_mib)],
                     timeout_s, out_dir, hosts)
  except RuntimeError as e:
    errors.append(str(e))
  with open(os.path.join(out_dir, f"{name}_raw.json"), "w") as f:
    json.dump({"engine": rows, "fig4": fig4}, f)  # every process's own numbers
  lines = ["| case | MiB | reshard mean / min ms | raw transfer mean / min ms | ratio | "
           "KV ops per call | chunks |", "| --- | --- | --- | --- | --- | --- | --- |"]
  table_rows = []
  for case in ("whole", "sharded"):
    for s in sizes:
      mine = [r for r in rows if r["case"] == case and r["size_mib"] == s]
      if not mine:
        continue
      m = max(r["m2n_ms"] for r in mine)
      w = max(r["raw_ms"] for r in mine)
      ok = all(r["ok"] for r in mine)
      kv = max(r["kv_ops"] for r in mine)
      table_rows.append({"case": case, "size_mib": s, "m2n_ms": m, "raw_ms": w,
                         "ratio": m / w, "ok": ok, "kv_ops": kv,
                         "chunks": mine[0]["chunks"]})
      lines.append(f"| {case}{'' if ok else ' (WRONG)'} | {s:g} | {m:.1f} / "
                   f"{max(r['m2n_min_ms'] for r in mine):.1f} | {w:.1f} / "
                   f"{max(r['raw_min_ms'] for r in mine):.1f} | {m / w:.2f} | {kv:.1f} | "
                   f"{mine[0]['chunks']} |")
  lines += ["", "| r_d | route | mean / min ms | estimate ms | measured / estimate | "
            "bytes sent (plan) | KV ops per call | chunks | flat / hierarchical |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  fig_rows = []
  for r_d in r_ds:
    mine = [r for r in fig4 if r["r_d"] == r_d and r["part"] == "fig4"]
    if not mine:
      continue
    nbytes = mine[0]["bytes"]
    raw = max(r["raw_ms"] for r in mine)
    nic = link_gbps or nbytes / (raw * 1e6)
    copy = nbytes / 2 / (max(r["copy_ms"] for r in mine) * 1e6)
    means = {route: max(r["ms"] for r in mine if r["route"] == route) for route in ROUTES}
    for route in ROUTES:
      rr = [r for r in mine if r["route"] == route]
      est = _estimate_ms(route, r_d, nbytes, nic, copy)
      sent = sum(r["sent"] for r in rr)
      ok = all(r["ok"] for r in rr)
      kv = max(r["kv_ops"] for r in rr)
      ratio = means["flat"] / means["hierarchical"] if route == "flat" else None
      fig_rows.append({"r_d": r_d, "route": route, "ms": means[route], "estimate_ms": est,
                       "sent": sent, "plan_network": rr[0]["plan_network"], "ok": ok,
                       "nic_gbps": nic, "copy_gbps": copy, "kv_ops": kv,
                       "chunks": rr[0]["chunks"], "flat_over_hierarchical": ratio})
      lines.append(f"| {r_d} | {route}{'' if ok else ' (WRONG)'} | {means[route]:.1f} / "
                   f"{min(r['min_ms'] for r in rr):.1f} | {est:.1f} | "
                   f"{means[route] / est:.2f} | {sent} ({rr[0]['plan_network']}) | "
                   f"{kv:.1f} | {rr[0]['chunks']} | "
                   f"{'' if ratio is None else f'{ratio:.2f} (goal >= {0.85 * r_d:.2f})'} |")
  chunk_rows = [r for r in fig4 if r["part"] == "fig4_chunks"]
  if chunk_rows:
    lines += ["", "| r_d | hierarchical, chunk bytes | chunks | KV ops per call |",
              "| --- | --- | --- | --- |"]
    for r_d in r_ds:
      rr = [r for r in chunk_rows if r["r_d"] == r_d]
      if rr:
        lines.append(f"| {r_d} | {rr[0]['chunk_bytes']} | {rr[0]['chunks']} | "
                     f"{max(r['kv_ops'] for r in rr):.1f} |")
  table = "\n".join(lines)
  echo(table)
  for e in errors:
    echo(f"{title} suite error: " + e[-3000:])
  with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
    json.dump({"schema": SCHEMA, "sizes_mib": sizes, "fig4_mib": fig4_mib,
               "iters": iters, "warmup": warmup,
               "placement": "loopback" if hosts is None else "emulated hosts",
               "link_gbps": link_gbps, "engine": table_rows, "fig4": fig_rows,
               "fig4_chunks": chunk_rows, "errors": errors}, f, indent=1)
  with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
    f.write(table + "\n")
  bad = errors or not all(r["ok"] for r in table_rows + fig_rows)
  return 1 if bad else 0


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--worker", choices=("engine", "fig4", "scale"))
  ap.add_argument("--pid", type=int, default=0)
  ap.add_argument("--n", type=int, default=2)
  ap.add_argument("--coordinator", default="")
  ap.add_argument("--size_mib", default="64")
  timing.add_loop_flags(ap, iters=5, warmup=2)
  ap.add_argument("--out_dir", default="/tmp/jax_m2n_bench")
  ap.add_argument("--r_d", default="2,3", help="Figure 4's r_d values (the launcher).")
  ap.add_argument("--scale", default="", help="Only the scale part at these process "
                  "counts (e.g. 1,4): per-process host time of a repeated call.")
  ap.add_argument("--devices", type=int, default=16, help="Devices per process (scale).")
  ap.add_argument("--layers", type=int, default=4, help="Layers per process (scale).")
  args = ap.parse_args(argv)
  if args.worker:
    rc = {"engine": worker_engine, "fig4": worker_fig4,
          "scale": worker_scale}[args.worker](args)
    sys.stdout.flush()
    from jax_m2n._src import jax_compat
    kv = jax_compat.distributed_client()
    if kv is None:  # one process (the scale part's baseline): no job to leave
      os._exit(rc)
    kv.wait_at_barrier("bench/end", 120_000)
    # Process 0 hosts the coordination service and leaves last: a worker still talking
    # to it when it goes is ended by JAX ("the leader task died").
    kv.key_value_set(f"bench/left/{args.pid}", "1")
    if args.pid == 0:
      deadline = time.monotonic() + 30
      while (len(kv.key_value_dir_get("bench/left/")) < args.n
             and time.monotonic() < deadline):
        time.sleep(0.05)
      time.sleep(0.2)
    os._exit(rc)  # no shutdown barrier: the launcher collects every worker's output
  if args.scale:
    return run_scale(args.out_dir, [int(n) for n in args.scale.split(",")],
                     args.devices, args.layers, args.iters, args.warmup)
  return run_suite(args.out_dir, [float(s) for s in args.size_mib.split(",")],
                   args.iters, args.warmup,
                   r_ds=tuple(int(r) for r in args.r_d.split(",")))


if __name__ == "__main__":
  sys.exit(main())
