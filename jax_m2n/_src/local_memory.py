"""Memory that another program on this host can read: the local data plane's segments.

Owns: host segments (`Segment`: an anonymous memfd, so nothing is left in /dev/shm or
the file system when either side dies), handing a segment's file descriptor to another
process of the same user that shows a ticket (`FdServer`, `fetch_fd`: an abstract Unix
socket, SO_PEERCRED, SCM_RIGHTS; `TicketServer`, the ticketed socket it and the jobs
layer's local line share), and device segments (`DeviceSegment`: CUDA IPC
memory through jax_m2n._ffi_cuda). Knows nothing of versions, layouts or control
messages: tickets are issued here but travel over the caller's authenticated channel.
Never copies array data (local_copy.py does).
"""

from __future__ import annotations

import dataclasses
import fcntl
import mmap
import os
import secrets
import selectors
import socket
import struct
import threading
import time
from typing import Any

import numpy as np

from jax_m2n._src import ffi
from jax_m2n._src.errors import (ReshardRuntimeError, ReshardTimeoutError,
                                 ReshardValueError)

# A ticket's length in bytes; a client that sends more (or other) bytes is refused.
TICKET_BYTES = 32
# At most this many bytes are read from one connection.
MAX_REQUEST_BYTES = 64
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class Segment:
  """A shared host memory segment: an anonymous memfd mapped into this process.

  The creator writes (e.g. `local_store` at `address + offset`); another process maps
  the same pages from the file descriptor (`FdServer` / `fetch_fd`, then `open`). The
  size is sealed at creation, so a reader's mapping can never lose pages under it. The
  memory lives while any process has the fd open or the segment mapped, and is freed by
  the kernel when the last one closes or dies.

  Attributes:
    fd: the file descriptor (close-on-exec); owned by the segment.
    nbytes: its size.
    array: a uint8 numpy view of the mapping (read-only for a reader).
    address: the mapping's address in this process, for local_copy / local_store.

  Example:
    >>> seg = Segment.create(4096)
    >>> seg.array[:4] = [1, 2, 3, 4]
    >>> reader = Segment.open(seg.read_only_fd(), 4096)
    >>> reader.array[:4].tolist()
    [1, 2, 3, 4]
    >>> reader.close(); seg.close()
  """

  def __init__(self, fd: int, nbytes: int, writable: bool, populate: bool):
    self.fd = fd
    self.nbytes = nbytes
    flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    self._map = mmap.mmap(fd, nbytes, flags=flags, prot=prot)
    self.array = np.frombuffer(self._map, dtype=np.uint8)
    self.address = int(self.array.ctypes.data)

  @classmethod
  def create(cls, nbytes: int, name: str = "jax_m2n", populate: bool = True) -> "Segment":
    """A new zero-filled segment of `nbytes` (> 0), mapped read-write.

    `populate` allocates and maps every page now (MAP_POPULATE): a first store into
    fresh shared pages otherwise pays their faults (256 MiB: ~370 ms on 2 loaded cores,
    against ~25 ms into mapped pages), so a pool of segments made ahead of time keeps
    them off the publish path."""
    if not isinstance(nbytes, int) or nbytes <= 0:
      raise ReshardValueError(f"Segment.create: nbytes must be an int > 0; got {nbytes!r}.")
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
      os.ftruncate(fd, nbytes)
      fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
      return cls(fd, nbytes, writable=True, populate=populate)
    except BaseException:
      os.close(fd)
      raise

  @classmethod
  def open(cls, fd: int, nbytes: int) -> "Segment":
    """Maps a segment another process created, read-only; takes ownership of `fd`.

    The pages are mapped at once (MAP_POPULATE): the first copy out of them then pays
    no page faults.

    Raises:
      ReshardValueError: `fd` is not a sealed segment of at least `nbytes` bytes (the
        fd is closed then too).
    """
    try:
      size = os.fstat(fd).st_size
      seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
      if not isinstance(nbytes, int) or not 0 < nbytes <= size or (
          seals & fcntl.F_SEAL_SHRINK) == 0:
        raise ReshardValueError(
            f"Segment.open: fd must be a size-sealed segment of at least nbytes bytes; "
            f"got {size} bytes (seals {seals:#x}) for nbytes {nbytes!r}.")
      return cls(fd, nbytes, writable=False, populate=True)
    except OSError as e:
      os.close(fd)
      raise ReshardValueError(f"Segment.open: fd must be a memfd segment; got {e}.") from e
    except BaseException:
      os.close(fd)
      raise

  def read_only_fd(self) -> int:
    """A new read-only file descriptor of this segment (the caller owns it): what to
    hand to readers, so that they cannot map it writable."""
    return os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY | os.O_CLOEXEC)

  def close(self) -> None:
    """Unmaps and closes; idempotent. Views of `array` must be gone by then."""
    if self._map is None:
      return
    self.array = None
    try:
      self._map.close()
    except BufferError as e:
      raise ReshardValueError(f"Segment.close: views of the segment's array must be "
                              f"released first; got {e}.") from None
    self._map = None
    os.close(self.fd)
    self.fd = -1

  def __enter__(self) -> "Segment":
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()


