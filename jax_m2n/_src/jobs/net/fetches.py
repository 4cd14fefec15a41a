"""The "net" transport's fetching side: one DEALER per peer address and the one thread
that sends requests, receives replies into aligned buffers and places them on devices.

Owns the fetches in flight and the connections they use: a fetch ends with its arrays,
its peer's answer that there is nothing (expired, busy, withdrawn, unreadable), its
peer's death or silence (zmq's monitor and heartbeats), `forget`, or `close`. Every
byte a peer sends is checked against what was asked before it is kept. Serving is
offers.py's.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import math
import struct
import threading
import time
from typing import Any, Sequence

import jax
import numpy as np

from jax_m2n._src.errors import ReshardRuntimeError, ReshardTimeoutError, ReshardValueError
from jax_m2n._src.jobs import channel
from jax_m2n._src.jobs.net import wire
from jax_m2n._src.jobs.net.curve import CurveKeys
from jax_m2n._src.jobs.transport import OFFER_GRACE_S, Pending

API = wire.API

# A fetch whose reply has not started this long after its wait ended, from a peer that
# sent nothing for as long, fails here (a live peer answers every request it keeps by
# the request's wait; this covers one that lost it).
REPLY_GRACE_S = 10.0
# Buffers that JAX's CPU client aliases instead of copying (measured: `device_put` of a
# 64-byte-aligned numpy array shares its memory; an unaligned one is copied).
ALIGN = 64
# Replies a connection may queue before zmq stops reading it (x CHUNK_BYTES at most).
QUEUED_MESSAGES = 64


class Fetch(Pending):
  """One fetch: its arrays arrive in the fetching thread; `result()` waits for them."""

  def __init__(self, address: str, ticket: int, specs: list[Any], devices: list[Any],
               deadline: float):
    self.address, self.ticket = address, ticket
    self.specs, self.devices = specs, devices
    self.sizes = [math.prod(s.shape) * np.dtype(s.dtype).itemsize for s in specs]
    self.deadline = deadline  # for the reply to start (REPLY_GRACE_S after the wait)
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


class Fetcher:
  """The fetching thread and its connections.

  Threads: `fetch` and `forget` from any thread; the sockets only on the fetching
  thread. `close` fails every fetch in flight and stops the thread (bounded).
  """

  def __init__(self, ctx: Any, curve: CurveKeys | None):
    self._zmq = wire.zmq_module()
    self._ctx, self._curve = ctx, curve
    self._lock = threading.Lock()
    self._stop = threading.Event()
    self._rids = itertools.count(1)
    self._fetches: dict[int, Fetch] = {}
    self._commands: list[tuple[str, Any]] = []
    self._peers: dict[str, _Peer] = {}   # the fetching thread's own, like the poller
    self._by_socket: dict[Any, _Peer] = {}
    self._late_due = 0.0  # when `_late` runs next
    self._waker = wire.Waker(ctx, self._zmq, "fetch")
    self._poller = self._zmq.Poller()
    self._poller.register(self._waker.socket, self._zmq.POLLIN)
    self._thread = threading.Thread(target=self._loop, daemon=True,
                                    name="jax_m2n-net-fetch")
    self._thread.start()

  # Any thread -------------------------------------------------------------------------

  def fetch(self, address: str, ticket: int, specs: Sequence[Any],
            timeout_s: float | None) -> Fetch:
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
    wait_ms = min(int(wait_s * 1000), (1 << 32) - 1)
    fetch = Fetch(address, ticket, specs, devices,
                  time.monotonic() + wait_s + REPLY_GRACE_S)
    with self._lock:
      if self._stop.is_set():
        raise ReshardRuntimeError(f"{API}.fetch: the transport must be open; it is "
                                  "closed.")
      rid = next(self._rids)
      self._fetches[rid] = fetch
      self._commands.append(("send", (rid, wait_ms)))
    self._waker.wake()
    return fetch

  def forget(self, address: str) -> None:
    with self._lock:
      gone = self._pop(address)
      self._commands.append(("close", address))
    for f in gone:
      f.fail(ReshardRuntimeError(f"{API}: the fetch of ticket {f.ticket} from {address} "
                                 "was abandoned (the peer was forgotten)."))
    self._waker.wake()

  def close(self) -> bool:
    """Fails every fetch in flight and stops the thread (it closes its sockets); False
    where the thread did not stop within 5 s."""
    with self._lock:
      self._stop.set()
      gone = self._pop(None)
    for f in gone:
      f.fail(ReshardRuntimeError(f"{API}: the fetch of ticket {f.ticket} from "
                                 f"{f.address} was abandoned (the transport closed)."))
    self._waker.close_sender()
    if threading.current_thread() is not self._thread:
      self._thread.join(timeout=5.0)
    return not self._thread.is_alive()

  def _pop(self, address: str | None) -> list[Fetch]:
    """Removes (the lock is held) and returns the fetches from `address` (None: all)."""
    rids = [r for r, f in self._fetches.items() if address is None or f.address == address]
    return [self._fetches.pop(r) for r in rids]

  def _fail(self, address: str, why: str) -> None:
    with self._lock:
      gone = self._pop(address)
    for f in gone:
      f.fail(ReshardRuntimeError(f"{API}: the fetch of ticket {f.ticket} from the peer at "
                                 f"{address} failed: {why}."))

  # The fetching thread ----------------------------------------------------------------

  def _loop(self) -> None:
    try:
      wire.run("fetching", self._poller, self._stop, lambda: int(wire.TICK_S * 1000),
               self._step, self._zmq)
    finally:
      for peer in list(self._peers.values()):
        self._drop(peer)
      self._waker.socket.close(0)

  def _step(self, events: dict[Any, int]) -> None:
    """Requests to send, connections to close, replies and monitor events to take."""
    if self._waker.socket in events:
      self._waker.drain()
    with self._lock:
      commands, self._commands = self._commands, []
    for what, arg in commands:
      if what == "close":
        if arg in self._peers:
          self._drop(self._peers[arg])
      else:
        self._send(*arg)
    # Data before monitor events: a reply that arrived whole before its peer's
    # connection closed is delivered, not failed.
    hit = {self._by_socket[s] for s in events if s in self._by_socket}
    for peer in [p for p in hit if p.sock in events]:
      if not self._receive(peer):
        self._drop(peer)
    for peer in [p for p in hit if p.monitor in events and self._peers.get(p.address) is p]:
      why = peer.broken()
      if why is not None:
        self._receive(peer)
        self._drop(peer)
        self._fail(peer.address, why)
    if time.monotonic() >= self._late_due:
      self._late()
      self._late_due = time.monotonic() + 0.1

  def _send(self, rid: int, wait_ms: int) -> None:
    with self._lock:
      fetch = self._fetches.get(rid)
    if fetch is None:
      return  # forgotten meanwhile
    try:
      peer = self._peers.get(fetch.address)
      if peer is None:
        peer = self._peers[fetch.address] = _Peer(self._ctx, self._zmq, self._curve,
                                                   fetch.address)
        for s in (peer.sock, peer.monitor):
          self._poller.register(s, self._zmq.POLLIN)
          self._by_socket[s] = peer
      peer.sock.send(wire.REQUEST.pack(wire.REQUEST_MAGIC, fetch.ticket, rid, wait_ms),
                     self._zmq.NOBLOCK)
    except Exception as e:  # noqa: BLE001 - the fetch fails, the thread lives
      if fetch.address in self._peers:
        self._drop(self._peers[fetch.address])
      self._fail(fetch.address, f"no request could be sent: {e}")

  def _drop(self, peer: "_Peer") -> None:
    """Closes a connection: its monitor, its socket."""
    self._peers.pop(peer.address, None)
    for s in (peer.sock, peer.monitor):
      if self._by_socket.pop(s, None) is not None:
        self._poller.unregister(s)
    peer.close()

  def _late(self) -> None:
    """Fails fetches whose reply never started although their wait is over and their
    peer sent nothing for REPLY_GRACE_S (a reply may queue behind others' bytes on a
    slow link)."""
    now = time.monotonic()
    quiet = {a for a, p in self._peers.items() if now - p.received > REPLY_GRACE_S}
    with self._lock:
      late = [r for r, f in self._fetches.items() if f.buffers is None
              and f.deadline < now and (f.address in quiet or f.address not in self._peers)]
      late = [self._fetches.pop(r) for r in late]
    for f in late:
      f.fail(ReshardTimeoutError(f"{API}: the peer at {f.address} must answer the fetch "
                                 f"of ticket {f.ticket}; got no answer in time."))

  def _receive(self, peer: "_Peer") -> bool:
    """Takes what `peer` sent (a burst); False where it broke the protocol (its
    fetches then failed)."""
    zmq = self._zmq
    for _ in range(64):
      try:
        first = peer.sock.recv(zmq.NOBLOCK)
      except zmq.Again:
        return True
      peer.received = time.monotonic()
      more = peer.sock.getsockopt(zmq.RCVMORE)
      if first[:4] == wire.HEAD_MAGIC and len(first) >= wire.HEAD.size:
        error = self._head(peer, first, more)
      elif first[:4] == wire.CHUNK_MAGIC and more and len(first) == wire.CHUNK.size:
        error = self._chunk(peer, first)
      else:
        error = "it sent a malformed reply"
      wire.discard_rest(peer.sock, zmq)  # what a failed or forgotten fetch was sent
      if error is not None:
        self._fail(peer.address, error)
        return False
    return True

  def _head(self, peer: "_Peer", frame: bytes, inline: bool) -> str | None:
    """A reply's HEAD; `inline`: the arrays follow in the same message (a small
    reply), else as CHUNK messages. Returns the peer's protocol error, if any."""
    _, rid, status, n = wire.HEAD.unpack_from(frame)
    if len(frame) != wire.HEAD.size + 8 * n or (inline and status != wire.OK):
      return "it sent a malformed reply header"
    with self._lock:
      fetch = self._fetches.get(rid)
      if fetch is None:
        return None  # forgotten meanwhile: its chunks are discarded as they come
      if fetch.address != peer.address or fetch.buffers is not None:
        return f"it answered request {rid}, which it was not sent or answered already"
      sizes = list(struct.unpack_from(f"<{n}Q", frame, wire.HEAD.size))
      if status != wire.OK or sizes != fetch.sizes:
        self._fetches.pop(rid)
    where = f"the peer at {peer.address}"
    if status != wire.OK:
      kind = ReshardTimeoutError if status == wire.EXPIRED else ReshardRuntimeError
      fetch.fail(kind(f"{API}: the fetch of ticket {fetch.ticket} from {where} got "
                      f"nothing: {wire.WHY.get(status, f'status {status}')}."))
      return None
    if sizes != fetch.sizes:
      fetch.fail(ReshardValueError(
          f"{API}: the arrays of ticket {fetch.ticket} from {where} must be the specs' "
          f"sizes {fetch.sizes} bytes ({[(s.shape, str(s.dtype)) for s in fetch.specs]}); "
          f"got {sizes}."))
      return None
    fetch.buffers = [_aligned(size) for size in sizes]
    if inline:
      for a, buffer in enumerate(fetch.buffers):
        got = peer.sock.recv_into(buffer) if peer.sock.getsockopt(self._zmq.RCVMORE) else -1
        if got != buffer.size:
          return f"it sent {max(got, 0)} bytes of array {a} where {buffer.size} were due"
      fetch.array = n
    self._next(fetch)
    if fetch.array == n:
      self._complete(rid, fetch)
    return None

  def _chunk(self, peer: "_Peer", frame: bytes) -> str | None:
    """One CHUNK message (its bytes land in place); returns the peer's protocol error,
    if any."""
    _, rid, a, at = wire.CHUNK.unpack(frame)
    with self._lock:
      fetch = self._fetches.get(rid)
    if fetch is None or fetch.buffers is None:
      return None  # a fetch forgotten or failed: its bytes are dropped
    if fetch.address != peer.address or (a, at) != (fetch.array, fetch.offset):
      return (f"it sent array {a} at byte {at} where array {fetch.array} at byte "
              f"{fetch.offset} was due")
    want = min(wire.CHUNK_BYTES, fetch.sizes[a] - at)
    got = peer.sock.recv_into(fetch.buffers[a][at:at + want], flags=self._zmq.NOBLOCK)
    if got != want:
      return f"it sent {got} bytes of array {a} at byte {at} where {want} were due"
    fetch.offset += want
    if fetch.offset == fetch.sizes[a]:
      fetch.array, fetch.offset = a + 1, 0
      self._next(fetch)
    if fetch.array == len(fetch.sizes):
      self._complete(rid, fetch)
    return None

  @staticmethod
  def _next(fetch: Fetch) -> None:
    """Skips the empty arrays (no chunk comes for them)."""
    while fetch.array < len(fetch.sizes) and fetch.sizes[fetch.array] == 0:
      fetch.array += 1

  def _complete(self, rid: int, fetch: Fetch) -> None:
    with self._lock:
      if self._fetches.pop(rid, None) is None:
        return
    try:  # one device_put for all (~30 us per call, ~18 per array batched)
      arrays = jax.device_put([b.view(s.dtype).reshape(s.shape)
                               for b, s in zip(fetch.buffers, fetch.specs)],
                              fetch.devices)
    except Exception as e:  # noqa: BLE001 - the fetch fails, the thread lives
      fetch.fail(ReshardRuntimeError(f"{API}: the arrays of ticket {fetch.ticket} from "
                                     f"{fetch.address} arrived but could not be placed: "
                                     f"{type(e).__name__}: {e}"))
      return
    fetch.buffers = None
    if not fetch.future.done():
      fetch.future.set_result(arrays)


