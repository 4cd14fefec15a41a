"""A publisher process's versions in memory another program on this host can read: the
publishing side of the local data plane.

Owns one `Export` per layout set (manifest) with `keep` slots and a header a reader
checks before and after it copies (the last version begun, then per slot: slot s holds
version v when its entry is v, -v while v is being written), so a slot reused for a
newer version is never read as the old one (a seqlock: no lease, no round trip). On
CPU a slot is memory (a memfd holding one version's shards at fixed offsets: the
snapshot itself). On GPUs a slot is a table in the header's memfd: per shard, the XLA
allocation holding it (an id of `Allocations`, this process's allocations lent by
file descriptor: lent_memory.py) and its offset there; the shards stay XLA's buffers
(the snapshot, or the caller's own arrays when lent) and a reader maps their
allocations. Also this host's identity (`host_identity`), which decides whether a
subscriber may use the local path. Knows no sockets but the fd server's; copies only
through local_copy.py (local_store on the way in, CPU).
"""

from __future__ import annotations

import functools
import logging
import math
import os
import queue
import threading
from typing import Any, Callable

import numpy as np

from jax_m2n._src import lent_memory, local_copy as local_copy_lib
from jax_m2n._src import local_memory
from jax_m2n._src.errors import ReshardRuntimeError
from jax_m2n._src.layout import Box

logger = logging.getLogger("jax_m2n")

