"""The CPU engine of cross-process reshards: JAX's transfer server between processes,
in-process copies inside one, driven by the plan's transfers in dependency order.

Owns executing one process's part of a plan: this process's waves of the plan, one
`await_pull`/`pull` per (wave, sending process, receiving process), all issued at once
and ordered by their data, the programs that read, move and assemble (programs.py,
built once per plan), and counting the bytes that cross processes. It never plans and
makes no key-value call itself.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import threading
import weakref
from typing import Any, Callable, Sequence

import jax
import numpy as np

from jax_m2n._src import collector, local_copy, transfer_server
from jax_m2n._src.errors import ReshardRuntimeError
from jax_m2n._src.layout import Box
from jax_m2n._src.planner import STAGES, Plan
from jax_m2n._src.processes import programs

from jax_m2n._src.errors import API as _API

# Bytes this process put on / took off the engine (every call; tests and the benchmark
# compare them with the plan's network bytes).
stats = collections.Counter()

# Fault injection for tests (tests/multiprocess_cpu_worker.py): called with a phase,
# "offered" once this process has offered its bytes. None in normal use.
_fault_hook = None

# An offer or request outlives its call's deadline by this much at the server.
_EXPIRY_MARGIN_S = 30.0


@dataclasses.dataclass(frozen=True)
class Op:
  """One transfer of the plan, as this process sees it."""

  tensor: int
  src: int            # device ids
  dst: int
  src_kind: int
  dst_kind: int
  box: Box
  stage: str


@dataclasses.dataclass
class Wave:
  """The chunks of one step: those inside this process, those it sends (by receiving
  process) and those it receives (by sending process). `depth` (the step) names the
  wave alike on every process."""

  depth: int = 0
  local: list[Op] = dataclasses.field(default_factory=list)
  sends: dict[int, list[Op]] = dataclasses.field(default_factory=dict)
  recvs: dict[int, list[Op]] = dataclasses.field(default_factory=dict)


def waves_of(plan: Plan, me: int, process_of: dict[int, int]) -> list[Wave]:
  """This process's part of `plan`, one Wave per step of its chunked schedule
  (`Plan.chunks`: a chunk runs one step after the chunks it reads, so a leader forwards
  chunk c while chunk c + 1 arrives, the paper's PIPE). A transfer in `whole_transfers`
  moves as one piece, in the step of its first chunk. Every process derives the same
  waves; a process skips the steps it has no part in.

  Host work: array operations over the plan's chunks, then a loop over this process's
  own chunks only (a process of a 256-device job does not walk the other processes'
  transfers in Python)."""
  rows = plan_rows(plan)
  chunks = plan.chunks
  transfer = np.asarray(chunks.transfer, np.int64)
  proc = rows.processes(process_of)
  ps, pd = proc[0][transfer], proc[1][transfer]
  sel = np.flatnonzero((ps == me) | (pd == me))
  whole = rows.whole[transfer[sel]]
  if whole.any():  # a whole transfer moves once, with its first chunk (step order)
    at = np.flatnonzero(whole)
    _, first = np.unique(transfer[sel[at]], return_index=True)
    keep = ~whole
    keep[at[first]] = True
    sel, whole = sel[keep], whole[keep]
  with collector.paused():
    return _own_waves(plan, chunks, rows, transfer, sel, whole, ps, pd, me)


def _own_waves(plan, chunks, rows, transfer, sel, whole, ps, pd, me) -> list[Wave]:
  """waves_of's loop over this process's chunks (`sel`)."""
  tensor = np.asarray(chunks.tensor, np.int64)[sel]
  boxes = _chunk_boxes(plan, chunks, tensor, np.asarray(chunks.index)[sel], whole,
                       transfer[sel] - rows.offsets[tensor])
  g = transfer[sel]
  by_step: dict[int, Wave] = {}
  for t, s, d, sk, dk, st, box, step, a, b in zip(
      tensor.tolist(), rows.src[g].tolist(), rows.dst[g].tolist(),
      rows.src_kind[g].tolist(), rows.dst_kind[g].tolist(), rows.stage[g].tolist(), boxes,
      np.asarray(chunks.step)[sel].tolist(), ps[sel].tolist(), pd[sel].tolist()):
    op = Op(t, s, d, sk, dk, box, STAGES[st])
    w = by_step.get(step)
    if w is None:
      w = by_step[step] = Wave(step)
    if a == b:
      w.local.append(op)
    elif a == me:
      w.sends.setdefault(b, []).append(op)
    else:
      w.recvs.setdefault(a, []).append(op)
  return [by_step[k] for k in sorted(by_step)]


def _chunk_boxes(plan: Plan, chunks: Any, tensor: np.ndarray, index: np.ndarray,
                 whole: np.ndarray, local: np.ndarray) -> list[Box]:
  """The boxes of the chunks selected (their tensors, chunk indices in the tensor's
  `TensorChunks`): a whole transfer's box (`local`: its index in the tensor's
  transfers), else the chunk's; gathered per distinct route (the tensors of one
  layout share their chunks), not per tensor."""
  out: list[Any] = [None] * len(tensor)
  if not len(tensor):
    return out
  group: dict[int, int] = {}
  first: list[int] = []
  for t, part in enumerate(chunks.parts):
    g = group.setdefault(id(part), len(group))
    if g == len(first):
      first.append(t)
  of_tensor = np.array([group[id(part)] for part in chunks.parts], np.int64)[tensor]
  order = np.argsort(of_tensor, kind="stable")
  cuts = np.flatnonzero(np.diff(of_tensor[order])) + 1
  for pos in np.split(order, cuts):
    t = first[int(of_tensor[pos[0]])]
    part, tr = chunks.parts[t], plan.tensors[t].transfers
    rank = part.rank
    k = index[pos]
    lo, hi = part.lo[k, :rank].tolist(), part.hi[k, :rank].tolist()
    boxes, box_of = tr.boxes, tr.box
    for p, wi, li, l, h in zip(pos.tolist(), whole[pos].tolist(), local[pos].tolist(),
                               lo, hi):
      out[p] = boxes[box_of[li]] if wi else tuple(zip(l, h))
  return out


@dataclasses.dataclass(frozen=True, eq=False)
class PlanRows:
  """A plan's transfers as global columns (tensor after tensor), built once per plan:
  what `waves_of` and `network_bytes` select this process's rows from."""

  offsets: np.ndarray   # (tensors + 1,) first global transfer of each tensor
  src: np.ndarray       # (transfers,) device ids
  dst: np.ndarray
  src_kind: np.ndarray
  dst_kind: np.ndarray
  stage: np.ndarray     # index into STAGES
  whole: np.ndarray     # (transfers,) bool: moved whole (`whole_transfers`)
  nbytes: np.ndarray    # (transfers,) bytes (int64, or Python ints: Transfers.nbytes)

  def processes(self, process_of: dict[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """Per transfer, the process of its source and of its destination device."""
    key = tuple(sorted(process_of.items()))
    cached = self.__dict__.get("_processes")
    if cached is not None and cached[0] == key:
      return cached[1]
    ids = np.array([k for k, _ in key], np.int64)
    procs = np.array([v for _, v in key], np.int64)
    out = []
    for devs in (self.src, self.dst):
      at = np.searchsorted(ids, devs)
      if len(devs) and (at.max() >= len(ids) or (ids[at] != devs).any()):
        missing = sorted(set(devs.tolist()) - set(ids.tolist()))[0]
        raise KeyError(missing)
      out.append(procs[at] if len(devs) else np.zeros(0, np.int64))
    object.__setattr__(self, "_processes", (key, tuple(out)))
    return out[0], out[1]


_rows_cache: "weakref.WeakKeyDictionary[Plan, PlanRows]" = weakref.WeakKeyDictionary()
_rows_lock = threading.Lock()


def plan_rows(plan: Plan) -> PlanRows:
  """The global columns of `plan` (cached per plan object)."""
  with _rows_lock:
    rows = _rows_cache.get(plan)
  if rows is not None:
    return rows
  per: dict[int, tuple] = {}  # per distinct Transfers (tensors of one layout share one)
  cols: list[tuple] = []
  for tp in plan.tensors:
    tr = tp.transfers
    c = per.get(id(tr), (None, None))
    if c[0] is not tr or c[1] != tp.itemsize:
      parent = np.asarray(tr.parent)
      read = np.zeros(len(tr), bool)
      read[parent[parent >= 0]] = True
      for ps in tr.extra_parents.values():
        read[list(ps)] = True
      c = per[id(tr)] = (tr, tp.itemsize, (parent < 0) & ~read,
                         np.asarray(tr.nbytes(tp.itemsize), np.int64))
    cols.append((tr, c[2], c[3]))
  cat = lambda xs, dt: (np.concatenate(xs).astype(dt, copy=False) if xs  # noqa: E731
                        else np.zeros(0, dt))
  counts = np.array([len(tr) for tr, _, _ in cols], np.int64)
  rows = PlanRows(
      np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
      cat([tr.src for tr, _, _ in cols], np.int64), cat([tr.dst for tr, _, _ in cols], np.int64),
      cat([tr.src_kind for tr, _, _ in cols], np.int64),
      cat([tr.dst_kind for tr, _, _ in cols], np.int64),
      cat([tr.stage for tr, _, _ in cols], np.int64), cat([w for _, w, _ in cols], bool),
      np.concatenate([n for _, _, n in cols]) if cols else np.zeros(0, np.int64))
  with _rows_lock:
    _rows_cache[plan] = rows
  return rows


def whole_transfers(plan: Plan) -> dict[int, bool]:
  """The transfers (indices into `plan.transfers`) this engine moves whole rather than
  chunk by chunk, each mapped to False: those that read a source shard and that no
  other transfer reads. Their chunks pipeline nothing (the planner cuts them to bound
  a transport's staging; the transfer server streams any size), and each would cost a
  slice on the sender and an assembly copy on the receiver: a 256 MiB copy between two
  processes took 1.6-1.8x the raw pull of the same bytes on 2 cores that way."""
  return dict.fromkeys(np.flatnonzero(plan_rows(plan).whole).tolist(), False)


def network_bytes(plan: Plan, process_of: dict[int, int]) -> int:
  """Bytes of the plan's transfers between devices of different processes."""
  rows = plan_rows(plan)
  ps, pd = rows.processes(process_of)
  return int(rows.nbytes[ps != pd].sum())


def uuid(tag: str, call: int, wave: int, sender: int, receiver: int) -> int:
  """The transfer server's request id of one (call, wave, sender, receiver). `tag` is
  the call's plan fingerprint: a process that called with other arguments requests
  other ids, so no byte can pass between processes that disagree."""
  h = hashlib.blake2b(f"{tag}/{call}/{wave}/{sender}/{receiver}".encode(), digest_size=8)
  return int.from_bytes(h.digest(), "little")


def _all_ready(arrays: Sequence[jax.Array]) -> Callable[[], bool]:
  """A `ready()` for CallWaits.wait_ready: whether every one of `arrays` is ready. A
  poll stops at the first one not ready and the next starts there: each array is
  found ready once (a rescan of a thousand outputs per poll cost about 1 ms a call)."""
  at = 0

  def ready() -> bool:
    nonlocal at
    while at < len(arrays) and arrays[at].is_ready():
      at += 1
    return at == len(arrays)
  return ready


class Run:
  """This process's part of one call: `request` (every pull, of every wave, at once:
  a pull waits at the sender's server until the sender offers its id), `offer` (after
  the agreement: every wave's reads, in-process moves and sends; programs, moves and
  sends may read arrays still arriving, ordered by their data, while a wave's local
  copies, which read raw pointers, first wait for their inputs: a leader forwards
  wave w while wave w + 1 arrives), `wait` for what was pulled and what the
  assembly reads, `assemble` (the destination shards), then `settle` for them. No
  key-value round per wave or chunk, and no Python step per transfer: the
  schedule's programs (programs.build, once per plan) hold every box."""

  def __init__(self, schedule: programs.Schedule, arrays: list[Any], waits: Any,
               tag: str):
    """`arrays`: the call's slots (schedule.slots), its source shards filled in."""
    self.schedule = schedule
    self.arrays = arrays
    self.waits = waits
    self.tag = tag
    self.eng = waits.engine
    self.pulled: dict[int, list[jax.Array]] = {}  # by sending process
    self._pointers = np.zeros(schedule.slots, np.int64)  # of the slots copies read
    # The server drops an offer (or a paused request) not taken by then: a failed
    # call's leftovers do not stay in its table.
    self._expiry = waits.deadline + _EXPIRY_MARGIN_S

  def request(self) -> None:
    """Every pull of this process's waves, one per (wave, sending process)."""
    me, n, arrays = self.waits.pid, self.waits.n, self.arrays
    for wave in self.schedule.waves:
      for peer, specs, slots in wave.recvs:
        got = transfer_server.pull(self.eng.connection(peer),
                                   uuid(self.tag, n, wave.depth, peer, me), specs,
                                   deadline=self._expiry)
        for s, a in zip(slots, got):
          arrays[s] = a
        self.pulled.setdefault(peer, []).extend(got)

  def offer(self) -> None:
    """Every wave's reads (one program per device), in-process moves (one batched
    device_put) and sends (one await_pull per receiving process), in wave order (a
    wave reads only what earlier waves delivered)."""
    me, n, arrays = self.waits.pid, self.waits.n, self.arrays
    for wave in self.schedule.waves:
      if wave.copies:
        self._ready(wave.copy_inputs)
      self._run_into(arrays, wave.copies, wave.programs)
      src, to, into = wave.moves
      if src:
        moved = jax.device_put([arrays[s] for s in src], list(to))
        for s, a in zip(into, moved):
          arrays[s] = a
      for peer, slots in wave.sends:
        out = [arrays[s] for s in slots]
        transfer_server.await_pull(self.eng.server,
                                   uuid(self.tag, n, wave.depth, me, peer), out,
                                   self._expiry)
        stats["sent_bytes"] += sum(a.nbytes for a in out)
    if _fault_hook is not None:
      _fault_hook("offered")

  def copy_inputs(self) -> list[jax.Array]:
    """The arrays the assembly's local copies read (they must be ready first: a local
    copy reads raw pointers)."""
    return [self.arrays[s] for s in self.schedule.copy_inputs]

  def assemble(self) -> list[list[jax.Array]]:
    """Per leaf, this process's destination shards (addressable device order): one
    local copy per destination device (after `wait`), a program for what a local copy
    does not express, and the arrays delivered whole."""
    sched, arrays = self.schedule, self.arrays
    flat: list[Any] = [None] * sched.out_offsets[-1]
    if sched.copies:
      self._note_pointers(sched.copy_inputs)
    self._run_into(flat, sched.copies, sched.assemble)
    for p, s in sched.passthrough:
      flat[p] = arrays[s]
    offsets = sched.out_offsets
    return [flat[offsets[t]:offsets[t + 1]] for t in range(len(offsets) - 1)]

  def _run_into(self, into: list[Any], copies, progs: Sequence[programs.Program]
                ) -> None:
    """Runs local copies (their inputs ready) then programs over this call's arrays,
    each output stored at its position of `into` (copies: the last field of each;
    programs: their `outputs`)."""
    for (_, _, _, at), got in zip(copies, self._copy(copies)):
      for p, a in zip(at, got):
        into[p] = a
    for prog in progs:
      for p, a in zip(prog.outputs, prog(self.arrays)):
        into[p] = a

  def _copy(self, copies) -> list[list[jax.Array]]:
    """Runs local copies ((copier, pointer slots, byte offsets, where the outputs
    go)) on the arrays of their slots, which are ready; per copy its outputs."""
    return local_copy.copy_all([(copier, self._pointers[slots] + offsets)
                                for copier, slots, offsets, _ in copies])

  def _note_pointers(self, slots: Sequence[int]) -> None:
    """The raw addresses of the (ready) arrays of `slots`, once per array (a local
    copy's pointers are these plus each piece's byte offset)."""
    arrays, pointers = self.arrays, self._pointers
    pointers[list(slots)] = [arrays[s].unsafe_buffer_pointer() for s in slots]

  def _ready(self, slots: Sequence[int]) -> None:
    """Waits (bounded, liveness-aware) until the arrays of `slots` are ready (a wave's
    local copies read them), watching the senders pulled from; notes their pointers."""
    ready = _all_ready([self.arrays[s] for s in slots])
    if not ready():
      senders = {p: (lambda arrs=arrs: sum(a.is_ready() for a in arrs))
                 for p, arrs in sorted(self.pulled.items())}
      self.waits.wait_ready(ready, senders, "the data this process forwards")
    self._note_pointers(slots)

  def settle(self, outputs: Sequence[jax.Array]) -> None:
    """Waits (bounded) until `outputs` (this process's own copies) are ready."""
    self.waits.wait_ready(_all_ready(outputs), {}, "this process's copies")

  def wait(self, outputs: Sequence[jax.Array]) -> None:
    """Waits (bounded, liveness-aware) until `outputs` and every pulled array are
    ready; a failed pull (its sender died, or closed its server, mid-transfer) is a
    ReshardRuntimeError naming the sender."""
    ready = _all_ready([a for arrs in self.pulled.values() for a in arrs] + list(outputs))

    def completed(arrays):
      return lambda: sum(a.is_ready() for a in arrays)

    senders = {p: completed(arrs) for p, arrs in sorted(self.pulled.items())}
    stage = ("the data from " + ", ".join(f"process {p}" for p in senders)
             if senders else "this process's copies")
    self.waits.wait_ready(ready, senders, stage)
    for peer, arrays in sorted(self.pulled.items()):
      for arr in arrays:
        try:
          arr.block_until_ready()
        except Exception as e:  # noqa: BLE001 - the engine's failure, named
          # A sender that forwards what it could not get itself fails its offer too:
          # its own failure (naming the process at fault) is the one to report.
          self.waits.relay_failure(peer)
          raise ReshardRuntimeError(
              f"{_API}: the transfer from process {peer} failed in cross-process call "
              f"#{self.waits.n} (the process died, or its connection was closed, "
              f"mid-transfer): {type(e).__name__}: {e}") from e
      stats["received_bytes"] += sum(a.nbytes for a in arrays)
