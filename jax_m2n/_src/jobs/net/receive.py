"""One fetch of the "net" transport: its checked arguments and its reply's receive
state machine (a HEAD, then the arrays inline or chunk by chunk in order, into
64-byte-aligned buffers, then placed on their devices in one `jax.device_put`).

Owns a fetch's own state and the checks of every byte against what was asked; it
never owns a socket, a connection or the table of fetches in flight (fetches.py).
"""

from __future__ import annotations

import concurrent.futures
import math
import time
from typing import Any, Sequence

import jax
import numpy as np

from jax_m2n._src.errors import ReshardRuntimeError, ReshardTimeoutError, ReshardValueError
from jax_m2n._src.jobs import channel
from jax_m2n._src.jobs.net import wire
from jax_m2n._src.jobs.transport import OFFER_GRACE_S, Pending

API = wire.API

# Buffers that JAX's CPU client aliases instead of copying (measured: `device_put` of a
# 64-byte-aligned numpy array shares its memory; an unaligned one is copied).
ALIGN = 64


def _aligned(nbytes: int) -> np.ndarray:
  """An uninitialized uint8 buffer whose data starts on an ALIGN boundary."""
  raw = np.empty(nbytes + ALIGN, np.uint8)
  start = -raw.ctypes.data % ALIGN
  return raw[start:start + nbytes]


def _device_of(spec: Any, i: int) -> Any:
  """The device a spec lands on; refuses specs JAX would not place as they are."""
  sharding = getattr(spec, "sharding", None)
  if not isinstance(sharding, jax.sharding.SingleDeviceSharding):
    raise ReshardValueError(f"{API}.fetch: specs[{i}] must have a SingleDeviceSharding; "
                            f"got {sharding!r}.")
  if jax.dtypes.canonicalize_dtype(spec.dtype) != spec.dtype:
    raise ReshardValueError(f"{API}.fetch: specs[{i}]'s dtype must exist in this process "
                            f"as a jax.Array; got {spec.dtype} with jax_enable_x64 off.")
  return next(iter(sharding.device_set))


class Fetch(Pending):
  """One fetch: its arrays arrive in the fetching thread; `result()` waits for them.

  The constructor checks the arguments (ReshardValueError, before anything is sent);
  `head`, `chunk` and `place` run on the fetching thread only.
  """

  def __init__(self, address: str, ticket: int, specs: Sequence[Any],
               timeout_s: float | None, grace_s: float):
    specs = list(specs)
    devices = [_device_of(s, i) for i, s in enumerate(specs)]
    channel.split_address(f"{API}.fetch", address)
    if type(ticket) is not int or not 0 <= ticket < 1 << 64:
      raise ReshardValueError(f"{API}.fetch: ticket must be an int in [0, 2**64); got "
                              f"{ticket!r}.")
    wait_s = OFFER_GRACE_S if timeout_s is None else float(timeout_s)
    if not 0 <= wait_s < math.inf:
      raise ReshardValueError(f"{API}.fetch: timeout_s must be a finite number >= 0; got "
                              f"{timeout_s!r}.")
    self.wait_ms = min(int(wait_s * 1000), (1 << 32) - 1)  # as the request carries it
    self.address, self.ticket = address, ticket
    self.specs, self.devices = specs, devices
    self.sizes = [math.prod(s.shape) * np.dtype(s.dtype).itemsize for s in specs]
    # For the reply to start: `grace_s` after the wait.
    self.deadline = time.monotonic() + wait_s + grace_s
    self.future: concurrent.futures.Future = concurrent.futures.Future()
    self.buffers: list[np.ndarray] | None = None  # set once the reply's HEAD arrived
    self.array = 0   # the next chunk expected: array index and byte offset
    self.offset = 0

  def done(self) -> bool:
    return self.future.done()

  def result(self) -> list[jax.Array]:
    return self.future.result()

  def wait(self, timeout_s: float) -> bool:  # woken by the receiving thread
    concurrent.futures.wait([self.future], timeout=max(timeout_s, 0))
    return self.future.done()

  def fail(self, error: BaseException) -> None:
    if not self.future.done():
      self.future.set_exception(error)

  @property
  def received(self) -> bool:
    """Every array arrived (and is not placed yet)."""
    return self.buffers is not None and self.array == len(self.sizes)

  def head(self, status: int, sizes: list[int], sock: Any, zmq: Any) -> str | None:
    """Takes the reply's HEAD: a status other than OK, or sizes other than the specs',
    fail the fetch (named); else the buffers are made and, `sock` given, the arrays
    read inline from the rest of its message. Returns the peer's protocol error, if
    any."""
    where = f"the peer at {self.address}"
    if status != wire.OK:
      kind = ReshardTimeoutError if status == wire.EXPIRED else ReshardRuntimeError
      self.fail(kind(f"{API}: the fetch of ticket {self.ticket} from {where} got "
                     f"nothing: {wire.WHY.get(status, f'status {status}')}."))
      return None
    if sizes != self.sizes:
      self.fail(ReshardValueError(
          f"{API}: the arrays of ticket {self.ticket} from {where} must be the specs' "
          f"sizes {self.sizes} bytes ({[(s.shape, str(s.dtype)) for s in self.specs]}); "
          f"got {sizes}."))
      return None
    self.buffers = [_aligned(size) for size in sizes]
    if sock is not None:
      for a, buffer in enumerate(self.buffers):
        got = sock.recv_into(buffer) if sock.getsockopt(zmq.RCVMORE) else -1
        if got != buffer.size:
          return f"it sent {max(got, 0)} bytes of array {a} where {buffer.size} were due"
      self.array = len(sizes)
    self._skip_empty()
    return None

  def chunk(self, sender: str, a: int, at: int, sock: Any, zmq: Any) -> str | None:
    """One CHUNK from the peer at `sender`: array `a` at byte `at`, read from the rest
    of its message in place. Returns the peer's protocol error, if any."""
    if sender != self.address or (a, at) != (self.array, self.offset):
      return (f"it sent array {a} at byte {at} where array {self.array} at byte "
              f"{self.offset} was due")
    want = min(wire.CHUNK_BYTES, self.sizes[a] - at)
    got = sock.recv_into(self.buffers[a][at:at + want], flags=zmq.NOBLOCK)
    if got != want:
      return f"it sent {got} bytes of array {a} at byte {at} where {want} were due"
    self.offset += want
    if self.offset == self.sizes[a]:
      self.array, self.offset = a + 1, 0
      self._skip_empty()
    return None

  def _skip_empty(self) -> None:
    """Skips the empty arrays (no chunk comes for them)."""
    while self.array < len(self.sizes) and self.sizes[self.array] == 0:
      self.array += 1

  def place(self) -> None:
    """Ends the fetch with the received arrays on their devices (one device_put: ~30 us
    per call, ~18 per array batched), or fails it, named."""
    try:
      arrays = jax.device_put([b.view(s.dtype).reshape(s.shape)
                               for b, s in zip(self.buffers, self.specs)], self.devices)
    except Exception as e:  # noqa: BLE001 - the fetch fails, the thread lives
      self.fail(ReshardRuntimeError(f"{API}: the arrays of ticket {self.ticket} from "
                                    f"{self.address} arrived but could not be placed: "
                                    f"{type(e).__name__}: {e}"))
      return
    self.buffers = None
    if not self.future.done():
      self.future.set_result(arrays)
