"""One process of tests/multiprocess_cpu_test.py: jax.distributed on 127.0.0.1, CPU.

Not a test by itself (no `_test` suffix). Usage, one per process, started together:
  python3 tests/multiprocess_cpu_worker.py --process-id I --num-processes N \
      --devices D --port P --scenario S [--seed K] [--cases C]
Prints one "RESULT <what> process=I ..." line per check and "DONE process=I" at the
end; exits non-zero on a failed check. Every wait inside is bounded (timeout_s).

Scenarios:
  random    C seeded random layout pairs whose device sets span processes (mesh rank
            1-2, any PartitionSpec, disjoint/overlapping/identical device sets, every
            route, dtype=, pytrees of 1-2 leaves), every result bitwise against numpy
            on every process; the bytes this process sent and the plan's network bytes.
  refit     a pytree trainer (process 0's devices) -> generator (the last process's
            devices) with dtype=bfloat16 and donate=True, then every route of a
            1 -> N-1 replicated refit with bytes sent vs the plan's network bytes,
            a 70-leaf pytree, jit over a mesh spanning processes; then `mismatch`.
  mismatch  the last process calls with another shape / dtype / sharding / route /
            pytree structure: ReshardValueError everywhere, then a healthy call works.
  raise     the last process raises before the call and exits; the others fail
            naming it, then a call over the remaining processes works.
  die       the last process dies right after offering its bytes (mid-transfer).
  vanish    the last process dies before its call (no exit hook): its beat stops.
  absent    the last process stays alive but never calls: the others time out.
  interrupt process 0 is sent SIGINT while it waits for an absent peer (Ctrl-C).
  scale     a model-shaped pytree (C layers of 4 leaves of mixed layouts and dtypes,
            every process a pipeline stage) into a (dp, tp) mesh over every process,
            3 calls bitwise; the key-value operations of each call and of a 2-leaf one.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jax_m2n.testing import workers  # noqa: E402


def _log(pid, what):
  print(f"[{time.strftime('%H:%M:%S')} process {pid}] {what}", file=sys.stderr, flush=True)


def _bits(a):
  import numpy as np
  a = np.asarray(a)
  return a.view(f"u{a.dtype.itemsize}") if a.dtype.itemsize in (1, 2, 4, 8) else a


def _check(y, host, sharding, dtype=None):
  """Every addressable shard of y equals host (cast to dtype) bitwise."""
  import numpy as np
  want = host if dtype is None else host.astype(dtype)
  assert y.shape == host.shape, (y.shape, host.shape)
  assert y.sharding == sharding or y.sharding.is_equivalent_to(sharding, y.ndim), (
      y.sharding, sharding)
  assert y.dtype == want.dtype, (y.dtype, want.dtype)
  idx = sharding.addressable_devices_indices_map(host.shape)
  assert {s.device for s in y.addressable_shards} == set(idx), "wrong devices"
  for s in y.addressable_shards:
    np.testing.assert_array_equal(_bits(s.data), _bits(want[idx[s.device]]))


def _host(rng, shape, dtype):
  import ml_dtypes
  import numpy as np
  if np.dtype(dtype) == ml_dtypes.bfloat16:
    return rng.standard_normal(shape).astype(np.float32).astype(dtype)
  if np.issubdtype(dtype, np.floating):
    return rng.standard_normal(shape).astype(dtype)
  return rng.integers(-100, 100, size=shape).astype(dtype)


def _put(jax, host, sharding):
  return jax.make_array_from_callback(host.shape, sharding, lambda i: host[i],
                                      dtype=host.dtype)


def _random_sharding(jax, rng, shape, devices):
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  n = len(devices)
  if n >= 4 and n % 2 == 0 and rng.random() < 0.5:
    mesh_shape, names = (2, n // 2), ("a", "b")
  else:
    mesh_shape, names = (n,), ("a",)
  mesh = Mesh(np.array(devices, dtype=object).reshape(mesh_shape), names)
  spec = [None] * len(shape)
  free = list(names)
  for d in rng.permutation(len(shape)).tolist():
    if not free or rng.random() < 0.3:
      continue
    size = 1
    take = []
    for a in list(free):
      k = mesh.shape[a]
      if shape[d] % (size * k) == 0 and rng.random() < 0.7:
        take.append(a)
        size *= k
    for a in take:
      free.remove(a)
    if take:
      spec[d] = take[0] if len(take) == 1 else tuple(take)
  return NamedSharding(mesh, P(*spec))


def _random_case(jax, rng):
  import ml_dtypes
  import numpy as np
  devs = jax.devices()
  nproc = jax.process_count()
  while True:
    rank = int(rng.integers(0, 4))
    shape = tuple(int(rng.choice([1, 2, 4, 6, 8, 12])) for _ in range(rank))
    kind = rng.choice(["disjoint", "overlap", "same", "any"])
    perm = [devs[i] for i in rng.permutation(len(devs))]
    sizes = [k for k in (1, 2, 3, 4, 6, 8) if k <= len(devs)]
    n_src = int(rng.choice(sizes))
    src_devs = perm[:n_src]
    if kind == "same":
      dst_devs = list(rng.permutation(np.array(src_devs, dtype=object)))
    elif kind == "disjoint" and n_src < len(devs):
      rest = perm[n_src:]
      dst_devs = rest[:int(rng.choice([k for k in sizes if k <= len(rest)]))]
    else:
      n_dst = int(rng.choice(sizes))
      dst_devs = [perm[i] for i in rng.permutation(len(devs))[:n_dst]]
    procs = {d.process_index for d in [*src_devs, *dst_devs]}
    if len(procs) < 2 and nproc > 1:
      continue
    src = _random_sharding(jax, rng, shape, src_devs)
    dst = _random_sharding(jax, rng, shape, list(dst_devs))
    dtype = rng.choice([np.float32, np.int8, ml_dtypes.bfloat16, np.int32, np.float16])
    out = None
    if np.dtype(dtype) in (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16)) and (
        rng.random() < 0.3):
      out = ml_dtypes.bfloat16 if np.dtype(dtype) == np.float32 else np.float32
    route = str(rng.choice(["hierarchical", "flat", "gather_bcast"]))
    pytree = rng.random() < 0.25
    # Small chunks: several steps per transfer (a forward or fan-out of chunk c in the
    # step after chunk c arrives).
    chunk = int(rng.choice([8, 24])) if rng.random() < 0.3 else None
    return shape, np.dtype(dtype), src, dst, out, route, pytree, chunk


def scenario_random(jax, jax_m2n, pid, args):
  import numpy as np
  from jax_m2n._src.processes import transfer_engine
  rng = np.random.default_rng(args.seed)
  ok = 0
  plan_bytes = 0
  sent0 = transfer_engine.stats["sent_bytes"]
  t0 = time.perf_counter()
  for c in range(args.cases):
    shape, dtype, src, dst, out, route, pytree, chunk = _random_case(jax, rng)
    host = _host(rng, shape, dtype)
    what = f"case {c}: {shape} {dtype} {src.spec}@{[d.id for d in src.mesh.devices.flat]}"
    what += f" -> {dst.spec}@{[d.id for d in dst.mesh.devices.flat]} {route} dtype={out}"
    what += f" chunk_bytes={chunk}"
    x = _put(jax, host, src)
    if args.verbose:
      _log(pid, what + f" pytree={pytree}")
    if pytree:
      host2 = _host(rng, (4,), np.float32)
      x2 = _put(jax, host2, jax.sharding.NamedSharding(src.mesh,
                                                       jax.sharding.PartitionSpec()))
      tree = {"w": x, "v": [x2]}
      dsts = {"w": dst, "v": [jax.sharding.NamedSharding(
          dst.mesh, jax.sharding.PartitionSpec("a") if len(dst.mesh.devices.flat) in (
              1, 2, 4) else jax.sharding.PartitionSpec())]}
      y = jax_m2n.reshard(tree, dsts, route=route, dtype=out, timeout_s=60,
                          chunk_bytes=chunk)
      plan_bytes += jax_m2n.plan(tree, dsts, route=route, dtype=out).bytes_by_link[
          "network"]
      try:
        _check(y["w"], host, dst, out)
        _check(y["v"][0], host2, y["v"][0].sharding, out)
      except AssertionError as e:
        print(f"RESULT random process={pid} FAIL {what} pytree: {e}", flush=True)
        return 1
    else:
      y = jax_m2n.reshard(x, dst, route=route, dtype=out, timeout_s=60, chunk_bytes=chunk)
      try:
        _check(y, host, dst, out)
      except AssertionError as e:
        print(f"RESULT random process={pid} FAIL {what}: {e}", flush=True)
        return 1
      p = jax_m2n.plan(x, dst, route=route, dtype=out)
      plan_bytes += p.bytes_by_link["network"]
    ok += 1
  sent = transfer_engine.stats["sent_bytes"] - sent0
  print(f"RESULT random process={pid} ok={ok} seconds={time.perf_counter() - t0:.1f} "
        f"sent={sent} plan_network={plan_bytes}", flush=True)
  return 0


def scenario_refit(jax, jax_m2n, pid, args):
  import ml_dtypes
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  from jax_m2n._src.processes import transfer_engine
  trainer = Mesh(np.array(jax.devices()[:args.devices]).reshape(2, -1), ("dp", "tp"))
  last = [d for d in jax.devices() if d.process_index == jax.process_count() - 1]
  gen = Mesh(np.array(last), ("tp",))
  rng = np.random.default_rng(3)
  hosts = {"layers": [{"w": _host(rng, (64, 32), np.float32),
                       "b": _host(rng, (32,), np.float32)} for _ in range(2)],
           "embed": _host(rng, (16, 8), np.float32)}
  src = {"layers": [{"w": NamedSharding(trainer, P("dp", "tp")),
                     "b": NamedSharding(trainer, P("tp"))} for _ in range(2)],
         "embed": NamedSharding(trainer, P(None, "tp"))}
  dst = {"layers": [{"w": NamedSharding(gen, P(None, "tp")),
                     "b": NamedSharding(gen, P())} for _ in range(2)],
         "embed": NamedSharding(gen, P("tp", None))}
  params = jax.tree.map(lambda h, s: _put(jax, h, s), hosts, src)
  y = jax_m2n.reshard(params, dst, dtype=ml_dtypes.bfloat16, donate=True, timeout_s=60)
  jax.tree.map(lambda a, h, s: _check(a, h, s, ml_dtypes.bfloat16), y, hosts, dst)
  donated = all(a.is_deleted() for a in jax.tree.leaves(params))
  print(f"RESULT refit process={pid} ok=1 donated={donated}", flush=True)
  # A large pytree (> 64 leaves: moved in groups of one layout, each a cross-process
  # call of its own, numbered alike everywhere).
  many = [_host(rng, (8, 4), np.float32) for _ in range(70)]
  s_many = NamedSharding(trainer, P("dp", None))
  d_many = NamedSharding(gen, P(None, "tp"))
  xs = [_put(jax, h, s_many) for h in many]
  ys = jax_m2n.reshard(xs, d_many, timeout_s=60)
  for y, h in zip(ys, many):
    _check(y, h, d_many)
  print(f"RESULT large_pytree process={pid} ok=1 leaves={len(ys)}", flush=True)
  # 1 source process -> every other process, replicated: the hierarchical route sends
  # each byte once per destination process, flat once per destination device.
  host = _host(rng, (256, 64), np.float32)
  s0 = NamedSharding(Mesh(np.array(jax.devices()[:args.devices]), ("x",)), P("x", None))
  rest = Mesh(np.array(jax.devices()[args.devices:]), ("x",))
  for route in ("hierarchical", "flat", "gather_bcast"):
    x = _put(jax, host, s0)
    d = NamedSharding(rest, P())
    before = transfer_engine.stats["sent_bytes"]
    y = jax_m2n.reshard(x, d, route=route, timeout_s=60)
    _check(y, host, d)
    sent = transfer_engine.stats["sent_bytes"] - before
    plan = jax_m2n.plan(x, d, route=route)
    print(f"RESULT bytes process={pid} route={route} sent={sent} "
          f"plan_network={plan.bytes_by_link['network']}", flush=True)
  # Inside jit over a mesh spanning processes: XLA's partitioner (gloo) moves it.
  import logging
  records = []
  handler = logging.Handler()
  handler.emit = records.append
  logging.getLogger("jax_m2n").addHandler(handler)
  logging.getLogger("jax_m2n").setLevel(logging.DEBUG)
  everyone = Mesh(np.array(jax.devices()), ("x",))
  host = _host(rng, (len(jax.devices()) * 2, len(jax.devices())), np.float32)
  x = _put(jax, host, NamedSharding(everyone, P("x", None)))
  d = NamedSharding(everyone, P(None, "x"))
  y = jax.jit(lambda v: jax_m2n.reshard(v, d) * 2)(x)
  _check(y, host * 2, d)
  said = any("XLA's partitioner" in r.getMessage() for r in records)
  print(f"RESULT jit process={pid} ok={int(said)}", flush=True)
  return scenario_mismatch(jax, jax_m2n, pid, args)  # one launch fewer


def scenario_scale(jax, jax_m2n, pid, args):
  """A model-shaped pytree (--cases layers of 4 leaves + 2: every process a pipeline
  stage, the generator a (dp, tp) mesh over every process), called 3 times: bitwise
  each time, and the key-value operations of each call (one call of the engine per
  reshard, whatever its leaves: as many for this pytree as for a 2-leaf one)."""
  import ml_dtypes
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  from jax_m2n._src.processes import store
  n_proc = jax.process_count()
  stages = [Mesh(np.array([d for d in jax.devices() if d.process_index == p]), ("tp",))
            for p in range(n_proc)]
  gen = Mesh(np.array(jax.devices()).reshape(-1, 2), ("dp", "tp"))
  rng = np.random.default_rng(args.seed)
  kinds = [((16, 8), np.float32, P("tp", None), P(None, "tp")),
           ((8,), np.float32, P(), P()),
           ((4, 16, 8), ml_dtypes.bfloat16, P(None, None, "tp"), P("dp", "tp", None)),
           ((32, 4), np.int32, P(None, "tp"), P(("dp", "tp"), None))]
  hosts, srcs, dsts = [], [], []
  for layer in range(args.cases):
    stage = stages[layer * n_proc // args.cases]
    for shape, dtype, sspec, dspec in kinds:
      hosts.append(_host(rng, shape, dtype))
      srcs.append(NamedSharding(stage, sspec))
      dsts.append(NamedSharding(gen, dspec))
  hosts += [_host(rng, (64, 8), np.float32), _host(rng, (8, 64), np.float32)]
  srcs += [NamedSharding(stages[0], P("tp", None)), NamedSharding(stages[-1], P(None, "tp"))]
  dsts += [NamedSharding(gen, P("tp", None)), NamedSharding(gen, P(None, "tp"))]
  xs = [_put(jax, h, s) for h, s in zip(hosts, srcs)]
  ops, seconds = [], []
  for _ in range(3):
    before = store.stats["kv_ops"]
    t0 = time.process_time()
    ys = jax_m2n.reshard(xs, dsts, timeout_s=120)
    seconds.append(time.process_time() - t0)
    ops.append(store.stats["kv_ops"] - before)
    for y, h, d in zip(ys, hosts, dsts):
      _check(y, h, d)
  small = xs[-2:]
  jax_m2n.reshard(small, dsts[-2:], timeout_s=120)
  before = store.stats["kv_ops"]
  for y, h, d in zip(jax_m2n.reshard(small, dsts[-2:], timeout_s=120), hosts[-2:],
                     dsts[-2:]):
    _check(y, h, d)
  small_ops = store.stats["kv_ops"] - before
  print(f"RESULT scale process={pid} ok=1 leaves={len(xs)} kv_first={ops[0]} "
        f"kv_repeat={max(ops[1:])} kv_small={small_ops} "
        f"repeat_cpu_s={min(seconds[1:]):.4f}", flush=True)


def _mesh_of_processes(jax, procs, spec_axes=("x",)):
  import numpy as np
  from jax.sharding import Mesh
  devs = [d for d in jax.devices() if d.process_index in procs]
  return Mesh(np.array(devs), spec_axes)


def _healthy_call(jax, jax_m2n, pid, procs, tag):
  """A call over the processes in `procs` that must work after a failure."""
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P
  if pid not in procs:
    return
  mesh = _mesh_of_processes(jax, procs)
  host = np.arange(len(mesh.devices.flat) * 6, dtype=np.float32).reshape(-1, 2)
  x = _put(jax, host, NamedSharding(mesh, P("x", None)))
  try:
    y = jax_m2n.reshard(x, NamedSharding(mesh, P(None, None)), timeout_s=30)
    _check(y, host, NamedSharding(mesh, P(None, None)))
    print(f"RESULT next_call process={pid} after={tag} ok=1", flush=True)
  except Exception as e:  # noqa: BLE001 - reported
    print(f"RESULT next_call process={pid} after={tag} FAIL {type(e).__name__}: {e}",
          flush=True)


def scenario_mismatch(jax, jax_m2n, pid, args):
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P
  everyone = list(range(jax.process_count()))
  mesh = _mesh_of_processes(jax, everyone)
  odd = pid == jax.process_count() - 1
  n = len(mesh.devices.flat)
  for field in ("shape", "dtype", "sharding", "route", "pytree"):
    shape = (n * (3 if odd and field == "shape" else 2), 4)
    dtype = np.int32 if odd and field == "dtype" else np.float32
    host = np.ones(shape, dtype)
    x = _put(jax, host, NamedSharding(mesh, P("x", None)))
    spec = P("x", None) if odd and field == "sharding" else P()
    route = "flat" if odd and field == "route" else "hierarchical"
    tree = {"b": x} if odd and field == "pytree" else {"a": x}
    t0 = time.perf_counter()
    try:
      jax_m2n.reshard(tree, NamedSharding(mesh, spec), route=route, timeout_s=30)
      print(f"RESULT mismatch process={pid} field={field} FAIL no error", flush=True)
    except jax_m2n.ReshardValueError as e:
      dt = time.perf_counter() - t0
      print(f"RESULT mismatch process={pid} field={field} ok=1 seconds={dt:.3f} "
            f"error={str(e)[:1500]!r}", flush=True)
    except Exception as e:  # noqa: BLE001 - reported
      print(f"RESULT mismatch process={pid} field={field} FAIL {type(e).__name__}: {e}",
            flush=True)
  _healthy_call(jax, jax_m2n, pid, everyone, "mismatch")
  return 0


def _failure_call(jax, jax_m2n, pid, tag, timeout_s=30.0, size=(256, 1024)):
  """Everyone but the last process calls a reshard whose data comes from the last
  process; prints how long the failure took to reach this process."""
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P
  everyone = list(range(jax.process_count()))
  mesh = _mesh_of_processes(jax, everyone)
  rows = size[0] - size[0] % len(mesh.devices.flat)
  host = np.ones((rows, size[1]), np.float32)
  x = _put(jax, host, NamedSharding(mesh, P("x", None)))
  print(f"WAITING process={pid}", flush=True)
  t0 = time.perf_counter()
  try:
    jax_m2n.reshard(x, NamedSharding(mesh, P(None, None)), timeout_s=timeout_s)
    print(f"RESULT {tag} process={pid} FAIL no error", flush=True)
  except jax_m2n.ReshardError as e:
    dt = time.perf_counter() - t0
    print(f"RESULT {tag} process={pid} ok=1 seconds={dt:.3f} type={type(e).__name__} "
          f"error={str(e)[:1500]!r}", flush=True)
  except KeyboardInterrupt:
    dt = time.perf_counter() - t0
    print(f"RESULT {tag} process={pid} ok=1 seconds={dt:.3f} type=KeyboardInterrupt",
          flush=True)


def scenario_failure(jax, jax_m2n, pid, args):
  from jax_m2n._src.processes import transfer_engine
  last = jax.process_count() - 1
  healthy = list(range(last))
  kind = args.scenario
  # A first call that works: every process has taken part once (its engine, beats and
  # exit marker are up), as in a training loop that fails at some step.
  _healthy_call(jax, jax_m2n, pid, list(range(last + 1)), "start")
  if pid == last:
    if kind == "raise":
      raise RuntimeError("the user's program failed before its reshard")
    if kind == "absent":
      time.sleep(600)
    if kind == "vanish":  # killed before its call: no exit hook, its beat stops
      os._exit(17)
    if kind == "die":
      def die(phase):
        if phase == "offered":
          os._exit(17)
      transfer_engine._fault_hook = die
    if kind == "interrupt":
      time.sleep(600)
  timeout = 2.0 if kind == "absent" else 30.0
  if kind == "interrupt" and pid != 0:
    _failure_call(jax, jax_m2n, pid, "interrupt_peer", timeout)
  else:
    _failure_call(jax, jax_m2n, pid, kind, timeout)
  _healthy_call(jax, jax_m2n, pid, healthy, kind)
  return 0


SCENARIOS = {"random": scenario_random, "refit": scenario_refit, "scale": scenario_scale,
             "mismatch": scenario_mismatch, "raise": scenario_failure,
             "die": scenario_failure, "absent": scenario_failure,
             "vanish": scenario_failure,
             "interrupt": scenario_failure}


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--process-id", type=int, required=True)
  ap.add_argument("--num-processes", type=int, required=True)
  ap.add_argument("--devices", type=int, default=2)
  ap.add_argument("--port", type=int, required=True)
  ap.add_argument("--scenario", required=True, choices=sorted(SCENARIOS))
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--cases", type=int, default=30)
  ap.add_argument("--verbose", action="store_true")
  args = ap.parse_args()
  pid = args.process_id
  import jax
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  workers.start_jax(args.devices, args.num_processes, pid, f"127.0.0.1:{args.port}")
  import jax_m2n
  rc = SCENARIOS[args.scenario](jax, jax_m2n, pid, args)
  print(f"DONE process={pid}", flush=True)
  # Process 0 leaves last, but does not wait for a process that failed on purpose.
  workers.leave_job(pid, args.num_processes, rc, expected=args.num_processes - (
      args.scenario in ("raise", "die", "absent", "interrupt", "vanish")))


if __name__ == "__main__":
  main()
