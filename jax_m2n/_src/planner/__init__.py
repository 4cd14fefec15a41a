"""The planner: from two layouts and a topology to the exact transfers of a route.

A package by concern, one way (transfers <- routes, cost, chunking <- plan):
  transfers.py  what a transfer is; one route's transfers as columns (`Transfers`);
  routes.py     the three routes, each a function: hierarchical, flat, gather_bcast;
  cost.py       traffic per link, the data-movement bound, the route and step estimates
                and the estimate of the schedule that runs;
  chunking.py   the transports' fixed costs and the default chunk size of a plan;
  plan.py       `plan_reshard`, the `Plan` container and its cache, plan-size limits.
Pure and deterministic: every rank derives the same plan; never touches devices,
buffers or JAX runtime state. This module re-exports what callers import.
"""

from jax_m2n._src.planner.chunking import (
    CPU_MAX_CHUNK_BYTES, GPU_MAX_CHUNK_BYTES, Chunking, Transport, default_chunk_bytes)
from jax_m2n._src.planner.cost import Traffic, sol_ms
from jax_m2n._src.planner.plan import (
    DEFAULT_CHUNK_BYTES, MAX_PLAN_CHUNKS, MAX_PLAN_TRANSFERS, Plan, PlanSize, TensorPlan,
    _plan_cached, _tensor_size, check_plan_size, fmt_time, logger, plan_reshard,
    plan_size, plan_tensor)
from jax_m2n._src.planner.routes import _shards, route_tensor
from jax_m2n._src.planner.transfers import (
    DST_SHARD, FULL_TMP, LINKS, ROUTES, SRC_SHARD, STAGE_CODES, STAGES, Transfer,
    Transfers)
