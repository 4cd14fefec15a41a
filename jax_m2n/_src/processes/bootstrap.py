"""Bootstrap of the cross-process CPU engine, made once per job: one JAX transfer server
per process on an address its peers can reach, the connections to peers, and the beat
thread (this process's beat, every peer's, deleting finished calls' keys) and exit
marker.

Owns that process-wide state; the key-value store (store.py) and the liveness rules
(liveness.py) are below it. It moves no array bytes itself and knows nothing of plans.
"""

from __future__ import annotations

import atexit
import functools
import os
import socket
import threading
from typing import Any, Callable

import jax

from jax_m2n._src import jax_compat, transfer_server
from jax_m2n._src.errors import CoordinatorUnreachable, ReshardRuntimeError
from jax_m2n._src.processes import liveness, store
from jax_m2n._src.processes.store import split_address

from jax_m2n._src.errors import API as _API
PREFIX = "jax_m2n"


def kv_client() -> Any:
  """The `jax.distributed` key-value client; a ReshardRuntimeError outside a job."""
  client = jax_compat.distributed_client()
  if client is None:
    raise ReshardRuntimeError(
        f"{_API}: a reshard across processes must run under jax.distributed; got no "
        "distributed client. Hint: call jax.distributed.initialize() first.")
  return client


def transfer_host() -> str:
  """The address this process's transfer server binds: JAX_M2N_TRANSFER_HOST where set;
  else this host's own address on the interface that routes to the jax.distributed
  coordinator, an address every peer reaches already (they all reach the coordinator).
  A coordinator on loopback gives 127.0.0.1 (one host)."""
  host = os.environ.get("JAX_M2N_TRANSFER_HOST")
  if host:
    return host
  coordinator = jax_compat.distributed_coordinator_address()
  target, port = split_address(coordinator)
  family, _, _, _, sockaddr = socket.getaddrinfo(target, port, type=socket.SOCK_DGRAM)[0]
  with socket.socket(family, socket.SOCK_DGRAM) as s:
    s.connect(sockaddr)  # a route lookup: a datagram socket sends nothing on connect
    return s.getsockname()[0]


class _Engine:
  """This process's transfer server, its connections to peers, and its beat thread.

  The transfer server starts on first use (`server`): a process that only waits with
  its job's peers (a multi-process Subscriber job, whose bytes cross jobs/' own
  transport) opens no port of JAX's, whose wire format trusts its peers. Such a process
  posts another address its peers may probe (`post_probe_address`)."""

  def __init__(self):
    self.pid = jax.process_index()
    self.kv = store.Store(kv_client(), jax_compat.distributed_coordinator_address())
    self._server: Any = None
    self._posted: str | None = None
    self.liveness = liveness.Liveness()
    self._addresses: dict[int, str] = {}
    self._connections: dict[int, Any] = {}
    self._lock = threading.RLock()
    self._stop = threading.Event()
    self._beats = 0
    # The call number up to which this process has finished its calls (sequence.py
    # sets it; every beat carries it).
    self.finished = 0
    self._cleanups: list[Callable[[], None]] = []
    self._beat()
    self._thread = threading.Thread(target=self._beat_loop, name="jax_m2n-beat",
                                    daemon=True)
    self._thread.start()
    atexit.register(self.leave)

  @property
  def server(self) -> Any:
    """This process's transfer server, started (and its address posted) on first use."""
    with self._lock:
      if self._server is None:
        self._server = transfer_server.start(transfer_host())
        self._posted = self._server.address()
        self.kv.set(f"{PREFIX}/addr/{self.pid}", self._posted)
      return self._server

  @property
  def address(self) -> str:
    return self.server.address()

  def post_probe_address(self, address: str) -> None:
    """Posts `address` (a port of this process that its kernel answers: a jobs
    transport's) as the one peers probe when this process falls silent, unless the
    transfer server's is posted already."""
    with self._lock:
      if self._posted is None:
        self._posted = address
        self.kv.set(f"{PREFIX}/addr/{self.pid}", address)

  def _beat(self) -> None:
    self._beats += 1
    c = "kv_background_ops"
    self.kv.set(f"{PREFIX}/beat/{self.pid}", f"{self._beats} {self.finished}", counter=c)
    self.liveness.update(self.kv.dir_get(f"{PREFIX}/beat/", counter=c),
                         self.kv.dir_get(f"{PREFIX}/gone/", counter=c))

  def _beat_loop(self) -> None:
    while not self._stop.wait(liveness.BEAT_S):
      try:
        self._beat()
        for cleanup in list(self._cleanups):
          cleanup()
      except CoordinatorUnreachable:
        continue  # cut off (kv.cut_off() says so meanwhile): try again
      except Exception:  # noqa: BLE001 - the store is gone (shutdown): stop beating
        return

  def on_beat(self, fn: Callable[[], None]) -> None:
    """Runs fn() after every beat on the beat thread (deleting finished calls' keys)."""
    self._cleanups.append(fn)

  def leave(self) -> None:
    """At exit: stops beating and tells the peers this process is gone, so that one
    waiting for it fails at once (a process that raised before a call and exited)."""
    if self._stop.is_set():
      return
    self._stop.set()
    try:
      self.kv.set(f"{PREFIX}/gone/{self.pid}", "exited")
    except Exception:  # noqa: BLE001 - the store is already down or unreachable
      pass

  def peer_address(self, peer: int) -> str:
    """`peer`'s transfer server address (posted at its bootstrap; read once)."""
    address = self._addresses.get(peer)
    if address is None:
      address = self.kv.blocking_get(f"{PREFIX}/addr/{peer}", 10.0)
      if address is None:
        raise ReshardRuntimeError(
            f"{_API}: process {peer} has not posted its transfer server's address "
            "within 10 s (it never started the cross-process engine).")
      self._addresses[peer] = address
    return address

  def connection(self, peer: int) -> Any:
    """The connection to `peer`'s server (made once, until dropped)."""
    conn = self._connections.get(peer)
    if conn is None:
      address = self.peer_address(peer)
      with self._lock:
        conn = self._connections.get(peer)
        if conn is None:
          conn = self._connections[peer] = transfer_server.connect(self.server, address)
    return conn

  def drop_connections(self) -> None:
    """After a failed call: fails what is still pending on every connection (a pull
    stalled on a cut link would otherwise wait for TCP to give up, many minutes) and
    forgets them; the next call connects again."""
    with self._lock:
      dropped, self._connections = self._connections, {}
    for conn in dropped.values():
      try:
        transfer_server.cancel(conn)
      except Exception:  # noqa: BLE001 - best effort: the connection is forgotten anyway
        pass


_engine: list[_Engine] = []
_engine_lock = threading.Lock()


def engine() -> _Engine:
  """This process's engine, started on first use (every process of a call starts it)."""
  if not _engine:
    with _engine_lock:
      if not _engine:
        _engine.append(_Engine())
  return _engine[0]


@functools.lru_cache(maxsize=None)
def process_of_device() -> dict[int, int]:
  """Global device id -> process index, for every device of the job."""
  return {d.id: d.process_index for d in jax.devices()}
