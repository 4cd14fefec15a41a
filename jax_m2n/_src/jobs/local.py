"""A pull on the publisher's host: the subscribing side of the local data plane.

Owns mapping a publisher process's export of a layout set (`Import`: its host segment
through the fd server; on GPUs the trainer's XLA allocations its slot tables name,
each mapped once by file descriptor and cached until no held version lies in it), and
a local pull (`run`): per destination device one `local_copy` straight from the
publisher's memory into the destination shards (the flat plan's boxes; dtype
conversion fused where the copies convert), between two checks of the slot's header
(a version overwritten meanwhile is never returned); a lent version (the trainer's own
arrays) is confirmed with each publisher process after the copy (none donated or
deleted meanwhile), on the local line where the publisher offers one (line.py), else
over the control channel. Plans nothing; reads no sharding.
"""

from __future__ import annotations

import functools
import logging
import os
import select
import time
from typing import Any

import jax
import numpy as np

from jax_m2n._src import lent_memory, local_copy as local_copy_lib
from jax_m2n._src import local_memory
from jax_m2n._src import schedule
from jax_m2n._src.errors import (ReshardRuntimeError, ReshardTimeoutError, Unconfirmed,
                                 VersionGone)
from jax_m2n._src.jobs import exports, line as line_lib, manifest as manifest_lib
from jax_m2n._src.jobs import messages, pieces
from jax_m2n._src.jobs.manifest import PUBLISHER_DEVICE_BASE
from jax_m2n._src.jobs.planning import PUBLISHER_PROCESS_BASE, PullPlan
from jax_m2n._src.jobs.pull import API, Pull
from jax_m2n._src.planner import DST_SHARD

logger = logging.getLogger("jax_m2n")

# How long a pull waits for a slot being written (the publisher's copy in flight) to
# be committed before it gives up on the version.
COMMIT_WAIT_S = 10.0
# How long a publisher process may take to answer a lent pull's confirmation (answered
# on its server thread: a dead or stalled one is named within this), and the tickets
# of its allocations (its worker thread, which may be cutting for another pull).
CONFIRM_S = 1.0
MAP_S = 10.0
# A pull waiting for its slot to be committed looks again after this long, doubling up
# to SLOT_POLL_MAX_S (a GPU snapshot's copy commits within a millisecond or so: a
# coarser poll would add most of a poll to the pull).
SLOT_POLL_S = 5e-5
SLOT_POLL_MAX_S = 2.5e-4
# GPU: how many (slot rows, device) address lists an Import keeps (Import.addresses).
ADDRESS_CACHE = 64


