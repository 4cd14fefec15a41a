"""The control messages between jobs: one versioned JSON format with size limits.

Owns encoding and decoding (JSON only: nothing is ever unpickled or evaluated), the
limits every message is held to before it is parsed, cutting a message into frames of
at most MAX_FRAME_BYTES and putting a peer's frames back together within bounds, and
the schema checks of each message kind. Knows no sockets, no tokens, no arrays.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

from jax_m2n._src.errors import ProtocolError, VersionGone  # noqa: F401 - re-exported

# The protocol's version: 3 is CurveZMQ (auth.py's keys) with chunked requests, and a
# pull that may name "the newest after my last" (`after`, `want`), answered before its
# offers. A peer of protocol 2 completes the handshake and has every message refused
# ("protocol must be m2n 3"); one of protocol 1 (an HMAC challenge-response over plain
# TCP) fails the handshake.
PROTOCOL = 3
# The largest frame a publisher's zmq socket accepts from anyone (its ZMQ_MAXMSGSIZE):
# zmq's decoder refuses a larger frame, handshake commands included, before allocating
# it, so an unauthenticated peer can make it hold at most this much per connection.
MAX_FRAME_BYTES = 64 << 10
# CurveZMQ's MESSAGE command adds 33 bytes to a frame's payload (measured: 65503 bytes
# pass a 64 KiB limit, 65504 do not); one more byte is the chunk's flag.
CURVE_OVERHEAD = 33
CHUNK_BYTES = MAX_FRAME_BYTES - CURVE_OVERHEAD - 1
# Bounds on one message. A call carries at most a pull's piece list (a 2,000-leaf model
# over 256 devices is ~2 MB); a reply at most a manifest. A request arrives as separate
# one-frame messages of CHUNK_BYTES (not one multipart message: zmq holds a multipart
# message whole before the reader sees any frame, and its receive high-water mark counts
# messages, so it would bound nothing), reassembled here within these bounds.
MAX_MESSAGE_BYTES = 64 << 20
# All requests being reassembled at once on one server (across its peers), and how long
# a request may take to arrive whole.
MAX_ASSEMBLING_BYTES = 256 << 20
ASSEMBLY_S = 60.0
# A chunk's first byte: more chunks of this message follow, or this one ends it.
MORE, LAST = b"+", b"."
# Bounds on what a message may hold once parsed.
MAX_LIST = 1 << 22
MAX_DEPTH = 16
MAX_STRING = 1 << 16


def encode(message: dict[str, Any]) -> bytes:
  """The wire form of a message (compact JSON, UTF-8)."""
  return json.dumps(message, separators=(",", ":"), allow_nan=False).encode()


def _reject_constant(name: str) -> Any:
  raise ProtocolError(f"message: numbers must be finite; got {name}.")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
  out = dict(pairs)
  if len(out) != len(pairs):
    raise ProtocolError("message: an object must not repeat a key.")
  return out


def parse_object(data: bytes, limit: int = MAX_MESSAGE_BYTES) -> dict[str, Any]:
  """Parses one JSON object, refusing anything outside the format.

  Raises:
    ProtocolError: over `limit` bytes, not UTF-8 JSON, not an object, a repeated key,
      NaN or infinities, nesting deeper than MAX_DEPTH, lists longer than MAX_LIST.
  """
  if not isinstance(data, (bytes, bytearray, memoryview)):
    raise ProtocolError(f"message: must be bytes; got {type(data).__name__}.")
  if len(data) > limit:
    raise ProtocolError(f"message: must be at most {limit} bytes; got {len(data)}.")
  try:
    value = json.loads(bytes(data).decode("utf-8"), parse_constant=_reject_constant,
                       object_pairs_hook=_no_duplicates)
  except ProtocolError:
    raise
  except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeError
    raise ProtocolError(f"message: must be UTF-8 JSON; got bytes that are not "
                        f"({type(e).__name__}).") from None
  if not isinstance(value, dict):
    raise ProtocolError(f"message: must be a JSON object; got {type(value).__name__}.")
  _check_shape(value, 0)
  return value


def decode(data: bytes, limit: int = MAX_MESSAGE_BYTES) -> dict[str, Any]:
  """Parses one message (`parse_object`) of this protocol version, naming its type.

  Raises:
    ProtocolError: what `parse_object` refuses, another protocol version, no type.
  """
  value = parse_object(data, limit)
  if value.get("m2n") != PROTOCOL:
    raise ProtocolError(f"message: protocol must be m2n {PROTOCOL}; got "
                        f"{_short(value.get('m2n'))}.")
  if not isinstance(value.get("type"), str):
    raise ProtocolError("message: must name its type (a string).")
  return value


def _check_shape(value: Any, depth: int) -> None:
  if depth > MAX_DEPTH:
    raise ProtocolError(f"message: must nest at most {MAX_DEPTH} deep.")
  if isinstance(value, dict):
    for v in value.values():
      _check_shape(v, depth + 1)
  elif isinstance(value, list):
    if len(value) > MAX_LIST:
      raise ProtocolError(f"message: lists must hold at most {MAX_LIST} items; got "
                          f"{len(value)}.")
    if value and not isinstance(value[0], (dict, list)) and all(
        type(v) is int for v in value):
      return  # a list of ints (the piece lists): nothing nested to walk
    for v in value:
      _check_shape(v, depth + 1)


def _short(value: Any) -> str:
  text = repr(value)
  return text if len(text) <= 80 else text[:77] + "..."


# ---------------------------------------------------------------------------------------
# Chunks: a message as frames of at most MAX_FRAME_BYTES, and back
# ---------------------------------------------------------------------------------------

def split(data: bytes) -> list[bytes]:
  """`data` as chunks of at most CHUNK_BYTES, each led by its flag (MORE or LAST)."""
  view = memoryview(data)
  out = [MORE + view[i:i + CHUNK_BYTES] for i in range(0, len(view), CHUNK_BYTES)]
  if out:
    out[-1] = LAST + out[-1][1:]
  return out or [LAST]


@dataclasses.dataclass
class _Partial:
  data: bytearray
  started: float
  failed: bool = False  # refused: its remaining chunks are dropped up to its last


class Assembler:
  """Puts each peer's chunks back into whole messages, within bounds: a message at most
  `limit` bytes, all partial messages together at most `total`, each whole within
  `expire_s` of its first chunk. One message at a time per peer (chunks of one peer
  arrive in order). Not thread-safe: the server thread owns it.
  """

  def __init__(self, limit: int | None = None, total: int | None = None,
               expire_s: float | None = None):
    # The module's limits as they are now (tests lower them).
    self._limit = MAX_MESSAGE_BYTES if limit is None else limit
    self._total = MAX_ASSEMBLING_BYTES if total is None else total
    self._expire_s = ASSEMBLY_S if expire_s is None else expire_s
    self._partial: dict[bytes, _Partial] = {}
    self.held = 0  # bytes held in partial messages

  def add(self, peer: bytes, frame: bytes) -> bytes | None:
    """The whole message when `frame` (a chunk of `peer`) ends one, else None.

    Raises:
      ProtocolError: the chunk has no flag, or its message breaks a bound (raised once
        per message; its later chunks are dropped quietly up to its last).
    """
    flag, payload = frame[:1], frame[1:]
    if flag not in (MORE, LAST):
      self._drop(peer)
      raise ProtocolError(f"message: a chunk must start with {MORE!r} or {LAST!r}; got "
                          f"{_short(bytes(flag))}.")
    part = self._partial.get(peer)
    if part is None:
      if flag == LAST:  # the common case: a message of one chunk, never held here
        if len(payload) > self._limit:  # (a frame is far below the limit; kept exact)
          raise ProtocolError(f"message: must be at most {self._limit} bytes.")
        return bytes(payload)
      part = self._partial[peer] = _Partial(bytearray(), time.monotonic())
    if not part.failed:
      size = len(part.data) + len(payload)
      if size > self._limit or self.held + len(payload) > self._total:
        self.held -= len(part.data)
        part.data = bytearray()
        part.failed = True
        if flag == LAST:
          del self._partial[peer]
        raise ProtocolError(
            f"message: must be at most {self._limit} bytes" if size > self._limit else
            f"message: the server must have room for it; {self._total} bytes of other "
            "requests are being received. Hint: retry.")
      part.data += payload
      self.held += len(payload)
    if flag == MORE:
      return None
    del self._partial[peer]
    self.held -= len(part.data)
    return None if part.failed else bytes(part.data)

  def expire(self) -> int:
    """Drops the partial messages older than expire_s; returns how many."""
    now = time.monotonic()
    old = [p for p, part in self._partial.items() if now - part.started > self._expire_s]
    for peer in old:
      self._drop(peer)
    return len(old)

  def _drop(self, peer: bytes) -> None:
    part = self._partial.pop(peer, None)
    if part is not None:
      self.held -= len(part.data)


# ---------------------------------------------------------------------------------------
# Schema checks: each field of a message kind, its type and range
# ---------------------------------------------------------------------------------------

def field(message: dict[str, Any], name: str, kind: Any, *, lo: int | None = None,
          hi: int | None = None, max_len: int = MAX_STRING) -> Any:
  """`message[name]`, checked: a `kind` (int, str, list, dict, bool), ints in
  [lo, hi], strings at most `max_len` characters.

  Raises:
    ProtocolError: the field is missing or breaks its rule (naming both).
  """
  what = message.get("type") or message.get("op") or "message"
  if name not in message:
    raise ProtocolError(f"{what}: must have field {name!r}.")
  value = message[name]
  if kind is int:
    ok = type(value) is int
  else:
    ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
  if not ok:
    raise ProtocolError(f"{what}: field {name!r} must be {kind.__name__}; got "
                        f"{type(value).__name__} {_short(value)}.")
  if kind is int and ((lo is not None and value < lo) or (hi is not None and value > hi)):
    raise ProtocolError(f"{what}: field {name!r} must be in [{lo}, {hi}]; got {value}.")
  if kind is str and len(value) > max_len:
    raise ProtocolError(f"{what}: field {name!r} must be at most {max_len} characters; "
                        f"got {len(value)}.")
  return value


def int_list(value: Any, what: str, lo: int, hi: int, max_len: int = MAX_LIST) -> list[int]:
  """A list of ints in [lo, hi]."""
  if not isinstance(value, list) or len(value) > max_len:
    raise ProtocolError(f"{what}: must be a list of at most {max_len} ints; got "
                        f"{type(value).__name__}.")
  for v in value:
    if type(v) is not int or not lo <= v <= hi:
      raise ProtocolError(f"{what}: must hold ints in [{lo}, {hi}]; got {_short(v)}.")
  return value