# The header: `latest`, then one int64 per slot (the version it holds), then one per
# slot (its flags: LENT), at the start of the CPU segment (or of the GPU export's
# memfd, its slot tables after it).
HEADER_BYTES = 4096
MAX_SLOTS = (HEADER_BYTES // 8 - 1) // 2
# A slot's flag: its version is the caller's own arrays (lent): a reader confirms with
# the publisher after its copy that none of them was donated or deleted meanwhile.
LENT = 1
# A GPU slot table's row per shard: (allocation id, byte offset in the allocation).
ROW_WORDS = 2
# `latest` of a closed export: past every version (none is still to be written).
CLOSED = np.iinfo(np.int64).max
# Shards start at multiples of this in a slot (the CUDA copy kernels read 32 bytes at
# once; XLA's CPU buffers are 64-byte aligned; 256 keeps both and cache lines apart).
ALIGN = 256


@functools.lru_cache(maxsize=None)
def host_identity() -> str:
  """This host as the local data plane sees it: the kernel's boot id, the network
  namespace (the fd server is an abstract Unix socket: one per namespace) and the user
  (it hands fds to the same user only). Equal on both sides = the local path works."""
  try:
    with open("/proc/sys/kernel/random/boot_id") as f:
      boot = f.read().strip()
    netns = os.stat("/proc/self/ns/net").st_ino
  except OSError:
    return ""  # not Linux: no local path
  return f"{boot}/{netns}/{os.getuid()}"


def _align(n: int) -> int:
  return -(-n // ALIGN) * ALIGN


class Allocations:
  """This process's XLA allocations lent to local readers (GPU): each allocation
  holding a shard of a held version that a reader maps, retained once under an id that
  is never reused (a reader caches its mapping by id), released once no held version
  lies in it. Any thread; one lock."""

  def __init__(self):
    self._lock = threading.Lock()
    self._ids: dict[int, int] = {}  # driver handle -> id
    self.held: dict[int, lent_memory.Allocation] = {}  # id -> allocation
    self._next = 1

  def locate(self, array: Any) -> tuple[int, int, lent_memory.Allocation]:
    """(id, byte offset, allocation) of a single-device array's buffer.

    Raises:
      ReshardRuntimeError: the buffer is not in one VMM allocation (then it cannot be
        lent by one file descriptor).
    """
    pointer = array.unsafe_buffer_pointer()
    a = lent_memory.allocation_of(pointer, int(array.device.local_hardware_id))
    with self._lock:
      got = self._ids.get(a.handle)
      if got is None:
        got = self._ids[a.handle] = self._next
        self._next += 1
        self.held[got] = a
        fresh = None
      else:
        fresh = a
      a = self.held[got]
    if fresh is not None:
      lent_memory.release(fresh)  # the one reference we keep is the first
    if pointer + int(array.nbytes) > a.base + a.nbytes:
      raise ReshardRuntimeError(
          f"Publisher: a lent shard must lie in one allocation; got {array.nbytes} bytes "
          f"at offset {pointer - a.base} of a {a.nbytes}-byte allocation.")
    return got, pointer - a.base, a

  def sizes(self) -> list[int]:
    """The bytes of each allocation lent now."""
    with self._lock:
      return [a.nbytes for a in self.held.values()]

  def keep_only(self, live: set[int]) -> None:
    """Releases the allocations no held version lies in any more."""
    with self._lock:
      gone = [i for i in self.held if i not in live]
      dropped = [self.held.pop(i) for i in gone]
      for a in dropped:
        self._ids.pop(a.handle, None)
    for a in dropped:
      try:
        lent_memory.release(a)
      except ReshardRuntimeError as e:
        logger.warning("jax_m2n Publisher: releasing a lent allocation failed: %s", e)

  def describe(self, ids: list[int], fds: local_memory.FdServer) -> list[list[Any]]:
    """[[id, bytes, ticket (hex)], ...] for the held ones of `ids` (one-use tickets
    for a new file descriptor of each)."""
    out = []
    with self._lock:
      found = [(i, self.held[i]) for i in ids if i in self.held]
    for i, a in found:
      out.append([i, a.nbytes, fds.offer(lent_memory.export_fd(a)).hex()])
    return out


class Export:
  """One layout set's slots on this process.

  Args:
    shards: per (leaf, publisher device index) this process holds: (box, dtype).
    devices: per publisher device index, the jax device.
    keep: the slots (the versions held at most).
    fds: makes (once) or returns the process's fd server, which hands the segment to
      readers that show a ticket.
    allocations: on GPUs, this process's lent allocations (`Allocations`).
  """

  def __init__(self, shards: dict[tuple[int, int], tuple[Box, np.dtype]],
               devices: dict[int, Any], keep: int,
               fds: Callable[[], local_memory.FdServer],
               allocations: Allocations | None = None):
    if keep > MAX_SLOTS:
      raise ReshardRuntimeError(f"Publisher: keep must be at most {MAX_SLOTS} for the "
                                f"local data plane; got {keep}.")
    self.keep = keep
    self.platform = next(iter(devices.values())).platform
    self._fds = fds
    self.devices = devices
    self.allocations = allocations
    # Per device index, the byte offset of each of its shards in a slot, and its size.
    self.offsets: dict[tuple[int, int], int] = {}
    self.slot_bytes: dict[int, int] = {}
    for (t, k), (box, dtype) in sorted(shards.items(), key=lambda kv: (kv[0][1], kv[0][0])):
      at = self.slot_bytes.get(k, 0)
      self.offsets[(t, k)] = at
      self.slot_bytes[k] = at + _align(int(np.prod([hi - lo for lo, hi in box])) *
                                       np.dtype(dtype).itemsize or 1)
    self.lock = threading.RLock()  # held while a slot is written or read here
    self._versions = [0] * keep      # per slot, the version it holds (0: none)
    self._allocs: list[set[int]] = [set() for _ in range(keep)]  # per slot (GPU)
    self.rows = {key: i for i, key in enumerate(sorted(self.offsets))}  # GPU tables
    if self.platform == "cpu":
      self._host = local_memory.Segment.create(
          HEADER_BYTES + keep * sum(self.slot_bytes.values()))
      base, self._bases = HEADER_BYTES, {}
      for k in sorted(self.slot_bytes):
        self._bases[k] = (self._host.address + base, sum(self.slot_bytes.values()))
        base += self.slot_bytes[k]
      self.tables = None
    else:
      n = len(self.rows)
      self._host = local_memory.Segment.create(HEADER_BYTES + keep * n * ROW_WORDS * 8)
      self.tables = self._host.array[HEADER_BYTES:].view(np.int64).reshape(
          keep, n, ROW_WORDS)
      self._bases = {}
    words = self._host.array[:HEADER_BYTES].view(np.int64)
    self.latest, self.header = words[:1], words[1:1 + keep]
    self.flags = words[1 + keep:1 + 2 * keep]
    self._commits: queue.Queue = queue.Queue()
    self._committer: threading.Thread | None = None

  def pointer(self, t: int, k: int, slot: int) -> int:
    """CPU: where shard (t, k) of `slot` lies in this process."""
    return self.base(k, slot) + self.offsets[(t, k)]

  def host_shard(self, t: int, k: int, slot: int, shape: tuple[int, ...],
                 dtype: np.dtype) -> np.ndarray:
    """CPU: shard (t, k) of `slot` as a numpy view of the mapping (read it under
    `lock`, and copy what must outlive a newer version's write)."""
    start = self.pointer(t, k, slot) - self._host.address
    n = math.prod(shape) * np.dtype(dtype).itemsize
    return self._host.array[start:start + n].view(dtype).reshape(shape)

  def base(self, k: int, slot: int) -> int:
    """CPU: where device k's shards of `slot` begin in this process (shard (t, k) lies
    `offsets[(t, k)]` bytes further)."""
    base, stride = self._bases[k]
    return base + slot * stride

  def write(self, version: int, arrays: dict[tuple[int, int], Any],
            lent: bool = False) -> int:
    """Writes `version` (its shards, as single-device arrays in the published dtype)
    into the slot of the oldest version and returns the slot; the header says so once
    every byte landed (at once on CPU; from a committer thread on GPUs, once the
    arrays are ready). On GPUs the slot's table names each array's allocation and
    offset (`lent`: they are the caller's own arrays, flagged LENT).

    Raises:
      ReshardRuntimeError: GPU: an array not in one VMM allocation (the slot then
        holds no version).
    """
    with self.lock:
      slot = min(range(self.keep), key=lambda s: self._versions[s])
      self._versions[slot] = version
      self.latest[0] = version
      self.header[slot] = -version
      self.flags[slot] = LENT if lent else 0
      waits = []
      if self.platform == "cpu":  # numpy into the mapping: the buffers themselves
        data = self._host.array
        for (t, k), at in self.offsets.items():
          src = np.asarray(arrays[(t, k)]).reshape(-1).view(np.uint8)
          start = self._bases[k][0] - self._host.address + slot * self._bases[k][1] + at
          data[start:start + src.size] = src
      else:
        table, used = self.tables[slot], set()
        try:
          for key, row in self.rows.items():
            a = arrays[key]
            if a.nbytes == 0:
              table[row] = (0, 0)
              continue
            ident, offset, _ = self.allocations.locate(a)
            table[row] = (ident, offset)
            used.add(ident)
        except BaseException:
          self._versions[slot] = 0
          self.header[slot] = 0
          self._allocs[slot] = set()
          raise
        self._allocs[slot] = used
        waits = list(arrays.values())
    if all(w.is_ready() for w in waits):
      self.header[slot] = version
      return slot
    with self.lock:
      if self._committer is None:  # one per export, until it closes
        self._committer = threading.Thread(target=self._commit, daemon=True,
                                           name="jax_m2n-export-commit")
        self._committer.start()
    self._commits.put((slot, version, waits))
    return slot

  def _commit(self) -> None:
    while self._host is not None:
      try:
        slot, version, waits = self._commits.get(timeout=0.5)
      except queue.Empty:
        continue
      try:
        for w in waits:
          w.block_until_ready()
      except Exception as e:  # noqa: BLE001 - a failed store: the slot holds no version
        donated = any(getattr(w, "is_deleted", lambda: False)() for w in waits)
        (logger.info if donated else logger.warning)(
            "jax_m2n Publisher: version %d is not exported to local subscribers (%s): "
            "%s", version, "a lent array was donated or deleted before it was ready"
            if donated else "its store failed", e)
        with self.lock:  # readers find it gone, rather than waiting for it
          if self._versions[slot] == version and self.header is not None:
            self.header[slot] = 0
            self._versions[slot] = 0
            self._allocs[slot] = set()
        continue
      with self.lock:
        if self._versions[slot] == version and self.header is not None:
          self.header[slot] = version

  def forget(self, version: int) -> None:
    """The slot holding `version` (committed or being written) holds none from now
    on: called before the version's arrays are dropped, so a reader's check after its
    copy finds it gone."""
    with self.lock:
      if self.header is None:
        return
      for s in range(self.keep):
        if self._versions[s] == version:
          self.header[s] = 0
          self._versions[s] = 0
          self._allocs[s] = set()

  def allocation_ids(self) -> set[int]:
    """GPU: the allocations the slots' versions lie in."""
    with self.lock:
      return set().union(*self._allocs)

  def slot_of(self, version: int) -> int | None:
    """The slot holding `version` (committed), or None."""
    hits = np.flatnonzero(self.header == version)
    return int(hits[0]) if hits.size else None

  def memory_bytes(self) -> int:
    """The memory this export holds beside the versions' own buffers (CPU: the slots,
    which are the snapshots; GPU: the header and tables only)."""
    return 0 if self._host is None else self._host.nbytes

  def allocation_tickets(self, ids: list[int]) -> dict[str, Any]:
    """GPU: the `allocations` answer: [[id, bytes, ticket], ...] of the held ones of
    `ids`, and the fd server's name."""
    fds = self._fds()
    return {"allocations": self.allocations.describe(ids, fds), "fd_server": fds.name}

  def describe(self) -> dict[str, Any]:
    """What a reader on this host needs to map this export (tickets are one-use)."""
    fds = self._fds()
    out = {"platform": self.platform, "keep": self.keep, "pid": os.getpid(),
           "fd_server": fds.name, "fd": fds.offer(self._host.read_only_fd()).hex(),
           "fd_bytes": self._host.nbytes,
           "shards": [[t, k, at] for (t, k), at in sorted(self.offsets.items())],
           "slots": [[k, n] for k, n in sorted(self.slot_bytes.items())]}
    if self.tables is not None:  # GPU: per shard its row of the slot tables
      out["rows"] = [[t, k, i] for (t, k), i in sorted(self.rows.items())]
    return out

  def close(self) -> None:
    """Frees the memory (readers' mappings of the host segment stay valid). The header
    says no slot holds a version first, so a reader's check before or after its copy
    finds its version gone rather than returning what freed memory held (and `latest`
    past any version: none is still to be written)."""
    with self.lock:
      if self.header is not None:
        self.header[:] = 0
        self.latest[0] = CLOSED
      self._allocs = [set() for _ in range(self.keep)]
    if self._host is not None:
      with self.lock:
        self.header = self.latest = self.flags = self.tables = None
        host, self._host = self._host, None
      host.close()