class Import:
  """A publisher process's export of one layout set, mapped into this process.

  Args:
    reply: the publisher's `local` answer (`exports.Export.describe`).
    name: how messages name the publisher process.
    manifest_id: the layout set (its allocations are asked for by it).
  """

  def __init__(self, reply: dict[str, Any], name: str, manifest_id: str = ""):
    self.name = name
    self.manifest_id = manifest_id
    try:
      self.keep = messages.field(reply, "keep", int, lo=1, hi=exports.MAX_SLOTS)
      nbytes = messages.field(reply, "fd_bytes", int, lo=exports.HEADER_BYTES,
                              hi=1 << 48)
      ticket = bytes.fromhex(messages.field(reply, "fd", str, max_len=128))
      server = messages.field(reply, "fd_server", str, max_len=128)
      self.slots = {k: n for k, n in messages.field(reply, "slots", list)}
      self.offsets = {(t, k): at for t, k, at in messages.field(reply, "shards", list)}
      pid = messages.field(reply, "pid", int, lo=1, hi=1 << 31)
      rows = {(t, k): i for t, k, i in reply.get("rows", [])}
      line = None
      if "line" in reply:  # the local line (line.py): a lent pull's confirmation
        line = (messages.field(reply, "line", str, max_len=128),
                bytes.fromhex(messages.field(reply, "line_ticket", str, max_len=128)))
    except (ValueError, TypeError) as e:
      raise ReshardRuntimeError(f"{API}: {name} answered the local request with a "
                                f"malformed description: {e}") from None
    self._host = local_memory.Segment.open(local_memory.fetch_fd(server, ticket), nbytes)
    words = self._host.array[:exports.HEADER_BYTES].view(np.int64)
    self.latest, self.header = words[:1], words[1:1 + self.keep]
    self.flags = words[1 + self.keep:1 + 2 * self.keep]
    self._liveness = _pidfd(pid)
    self.line: line_lib.Client | None = None
    self._bases: dict[int, tuple[int, int]] = {}
    self.rows = rows
    self._maps: dict[int, lent_memory.Mapping] = {}  # GPU: allocation id -> mapping
    # What `trim` saw last (which slots held a version, and their allocations): it
    # unmaps only where that changed.
    self._trimmed: bytes | None = None
    # Cleared whenever an allocation is unmapped: per slot, the allocation column of
    # its table when `missing` found all of it mapped; per (slot rows, ordinal), the
    # addresses `addresses` computed from them. A steady pull (its versions in the
    # same allocations) then skips the numpy work (0.1-0.2 ms of a lent pull on an
    # H100's host).
    self._all_mapped: dict[int, bytes] = {}
    self._addresses: dict[tuple[bytes, int], np.ndarray] = {}
    self.tables = None
    if rows:  # GPUs: per slot, each shard's (allocation id, offset)
      n = len(rows)
      if nbytes < exports.HEADER_BYTES + self.keep * n * exports.ROW_WORDS * 8:
        raise ReshardRuntimeError(f"{API}: {name} described slot tables larger than "
                                  "its segment.")
      self.tables = self._host.array[exports.HEADER_BYTES:exports.HEADER_BYTES + self.keep
                                     * n * exports.ROW_WORDS * 8].view(np.int64).reshape(
                                         self.keep, n, exports.ROW_WORDS)
    else:
      base = self._host.address + exports.HEADER_BYTES
      stride = sum(self.slots.values())
      for k in sorted(self.slots):
        self._bases[k] = (base, stride)
        base += self.slots[k]
    # The local line to the publisher process (None: confirmations take the control
    # channel; also once the line failed).
    if line is not None:
      try:
        self.line = line_lib.Client(*line)
      except (ReshardRuntimeError, ValueError) as e:
        logger.info("Subscriber.pull: the local line to %s failed (%s); confirmations "
                    "take the control channel", name, e)

  def base(self, k: int, device: Any) -> tuple[int, int]:
    """CPU: (address of slot 0, slot stride) of publisher device k's shards."""
    return self._bases[k]

  def lent(self, slot: int) -> bool:
    """Whether the slot's version is the trainer's own arrays (confirm after a copy)."""
    return bool(int(self.flags[slot]) & exports.LENT)

  def missing(self, slot: int) -> list[int]:
    """GPU: the allocations the slot's table names that are not mapped here yet."""
    column = self.tables[slot][:, 0]
    seen = column.tobytes()
    if self._all_mapped.get(slot) == seen:
      return []
    ids = [int(i) for i in np.unique(column) if i and int(i) not in self._maps]
    if not ids:
      self._all_mapped[slot] = seen
    return ids

  def map(self, client: Any, ids: list[int], ordinal: int, answer_s: float) -> None:
    """Maps allocations `ids` (asked for over the authenticated `client`: one-use
    tickets for their fds, fetched from the fd server) on device `ordinal`.

    Raises:
      VersionGone: an allocation no held version lies in any more.
    """
    reply = client.call({"op": "allocations", "manifest": self.manifest_id, "ids": ids},
                        answer_s, "the lent allocations")
    try:
      server = messages.field(reply, "fd_server", str, max_len=128)
      got = {int(i): (int(n), bytes.fromhex(t)) for i, n, t in
             messages.field(reply, "allocations", list)}
    except (ValueError, TypeError) as e:
      raise ReshardRuntimeError(f"{API}: {self.name} answered the allocations request "
                                f"malformed: {e}") from None
    for i, (n, ticket) in got.items():
      if i not in self._maps:
        self._maps[i] = lent_memory.Mapping.open(local_memory.fetch_fd(server, ticket), n,
                                                 ordinal)
    if set(ids) - set(got):
      raise VersionGone(f"{API}: the memory of the version must still be held by "
                        f"{self.name}; it was released meanwhile (dropped).")

  def addresses(self, rows: np.ndarray, slot: int, ordinal: int) -> np.ndarray:
    """GPU: the device addresses, in this process, of the shards at `rows` of the
    slot's table (their allocations mapped: `missing` first), readable from `ordinal`."""
    table = self.tables[slot][rows]
    key = (table.tobytes(), ordinal)
    got = self._addresses.get(key)
    if got is not None:
      return got
    uniq, inverse = np.unique(table[:, 0], return_inverse=True)
    bases = np.zeros(len(uniq), np.int64)
    for j, i in enumerate(uniq.tolist()):
      if i:
        m = self._maps.get(i)
        if m is None:
          raise VersionGone(f"{API}: the slot's allocations changed while it was read on "
                            f"{self.name} (a newer version).")
        m.grant(ordinal)
        bases[j] = m.address
    got = self._addresses[key] = bases[inverse] + table[:, 1]
    while len(self._addresses) > ADDRESS_CACHE:
      self._addresses.pop(next(iter(self._addresses)))
    return got

  def trim(self) -> None:
    """GPU: unmaps the allocations no slot's version lies in any more (their versions
    retired). Copies reading them must have finished."""
    if self.tables is None or not self._maps:
      return
    held = self.header != 0
    seen = held.tobytes() + self.tables[:, :, 0].tobytes()
    if seen == self._trimmed:
      return
    self._trimmed = seen
    live = set(np.unique(self.tables[held][:, :, 0]).tolist())
    gone = [i for i in self._maps if i not in live]
    if gone:
      self._all_mapped.clear()
      self._addresses.clear()
    for i in gone:
      self._maps.pop(i).close()

  def alive(self) -> bool:
    """Whether the publisher process still runs (its CUDA IPC memory dies with it)."""
    if self._liveness is None:
      return True
    poller = select.poll()  # not select(): fds above 1023 are common in big programs
    poller.register(self._liveness, select.POLLIN)
    return not poller.poll(0)

  def slot_of(self, version: int, deadline: float) -> int:
    """The slot holding `version`, waiting (bounded) while it is being written, and
    only while the publisher process runs (killed mid-write, it never finishes).

    Raises:
      VersionGone: no slot holds it (dropped, or overwritten by a newer one).
      ReshardRuntimeError: the publisher process exited before it was written.
    """
    delay = SLOT_POLL_S
    while True:
      hits = np.flatnonzero(self.header == version)
      if hits.size:
        return int(hits[0])
      pending = int(self.latest[0]) < version or (self.header == -version).any()
      if not pending:
        raise VersionGone(f"{API}: version {version} must be held by {self.name}; its "
                          "slot holds another version (dropped meanwhile).")
      if not self.alive():
        raise ReshardRuntimeError(f"{API}: {self.name} must be alive to write version "
                                  f"{version}; it exited while writing it.")
      if time.monotonic() > deadline:
        raise ReshardTimeoutError(f"{API}: version {version} must be written by "
                                  f"{self.name} in time; it was not (it lags, or stalled).")
      time.sleep(delay)
      delay = min(2 * delay, SLOT_POLL_MAX_S)

  def unmap(self) -> None:
    """GPU: unmaps every allocation mapped here (copies reading them finished)."""
    maps, self._maps = self._maps, {}
    self._trimmed = None
    self._all_mapped.clear()
    self._addresses.clear()
    for m in maps.values():
      try:
        m.close()
      except ReshardRuntimeError:
        pass  # the publisher's memory is gone with it

  def close(self) -> None:
    self.unmap()
    if self.line is not None:
      self.line.close()
      self.line = None
    self.header = self.latest = self.flags = self.tables = None
    self._host.close()
    if self._liveness is not None:
      os.close(self._liveness)
      self._liveness = None


