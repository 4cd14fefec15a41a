"""Bootstrap of the cross-process CPU engine: the distributed key-value store (every
operation bounded), one JAX transfer server per process on an address its peers can
reach, the connections to peers, liveness, and reachability probes.

Owns process-wide state made once per job: the server, its connections, the beat
thread (this process's beat, every peer's liveness, deleting finished calls' keys) and
the exit marker. It moves no array bytes itself and knows nothing of plans.
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import functools
import os
import queue
import socket
import threading
import time
from typing import Any, Callable

import jax

from jax_m2n._src import jax_compat
from jax_m2n._src.errors import ReshardRuntimeError

_API = "reshard"
PREFIX = "jax_m2n"

# Liveness through the key-value store: every process that took part in a cross-process
# reshard overwrites its beat key every BEAT_S and reads every peer's (the beat thread).
# Silence alone proves nothing on a loaded host (a first call's compilation held a
# coordinator's answers back for a second here, on 2 cores), so a peer is *suspected*
# once its beat has not changed for SUSPECT_S (or, for a sender, its data stalls) and
# then probed: a TCP connection to its transfer server, answered by the peer's kernel
# even while the process itself is busy. A refused connection means the process is
# gone; a failed probe with the beat silent for DEAD_AFTER_S, or two failed (stall)
# probes in a row, mean it is unreachable. The coordination service's own heartbeats see a death
# only after jax.distributed's heartbeat_timeout_seconds (100 s by default).
BEAT_S = 0.25
SUSPECT_S = 0.5
DEAD_AFTER_S = float(os.environ.get("JAX_M2N_PEER_DEAD_S", "1.0"))
# One probe: a TCP connection attempt, bounded. A peer whose beat is silent gets
# PROBE_TIMEOUT_S (answers take < 0.1 s even over 20 ms links); one whose beat is fine
# but whose data stalls gets STALL_PROBE_TIMEOUT_S, which outlasts one lost SYN (sent
# again after 1 s), and must fail twice in a row: a lossy link is not a partition.
PROBE_TIMEOUT_S = 0.5
STALL_PROBE_TIMEOUT_S = 1.2
# A key-value operation unanswered for SUSPECT_S makes this process probe the
# coordinator the same way (the client itself waits without end for an unreachable
# one): two failed probes in a row are CoordinatorUnreachable. A coordinator that accepts
# connections but does not answer for STORE_GIVE_UP_S is one too.
STORE_GIVE_UP_S = float(os.environ.get("JAX_M2N_STORE_TIMEOUT_S", "30"))

# Key-value operations made by the calls (on the calling thread) and by the beat thread.
stats = collections.Counter()


class CoordinatorUnreachable(ReshardRuntimeError):
  """A key-value operation got no answer in time: this process is cut off from the
  jax.distributed coordinator."""


class _Workers:
  """Daemon threads that run blocking calls for a caller that waits a bounded time (a
  call that never returns keeps its thread, never the caller; daemon threads never
  hold up the interpreter's exit)."""

  def __init__(self, limit: int = 16):
    self._jobs: queue.SimpleQueue = queue.SimpleQueue()
    self._lock = threading.Lock()
    self._idle = 0
    self._threads = 0
    self._limit = limit

  def submit(self, fn: Callable, *args) -> concurrent.futures.Future:
    future: concurrent.futures.Future = concurrent.futures.Future()
    with self._lock:
      if self._idle == 0:
        if self._threads >= self._limit:  # every thread is stuck in a call
          future.set_exception(TimeoutError("every helper thread is blocked"))
          return future
        self._threads += 1
        threading.Thread(target=self._loop, name="jax_m2n-store", daemon=True).start()
      else:
        self._idle -= 1
    self._jobs.put((future, fn, args))
    return future

  def _loop(self) -> None:
    while True:
      future, fn, args = self._jobs.get()
      if future.set_running_or_notify_cancel():
        try:
          future.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to the waiting caller
          future.set_exception(e)
      with self._lock:
        self._idle += 1


class Store:
  """The `jax.distributed` key-value store, every operation bounded: one unanswered
  for SUSPECT_S probes the coordinator, and two failed probes (or STORE_GIVE_UP_S)
  are CoordinatorUnreachable. Operations are counted in `stats[counter]`."""

  def __init__(self, client: Any, coordinator: str):
    self._client = client
    self.coordinator = coordinator
    self._workers = _Workers()
    # Blocking gets that last a call (get_soon): one thread each while they wait.
    self._waiters = _Workers(limit=1024)
    # Since when this process has found the coordinator unreachable (None: it is not):
    # set by a failed operation, cleared by an answer or by a probe that gets through
    # (the path is back; the client's own connection may take seconds to recover).
    self.cut_off_since: float | None = None

  def cut_off(self) -> str | None:
    """Why this process is cut off from the coordinator now, or None."""
    since = self.cut_off_since
    if since is None:
      return None
    return (f"this process has not reached the coordinator at {self.coordinator} for "
            f"{time.monotonic() - since:.1f} s (its link or the coordinator's host is "
            "down)")

  def _call(self, counter: str, extra_s: float, fn: Callable, *args) -> Any:
    stats[counter] += 1
    future = self._workers.submit(fn, *args)
    began = time.monotonic()
    probing, failed = None, 0
    while True:
      try:
        result = future.result(timeout=0.05)
        self.cut_off_since = None
        return result
      except TimeoutError:  # concurrent.futures' own since Python 3.11
        pass
      waited = time.monotonic() - began - extra_s
      why = None
      if waited > STORE_GIVE_UP_S:
        why = f"no answer within {STORE_GIVE_UP_S:g} s"
      elif waited > SUSPECT_S:
        if probing is None:
          probing = probe_soon(self.coordinator)
        elif probing.done():  # two failed probes in a row: one lost SYN is not a cut
          result, probing = probing.result(), None
          failed = 0 if result is None else failed + 1
          if result is None:
            self.cut_off_since = None
          if failed >= 2:
            why = f"no answer, and {result[1]} ({failed} probes)"
      if why is not None:
        if self.cut_off_since is None:
          self.cut_off_since = began
        raise CoordinatorUnreachable(
            f"{_API}: process {jax.process_index()} cannot reach the jax.distributed "
            f"coordinator at {self.coordinator} (process 0's key-value store): {why}. "
            "This process is cut off from the job (its link or the coordinator's host "
            "is down).")

  def set(self, key: str, value: str, counter: str = "kv_ops",
          overwrite: bool = True) -> None:
    """Sets `key`; with overwrite=False a key already set keeps its value (the first
    writer wins)."""
    try:
      self._call(counter, 0.0, self._client.key_value_set, key, value, overwrite)
    except CoordinatorUnreachable:
      raise
    except Exception:  # noqa: BLE001 - ALREADY_EXISTS: another process set it first
      if overwrite:
        raise

  def increment(self, key: str, by: int, counter: str = "kv_ops") -> int:
    """Adds `by` to the counter at `key` (atomic in the store); returns the new value."""
    return self._call(counter, 0.0, self._client.key_value_increment, key, by)

  def dir_get(self, prefix: str, counter: str = "kv_ops") -> list[tuple[str, str]]:
    return self._call(counter, 0.0, self._client.key_value_dir_get, prefix)

  def try_get(self, key: str, counter: str = "kv_ops") -> str | None:
    try:
      return self._call(counter, 0.0, self._client.key_value_try_get, key)
    except CoordinatorUnreachable:
      raise
    except Exception:  # noqa: BLE001 - NOT_FOUND: the key is not there (yet)
      return None

  def blocking_get(self, key: str, timeout_s: float, counter: str = "kv_ops"
                   ) -> str | None:
    """The value of `key` as soon as it is set, or None after `timeout_s`."""
    try:
      return self._call(counter, timeout_s, self._client.blocking_key_value_get, key,
                        max(1, int(timeout_s * 1000)))
    except CoordinatorUnreachable:
      raise
    except Exception:  # noqa: BLE001 - DEADLINE_EXCEEDED: not set within timeout_s
      return None

  def delete(self, key: str, counter: str = "kv_background_ops") -> None:
    self._call(counter, 0.0, self._client.key_value_delete, key)

  def post_soon(self, key: str, value: str, overwrite: bool = True) -> None:
    """Sets `key` without waiting (a failure from a process that may be cut off: it
    must fail at once, not after a probe)."""
    stats["kv_ops"] += 1
    self._workers.submit(self._client.key_value_set, key, value, overwrite)

  def get_soon(self, key: str, timeout_s: float) -> concurrent.futures.Future:
    """A Future of the value of `key` as soon as it is set, or of None after
    `timeout_s`: a blocking get on a helper thread, for waits that must watch other
    things meanwhile."""
    stats["kv_ops"] += 1

    def get():
      try:
        return self._client.blocking_key_value_get(key, max(1, int(timeout_s * 1000)))
      except Exception:  # noqa: BLE001 - DEADLINE_EXCEEDED, or the store is gone
        return None
    return self._waiters.submit(get)


def kv_client() -> Any:
  """The `jax.distributed` key-value client; a ReshardRuntimeError outside a job."""
  client = jax_compat.distributed_client()
  if client is None:
    raise ReshardRuntimeError(
        f"{_API}: a reshard across processes must run under jax.distributed; got no "
        "distributed client. Hint: call jax.distributed.initialize() first.")
  return client


def _split_address(address: str) -> tuple[str, int]:
  host, _, port = address.rpartition(":")
  return host.strip("[]"), int(port)


def transfer_host() -> str:
  """The address this process's transfer server binds: JAX_M2N_TRANSFER_HOST where set;
  else this host's own address on the interface that routes to the jax.distributed
  coordinator, an address every peer reaches already (they all reach the coordinator).
  A coordinator on loopback gives 127.0.0.1 (one host)."""
  host = os.environ.get("JAX_M2N_TRANSFER_HOST")
  if host:
    return host
  coordinator = jax_compat.distributed_coordinator_address()
  target, port = _split_address(coordinator)
  family, _, _, _, sockaddr = socket.getaddrinfo(target, port, type=socket.SOCK_DGRAM)[0]
  with socket.socket(family, socket.SOCK_DGRAM) as s:
    s.connect(sockaddr)  # a route lookup: a datagram socket sends nothing on connect
    return s.getsockname()[0]


def probe(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> tuple[bool, str] | None:
  """None when a TCP connection to `address` (a peer's transfer server, or the
  coordinator) opens within `timeout_s`; else (refused, why): refused is True where
  the host answered that nothing listens there (the process is gone). A check of the
  path, not a transport: it sends nothing."""
  host, port = _split_address(address)
  try:
    socket.create_connection((host, port), timeout=timeout_s).close()
  except OSError as e:
    why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    return isinstance(e, ConnectionRefusedError), why
  return None


_probe_workers = _Workers()


def probe_soon(address: str, timeout_s: float = PROBE_TIMEOUT_S
               ) -> concurrent.futures.Future:
  """probe(address, timeout_s) on a helper thread: a Future of its result."""
  return _probe_workers.submit(probe, address, timeout_s)


class Liveness:
  """What this process knows of its peers, kept by the beat thread: each peer's beat
  and when it last changed, and the processes that left."""

  def __init__(self):
    self._lock = threading.Lock()
    self._seen: dict[int, tuple[str, float]] = {}
    self._gone: dict[int, str] = {}
    self.read_at = time.monotonic()

  def update(self, beats: list[tuple[str, str]], gone: list[tuple[str, str]]) -> None:
    now = time.monotonic()
    with self._lock:
      for key, value in beats:
        pid = int(key.rsplit("/", 1)[1])
        last = self._seen.get(pid)
        if last is None or last[0] != value:
          self._seen[pid] = (value, now)
      for key, value in gone:
        self._gone[int(key.rsplit("/", 1)[1])] = value
      self.read_at = now

  def gone(self, peer: int) -> str | None:
    """Why `peer` left the job (its exit marker), or None."""
    with self._lock:
      return self._gone.get(peer)

  def silent_s(self, peer: int) -> float:
    """For how long `peer`'s beat has not changed, as of this process's last fresh
    read of the store (0 for a peer never seen beating)."""
    with self._lock:
      seen = self._seen.get(peer)
      return 0.0 if seen is None else max(0.0, self.read_at - seen[1])

class _Engine:
  """This process's transfer server, its connections to peers, and its beat thread."""

  def __init__(self):
    from jax.experimental import transfer
    self.pid = jax.process_index()
    self.kv = Store(kv_client(), jax_compat.distributed_coordinator_address())
    client = jax.local_devices()[0].client
    host = transfer_host()
    where = f"[{host}]" if ":" in host else host
    self.server = transfer.start_transfer_server(client, f"{where}:0", [f"{where}:0"])
    self.address = self.server.address()
    self.kv.set(f"{PREFIX}/addr/{self.pid}", self.address)
    self.liveness = Liveness()
    self._addresses: dict[int, str] = {}
    self._connections: dict[int, Any] = {}
    self._lock = threading.Lock()
    self._stop = threading.Event()
    self._beats = 0
    self._cleanups: list[Callable[[], None]] = []
    self._beat()
    self._thread = threading.Thread(target=self._beat_loop, name="jax_m2n-beat",
                                    daemon=True)
    self._thread.start()
    atexit.register(self.leave)

  def _beat(self) -> None:
    self._beats += 1
    c = "kv_background_ops"
    self.kv.set(f"{PREFIX}/beat/{self.pid}", str(self._beats), counter=c)
    self.liveness.update(self.kv.dir_get(f"{PREFIX}/beat/", counter=c),
                         self.kv.dir_get(f"{PREFIX}/gone/", counter=c))

  def _beat_loop(self) -> None:
    while not self._stop.wait(BEAT_S):
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
          conn = self._connections[peer] = self.server.connect(address)
    return conn

  def drop_connections(self) -> None:
    """After a failed call: fails what is still pending on every connection (a pull
    stalled on a cut link would otherwise wait for TCP to give up, many minutes) and
    forgets them; the next call connects again."""
    with self._lock:
      dropped, self._connections = self._connections, {}
    for conn in dropped.values():
      try:
        jax_compat.poison_transfer_connection(conn)
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
