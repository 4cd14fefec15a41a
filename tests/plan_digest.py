"""Digests of plans over a fixed table of cases: what `planner_digest_test` compares with
the digests the planner made before a refactoring (tests/plan_digests.json).

A digest covers everything a plan decides at a given chunk size: every tensor's transfer
columns and boxes, the chunks and their steps, the SPMD encoding (with and without
staging), the bytes per link and the aggregate estimate and bound of every route. The
cases: the planner tests' explicit layouts, the CLI's, a seeded random table like the
property tests' (tests/plan_strategies.py), and the planner bench's smoke model (one plan
per stage). A helper module: every test target gets it (tests/BUILD).

Regenerate (only when a plan is meant to change, and say why in the commit):
  PYTHONPATH=. python tests/plan_digest.py > tests/plan_digests.json
"""

import hashlib
import json
import math
import random

import numpy as np

from jax_m2n._src import schedule as schedule_lib
from jax_m2n._src.layout import parse_layout
from jax_m2n._src.planner import ROUTES, plan_reshard
from jax_m2n._src.topology import Topology

# (shape, src, dst, domain_size or None, itemsize, chunk_bytes)
EXPLICIT = [
    ((4, 8), "mesh(dp=1, tp=4) P(tp, None) @0", "mesh(dp=2, tp=2) P(tp, None) @4", 8, 4,
     16 << 20),  # the CLI's example (domain size 8, its default)
    ((4, 8), "mesh(dp=1, tp=4) P(tp, None) @0", "mesh(dp=2, tp=2) P(tp, None) @4", 4, 4,
     16 << 20),
    ((4, 8), "mesh(tp=2) P(tp, None) @0", "mesh(tp=1) P(None, None) @4", None, 8, 16 << 20),
    ((4, 8), "mesh(tp=4) P(tp, None) @0", "mesh(dp=4, tp=2) P(tp, None) @4", 4, 4, 16 << 20),
    ((256, 2048, 7168), "mesh(ep=16) P(ep, None, None) @0",
     "mesh(dp=4, tp=8) P(None, None, tp) @16", 16, 2, 16 << 20),
    ((300, 64), "mesh(x=1) P(None, None) @0", "mesh(dp=3) P(None, None) @1", None, 4,
     16 << 20),
    ((1 << 16,), "mesh(x=1) P(None) @0", "mesh(dp=4) P(None) @4", 2, 4, 4096),
    ((8, 8), "mesh(a=2, b=2) P(a, b) @0", "mesh(c=4) P(None, c) @2", 2, 4, 64),
    ((8, 8), "mesh(a=4) P(a, None) @0", "mesh(b=2, c=2) P(c, b) @4", None, 4, 1),
    ((64, 16), "mesh(tp=2) P(tp, None) @0", "mesh(dp=2, tp=2) P(tp, None) @2", 2, 4, 512),
    ((8, 8), "mesh(a=2, b=2) P(a, b) @0", "mesh(dp=3, tp=2) P(None, tp) @2", 2, 4,
     16 << 20),
    ((64,), "mesh(a=8) P(a)", "mesh(a=4, b=4) P(None) @8", 4, 4, 16 << 20),
    ((4, 8), "mesh(tp=4) P(tp) @0", "mesh(dp=2, tp=2) P() @4", 8, 4, 16 << 20),
    ((1024, 8192), "mesh(x=2) P(x, None) @0", "mesh(dp=2, tp=2) P(None, tp) @2", 2, 4,
     16 << 20),  # issue 23's case
    ((1024, 8192), "mesh(x=2) P(x, None) @0", "mesh(dp=3, tp=2) P(None, tp) @2", 2, 4,
     2 << 20),
]


def _random_mesh(rng: random.Random, ndim: int) -> tuple[str, dict, list]:
  """As plan_strategies.mesh_specs, from a seeded generator."""
  n_axes = rng.randint(1, 3)
  sizes = [rng.choice([1, 2, 2, 3, 4]) for _ in range(n_axes)]
  while math.prod(sizes) > 8:
    sizes[sizes.index(max(sizes))] = 1
  names = [f"a{i}" for i in range(n_axes)]
  rng.shuffle(names)
  spec = [[] for _ in range(ndim)]
  for name in names:
    slot = rng.randint(-1, ndim - 1) if ndim else -1
    if slot >= 0:
      spec[slot].append(name)
  first = rng.randint(0, 8)
  mesh = ", ".join(f"a{i}={s}" for i, s in enumerate(sizes))
  entries = ", ".join("None" if not e else (e[0] if len(e) == 1 else "(" + ", ".join(e) + ")")
                      for e in spec)
  return f"mesh({mesh}) P({entries}) @{first}", {f"a{i}": s for i, s in enumerate(sizes)}, spec