def _pidfd(pid: int) -> int | None:
  """A descriptor that becomes readable when process `pid` exits (None where the
  kernel or the pid namespace does not give one: the check is then skipped)."""
  try:
    return os.pidfd_open(pid)
  except (AttributeError, OSError):
    return None


def prepare(pp: PullPlan) -> None:
  """Compiles a plan's copies now (`Subscriber.prepare`), not on its first pull."""
  _copies(pp)


@functools.lru_cache(maxsize=64)
def _copies(pp: PullPlan) -> dict[int, tuple[list[tuple[int, int]],
                                             list[tuple[int, int, int]], Any]]:
  """Per destination device of this process: its outputs (leaf, position in
  pp.local_dst[leaf]), its sources (publisher process, leaf, publisher device) and the
  prepared local_copy (`local_copy.copier`) of the flat plan's boxes into them, in the
  dtype the copy delivers (the result's, or the published one where only astype
  converts). Prepared once per plan: a pull that recurs pays only the copies."""
  per_device: dict[int, Any] = {}
  for t, tp in enumerate(pp.plan.tensors):
    local = {d.id: j for j, d in enumerate(pp.local_dst[t])}
    published = pp.published[t]
    delivered = pp.out[t] if (pp.out[t] == published or schedule.fused_conversion(
        published, pp.out[t])) else published
    tr = tp.transfers
    for i in range(len(tr)):
      x = tr[i]
      if x.dst not in local or x.dst_kind != DST_SHARD:
        continue
      outputs, sources, boxes, outs, index, slot_of = per_device.setdefault(
          x.dst, ([], [], [], [], {}, {}))
      dbox = tp.dst.box_of(x.dst)
      if t not in index:
        index[t] = len(outputs)
        outputs.append((t, local[x.dst]))
        outs.append(local_copy_lib.Out(tuple(hi - lo for lo, hi in dbox), delivered))
      source = (pp.process_of[x.src] - PUBLISHER_PROCESS_BASE, t,
                x.src - PUBLISHER_DEVICE_BASE)
      if source not in slot_of:
        slot_of[source] = len(sources)
        sources.append(source)
      sbox = tp.src.box_of(x.src)
      boxes.append(local_copy_lib.Box(
          index[t], slot_of[source], tuple(hi - lo for lo, hi in sbox), published,
          tuple(lo - s for (lo, _), (s, _) in zip(x.box, sbox)),
          tuple(lo - d for (lo, _), (d, _) in zip(x.box, dbox)),
          tuple(hi - lo for lo, hi in x.box)))
  devices = {d.id: d for d in jax.local_devices()}
  return {d: (outputs, sources, local_copy_lib.copier(devices[d], boxes, outs,
                                                       len(sources)))
          for d, (outputs, sources, boxes, outs, _, _) in per_device.items()}


