"""GPU memory lent between programs on one host: XLA's own allocations, by file
descriptor.

Owns the CUDA driver calls (libcuda through ctypes, no JAX needed) of the local data
plane on GPUs. The lending side: `allocation_of(pointer)` finds and retains the VMM
allocation holding a device pointer (XLA allocates with cuMemCreate and POSIX-fd
handles), `export_fd` makes a file descriptor of it, `release` drops the reference.
The reading side: `Mapping.open(fd, nbytes, ordinal)` imports the fd, reserves and maps
the whole allocation and grants a device read access; `address + offset` is then a
device pointer for any copy (a JAX custom call, torch, cuMemcpy); `close` unmaps.

This is the interface other readers (e.g. a torch subscriber) use to read a lent
allocation: they receive (fd, nbytes, offset) through the fd server and map it here.
Knows nothing of versions, tickets, JAX arrays or sockets; copies nothing.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading

from jax_m2n._src.errors import ReshardRuntimeError

# CUmemAllocationHandleType: a POSIX file descriptor (what XLA's allocations allow).
POSIX_FD = 1
# CUmemLocationType device; CUmemAccess_flags read-write (read-only is not offered for
# device memory by the driver).
_LOCATION_DEVICE = 1
_ACCESS_READWRITE = 3
_U64, _SIZE = ctypes.c_uint64, ctypes.c_size_t


class _Location(ctypes.Structure):
  _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _Access(ctypes.Structure):
  _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class _Driver:
  """libcuda.so.1, initialized once; `call` raises ReshardRuntimeError naming the call."""

  def __init__(self):
    try:
      self.lib = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
      raise ReshardRuntimeError(f"lent memory: the CUDA driver (libcuda.so.1) must be "
                                f"loadable; got {e}.") from None
    self._contexts: dict[int, ctypes.c_void_p] = {}
    self._lock = threading.Lock()
    self.call("cuInit", 0)

  def call(self, name: str, *args) -> None:
    r = getattr(self.lib, name)(*args)
    if r != 0:
      text = ctypes.c_char_p()
      self.lib.cuGetErrorString(r, ctypes.byref(text))
      raise ReshardRuntimeError(f"lent memory: {name} must succeed; got CUDA error {r} "
                                f"({(text.value or b'?').decode()}).")

  def current(self, ordinal: int) -> None:
    """Makes device `ordinal`'s primary context (the one JAX and torch use) current on
    this thread."""
    with self._lock:
      ctx = self._contexts.get(ordinal)
      if ctx is None:
        dev, ctx = ctypes.c_int(), ctypes.c_void_p()
        self.call("cuDeviceGet", ctypes.byref(dev), ordinal)
        self.call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
        self._contexts[ordinal] = ctx
    self.call("cuCtxSetCurrent", ctx)


@functools.lru_cache(maxsize=None)
def driver() -> _Driver:
  return _Driver()


class Allocation:
  """A retained VMM allocation of this process: `handle` (drop it with `release`),
  `base` and `nbytes` (the allocation's address range), `ordinal` (its device)."""

  __slots__ = ("handle", "base", "nbytes", "ordinal")

  def __init__(self, handle: int, base: int, nbytes: int, ordinal: int):
    self.handle, self.base, self.nbytes, self.ordinal = handle, base, nbytes, ordinal


def allocation_of(pointer: int, ordinal: int) -> Allocation:
  """The allocation holding device `pointer` (of device `ordinal`), retained (one
  reference: `release` it). The driver gives the same handle for the same allocation,
  so a caller can tell two pointers in one allocation apart from two allocations.

  Raises:
    ReshardRuntimeError: the pointer is not in a VMM allocation of this process (e.g.
      cudaMalloc memory), or the driver refuses.
  """
  d = driver()
  d.current(ordinal)
  handle = _U64()
  d.call("cuMemRetainAllocationHandle", ctypes.byref(handle), ctypes.c_void_p(pointer))
  base, size = _U64(), _SIZE()
  try:
    d.call("cuMemGetAddressRange_v2", ctypes.byref(base), ctypes.byref(size),
           _U64(pointer))
  except BaseException:
    d.call("cuMemRelease", handle)
    raise
  return Allocation(handle.value, base.value, size.value, ordinal)


def export_fd(a: Allocation) -> int:
  """A new file descriptor of allocation `a` (the caller owns it; close-on-exec)."""
  d = driver()
  d.current(a.ordinal)
  fd = ctypes.c_int(-1)
  d.call("cuMemExportToShareableHandle", ctypes.byref(fd), _U64(a.handle), POSIX_FD,
         _U64(0))
  os.set_inheritable(fd.value, False)
  return fd.value


def release(a: Allocation) -> None:
  """Drops the reference `allocation_of` took (the memory stays XLA's)."""
  d = driver()
  d.current(a.ordinal)
  d.call("cuMemRelease", _U64(a.handle))


class Mapping:
  """Another program's allocation mapped into this one (read it at `address + offset`
  from the devices granted: `ordinal` at open, others with `grant`).

  Example (a reader given fd, nbytes and an offset; no JAX needed):
    m = Mapping.open(fd, nbytes, ordinal=0)   # takes ownership of fd (closed here)
    pointer = m.address + offset              # a device pointer on GPU 0
    ...copy from it, synchronize...
    m.close()
  """

  def __init__(self, handle: int, address: int, nbytes: int, ordinal: int):
    self.handle, self.address, self.nbytes = handle, address, nbytes
    self.ordinal = ordinal
    self.granted = {ordinal}

  @classmethod
  def open(cls, fd: int, nbytes: int, ordinal: int) -> "Mapping":
    """Imports allocation `fd` (closed here, mapped or not) of `nbytes` bytes, maps it
    whole and grants device `ordinal` access.

    Raises:
      ReshardRuntimeError: the driver refuses (not an allocation's fd, the wrong size,
        no access from that device).
    """
    d = driver()
    handle, address = _U64(), _U64()
    try:
      d.current(ordinal)
      d.call("cuMemImportFromShareableHandle", ctypes.byref(handle),
             ctypes.c_void_p(fd), POSIX_FD)
    finally:
      os.close(fd)
    try:
      d.call("cuMemAddressReserve", ctypes.byref(address), _SIZE(nbytes), _SIZE(0),
             _U64(0), _U64(0))
      try:
        d.call("cuMemMap", address, _SIZE(nbytes), _SIZE(0), handle, _U64(0))
        try:
          _grant(d, address.value, nbytes, ordinal)
        except BaseException:
          d.call("cuMemUnmap", address, _SIZE(nbytes))
          raise
      except BaseException:
        d.call("cuMemAddressFree", address, _SIZE(nbytes))
        raise
    except BaseException:
      d.call("cuMemRelease", handle)
      raise
    return cls(handle.value, address.value, nbytes, ordinal)

  def grant(self, ordinal: int) -> None:
    """Lets device `ordinal` read the mapping too (peer access over NVLink)."""
    if ordinal not in self.granted:
      d = driver()
      d.current(self.ordinal)
      _grant(d, self.address, self.nbytes, ordinal)
      self.granted.add(ordinal)

  def close(self) -> None:
    """Unmaps and drops the import (idempotent). Copies reading it must have finished."""
    if not self.address:
      return
    address, self.address = self.address, 0
    d = driver()
    d.current(self.ordinal)
    d.call("cuMemUnmap", _U64(address), _SIZE(self.nbytes))
    d.call("cuMemAddressFree", _U64(address), _SIZE(self.nbytes))
    d.call("cuMemRelease", _U64(self.handle))


def _grant(d: _Driver, address: int, nbytes: int, ordinal: int) -> None:
  access = _Access(_Location(_LOCATION_DEVICE, ordinal), _ACCESS_READWRITE)
  d.call("cuMemSetAccess", _U64(address), _SIZE(nbytes), ctypes.byref(access), _SIZE(1))


def device_memory_used(ordinal: int) -> tuple[int, int]:
  """(free, total) bytes of device `ordinal` as the driver reports them (cuMemGetInfo):
  what the memory figures outside XLA's allocator are read from."""
  d = driver()
  d.current(ordinal)
  free, total = _SIZE(), _SIZE()
  d.call("cuMemGetInfo_v2", ctypes.byref(free), ctypes.byref(total))
  return free.value, total.value
