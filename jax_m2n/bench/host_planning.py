"""The host cost of planning alone, without moving anything: the cases behind the
planning goals of the scale work, each in this process on CPU devices.

Owns three measurements (process CPU time beside wall time: the machine may be shared):
  pull      a first network pull's plan phase of N leaves (default 20,000 leaves of
            (256,) float32, one device per side, as bench/jobs_trees.py's "20k_leaves"):
            the manifest read from its JSON, the request's checks, the pull's plan
            (jobs/manifest.from_json, jobs/request.pull_request, jobs/planning.plan_pull).
  process   one process of a jax.distributed job of --devices devices in processes of 8
            (the paper's 256-GPU case by default): the 856-leaf DeepSeek-V3-shaped tree
            of bench/scale.py planned over every device (call_plan.plan_call, cold), then
            this process's waves (processes/transfer_engine.waves_of).
  plan      jax_m2n.plan() of that tree at --devices devices: first, and cached (median).
Usage:
  python -m jax_m2n.bench.host_planning --case pull [--leaves 20000]
  python -m jax_m2n.bench.host_planning --case process [--devices 256]
  python -m jax_m2n.bench.host_planning --case plan --devices 8
Prints one JSON line per case. Moves no data; never asserts a time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any, Callable


def _timed(fn: Callable[[], Any]) -> tuple[Any, float, float]:
  """(fn(), wall s, process CPU s)."""
  t, c = time.perf_counter(), time.process_time()
  out = fn()
  return out, time.perf_counter() - t, time.process_time() - c


def case_pull(leaves: int) -> dict:
  import jax
  jax.config.update("jax_num_cpu_devices", 2)
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  from jax_m2n._src.jobs import manifest, messages, planning, request
  tree = {f"l{i:06d}": 0 for i in range(leaves)}
  paths = [manifest.key_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
  published = manifest.Manifest(
      tuple(manifest.Leaf(p, (256,), "float32", 0) for p in paths),
      (((0,), (((0, 256),),)),), (0,), (("tcp://127.0.0.1:1", "tcp://127.0.0.1:2", "h",
                                         "net"),), manifest.skeleton_of(tree))
  body = messages.parse_object(messages.encode(published.to_json()))
  dst = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("x",)), P())
  dsts = {k: dst for k in tree}
  m, w0, c0 = _timed(lambda: manifest.from_json(body))
  req, w1, c1 = _timed(lambda: request.pull_request("pull", m, dsts, None, False,
                                                    request.PullOptions()))
  _, w2, c2 = _timed(lambda: planning.plan_pull(m, req.dsts, req.outs, "hierarchical"))
  return {"case": "pull", "leaves": leaves, "wall_s": w0 + w1 + w2, "cpu_s": c0 + c1 + c2,
          "cpu_s_manifest": c0, "cpu_s_request": c1, "cpu_s_plan": c2}


def _tree(n: int):
  import jax
  jax.config.update("jax_num_cpu_devices", n)
  from jax_m2n.bench import scale
  return jax, scale.layouts(jax, n)


def case_process(devices: int) -> dict:
  jax, (names, specs, dsts, topology) = _tree(devices)
  from jax_m2n._src import call_plan
  from jax_m2n._src.processes import transfer_engine
  from jax_m2n._src.request import Options
  call, w0, c0 = _timed(lambda: call_plan.plan_call(
      [s.shape for s in specs], [s.dtype for s in specs], [s.sharding for s in specs],
      dsts, Options(topology=topology), path="bench"))
  chunks, w1, c1 = _timed(lambda: len(call.plan.chunks))
  process_of = {d: d // 8 for d in range(devices)}
  waves, w2, c2 = _timed(lambda: transfer_engine.waves_of(call.plan, 0, process_of))
  ops = sum(len(w.local) + sum(map(len, w.sends.values())) + sum(map(len, w.recvs.values()))
            for w in waves)
  return {"case": "process", "devices": devices, "leaves": len(names), "chunks": chunks,
          "own_ops": ops, "cpu_s_plan": c0, "cpu_s_chunks": c1, "cpu_s_waves": c2,
          "wall_s": w0 + w1 + w2, "cpu_s": c0 + c1 + c2}


def case_plan(devices: int) -> dict:
  jax, (names, specs, dsts, topology) = _tree(devices)
  import jax_m2n
  x, d = dict(zip(names, specs)), dict(zip(names, dsts))
  _, w0, c0 = _timed(lambda: jax_m2n.plan(x, d, topology=topology))
  reps = [_timed(lambda: jax_m2n.plan(x, d, topology=topology))[1:] for _ in range(9)]
  return {"case": "plan", "devices": devices, "leaves": len(names), "first_wall_s": w0,
          "first_cpu_s": c0, "cached_wall_ms": 1e3 * statistics.median(w for w, _ in reps),
          "cached_cpu_ms": 1e3 * statistics.median(c for _, c in reps)}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--case", choices=("pull", "process", "plan"), required=True)
  ap.add_argument("--leaves", type=int, default=20_000, help="pull: leaves.")
  ap.add_argument("--devices", type=int, default=256, help="process, plan: devices.")
  args = ap.parse_args(argv)
  import jax
  jax.config.update("jax_platforms", "cpu")
  row = (case_pull(args.leaves) if args.case == "pull" else
         case_process(args.devices) if args.case == "process" else case_plan(args.devices))
  print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}))
  return 0


if __name__ == "__main__":
  sys.exit(main())