def _addresses(pp: PullPlan, d: int, sources, imports: dict[int, Import], device: Any
               ) -> tuple[np.ndarray, np.ndarray, list[int]]:
  """Per source of device d's copy: its address in slot 0 and the slot stride (int64
  arrays), and its publisher process (cached per plan, device and import)."""
  key = (id(pp), d)
  got = _ADDRESSES.get(key)
  if got is None or any(got[3].get(p) is not imp for p, imp in imports.items()):
    starts, strides, procs = [], [], []
    for p, t, k in sources:
      base, stride = imports[p].base(k, device)
      starts.append(base + imports[p].offsets[(t, k)])
      strides.append(stride)
      procs.append(p)
    got = _ADDRESSES[key] = (np.array(starts, np.int64), np.array(strides, np.int64),
                             procs, dict(imports))
    while len(_ADDRESSES) > 1024:
      _ADDRESSES.pop(next(iter(_ADDRESSES)))
  return got[0], got[1], got[2]


# (plan id, device) -> (starts, strides, processes, the imports they were made for)
_ADDRESSES: dict[tuple[int, int], Any] = {}
# (plan id, device) -> per publisher process, (positions in the sources, table rows)
_ROWS: dict[tuple[int, int], Any] = {}


def _gpu_addresses(pp: PullPlan, d: int, sources, imports: dict[int, Import],
                   slots: dict[int, int], ordinal: int) -> np.ndarray:
  """GPU: per source of device d's copy, its address in this process (the slot's
  table: allocation mapped here + offset)."""
  key = (id(pp), d)
  got = _ROWS.get(key)
  if got is None:
    per: dict[int, tuple[list[int], list[int]]] = {}
    for j, (p, t, k) in enumerate(sources):
      at, rows = per.setdefault(p, ([], []))
      at.append(j)
      rows.append(imports[p].rows[(t, k)])
    got = _ROWS[key] = {p: (np.array(a, np.int64), np.array(r, np.int64))
                        for p, (a, r) in per.items()}
    while len(_ROWS) > 1024:
      _ROWS.pop(next(iter(_ROWS)))
  out = np.zeros(len(sources), np.int64)
  for p, (at, rows) in got.items():
    out[at] = imports[p].addresses(rows, slots[p], ordinal)
  return out


