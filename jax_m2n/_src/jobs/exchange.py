"""One control client's messages over its connected DEALER socket: a request encoded,
bounded and sent in chunks; replies and errors read back (each reply's error raised
as its kind says), notices kept aside (bounded); the traffic counted.

Owns the message exchange of a connection; it never connects, diagnoses a handshake
or orders callers (channel.Client does, holding its lock around every call here).
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any, Callable

from jax_m2n._src.errors import (PlanUnknown, ReshardRuntimeError, ReshardTimeoutError,
                                 ReshardValueError)
from jax_m2n._src.jobs import messages
from jax_m2n._src.jobs.messages import ProtocolError

logger = logging.getLogger("jax_m2n")

# Notices a client keeps while nobody reads them; beyond, the oldest are dropped (and
# counted as "notices_dropped").
MAX_NOTICES = 1024


class Exchange:
  """Requests out and replies in on `sock`, for the client named `peer` ("the
  publisher at 1.2.3.4:7000") of API `api`; `count(name, n)` counts the traffic.

  Threads: one at a time (the caller's lock). `notices` holds the notices received
  while replies were awaited, oldest first.
  """

  def __init__(self, sock: Any, zmq: Any, api: str, peer: str,
               count: Callable[[str, int], None]):
    self._sock, self._zmq, self._api, self._peer = sock, zmq, api, peer
    self._count = count
    self._seq = 0
    self.notices: collections.deque[dict[str, Any]] = collections.deque()

  def send(self, body: dict[str, Any], what: str) -> int:
    """Sends the request of `body` (`what` names it in errors); returns its number.

    Raises:
      ReshardValueError: the request is over MAX_MESSAGE_BYTES (nothing was sent).
      zmq.ZMQError: sending failed (the connection is then unusable).
    """
    self._seq += 1
    seq = self._seq
    data = messages.encode({"m2n": messages.PROTOCOL, "type": "call", "seq": seq,
                            "body": body})
    if len(data) > messages.MAX_MESSAGE_BYTES:
      raise ReshardValueError(f"{self._api}: a request must be at most "
                              f"{messages.MAX_MESSAGE_BYTES} bytes; {what} is "
                              f"{len(data)}.")
    chunks = messages.split(data)
    for chunk in chunks:
      self._sock.send(chunk, self._zmq.NOBLOCK)
    self._count("calls", 1)
    self._count("sent", len(chunks))
    self._count("sent_bytes", len(data))
    return seq

  def reply(self, seq: int, deadline: float) -> dict[str, Any] | None:
    """The reply or error to request `seq` (late answers of earlier requests are
    dropped), or None at `deadline`."""
    while True:
      message = self.receive(deadline)
      if message is None or (message.get("seq") in (seq, None)
                             and message["type"] in ("reply", "error")):
        return message

  def body(self, message: dict[str, Any], what: str) -> dict[str, Any]:
    """The body of a `reply` message.

    Raises:
      ReshardRuntimeError: `message` is an error (the server refused `what`).
      The reply's own error, as its kind says: ReshardValueError / ReshardRuntimeError
        / ReshardTimeoutError / VersionGone / PlanUnknown.
    """
    if message["type"] == "error":
      raise ReshardRuntimeError(f"{self._api}: {self._peer} refused {what}: "
                                f"{messages._short(message.get('message'))}")
    out = messages.field(message, "body", dict)
    error = out.get("error")
    if error is not None:
      kind = {"value": ReshardValueError, "timeout": ReshardTimeoutError,
              "gone": messages.VersionGone, "unknown_plan": PlanUnknown}.get(
          out.get("kind"), ReshardRuntimeError)
      raise kind(f"{self._api}: {self._peer}: {error}")
    return out

  def receive(self, deadline: float | None) -> dict[str, Any] | None:
    """The next reply or error, keeping notices aside; None at `deadline` (None: only
    what has arrived, no wait)."""
    while True:
      if deadline is None:
        if not self._sock.poll(0):
          return None
      else:
        left = deadline - time.monotonic()
        if left <= 0 or not self._sock.poll(max(1, int(left * 1000))):
          return None
      data = self._sock.recv()
      self._count("received", 1)
      self._count("received_bytes", len(data))
      try:
        message = messages.decode(data)
        if message["type"] == "notice":
          body = messages.field(message, "body", dict)
        elif message["type"] not in ("reply", "error"):
          raise ProtocolError(f"message: type must be reply, error or notice; got "
                              f"{messages._short(message['type'])}.")
      except ProtocolError as e:
        logger.warning("jax_m2n jobs: %s sent a malformed message (dropped): %s",
                       self._peer, e)
        continue
      if message["type"] != "notice":
        return message
      self._count("notices", 1)
      if len(self.notices) >= MAX_NOTICES:
        self.notices.popleft()
        self._count("notices_dropped", 1)
      self.notices.append(body)
