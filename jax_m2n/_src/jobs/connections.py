"""A subscriber process's connections to the publisher's processes.

Owns the control clients (process 0's, made at once and remade after a failure; the
others' on first need, from the manifest's addresses) and this process's transport
towards the publisher (acquired on first need, released at close). Knows no versions,
plans or arrays.
"""

from __future__ import annotations

import dataclasses
import socket

from jax_m2n._src.jobs import channel, transports
from jax_m2n._src.jobs.manifest import Manifest


def local_host_towards(host: str) -> str:
  """The address of this machine's interface that routes to `host` (no packet is
  sent: a UDP socket's connect only picks the route)."""
  family = socket.AF_INET6 if ":" in host else socket.AF_INET
  try:
    with socket.socket(family, socket.SOCK_DGRAM) as s:
      s.connect((host, 9))
      return s.getsockname()[0]
  except OSError:
    return "::1" if family == socket.AF_INET6 else "127.0.0.1"


@dataclasses.dataclass
class Link:
  """A publisher process as a pull uses it: its control client, its transport's
  address (as this process reaches it), how messages name it, and the plans this
  process registered with it (each with its tickets' salt)."""

  client: channel.Client
  address: str
  name: str
  plans: dict[str, bytes] = dataclasses.field(default_factory=dict)  # registered: salt


class Connections:
  """The control clients to one publisher's processes, and this process's transport.

  Args:
    api: the name errors carry.
    address: process 0's control address ("host:port").
    key: the token's key (auth.as_key).
    connect_s: how long a connection may take to answer its handshake.
  """

  def __init__(self, api: str, address: str, key, connect_s: float):
    self._api = api
    self.address = address
    self.host, _ = channel.split_address(api, address)
    self._key = key
    self._connect_s = connect_s
    self._root: channel.Client | None = None
    self._links: dict[int, Link] = {}
    self._transport: transports.Transport | None = None
    self.root()

  def root(self) -> channel.Client:
    """Process 0's control client (a new one if the last one broke)."""
    if self._root is None or self._root.broken is not None:
      if self._root is not None:
        self._drop_links()
      self._root = self.new_root()
    return self._root

  def new_root(self) -> channel.Client:
    """A new control client to process 0 (a zmq socket serves one thread: a relay's
    forwarding thread has its own)."""
    return channel.Client(self._api, self.address, self._key, self._connect_s,
                          f"the publisher at {self.address}")

  def live_root(self) -> channel.Client | None:
    return self._root if self._root is not None and self._root.broken is None else None

  def reachable(self, address: str) -> str:
    """A manifest's address as this process reaches it: a wildcard host (the
    publisher bound every interface) is the host this subscriber was given."""
    host, port = channel.split_address(self._api, address)
    return channel.join_address(self.host if channel.is_wildcard(host) else host, port)

  def transport(self, m: Manifest) -> transports.Transport:
    """This process's transport of the publisher's spec (the manifest's), bound to
    the interface that routes to the publisher's process 0."""
    if self._transport is None:
      host, _ = channel.split_address(self._api, self.reachable(m.processes[0][1]))
      self._transport = transports.acquire_spec(m.processes[0][3],
                                                local_host_towards(host), self._key)
    return self._transport

  def link(self, k: int, m: Manifest) -> Link:
    """Publisher process k's link (made on first need, remade after a failure)."""
    link = self._links.get(k)
    if link is not None and link.client.broken is None:
      return link
    control, address = (self.reachable(a) for a in m.processes[k][:2])
    name = f"trainer process {k} (publisher at {control})"
    client = self.root() if k == 0 else channel.Client(
        self._api, control, self._key, self._connect_s, name)
    link = self._links[k] = Link(client, address, name)
    return link

  def clients(self) -> list[channel.Client]:
    """The control clients open now (process 0's and the other links'), each once."""
    out = [] if self._root is None else [self._root]
    return out + [l.client for l in self._links.values() if l.client is not self._root]

  def forget_broken(self) -> None:
    """Drops the links whose control client broke, and what their transport had
    pending (the next pull connects anew)."""
    for k in [k for k, link in self._links.items() if link.client.broken is not None]:
      if self._transport is not None:
        self._transport.forget(self._links[k].address)
      del self._links[k]

  def _drop_links(self) -> None:
    for link in self._links.values():
      if link.client is not self._root:
        link.client.close()
    self._links.clear()

  def close(self) -> None:
    self._drop_links()
    if self._root is not None:
      self._root.close()
    if self._transport is not None:
      transports.release(self._transport)
      self._transport = None