def confirm(pull: Pull, imports: dict[int, Import], slots: dict[int, int],
            answer_s: float) -> None:
  """After the copies of a lent version: each publisher process it read from says the
  version is still held with its arrays alive (none donated or deleted meanwhile),
  and counts the pull (`Publisher.wait_pulled`). One round trip, all at once: on the
  local line where there is one (line.py), else the control channel (also where the
  line closed under a publisher process that still runs).

  Raises:
    VersionGone: a publisher process no longer holds it as it was.
    ReshardRuntimeError: a publisher process died, closed or stalled.
  """
  body = {"op": "pulled", "version": pull.number, "check": True}
  what = "the pull's confirmation"
  started = []  # (import, its control request, or None: asked on its line)
  for k, imp in imports.items():
    if not imp.lent(slots[k]):
      continue
    if imp.line is not None:
      try:
        imp.line.start(pull.number)
        started.append((k, None))
        continue
      except ReshardRuntimeError:
        imp.line = None  # (closed by the failure)
    started.append((k, pull.links[k].client.start(body, what)))
  held = []
  for k, seq in started:
    imp = imports[k]
    if seq is None:
      try:
        held.append(imp.line.finish(answer_s))
        continue
      except ReshardTimeoutError:
        imp.line = None
        raise
      except ReshardRuntimeError:
        imp.line = None
        if not imp.alive():
          raise
        seq = pull.links[k].client.start(body, what)  # the line alone failed
    held.append(pull.links[k].client.finish(seq, answer_s, what).get("held") is True)
  if not all(held):
    raise VersionGone(f"{API}: version {pull.number} must still be held by every "
                      "trainer process it was read from; one of its lent arrays was "
                      "donated or deleted meanwhile (a newer version then).")


