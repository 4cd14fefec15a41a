"""How arrays cross between the processes of separate jobs: the transport interface.

Owns the seam between a pull's plan and the bytes: a sender `offer`s arrays under a
ticket (send boxes), a receiver that learned the ticket over the authenticated control
channel `fetch`es them into its own devices' memory (receive boxes), an offer can be
withdrawn (`cancel`) and expires at its deadline either way. Publisher, Subscriber,
relays and delta pulls move bytes only through this interface, so another engine (the
local data plane, NCCL between jobs) plugs in here without touching planning or the API.
Implementations: `TransferServerTransport` (JAX's transfer server) and
`net.NetTransport` (our own over ZeroMQ, in net/). Knows no plans, versions or control
messages.
"""

from __future__ import annotations

import abc
import secrets
import threading
import time
from typing import Any, Sequence

import jax

from jax_m2n._src import transfer_server

# How long after its deadline an offer stays fetchable (the receiver's own deadline
# passes first; then the offer is dropped: a receiver that died leaks nothing).
OFFER_GRACE_S = 30.0


class Pending(abc.ABC):
  """What a fetch is bringing: `done()` once its arrays arrived or the fetch failed;
  then `result()` is the arrays (on the devices the fetch named) or raises the
  transport's failure. Never blocks in `done()`."""

  @abc.abstractmethod
  def done(self) -> bool:
    """Whether the arrays arrived or the fetch failed (non-blocking)."""

  @abc.abstractmethod
  def result(self) -> list[jax.Array]:
    """The arrays (waits for them where not `done()`); the transport's failure raises."""

  def wait(self, timeout_s: float) -> bool:
    """Blocks until `done()` or `timeout_s` passed; returns `done()`. This default polls
    (sleeps doubling to 2 ms); a transport that learns of arrival wakes at once."""
    deadline, delay = time.monotonic() + timeout_s, 1e-4
    while not self.done():
      if time.monotonic() >= deadline:
        return False
      time.sleep(min(delay, max(deadline - time.monotonic(), 0)))
      delay = min(2 * delay, 2e-3)
    return True


class Arrived(Pending):
  """Arrays that are (or become, by themselves) ready: JAX's asynchronous arrays, or
  arrays already there."""

  def __init__(self, arrays: Sequence[jax.Array]):
    self._arrays = list(arrays)

  def done(self) -> bool:
    return all(a.is_ready() for a in self._arrays)

  def result(self) -> list[jax.Array]:
    for a in self._arrays:
      a.block_until_ready()
    return self._arrays


class Transport(abc.ABC):
  """One process's end of a transport, shared by its Publisher and Subscribers.

  Threads: every method may be called from any thread. Lifetime: made and released
  through `acquire` / `release` (the last release closes it: its ports stop listening).
  """

  kind: str = ""
  # Whether a fetch may be issued before its offer exists (it waits for it): a pull
  # then fetches as soon as it asked, one round trip before the bytes flow.
  early_fetch: bool = True
  # Whether `offer` also takes host numpy arrays (their bytes are sent as they are): a
  # CPU publisher then cuts a small pull with numpy instead of XLA programs.
  host_offers: bool = False

  @property
  @abc.abstractmethod
  def address(self) -> str:
    """Where peers fetch this process's offers ("host:port")."""

  @abc.abstractmethod
  def offer(self, arrays: Sequence[jax.Array], timeout_s: float,
            ticket: int | None = None) -> int:
    """Offers `arrays` (on this process's devices) to one fetch, for `timeout_s`
    (+ OFFER_GRACE_S); returns the ticket (a random 64-bit one, or `ticket`: a value
    both sides derived from a shared secret). The arrays must stay unmodified until
    fetched or expired (offers hold references to them)."""

  @abc.abstractmethod
  def fetch(self, address: str, ticket: int, specs: Sequence[jax.ShapeDtypeStruct],
            timeout_s: float | None = None) -> Pending:
    """The arrays offered under `ticket` at `address`, landing on the devices of
    `specs` (each with a SingleDeviceSharding). Asynchronous: returns at once; the
    `Pending` is done once they arrived (or the fetch failed). A ticket not offered
    yet is waited for, up to `timeout_s` (None: OFFER_GRACE_S) where the engine
    bounds that wait (a relay's member fetches chunks before its upstream has them)."""

  @abc.abstractmethod
  def cancel(self, ticket: int) -> bool:
    """Withdraws an offer not fetched yet; False where the engine cannot (the offer
    then expires at its deadline)."""

  @abc.abstractmethod
  def forget(self, address: str) -> None:
    """Fails what is pending from `address` and drops the connection to it (after a
    failure: the next fetch connects anew)."""

  @abc.abstractmethod
  def _close(self) -> None:
    """Stops listening and drops every connection and offer."""


class TransferServerTransport(Transport):
  """JAX's transfer server (transfer_server.py): host-staged TCP between processes, on
  every platform. It authenticates nobody (offers are named by unguessable tickets sent
  only over the control channel) and cannot withdraw an offer (offers expire)."""

  kind = "transfer_server"
  # A pull of a uuid offered later by the same server (publisher and subscriber in one
  # process) failed ("Async transfer object was deleted"): fetch after the offer.
  early_fetch = False

  def __init__(self, host: str):
    self._server = transfer_server.start(host)
    self._connections: dict[str, Any] = {}
    self._lock = threading.Lock()

  @property
  def address(self) -> str:
    return self._server.address()

  def offer(self, arrays, timeout_s, ticket=None):
    ticket = secrets.randbits(64) if ticket is None else ticket
    transfer_server.await_pull(self._server, ticket, arrays,
                               time.monotonic() + timeout_s + OFFER_GRACE_S)
    return ticket

  def fetch(self, address, ticket, specs, timeout_s=None):
    del timeout_s  # a pull waits until its offer comes or the connection breaks
    return Arrived(transfer_server.pull(self._connection(address), ticket, specs))

  def cancel(self, ticket):
    del ticket
    return False  # the transfer server has no per-offer withdrawal

  def _connection(self, address: str) -> Any:
    with self._lock:
      conn = self._connections.get(address)
      if conn is None:
        conn = self._connections[address] = transfer_server.connect(self._server,
                                                                     address)
      return conn

  def forget(self, address):
    with self._lock:
      conn = self._connections.pop(address, None)
    if conn is not None:
      try:
        transfer_server.cancel(conn)
      except Exception:  # noqa: BLE001 - best effort: it is forgotten anyway
        pass

  def _close(self):
    with self._lock:
      connections, self._connections = self._connections, {}
    for conn in connections.values():
      try:
        transfer_server.cancel(conn)
      except Exception:  # noqa: BLE001 - best effort
        pass
    self._server = None  # JAX stops a transfer server when its last reference goes