def peer_uid(sock: socket.socket) -> int:
  """The uid of the process at the other end of a Unix socket (SO_PEERCRED)."""
  return _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                       _UCRED.size))[1]


class TicketServer:
  """A same-user Unix socket on this host whose connections first show a one-use ticket:
  the mechanics `FdServer` and the jobs layer's local line (jobs/line.py) share.

  An abstract-namespace socket (nothing in the file system) with a random name, served
  by one daemon thread with a selector: it never waits on one client, refuses peers of
  another uid (SO_PEERCRED) and connections beyond `max_clients`, drops a connection
  that has not shown a live ticket within `client_timeout_s`, and keeps serving. A
  ticket (`offer(value)`) is good once, until it expires; the tickets themselves travel
  over the caller's authenticated channel. A subclass says what a connection does
  (`_read`, with `_take` for its ticket) and how a value it no longer holds is let go
  (`_release`: an fd closed, by default nothing).
  """

  def __init__(self, name: str, thread_name: str, client_timeout_s: float,
               max_clients: int, backlog: int):
    self.name = f"{name}.{secrets.token_hex(16)}"
    self._client_timeout_s = client_timeout_s
    self._max_clients = max_clients
    self._lock = threading.Lock()
    self._tickets: dict[bytes, tuple[Any, float]] = {}  # ticket -> (value, expiry)
    self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    self._listener.bind("\0" + self.name)
    self._listener.listen(backlog)
    self._listener.setblocking(False)
    self._wake_r, self._wake_w = socket.socketpair()
    self._selector = selectors.DefaultSelector()
    self._selector.register(self._listener, selectors.EVENT_READ, None)
    self._selector.register(self._wake_r, selectors.EVENT_READ, None)
    self._clients: dict[socket.socket, Conn] = {}
    self._closed = False
    self.refused = 0  # connections refused or dropped for a rule (tests and logs)
    self._thread = threading.Thread(target=self._serve, name=thread_name, daemon=True)
    self._thread.start()

  def offer(self, value: Any, ttl_s: float = 30.0) -> bytes:
    """A one-use ticket for `value`, valid `ttl_s` seconds."""
    ticket = secrets.token_bytes(TICKET_BYTES)
    with self._lock:
      if self._closed:
        self._release(value)
        raise ReshardValueError(f"{type(self).__name__}.offer: the server must be open; "
                                "got closed.")
      self._tickets[ticket] = (value, time.monotonic() + ttl_s)
    return ticket

  def revoke(self, ticket: bytes) -> None:
    """Withdraws a ticket not yet used (no effect otherwise)."""
    with self._lock:
      entry = self._tickets.pop(ticket, None)
    if entry is not None:
      self._release(entry[0])

  def pending(self) -> int:
    """Tickets issued and not yet used, expired or revoked."""
    with self._lock:
      return len(self._tickets)

  def clients(self) -> int:
    """Connections open now."""
    return len(self._clients)

  def _release(self, value: Any) -> None:
    """Lets go of an offered value nobody will be handed (expired, revoked, closed)."""

  def _read(self, conn: socket.socket) -> None:
    raise NotImplementedError

  def _take(self, ticket: bytes) -> tuple[bool, Any]:
    """(True, its value) for a live ticket, spent now; (False, None) otherwise."""
    with self._lock:
      entry = self._tickets.pop(ticket, None)
    if entry is None:
      return False, None
    if entry[1] < time.monotonic():
      self._release(entry[0])
      return False, None
    return True, entry[0]

  def _drop(self, conn: socket.socket, refused: bool) -> None:
    self.refused += int(refused)  # before the close the client sees
    self._selector.unregister(conn)
    del self._clients[conn]
    conn.close()

  def _accept(self) -> None:
    try:
      conn, _ = self._listener.accept()
    except (BlockingIOError, InterruptedError):
      return
    try:
      same_user = peer_uid(conn) == os.getuid()
    except OSError:
      same_user = False
    if not same_user or len(self._clients) >= self._max_clients:
      self.refused += 1
      conn.close()
      return
    conn.setblocking(False)
    self._clients[conn] = Conn(bytearray(), time.monotonic() + self._client_timeout_s)
    self._selector.register(conn, selectors.EVENT_READ, None)

  def _sweep(self) -> None:
    now = time.monotonic()
    for conn, c in list(self._clients.items()):
      if c.deadline is not None and c.deadline < now:
        self._drop(conn, refused=True)
    with self._lock:
      expired = [t for t, (_, expiry) in self._tickets.items() if expiry < now]
      values = [self._tickets.pop(t)[0] for t in expired]
    for v in values:
      self._release(v)

  def _serve(self) -> None:
    while not self._closed:
      for key, _ in self._selector.select(timeout=0.1):
        sock = key.fileobj
        if sock is self._listener:
          self._accept()
        elif sock is self._wake_r:
          sock.recv(64)
        elif sock in self._clients:
          self._read(sock)
      self._sweep()

  def close(self, timeout_s: float = 5.0) -> None:
    """Stops the thread, closes every connection (their clients see it closed) and
    lets go of every value still offered."""
    with self._lock:
      if self._closed:
        return
      self._closed = True
    self._wake_w.send(b"x")
    self._thread.join(timeout_s)
    for conn in list(self._clients):
      self._drop(conn, refused=False)
    for sock in (self._listener, self._wake_r, self._wake_w):
      sock.close()
    self._selector.close()
    with self._lock:
      values = [v for v, _ in self._tickets.values()]
      self._tickets.clear()
    for v in values:
      self._release(v)

  def __enter__(self) -> "TicketServer":
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()


