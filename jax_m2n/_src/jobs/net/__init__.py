"""The "net" transport: arrays between the processes of separate jobs over ZeroMQ TCP,
optionally CurveZMQ-encrypted, with every table bounded.

One concern per module, dependencies one way (each line uses only the lines above it):
  wire.py         the message formats, statuses, sizes and socket options both sides
                  share;
  curve.py        `CurveKeys`: the keys of encryption and mutual authentication;
  offer_table.py  what the serving side holds, bounded: offers, waiting requests,
                  bytes being sent;
  listen.py       the serving sockets: the ROUTER bound, the ZAP endpoint and its rule;
  replies.py      the serving side's replies: a status, or an offer's arrays zero-copy;
  offers.py       the serving side: the ROUTER socket's thread, its requests, `offer`;
  receive.py      one fetch: its checked arguments, its reply received into aligned
                  buffers and placed on devices;
  peers.py        the fetching side's connections: a DEALER per peer, its monitor;
  fetches.py      the fetching side: the fetches in flight, the fetching thread;
and here `NetTransport`, the two sides behind `transport.Transport`, in a zmq context of
their own. Before authentication a stranger reaches only libzmq's ZMTP and CURVE parsers
(frames over 64 KiB refused unallocated) and the 24-byte request. It knows no plans,
versions or control messages.
"""

from __future__ import annotations

import logging

from jax_m2n._src.errors import ReshardTypeError
from jax_m2n._src.jobs.net import fetches, offers, wire
from jax_m2n._src.jobs.net.curve import CurveKeys
from jax_m2n._src.jobs.transport import Pending, Transport

__all__ = ["CurveKeys", "NetTransport"]

logger = logging.getLogger("jax_m2n")


class NetTransport(Transport):
  """Arrays between processes over ZeroMQ TCP, optionally CurveZMQ-encrypted.

  Serving: `offer` registers arrays under a ticket (returns at once); a peer's fetch
  of that ticket gets them once (then the offer is dropped); a fetch that comes before
  its offer waits for it (bounded). The bytes are read from the arrays when served:
  zero-copy on CPU (the array's buffer goes to the socket), one device-to-host copy on
  an accelerator. Fetching: one connection per peer address, replies received by one
  thread into 64-byte-aligned buffers that `jax.device_put` aliases on CPU (one copy
  from the socket's buffer; on an accelerator one host-to-device copy more).

  Args:
    host: the interface to listen on (an IP address or name; "0.0.0.0" / "::" for
      every interface); the port is chosen free.
    curve: `CurveKeys` to encrypt and authenticate both directions; None: plain TCP
      (any process that can reach the port may fetch an offer whose ticket it knows).
    max_offers / max_offer_bytes: the bounds on what `offer` holds (offers not yet
      fetched, cancelled or expired, and the bytes of replies still being sent).

  Example:
    >>> import jax, numpy as np
    >>> a, b = NetTransport("127.0.0.1"), NetTransport("127.0.0.1")
    >>> x = jax.device_put(np.arange(6.0).reshape(2, 3), jax.devices()[0])
    >>> ticket = a.offer([x], timeout_s=10.0)
    >>> spec = jax.ShapeDtypeStruct((2, 3), x.dtype,
    ...     sharding=jax.sharding.SingleDeviceSharding(jax.devices()[1]))
    >>> [y] = b.fetch(a.address, ticket, [spec]).result()
    >>> bool((np.asarray(y) == np.asarray(x)).all()), y.devices() == {jax.devices()[1]}
    (True, True)
    >>> a._close(); b._close()
  """

  kind = "net"
  host_offers = True  # replies send np.asarray of what was offered

  def __init__(self, host: str, curve: CurveKeys | None = None, *,
               max_offers: int = offers.MAX_OFFERS,
               max_offer_bytes: int = offers.MAX_OFFER_BYTES):
    if curve is not None and not isinstance(curve, CurveKeys):
      raise ReshardTypeError(f"{wire.API}: curve must be CurveKeys or None; got "
                             f"{type(curve).__name__}.")
    zmq = wire.zmq_module()
    # A context of its own: its I/O thread carries only these bytes, and its ZAP
    # endpoint (one per context) is this transport's alone.
    self._ctx = zmq.Context(io_threads=1)
    self._server: offers.Server | None = None
    try:
      self._server = offers.Server(self._ctx, host, curve, max_offers, max_offer_bytes)
      self._fetcher = fetches.Fetcher(self._ctx, curve)
    except BaseException:
      if self._server is not None:
        self._server.close()
      self._ctx.destroy(linger=0)
      raise

  @property
  def address(self) -> str:
    return self._server.address

  @property
  def held(self) -> tuple[int, int]:
    """(offers, bytes) held now: the offers not fetched, cancelled or expired, and
    their bytes plus those of replies still being sent (what the bounds count)."""
    return self._server.held

  @property
  def counters(self) -> dict[str, int]:
    """Requests dropped unanswered (wrong shape), refused (too many waiting, or a
    CurveZMQ key the ZAP handler does not admit), offers served and their bytes."""
    s = self._server
    return {"dropped": s.dropped, "refused": s.refused, "served": s.served,
            "served_bytes": s.served_bytes}

  def offer(self, arrays, timeout_s, ticket=None):
    return self._server.offer(arrays, timeout_s, ticket)

  def cancel(self, ticket):
    return self._server.cancel(ticket)

  def fetch(self, address, ticket, specs, timeout_s=None) -> Pending:
    """As `Transport.fetch`; `timeout_s`: how long the serving side keeps the request
    while the ticket is not offered yet (None: OFFER_GRACE_S; at most
    offers.MAX_WAIT_S)."""
    return self._fetcher.fetch(address, ticket, specs, timeout_s)

  def forget(self, address):
    self._fetcher.forget(address)

  def _close(self):
    stopped = self._fetcher.close()
    stopped = self._server.close() and stopped
    if stopped:
      self._ctx.term()
    else:  # closing a socket under a running thread could crash the process
      logger.warning("jax_m2n net: a transport thread did not stop within 5 s; its "
                     "sockets stay open")
