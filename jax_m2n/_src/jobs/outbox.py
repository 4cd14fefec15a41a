"""What a control server sends: replies and notices posted from any thread, encoded
(and bounded) on the posting thread, queued, and sent by the server thread, woken for
them; counted.

Owns the queue, the wake-up pair (`Waker`, also the net transport's threads') and the
sending on the server's ROUTER socket; it never reads a request (channel.py).
"""

from __future__ import annotations

import collections
import secrets
import threading
from typing import Any

from jax_m2n._src.jobs import messages


class Waker:
  """An inproc pair that wakes one thread's poll from any thread (`socket` is the end
  that thread polls and `drain`s)."""

  def __init__(self, ctx: Any, zmq: Any, name: str):
    self._zmq = zmq
    self._out, self.socket = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    endpoint = f"inproc://jax_m2n-{name}-{secrets.token_hex(8)}"
    self.socket.bind(endpoint)
    self._out.connect(endpoint)
    self._lock = threading.Lock()
    self._closed = False

  def wake(self) -> None:
    with self._lock:
      if not self._closed:
        try:
          self._out.send(b"", self._zmq.NOBLOCK)
        except self._zmq.ZMQError:
          pass  # a wake is queued already

  def drain(self) -> None:
    drain(self.socket, self._zmq)

  def close_sender(self) -> None:
    """Wakes the thread a last time; later wakes do nothing."""
    self.wake()
    with self._lock:
      self._closed = True
      self._out.close(0)


def drain(sock: Any, zmq: Any) -> None:
  """Receives every message queued on `sock`, dropping them."""
  while True:
    try:
      sock.recv(zmq.NOBLOCK)
    except zmq.Again:
      return


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
    self._waker = Waker(ctx, zmq, "wake")
    self.socket = self._waker.socket
    self._queue: collections.deque[tuple[bytes, bytes]] = collections.deque()

  def wake(self) -> None:
    """Wakes the server thread's poll soon (any thread)."""
    self._waker.wake()

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
    self._waker.close_sender()

  def drain(self) -> None:
    """Takes the wakes that arrived."""
    self._waker.drain()

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
    """Closes the wake-up pair's polled end (the sender closed at `stop`; the ROUTER
    socket is the server's)."""
    self._waker.close_sender()
    self.socket.close(0)