@dataclasses.dataclass
class Conn:
  """One connection of a TicketServer: what it sent not yet read, the time by which it
  must show its ticket (None once it has), and what its ticket was offered for."""

  buf: bytearray
  deadline: float | None
  bound: Any = None


class FdServer(TicketServer):
  """Hands file descriptors to processes of this user that show a ticket (a
  TicketServer). It reads at most MAX_REQUEST_BYTES per connection and refuses anything
  but one live ticket; a connection ends once its fd is sent.

  Example:
    >>> seg = Segment.create(4096)
    >>> with FdServer() as server:
    ...   ticket = server.offer(seg.read_only_fd())
    ...   fd = fetch_fd(server.name, ticket, timeout_s=5)
    >>> Segment.open(fd, 4096).close(); seg.close()
  """

  def __init__(self, client_timeout_s: float = 1.0, max_clients: int = 64):
    super().__init__("jax_m2n", "jax_m2n-fd-server", client_timeout_s, max_clients,
                     backlog=max_clients)

  def offer(self, fd: int, ttl_s: float = 30.0) -> bytes:
    """Issues a one-use ticket for `fd`, valid `ttl_s` seconds. The server takes
    ownership of `fd` (closed once handed out, expired or at close())."""
    return super().offer(fd, ttl_s)

  def _release(self, fd: int) -> None:
    os.close(fd)

  def _read(self, conn: socket.socket) -> None:
    buf = self._clients[conn].buf
    try:
      data = conn.recv(MAX_REQUEST_BYTES - len(buf))
    except (BlockingIOError, InterruptedError):
      return
    except OSError:
      data = b""
    buf += data
    if not data or len(buf) > TICKET_BYTES:
      self._drop(conn, refused=True)  # closed early, or more than a ticket
      return
    if len(buf) < TICKET_BYTES:
      return
    good, fd = self._take(bytes(buf))
    if not good:
      self._drop(conn, refused=True)
      return
    try:
      socket.send_fds(conn, [b"ok"], [fd])
    except OSError:
      pass  # the client left: the ticket is spent all the same
    finally:
      os.close(fd)
    self._drop(conn, refused=False)


