"""A pull on the publisher's host: the subscribing side of the local data plane.

Owns mapping a publisher process's export of a layout set (`Import`: its host segment
through the fd server, its CUDA IPC memory), and a local pull (`run`): per destination
device one `local_copy` straight from the export's slot into the destination shards
(the flat plan's boxes; dtype conversion fused where the copies convert), between two
checks of the slot's header (a version overwritten meanwhile is never returned). No
round trip per pull: the version notice says which version, the header which slot.
Plans nothing; reads no sharding.
"""

from __future__ import annotations

import functools
import os
import select
import time
from typing import Any

import jax
import numpy as np

from jax_m2n._src import local_copy as local_copy_lib
from jax_m2n._src import local_memory
from jax_m2n._src import schedule
from jax_m2n._src.errors import ReshardRuntimeError, ReshardTimeoutError, VersionGone
from jax_m2n._src.jobs import exports, manifest as manifest_lib, messages, pieces
from jax_m2n._src.jobs.manifest import PUBLISHER_DEVICE_BASE
from jax_m2n._src.jobs.planning import PUBLISHER_PROCESS_BASE, PullPlan
from jax_m2n._src.jobs.pull import API, Pull
from jax_m2n._src.planner import DST_SHARD

# How long a pull waits for a slot being written (the publisher's copy in flight) to
# be committed before it gives up on the version.
COMMIT_WAIT_S = 10.0


class Import:
  """A publisher process's export of one layout set, mapped into this process.

  Args:
    reply: the publisher's `local` answer (`exports.Export.describe`).
    name: how messages name the publisher process.
  """

  def __init__(self, reply: dict[str, Any], name: str):
    self.name = name
    try:
      self.keep = messages.field(reply, "keep", int, lo=1, hi=exports.MAX_SLOTS)
      nbytes = messages.field(reply, "fd_bytes", int, lo=exports.HEADER_BYTES,
                              hi=1 << 48)
      ticket = bytes.fromhex(messages.field(reply, "fd", str, max_len=128))
      server = messages.field(reply, "fd_server", str, max_len=128)
      self.slots = {k: n for k, n in messages.field(reply, "slots", list)}
      self.offsets = {(t, k): at for t, k, at in messages.field(reply, "shards", list)}
      pid = messages.field(reply, "pid", int, lo=1, hi=1 << 31)
      handles = {k: bytes.fromhex(h) for k, h in reply.get("handles", [])}
    except (ValueError, TypeError) as e:
      raise ReshardRuntimeError(f"{API}: {name} answered the local request with a "
                                f"malformed description: {e}") from None
    self._host = local_memory.Segment.open(local_memory.fetch_fd(server, ticket), nbytes)
    words = self._host.array[:exports.HEADER_BYTES].view(np.int64)
    self.latest, self.header = words[:1], words[1:1 + self.keep]
    self._liveness = _pidfd(pid)
    self._device: dict[int, local_memory.DeviceSegment] = {}
    self._bases: dict[int, tuple[int, int]] = {}
    if handles:  # CUDA IPC memory, one segment per publisher device
      self._handles = handles
    else:
      base = self._host.address + exports.HEADER_BYTES
      stride = sum(self.slots.values())
      for k in sorted(self.slots):
        self._bases[k] = (base, stride)
        base += self.slots[k]

  def base(self, k: int, device: Any) -> tuple[int, int]:
    """(address of slot 0, slot stride) of publisher device k's shards, as `device`
    reaches them (CUDA IPC memory is opened on first need, on that device)."""
    if k not in self._bases:
      seg = self._device[k] = local_memory.DeviceSegment.open(
          device, self._handles[k], self.keep * self.slots[k])
      self._bases[k] = (seg.address, self.slots[k])
    return self._bases[k]

  def alive(self) -> bool:
    """Whether the publisher process still runs (its CUDA IPC memory dies with it)."""
    if self._liveness is None:
      return True
    poller = select.poll()  # not select(): fds above 1023 are common in big programs
    poller.register(self._liveness, select.POLLIN)
    return not poller.poll(0)

  def slot_of(self, version: int, deadline: float) -> int:
    """The slot holding `version`, waiting (bounded) while it is being written.

    Raises:
      VersionGone: no slot holds it (dropped, or overwritten by a newer one).
    """
    delay = 1e-4
    while True:
      hits = np.flatnonzero(self.header == version)
      if hits.size:
        return int(hits[0])
      pending = int(self.latest[0]) < version or (self.header == -version).any()
      if not pending:
        raise VersionGone(f"{API}: version {version} must be held by {self.name}; its "
                          "slot holds another version (dropped meanwhile).")
      if time.monotonic() > deadline:
        raise ReshardTimeoutError(f"{API}: version {version} must be written by "
                                  f"{self.name} in time; it was not (it lags, or stalled).")
      time.sleep(delay)
      delay = min(2 * delay, 1e-3)

  def close(self) -> None:
    for seg in self._device.values():
      seg.close()
    self._device = {}
    self.header = self.latest = None
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


