"""The planner: from two layouts and a topology to the exact transfers of a route.

A package by concern, one way (each imports only those above it):
  transfers.py  what a transfer is; one route's transfers as columns (`Transfers`);
  routes.py     the three routes, each a function: hierarchical, flat, gather_bcast;
  chunks.py     cutting transfers into chunks and assigning their steps;
  chunking.py   the transports' fixed costs and the default chunk size of a plan;
  size.py       lower bounds on a plan's size from the layouts alone, and its limits;
  cost.py       traffic per link, the data-movement bound and the route and step estimates;
  plan.py       `plan_reshard`, the `Plan` container and its cache.
Pure and deterministic: every rank derives the same plan; never touches devices,
buffers or JAX runtime state. This module re-exports what callers import.
"""

from jax_m2n._src.planner import chunks as _chunks
from jax_m2n._src.planner import plan as _plan
from jax_m2n._src.planner import routes as _routes
from jax_m2n._src.planner import size as _size
from jax_m2n._src.planner.chunking import (
    CPU_MAX_CHUNK_BYTES, DEFAULT_TRANSPORT, GPU_MAX_CHUNK_BYTES, TRANSPORTS, Chunking,
    Transport, default_chunk_bytes)
from jax_m2n._src.planner.cost import Traffic, sol_ms
from jax_m2n._src.planner.plan import (
    Plan, TensorPlan, fmt_time, plan_reshard, plan_tensor)
from jax_m2n._src.planner.routes import route_tensor, shards
from jax_m2n._src.planner.size import (
    MAX_PLAN_CHUNKS, MAX_PLAN_TRANSFERS, PlanSize, check_plan_size, plan_size)
from jax_m2n._src.planner.transfers import (
    DST_SHARD, FULL_TMP, LINKS, ROUTES, SRC_SHARD, STAGE_CODES, STAGES, Transfer,
    Transfers)


def clear_caches() -> None:
  """Forgets every cached plan, tensor route, size bound and shared chunks (benchmarks
  of cold planning, tests that look at what a fresh plan logs)."""
  for cache in (_plan.plan_cached, _plan.plan_tensor, _size.tensor_size, _routes.shards,
                _chunks._structure_chunks):
    cache.cache_clear()