class _Peer:
  """A connection to one address: a DEALER and its monitor (the fetching thread's)."""

  def __init__(self, ctx: Any, zmq: Any, curve: CurveKeys | None, address: str):
    self._zmq = zmq
    self.address = address
    self.received = time.monotonic()  # when it last sent something
    host, port = channel.split_address(f"{API}.fetch", address)
    sock = ctx.socket(zmq.DEALER)
    wire.tune(sock, zmq)
    sock.setsockopt(zmq.SNDHWM, 0)  # requests: bounded by the fetches in flight
    # What the peer can make this process hold: frames of one chunk at most, and
    # QUEUED_MESSAGES of them (the thread copies them out as they come).
    sock.setsockopt(zmq.MAXMSGSIZE, max(wire.CHUNK_BYTES, wire.INLINE_BYTES)
                    + wire.MAX_REQUEST_BYTES)
    sock.setsockopt(zmq.RCVHWM, QUEUED_MESSAGES)
    if curve is not None:
      sock.setsockopt(zmq.CURVE_SERVERKEY, curve.server_public)
      sock.setsockopt(zmq.CURVE_PUBLICKEY, curve.client_public)
      sock.setsockopt(zmq.CURVE_SECRETKEY, curve.client_secret)
    if ":" in host:
      sock.setsockopt(zmq.IPV6, 1)
    self.sock = sock
    self.monitor = sock.get_monitor_socket(
        zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED
        | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
        | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    try:
      sock.connect(f"tcp://{channel.join_address(host, port)}")
    except zmq.ZMQError:
      self.close()
      raise

  def broken(self) -> str | None:
    """Why the connection is over (a monitor event), or None."""
    from zmq.utils.monitor import recv_monitor_message  # pylint: disable=import-outside-toplevel
    zmq = self._zmq
    why = None
    while True:
      try:
        event = recv_monitor_message(self.monitor, zmq.NOBLOCK)["event"]
      except zmq.Again:
        return why
      why = why or {
          zmq.EVENT_DISCONNECTED: "it closed the connection (it died or closed)",
          zmq.EVENT_CONNECT_RETRIED: "it refused the connection (nothing listens there)",
          zmq.EVENT_HANDSHAKE_FAILED_AUTH: "it refused this process's CurveZMQ key",
      }.get(event, "the handshake failed (other CurveZMQ keys, or not a jax_m2n net "
                   "transport)")

  def close(self) -> None:
    try:
      self.sock.disable_monitor()
    except self._zmq.ZMQError:
      pass
    self.monitor.close(0)
    self.sock.close(0)
