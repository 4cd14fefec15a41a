"""Chunking: the transports' fixed costs and the default chunk size of a plan.

Owns what a call, a step and a chunk cost on each transport (measured: figures and
commands below) and the rule that picks a plan's chunk bytes when the caller gives none:
enough chunks that forwarding and fan-out overlap injection, none so small that the
per-step cost dominates. Reads a plan's traffic and transfers; builds no chunks
(planner/chunks.py cuts them).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from jax_m2n._src.errors import ReshardValueError
from jax_m2n._src.planner.chunks import STEP_CHUNKS

# Bound on one chunk on CPU, and the bound the planner's own callers default to.
CPU_MAX_CHUNK_BYTES = 16 << 20
# Bound on one chunk on GPU: 64 MiB came within 5-10% of the best in every case measured
# on H200 while keeping staging at 4 x 64 MiB per device (docs/cuda_transport.md).
GPU_MAX_CHUNK_BYTES = 64 << 20
# The smallest chunk the rule picks: below it the per-chunk cost (~15 us on CPU) is more
# than a tenth of the chunk's bytes at memory speed.
MIN_CHUNK_BYTES = 64 << 10


@dataclasses.dataclass(frozen=True)
class Transport:
  """What running a schedule costs on a transport besides its bytes.

  Attributes:
    name: `cpu`, `cpu_emulated` (the CPU transport with the emulated network) or `cuda`.
    call_us: fixed cost of one call (dispatch of the per-device programs, waiting).
    step_us: cost of one step (the CPU transport's barrier of every device; one NCCL
      group or a round of copy-engine copies on CUDA).
    chunk_us: cost of one chunk on the device that runs it, serial per device.
    max_chunk_bytes: bound on one chunk (staging memory; the default chunking never
      exceeds it).
    matched_steps: whether network chunks are scheduled one per device and direction
      per step (the emulated NIC reserves a transfer's egress and ingress queues
      together, in each receiver's op order: two receivers pulling from the same two
      sources in the same order serialize; a matching never does).
  """

  name: str
  call_us: float
  step_us: float
  chunk_us: float
  max_chunk_bytes: int
  matched_steps: bool = False


# CPU, measured with scripts/chunk_cost.py on the 2-core development machine (8 CPU
# devices, 2026-12-01, load average 6-12 from other jobs): a 1-step call 0.70 ms in
# process, 0.98 ms with the emulated network; each further step 100 / 135 us (8 device
# threads meet at a barrier; with the emulator they also sleep until the NIC is done);
# each further chunk in a step ~15 us.
CPU = Transport("cpu", call_us=500.0, step_us=100.0, chunk_us=15.0,
                max_chunk_bytes=CPU_MAX_CHUNK_BYTES)
CPU_EMULATED = Transport("cpu_emulated", call_us=750.0, step_us=135.0, chunk_us=15.0,
                         max_chunk_bytes=CPU_MAX_CHUNK_BYTES, matched_steps=True)
# CUDA (copy-engine peer path and NCCL alike), not measured here: the H200 figures of
# docs/cuda_transport.md and docs/benchmarks.md: each step (one NCCL group and its
# kernels) ~13 us on top of its bytes with blocking communicators; the fixed cost of a
# 1 KiB call 0.25 ms.
CUDA = Transport("cuda", call_us=250.0, step_us=13.0, chunk_us=1.0,
                 max_chunk_bytes=GPU_MAX_CHUNK_BYTES)

TRANSPORTS = ("cpu", "cuda")
# The transport a plan is priced for when no device says which: the `Chunking` default
# and the `plan` command's `--transport` default, so the command and `jax_m2n.plan()` on
# CPU devices give the same estimates for the same call (`reshard` and `jax_m2n.plan`
# take the transport from the devices' platform: call_plan.chunking).
DEFAULT_TRANSPORT = "cpu"


@dataclasses.dataclass(frozen=True)
class Chunking:
  """How a plan is cut into chunks: for which transport, and at what size.

  Attributes:
    transport: `cpu` or `cuda` (the platform the schedule runs on; `cpu` with a
      topology that emulates the network prices the emulator).
    chunk_bytes: a fixed bound on one chunk, or None: chosen per plan by
      `default_chunk_bytes`.
  """

  transport: str = DEFAULT_TRANSPORT
  chunk_bytes: int | None = None

  def __post_init__(self):
    if self.transport not in TRANSPORTS:
      raise ReshardValueError(f"Chunking: transport must be one of {TRANSPORTS}; got "
                       f"{self.transport!r}.")


def transport_of(chunking: Chunking, topology) -> Transport:
  if chunking.transport == "cuda":
    return CUDA
  return CPU_EMULATED if topology.emulate_network else CPU


def _pipeline(plan) -> tuple[float, int, int, int]:
  """(T ms, hops, largest pipelined transfer bytes, busiest device's bytes on its
  slowest link): what the rule needs, from the traffic and the transfer columns."""
  topo = plan.topology
  traffic = plan.traffic
  t_ms = traffic.time_ms(topo)
  # The busiest (device, direction, link): the first of the longest, devices in
  # order of first appearance, egress first, nvlink before network.
  loads = traffic.loads().reshape(-1)
  busiest = int(loads[int(traffic.link_ms(topo).argmax())]) if loads.size else 0
  hops = 0
  largest = 0
  distinct = {id(tp): tp for tp in plan.tensors}  # shared TensorPlans once each
  for tp in distinct.values():
    tp_hops, tp_largest = _hops_and_largest(tp)
    hops, largest = max(hops, tp_hops), max(largest, tp_largest)
  return t_ms, hops, largest, busiest


def _hops_and_largest(tp) -> tuple[int, int]:
  """(longest chain of parents, bytes of the largest transfer another reads) of one
  TensorPlan."""
  xs = tp.transfers
  if not len(xs):
    return 0, 0
  read = xs.parent[xs.parent >= 0]
  if xs.extra_parents:
    read = np.concatenate([read, np.array([p for ps in xs.extra_parents.values()
                                           for p in ps], read.dtype)])
  largest = int(xs.nbytes(tp.itemsize)[np.unique(read)].max()) if len(read) else 0
  return int(xs.depth.max()), largest


def model_ms(t_ms: float, hops: int, n: int, transport: Transport) -> float:
  """The rule's model of a pipelined schedule of n chunk-steps and `hops` fill steps,
  each step T / n long plus the step cost, plus the call."""
  return (t_ms * (n + hops) / n + (n + hops) * transport.step_us * 1e-3
          + transport.call_us * 1e-3)


def default_chunk_bytes(plan, transport: Transport) -> int:
  """The chunk bytes of `plan` when the caller names none.

  With no forwarding or fan-out (no transfer reads another's output, `hops` = 0)
  nothing overlaps: the transport's bound (fewest steps). Else, among powers of two from
  MIN_CHUNK_BYTES to the bound, the one that minimizes `model_ms`: n chunk-steps of the
  slowest stage (T, the route's aggregate time) and `hops` steps to fill and drain the
  pipeline, each step costing `step_us` more: T (n + hops) / n + (n + hops) step_us,
  smallest near n = sqrt(hops T / step_us). n is what one step can carry at chunk size
  c: the largest transfer that others read, in chunks (each step moves one chunk of
  every transfer at once), or, where steps are matched (`Transport.matched_steps`), the
  busiest device's bytes in chunks (one network chunk per device and direction per
  step); never fewer than the waves of `chunks.STEP_CHUNKS` chunks per
  device and step need.
  """
  cap = transport.max_chunk_bytes
  pipeline = _pipeline(plan)
  t_ms, hops, largest, _ = pipeline
  if hops == 0 or largest == 0 or t_ms <= 0:
    return cap
  best, best_ms = cap, math.inf
  c = cap
  while True:
    ms = _model_at(pipeline, c, transport)
    if ms < best_ms * (1 - 1e-9):
      best, best_ms = c, ms
    if c <= MIN_CHUNK_BYTES:
      break
    c = max(MIN_CHUNK_BYTES, c // 2)
  return best


def _model_at(pipeline, chunk_bytes: int, transport: Transport) -> float:
  t_ms, hops, largest, busiest = pipeline
  per_step = busiest if transport.matched_steps else largest
  n = max(math.ceil(per_step / chunk_bytes),
          math.ceil(busiest / (STEP_CHUNKS * chunk_bytes)), 1)
  return model_ms(t_ms, hops if largest else 0, n, transport)


def modelled_ms(plan) -> float:
  """The rule's model of `plan`'s schedule at its chunk bytes (`model_ms`), from its
  traffic and transfer columns alone: what `cost.schedule_ms` reports for a plan too
  large to chunk for an estimate."""
  return _model_at(_pipeline(plan), plan.chunk_bytes, plan.transport)