def random_cases(n: int = 150, seed: int = 23) -> list:
  rng = random.Random(seed)
  out = []
  for _ in range(n):
    ndim = rng.randint(0, 4)
    src, src_sizes, src_spec = _random_mesh(rng, ndim)
    dst, dst_sizes, dst_spec = _random_mesh(rng, ndim)
    shape = tuple(math.lcm(math.prod(src_sizes[a] for a in src_spec[d]),
                           math.prod(dst_sizes[a] for a in dst_spec[d])) * rng.randint(1, 3)
                  for d in range(ndim))
    out.append((shape, src, dst, rng.choice([None, 1, 2, 3, 4, 8]), rng.choice([1, 2, 4, 8]),
                rng.choice([8, 64, 1 << 20])))
  return out


def model_cases() -> list:
  """The planner bench's smoke model: one multi-tensor plan per pipeline stage."""
  from jax_m2n.bench import suites
  model = suites.SMOKE_PLANNER
  return [(model.name, s, rows, model.domain_size)
          for s, rows in enumerate(model.descriptors())]


def _hash_plan(h, plan) -> None:
  for tp in plan.tensors:
    xs = tp.transfers
    for c in ("src", "dst", "stage", "src_kind", "dst_kind", "box", "parent", "depth"):
      h.update(c.encode())
      h.update(np.ascontiguousarray(getattr(xs, c), np.int64).tobytes())
    h.update(repr(tuple(xs.boxes)).encode())
    h.update(repr(sorted(xs.extra_parents.items())).encode())
  chunks = plan.chunks
  for a in (chunks.tensor, chunks.index, chunks.transfer, chunks.step, chunks.order):
    h.update(np.ascontiguousarray(a, np.int64).tobytes())
  for part in chunks.parts:
    h.update(np.ascontiguousarray(part.lo, np.int64).tobytes())
    h.update(np.ascontiguousarray(part.hi, np.int64).tobytes())
  for staging in (False, True):
    # Its version-3 form: what the schedule says, whichever form encode wrote.
    h.update(np.ascontiguousarray(schedule_lib.widen(
        schedule_lib.encode(plan, staging=staging))).tobytes())
  h.update(json.dumps(plan.bytes_by_link, sort_keys=True).encode())
  h.update(repr((round(plan.route_estimate_ms(), 9), round(plan.sol_ms, 9))).encode())


def digest(srcs, dsts, itemsizes, topo, chunk_bytes) -> str:
  """One hex digest over the plans of every route."""
  h = hashlib.sha256()
  for route in ROUTES:
    _hash_plan(h, plan_reshard(srcs, dsts, itemsizes, topo, route, chunk_bytes))
  return h.hexdigest()


def all_digests() -> dict:
  out = {}
  for k, (shape, src, dst, domain, itemsize, chunk) in enumerate(EXPLICIT + random_cases()):
    topo = Topology(domain_size=domain, nic_gbps=12.5, nvlink_gbps=300.0)
    key = f"{k}: {shape} {src} -> {dst} domain {domain} itemsize {itemsize} chunk {chunk}"
    out[key] = digest([parse_layout(src, shape)], [parse_layout(dst, shape)], [itemsize],
                      topo, chunk)
  for name, s, rows, domain in model_cases():
    srcs = [parse_layout(src, shape) for _, shape, src, _ in rows]
    dsts = [parse_layout(dst, shape) for _, shape, _, dst in rows]
    for chunk in (1 << 20, 16 << 20):
      out[f"{name} stage {s} chunk {chunk}"] = digest(
          srcs, dsts, [2] * len(srcs), Topology(domain_size=domain), chunk)
  return out


if __name__ == "__main__":
  print(json.dumps(all_digests(), indent=1))
