"""Bootstrap of the cross-process CPU engine: the distributed key-value store, one JAX
transfer server per process (addresses exchanged through the store) and liveness.

Owns process-wide state made once per job: the server, its connections, the beat
thread and the exit marker. It moves no array bytes itself.
"""

from __future__ import annotations

import atexit
import functools
import os
import threading
import time
from typing import Any

import jax

from jax_m2n._src import jax_compat
from jax_m2n._src.errors import ReshardRuntimeError

from jax_m2n._src.errors import API as _API
PREFIX = "jax_m2n"

# Liveness through the key-value store: every process that took part in a cross-process
# reshard overwrites its beat key every BEAT_S; a peer whose beat has not changed for
# DEAD_AFTER_S while someone waits for it is taken for dead. The coordination service's
# own heartbeats see a death only after jax.distributed's heartbeat_timeout_seconds
# (100 s by default) and then end every process, so they cannot name a peer in 2 s.
BEAT_S = 0.25
DEAD_AFTER_S = float(os.environ.get("JAX_M2N_PEER_DEAD_S", "1.5"))


def kv_client() -> Any:
  """The `jax.distributed` key-value client; a ReshardRuntimeError outside a job."""
  client = jax_compat.distributed_client()
  if client is None:
    raise ReshardRuntimeError(
        f"{_API}: a reshard across processes must run under jax.distributed; got no "
        "distributed client. Hint: call jax.distributed.initialize() first.")
  return client


class _Engine:
  """This process's transfer server, its connections to peers, and its beat thread."""

  def __init__(self):
    from jax.experimental import transfer
    self.kv = kv_client()
    self.pid = jax.process_index()
    client = jax.local_devices()[0].client
    host = os.environ.get("JAX_M2N_TRANSFER_HOST", "127.0.0.1")
    self.server = transfer.start_transfer_server(client, f"{host}:0", [f"{host}:0"])
    self.kv.key_value_set(f"{PREFIX}/addr/{self.pid}", self.server.address(),
                          allow_overwrite=True)
    self._connections: dict[int, Any] = {}
    self._lock = threading.Lock()
    self._stop = threading.Event()
    self._beats = 0
    self._beat()
    self._thread = threading.Thread(target=self._beat_loop, name="jax_m2n-beat",
                                    daemon=True)
    self._thread.start()
    atexit.register(self.leave)

  def _beat(self) -> None:
    self._beats += 1
    self.kv.key_value_set(f"{PREFIX}/beat/{self.pid}", str(self._beats),
                          allow_overwrite=True)

  def _beat_loop(self) -> None:
    while not self._stop.wait(BEAT_S):
      try:
        self._beat()
      except Exception:  # noqa: BLE001 - the store is gone (shutdown): stop beating
        return

  def leave(self) -> None:
    """At exit: stops beating and tells the peers this process is gone, so that one
    waiting for it fails at once (a process that raised before a call and exited)."""
    if self._stop.is_set():
      return
    self._stop.set()
    try:
      self.kv.key_value_set(f"{PREFIX}/gone/{self.pid}", "exited", allow_overwrite=True)
    except Exception:  # noqa: BLE001 - the store is already down
      pass

  def connection(self, peer: int, address: str) -> Any:
    """The connection to `peer`'s server (made once)."""
    conn = self._connections.get(peer)
    if conn is None:
      with self._lock:
        conn = self._connections.get(peer)
        if conn is None:
          conn = self._connections[peer] = self.server.connect(address)
    return conn


_engine: list[_Engine] = []
_engine_lock = threading.Lock()


def engine() -> _Engine:
  """This process's engine, started on first use (every process of a call starts it)."""
  if not _engine:
    with _engine_lock:
      if not _engine:
        _engine.append(_Engine())
  return _engine[0]


class Liveness:
  """What a waiting process knows of its peers: the beats it has seen (and when they
  last changed) and the processes that left. `dead(peers)` reads the store at most
  every BEAT_S."""

  def __init__(self, kv: Any):
    self._kv = kv
    self._seen: dict[int, tuple[str, float]] = {}
    self._gone: dict[int, str] = {}
    self._read_at = 0.0

  def _read(self, now: float) -> None:
    self._read_at = now
    for key, value in self._kv.key_value_dir_get(f"{PREFIX}/beat/"):
      pid = int(key.rsplit("/", 1)[1])
      last = self._seen.get(pid)
      if last is None or last[0] != value:
        self._seen[pid] = (value, now)
    for key, value in self._kv.key_value_dir_get(f"{PREFIX}/gone/"):
      self._gone[int(key.rsplit("/", 1)[1])] = value

  def dead(self, peers) -> dict[int, str]:
    """The peers known to be gone, each with why."""
    now = time.monotonic()
    if now - self._read_at >= BEAT_S:
      self._read(now)
    out = {}
    for p in peers:
      if p in self._gone:
        out[p] = f"process {p} left the job ({self._gone[p]})"
        continue
      seen = self._seen.get(p)
      if seen is not None and now - seen[1] > DEAD_AFTER_S:
        out[p] = (f"process {p} stopped beating {now - seen[1]:.1f} s ago (died, or "
                  "stalled without releasing the GIL)")
    return out


@functools.lru_cache(maxsize=None)
def process_of_device() -> dict[int, int]:
  """Global device id -> process index, for every device of the job."""
  return {d.id: d.process_index for d in jax.devices()}