def run(pull: Pull, imports: dict[int, Import]) -> list[list[jax.Array]]:
  """A local pull: per destination device one local_copy from the publisher
  processes' slots of `pull.number`; returns per leaf its local destination shards (in
  the plan's `local_dst` order).

  Raises:
    VersionGone: a slot was reused for a newer version before the copies finished.
    ReshardRuntimeError: a publisher process died (its memory may be gone).
  """
  pp = pull.plan
  devices = {d.id: d for d in jax.local_devices()}
  deadline = time.monotonic() + min(COMMIT_WAIT_S, pull.timeout_s)
  slots = {k: imp.slot_of(pull.number, deadline) for k, imp in imports.items()}
  shards: list[list[Any]] = [[None] * len(devs) for devs in pp.local_dst]
  pending = []
  for k, imp in imports.items():
    if not imp.alive():
      raise ReshardRuntimeError(f"{API}: {imp.name} must be alive to be read from; it "
                                "exited.")
  jobs, outputs_of = [], []
  for d, (outputs, sources, copy) in _copies(pp).items():
    starts, strides, procs = _addresses(pp, d, sources, imports, devices[d])
    jobs.append((copy, starts + strides * np.array([slots[p] for p in procs], np.int64)))
    outputs_of.append(outputs)
  for outputs, arrays in zip(outputs_of, local_copy_lib.copy_all(jobs)):
    for (t, j), a in zip(outputs, arrays):
      shards[t][j] = a if a.dtype == pp.out[t] else pieces.converter(pp.out[t])(a)
    pending += arrays
  jax.block_until_ready(pending)
  for k, imp in imports.items():  # the seqlock's second read: the slot still holds it
    if int(imp.header[slots[k]]) != pull.number:
      raise VersionGone(f"{API}: version {pull.number} was overwritten on {imp.name} "
                        "while it was copied (dropped meanwhile).")
  empty = [(t, j) for t, row in enumerate(shards) for j, a in enumerate(row) if a is None]
  for t, j in empty:  # an empty destination box: nothing to copy
    box = pp.plan.tensors[t].dst.box_of(pp.local_dst[t][j].id)
    shards[t][j] = jax.device_put(np.zeros(tuple(hi - lo for lo, hi in box), pp.out[t]),
                                  pp.local_dst[t][j])
  if time.monotonic() > pull.deadline:
    raise ReshardTimeoutError(f"{API}: version {pull.number} must arrive within "
                              f"timeout_s={pull.timeout_s:g}; the local copy took longer.")
  return shards



def describe_request(manifest_id: str) -> dict[str, Any]:
  """The control call asking a publisher process for its export of a layout set."""
  return {"op": "local", "manifest": manifest_id, "host": exports.host_identity()}


def published_dtypes(m: manifest_lib.Manifest) -> tuple[np.dtype, ...]:
  return tuple(manifest_lib.dtype_of(l.dtype) for l in m.leaves)