def run(pull: Pull, imports: dict[int, Import], ahead: bool | None = None
        ) -> tuple[list[list[jax.Array]], bool]:
  """A local pull: per destination device one local_copy from the publisher
  processes' slots of `pull.number` (GPUs: from the allocations the slots name, mapped
  on first need); returns per leaf its local destination shards (in the plan's
  `local_dst` order), and whether the version was lent (then confirmed: `confirm`).
  Records its steps in `pull.steps` (records.LOCAL_STEPS).

  `ahead`: None where no versions request is open (pulling.Ahead); else whether the
  Ahead took the version as lent (True: no request open; False: one is, on the
  control clients this would use). A version that turns out otherwise once its slot
  is committed, or (a request open) needs an allocation mapped, raises Unconfirmed:
  the caller reads the answer and pulls again.

  Raises:
    VersionGone: a slot was reused for a newer version before the copies finished, or
      a lent version's array was donated or deleted meanwhile.
    ReshardRuntimeError: a publisher process died (its memory may be gone).
    Unconfirmed: see `ahead`.
  """
  pp = pull.plan
  steps = pull.steps
  mark = time.perf_counter()

  def step(name: str) -> None:
    nonlocal mark
    now = time.perf_counter()
    steps[name] = steps.get(name, 0.0) + now - mark
    mark = now

  devices = {d.id: d for d in jax.local_devices()}
  deadline = time.monotonic() + min(COMMIT_WAIT_S, pull.timeout_s)
  slots = {k: imp.slot_of(pull.number, deadline) for k, imp in imports.items()}
  shards: list[list[Any]] = [[None] * len(devs) for devs in pp.local_dst]
  pending = []
  for k, imp in imports.items():
    if not imp.alive():
      imp.unmap()  # (a mapping would keep the dead trainer's GPU memory)
      raise ReshardRuntimeError(f"{API}: {imp.name} must be alive to be read from; it "
                                "exited.")
  lent = any(imp.lent(slots[k]) for k, imp in imports.items())
  if ahead is not None and ahead != lent:
    raise Unconfirmed  # (the Ahead read the slot's flags while it was being written)
  step("slot")
  gpu = any(imp.tables is not None for imp in imports.values())
  if gpu:  # the allocations the slots name, mapped once (then cached)
    ordinal = int(next(iter(devices.values())).local_hardware_id)
    for k, imp in imports.items():
      ids = imp.missing(slots[k])
      if ids:
        if ahead is False:
          raise Unconfirmed  # (mapping is a control call: not while one is open)
        imp.map(pull.links[k].client, ids, ordinal, min(pull.timeout_s, MAP_S))
    step("map")
  jobs, outputs_of = [], []
  for d, (outputs, sources, copy) in _copies(pp).items():
    if gpu:
      jobs.append((copy, _gpu_addresses(pp, d, sources, imports, slots,
                                        int(devices[d].local_hardware_id))))
    else:
      starts, strides, procs = _addresses(pp, d, sources, imports, devices[d])
      jobs.append((copy, starts + strides * np.array([slots[p] for p in procs],
                                                     np.int64)))
    outputs_of.append(outputs)
  step("addresses")
  for outputs, arrays in zip(outputs_of, local_copy_lib.copy_all(jobs)):
    for (t, j), a in zip(outputs, arrays):
      shards[t][j] = a if a.dtype == pp.out[t] else pieces.converter(pp.out[t])(a)
    pending += arrays
  step("dispatch")
  jax.block_until_ready(pending)
  step("ready")
  for k, imp in imports.items():  # the seqlock's second read: the slot still holds it
    if int(imp.header[slots[k]]) != pull.number:
      raise VersionGone(f"{API}: version {pull.number} was overwritten on {imp.name} "
                        "while it was copied (dropped meanwhile).")
  step("check")
  if lent:
    confirm(pull, imports, slots, min(pull.timeout_s, CONFIRM_S))
    step("confirm")
  if gpu:
    for imp in imports.values():
      imp.trim()
    step("trim")
  empty = [(t, j) for t, row in enumerate(shards) for j, a in enumerate(row) if a is None]
  for t, j in empty:  # an empty destination box: nothing to copy
    box = pp.plan.tensors[t].dst.box_of(pp.local_dst[t][j].id)
    shards[t][j] = jax.device_put(np.zeros(tuple(hi - lo for lo, hi in box), pp.out[t]),
                                  pp.local_dst[t][j])
  if time.monotonic() > pull.deadline:
    raise ReshardTimeoutError(f"{API}: version {pull.number} must arrive within "
                              f"timeout_s={pull.timeout_s:g}; the local copy took longer.")
  return shards, lent


def describe_request(manifest_id: str) -> dict[str, Any]:
  """The control call asking a publisher process for its export of a layout set."""
  return {"op": "local", "manifest": manifest_id, "host": exports.host_identity()}


def published_dtypes(m: manifest_lib.Manifest) -> tuple[np.dtype, ...]:
  return tuple(manifest_lib.dtype_of(l.dtype) for l in m.leaves)