def fetch_fd(name: str, ticket: bytes, timeout_s: float = 5.0) -> int:
  """Asks the FdServer `name` (on this host, of this user) for the fd of `ticket`.

  Returns:
    The file descriptor (close-on-exec; the caller owns it).

  Raises:
    ReshardValueError: a ticket of the wrong length.
    ReshardTimeoutError: no answer within `timeout_s`.
    ReshardRuntimeError: the server is gone, of another user, or refused the ticket.
  """
  if not isinstance(ticket, bytes) or len(ticket) != TICKET_BYTES:
    raise ReshardValueError(f"fetch_fd: ticket must be {TICKET_BYTES} bytes; got "
                            f"{type(ticket).__name__} of length {len(ticket)}.")
  with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
    sock.settimeout(timeout_s)
    try:
      sock.connect("\0" + name)
      if peer_uid(sock) != os.getuid():
        raise ReshardRuntimeError(f"fetch_fd: the server {name!r} must run as this "
                                  f"user; got another uid.")
      sock.sendall(ticket)
      _, fds, _, _ = socket.recv_fds(sock, 16, 1)
    except socket.timeout:
      raise ReshardTimeoutError(f"fetch_fd: the server {name!r} must answer within "
                                f"{timeout_s} s; got no answer.") from None
    except OSError as e:
      raise ReshardRuntimeError(f"fetch_fd: the server {name!r} must be reachable; "
                                f"got {e}.") from None
  if not fds:
    raise ReshardRuntimeError(f"fetch_fd: the server {name!r} refused the ticket (unknown, "
                              "used or expired).")
  os.set_inheritable(fds[0], False)
  return fds[0]


class DeviceSegment:
  """GPU memory another program on this host can map: CUDA IPC (cudaMalloc in the
  device's primary context, the one XLA uses; XLA's own buffers cannot be exported).

  `create` allocates and exports (`handle`: 64 bytes, to send over the authenticated
  channel); `open` maps another process's handle (not one of this process).
  `address` is a device pointer valid in this process, for local_copy / local_store on
  that device. close() frees (creator) or unmaps (reader); the creator must outlive
  every reader's use of the memory.

  Example (GPU only):
    seg = DeviceSegment.create(jax.devices("gpu")[0], 1 << 20)
    # another process: DeviceSegment.open(its_device, seg.handle, 1 << 20)
  """

  def __init__(self, module: Any, ordinal: int, address: int, handle: bytes,
               nbytes: int, owner: bool):
    self._module = module
    self.ordinal = ordinal
    self.address = address
    self.handle = handle
    self.nbytes = nbytes
    self._owner = owner

  @staticmethod
  def _module_and_ordinal(device: Any) -> tuple[Any, int]:
    if device.platform not in ("gpu", "cuda"):
      raise ReshardValueError(f"DeviceSegment: device must be a CUDA GPU; got "
                              f"{device} ({device.platform}).")
    return ffi.load(device.platform), int(device.local_hardware_id)

  @classmethod
  def create(cls, device: Any, nbytes: int) -> "DeviceSegment":
    """Allocates `nbytes` (> 0) on `device` and exports it."""
    if not isinstance(nbytes, int) or nbytes <= 0:
      raise ReshardValueError(f"DeviceSegment.create: nbytes must be an int > 0; got "
                              f"{nbytes!r}.")
    module, ordinal = cls._module_and_ordinal(device)
    try:
      address, handle = module.ipc_alloc(ordinal, nbytes)
    except RuntimeError as e:
      raise ReshardRuntimeError(f"DeviceSegment.create: {e}") from None
    return cls(module, ordinal, address, handle, nbytes, owner=True)

  @classmethod
  def open(cls, device: Any, handle: bytes, nbytes: int) -> "DeviceSegment":
    """Maps another process's segment (its `handle`) on `device`."""
    module, ordinal = cls._module_and_ordinal(device)
    try:
      address = module.ipc_open(ordinal, handle)
    except (RuntimeError, ValueError) as e:
      raise ReshardRuntimeError(f"DeviceSegment.open: {e}") from None
    return cls(module, ordinal, address, handle, nbytes, owner=False)

  def close(self) -> None:
    """Frees (creator) or unmaps (reader); idempotent. Work that uses the memory must
    have finished (e.g. the local_copy outputs are ready)."""
    if self.address == 0:
      return
    address, self.address = self.address, 0
    try:
      (self._module.ipc_free if self._owner else self._module.ipc_close)(address)
    except RuntimeError as e:
      raise ReshardRuntimeError(f"DeviceSegment.close: {e}") from None

  def __enter__(self) -> "DeviceSegment":
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()
