"""A publisher process's versions in memory another program on this host can read: the
publishing side of the local data plane.

Owns one `Export` per layout set (manifest): `keep` slots of exportable memory, each
holding one version's shards of this process at fixed offsets (a memfd on CPU; CUDA
IPC memory per GPU), and a header a reader checks before and after it copies (the last
version begun, then per slot: slot s holds version v when its entry is v, -v while v
is being written), so a slot reused for
a newer version is never read as the old one (a seqlock: no lease, no round trip).
Also this host's identity (`host_identity`), which decides whether a subscriber may
use the local path. Knows no sockets but the fd server's; copies only through
local_copy.py (local_store on the way in).
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

from jax_m2n._src import local_copy as local_copy_lib
from jax_m2n._src import local_memory
from jax_m2n._src.errors import ReshardRuntimeError
from jax_m2n._src.layout import Box

logger = logging.getLogger("jax_m2n")

# The header: one int64 per slot at the start of the CPU segment (or of a small segment
# of its own beside CUDA IPC memory).
HEADER_BYTES = 4096
MAX_SLOTS = HEADER_BYTES // 8
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


class Export:
  """One layout set's slots on this process.

  Args:
    shards: per (leaf, publisher device index) this process holds: (box, dtype).
    devices: per publisher device index, the jax device.
    keep: the slots (the versions held at most).
    fds: makes (once) or returns the process's fd server, which hands the segment to
      readers that show a ticket.
  """

  def __init__(self, shards: dict[tuple[int, int], tuple[Box, np.dtype]],
               devices: dict[int, Any], keep: int,
               fds: Callable[[], local_memory.FdServer]):
    if keep > MAX_SLOTS:
      raise ReshardRuntimeError(f"Publisher: keep must be at most {MAX_SLOTS} for the "
                                f"local data plane; got {keep}.")
    self.keep = keep
    self.platform = next(iter(devices.values())).platform
    self._fds = fds
    self._devices = devices
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
    if self.platform == "cpu":
      self._host = local_memory.Segment.create(
          HEADER_BYTES + keep * sum(self.slot_bytes.values()))
      words = self._host.array[:HEADER_BYTES].view(np.int64)
      self.latest, self.header = words[:1], words[1:1 + keep]
      base, self._bases = HEADER_BYTES, {}
      for k in sorted(self.slot_bytes):
        self._bases[k] = (self._host.address + base, sum(self.slot_bytes.values()))
        base += self.slot_bytes[k]
      self._device: dict[int, local_memory.DeviceSegment] = {}
    else:
      self._host = local_memory.Segment.create(HEADER_BYTES)
      words = self._host.array.view(np.int64)
      self.latest, self.header = words[:1], words[1:1 + keep]
      self._device = {}
      try:
        for k, n in self.slot_bytes.items():
          self._device[k] = local_memory.DeviceSegment.create(devices[k], keep * n)
      except BaseException:
        self.close()
        raise
      self._bases = {k: (seg.address, self.slot_bytes[k])
                     for k, seg in self._device.items()}
    self._commits: queue.Queue = queue.Queue()
    self._committer: threading.Thread | None = None

  def pointer(self, t: int, k: int, slot: int) -> int:
    """Where shard (t, k) of `slot` lies in this process."""
    return self.base(k, slot) + self.offsets[(t, k)]

  def host_shard(self, t: int, k: int, slot: int, shape: tuple[int, ...],
                 dtype: np.dtype) -> np.ndarray:
    """CPU: shard (t, k) of `slot` as a numpy view of the mapping (read it under
    `lock`, and copy what must outlive a newer version's write)."""
    start = self.pointer(t, k, slot) - self._host.address
    n = math.prod(shape) * np.dtype(dtype).itemsize
    return self._host.array[start:start + n].view(dtype).reshape(shape)

  def base(self, k: int, slot: int) -> int:
    """Where device k's shards of `slot` begin in this process (shard (t, k) lies
    `offsets[(t, k)]` bytes further)."""
    base, stride = self._bases[k]
    return base + slot * stride

  def write(self, version: int, arrays: dict[tuple[int, int], Any]) -> int:
    """Writes `version` (its shards, as single-device arrays in the published dtype)
    into the slot of the oldest version and returns the slot; the header says so once
    every byte landed (at once on CPU; from a committer thread on CUDA, where the
    copies are asynchronous on each device's stream)."""
    with self.lock:
      slot = min(range(self.keep), key=lambda s: self._versions[s])
      self._versions[slot] = version
      self.latest[0] = version
      self.header[slot] = -version
      waits = []
      if self.platform == "cpu":  # numpy into the mapping: the buffers themselves
        data = self._host.array
        for (t, k), at in self.offsets.items():
          src = np.asarray(arrays[(t, k)]).reshape(-1).view(np.uint8)
          start = self._bases[k][0] - self._host.address + slot * self._bases[k][1] + at
          data[start:start + src.size] = src
      else:
        for k in sorted(self.slot_bytes):
          mine = sorted(t for (t, kk) in self.offsets if kk == k)
          if mine:
            waits.append(local_copy_lib.local_store(
                [arrays[(t, k)] for t in mine], self.pointer(mine[0], k, slot) -
                self.offsets[(mine[0], k)], [self.offsets[(t, k)] for t in mine]))
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
      except Exception as e:  # noqa: BLE001 - a failed store: the slot stays unreadable
        logger.warning("jax_m2n Publisher: storing version %d for local subscribers "
                       "failed: %s", version, e)
        continue
      with self.lock:
        if self._versions[slot] == version and self.header is not None:
          self.header[slot] = version

  def slot_of(self, version: int) -> int | None:
    """The slot holding `version` (committed), or None."""
    hits = np.flatnonzero(self.header == version)
    return int(hits[0]) if hits.size else None

  def describe(self) -> dict[str, Any]:
    """What a reader on this host needs to map this export (tickets are one-use)."""
    fds = self._fds()
    out = {"platform": self.platform, "keep": self.keep, "pid": os.getpid(),
           "fd_server": fds.name, "fd": fds.offer(self._host.read_only_fd()).hex(),
           "fd_bytes": self._host.nbytes,
           "shards": [[t, k, at] for (t, k), at in sorted(self.offsets.items())],
           "slots": [[k, n] for k, n in sorted(self.slot_bytes.items())]}
    if self._device:
      out["handles"] = [[k, seg.handle.hex()] for k, seg in sorted(self._device.items())]
    return out

  def close(self) -> None:
    """Frees the memory (readers' mappings of the host segment stay valid; CUDA IPC
    memory is freed: readers must not copy from it any more). The header says no slot
    holds a version first, so a reader's check before or after its copy finds its
    version gone rather than returning what freed memory held (and `latest` past any
    version: none is still to be written)."""
    with self.lock:
      if self.header is not None:
        self.header[:] = 0
        self.latest[0] = CLOSED
    for seg in self._device.values():
      try:
        seg.close()
      except ReshardRuntimeError as e:
        logger.warning("jax_m2n Publisher: freeing CUDA IPC memory failed: %s", e)
    self._device = {}
    if self._host is not None:
      with self.lock:
        self.header = self.latest = None
        host, self._host = self._host, None
      host.close()
