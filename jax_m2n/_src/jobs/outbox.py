"""What a control server sends: replies and notices posted from any thread, encoded
(and bounded) on the posting thread, queued, and sent by the server thread, woken for
them; counted.

Owns the queue, the wake-up pair and the sending on the server's ROUTER socket; it
never reads a request (channel.py).
"""

from __future__ import annotations

import collections
import secrets
import threading
from typing import Any

from jax_m2n._src.jobs import messages


def encode(message: dict[str, Any]) -> bytes:
  """`message` as sent (the protocol's version added); one over MAX_MESSAGE_BYTES
  becomes an error that names its size, sent in its place."""
  data = messages.encode({"m2n": messages.PROTOCOL, **message})
  if len(data) > messages.MAX_MESSAGE_BYTES:
    data = messages.encode({
        "m2n": messages.PROTOCOL, "type": "error", "seq": message.get("seq"),
        "message": f"{message['type']}: must be at most {messages.MAX_MESSAGE_BYTES} "
                   f"bytes; got {len(data)}."})
  return data


class Outbox:
  """Messages to `sock`'s clients (a ROUTER socket the server thread owns), counted in
  `stats["sent"]`, and the inproc pair that wakes the server thread's poll (`socket`
  is the end it polls and `drain`s).

  Threads: `post` and `wake` from any thread; `drain`, `flush`, `send` and `close` on
  the server thread (`close` once it stopped); after `stop`, wakes do nothing.
  """

  def __init__(self, zmq: Any, ctx: Any, sock: Any, stats: collections.Counter):
    self._zmq, self._sock, self._stats = zmq, sock, stats
    self._wake_in = ctx.socket(zmq.PAIR)
    self.socket = ctx.socket(zmq.PAIR)
    wake = f"inproc://jax_m2n-wake-{secrets.token_hex(8)}"
    self.socket.bind(wake)
    self._wake_in.connect(wake)
    self._lock = threading.Lock()
    self._stopped = False
    self._queue: collections.deque[tuple[bytes, bytes]] = collections.deque()

  def wake(self) -> None:
    """Wakes the server thread's poll soon (any thread)."""
    with self._lock:
      if not self._stopped:
        try:
          self._wake_in.send(b"", self._zmq.NOBLOCK)
        except self._zmq.Again:
          pass  # wakes are pending already: one is enough

  def post(self, peer: bytes, message: dict[str, Any], now: bool) -> None:
    """Sends `message` to `peer`: at once where `now` (the caller is the server
    thread), else queued for the server thread, woken. Encoded here either way (a big
    reply costs the posting thread, not the server thread)."""
    data = encode(message)
    if now:
      self.send(peer, data)
    else:
      self._queue.append((peer, data))
      self.wake()

  def stop(self) -> None:
    """Wakes the server thread a last time (to see its stop); later wakes do nothing."""
    with self._lock:
      self._stopped = True
      try:
        self._wake_in.send(b"", self._zmq.NOBLOCK)
      except self._zmq.ZMQError:
        pass

  def drain(self) -> None:
    """Takes the wakes that arrived."""
    while True:
      try:
        self.socket.recv(self._zmq.NOBLOCK)
      except self._zmq.Again:
        break

  def flush(self) -> None:
    """Sends what was queued, oldest first."""
    while self._queue:
      self.send(*self._queue.popleft())

  def send(self, peer: bytes, data: bytes) -> None:
    try:
      self._sock.send_multipart([peer, data], self._zmq.NOBLOCK)
      self._stats["sent"] += 1
    except self._zmq.ZMQError:
      pass  # the peer is gone (or not reading): nothing to answer

  def close(self) -> None:
    """Closes the wake-up pair (the ROUTER socket is the server's)."""
    for s in (self._wake_in, self.socket):
      s.close(0)
