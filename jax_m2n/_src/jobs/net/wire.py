"""The "net" transport's wire: message formats, statuses, sizes, and the socket plumbing
both ends share (zmq itself, heartbeats, handshake bounds, the thread loop; the
wake-up pair is outbox.Waker).

Owns what the serving and fetching sides must agree on; holds no state of either.
"""

from __future__ import annotations

import logging
import struct
import threading
from typing import Any, Callable

from jax_m2n._src.jobs import auth

API = "NetTransport"

logger = logging.getLogger("jax_m2n")

# A fetch sends one frame, REQUEST (24 bytes). The reply is one HEAD message (status,
# then each array's size). A reply of at most INLINE_BYTES in all carries the arrays'
# bytes in the same message, one frame each (a small fetch costs one message); a larger
# one sends, per array, CHUNK messages of at most CHUNK_BYTES (a CHUNK header frame, then
# the bytes): the receiver copies each chunk while the next one crosses, and no frame
# takes longer than a heartbeat on a slow link.
REQUEST = struct.Struct("<4sQQI")  # magic, ticket, request id, wait in ms
HEAD = struct.Struct("<4sQBI")     # magic, request id, status, number of arrays
CHUNK = struct.Struct("<4sQIQ")    # magic, request id, array index, byte offset
REQUEST_MAGIC, HEAD_MAGIC, CHUNK_MAGIC = b"m2nR", b"m2nH", b"m2nC"
INLINE_BYTES = 1 << 20
CHUNK_BYTES = 8 << 20
# What a stranger can make the serving socket allocate: zmq refuses bigger frames
# (handshake commands included) before allocating them.
MAX_REQUEST_BYTES = 64 << 10
# HEAD's status.
OK, EXPIRED, BUSY, WITHDRAWN, FAILED = 0, 1, 2, 3, 4
WHY = {EXPIRED: "the ticket was not offered within the fetch's wait",
       BUSY: "the peer holds too many waiting requests",
       WITHDRAWN: "the offer was withdrawn",
       FAILED: "the offered arrays could not be read (deleted or donated?)"}

# zmq's liveness checks: a peer silent for HEARTBEAT_TIMEOUT_S (host gone, link cut)
# closes the connection, which fails its fetches. A peer process that dies is noticed
# at once (its kernel closes the TCP connection).
HEARTBEAT_S = 1.0
HEARTBEAT_TIMEOUT_S = 5.0
# A connection that has not completed the ZMTP (and CURVE) handshake within this is
# closed: a half-open connection costs an fd for a bounded time only.
HANDSHAKE_S = 5.0
# The poll period of both threads when nothing is due sooner.
TICK_S = 0.5


def zmq_module():
  """pyzmq (with its z85 codec), or the jobs layer's error naming the extra."""
  return auth.zmq_module()


def tune(sock: Any, zmq: Any) -> None:
  """The options every data socket has: no linger, heartbeats, a handshake bound."""
  sock.setsockopt(zmq.LINGER, 0)
  sock.setsockopt(zmq.HEARTBEAT_IVL, int(HEARTBEAT_S * 1000))
  sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(HEARTBEAT_TIMEOUT_S * 1000))
  sock.setsockopt(zmq.HANDSHAKE_IVL, int(HANDSHAKE_S * 1000))


def stop_thread(stop: threading.Event, drop: Callable[[], None], waker: Any,
                thread: threading.Thread) -> bool:
  """Stops a socket thread: `stop` set, what it holds dropped (`drop`), woken a last
  time; waits up to 5 s for it (not from itself); whether it stopped."""
  stop.set()
  drop()
  waker.close_sender()
  if threading.current_thread() is not thread:
    thread.join(timeout=5.0)
  return not thread.is_alive()


def run(name: str, poller: Any, stop: threading.Event, timeout_ms: Callable[[], int],
        step: Callable[[dict[Any, int]], None], zmq: Any) -> None:
  """A socket thread's loop: poll (`timeout_ms()` at most), then `step(events)`, until
  `stop` (or the context closes); a step that fails is logged and the loop goes on."""
  while not stop.is_set():
    try:
      events = dict(poller.poll(timeout_ms()))
    except zmq.ZMQError:
      return
    if stop.is_set():
      return
    try:
      step(events)
    except Exception:  # noqa: BLE001 - the thread must outlive a bug
      logger.exception("jax_m2n net: the %s thread's step failed", name)


def discard_rest(sock: Any, zmq: Any) -> None:
  """Drops the remaining frames of the message being received."""
  while sock.getsockopt(zmq.RCVMORE):
    sock.recv(copy=False)
