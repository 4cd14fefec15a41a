"""The control messages between jobs: one versioned JSON format with size limits.

Owns encoding and decoding (JSON only: nothing is ever unpickled or evaluated), the
limits every message is held to before it is parsed, and the schema checks of each
message kind. Knows no sockets, no tokens, no arrays.
"""

from __future__ import annotations

import json
from typing import Any

from jax_m2n._src.errors import ProtocolError, VersionGone  # noqa: F401 - re-exported

# The protocol's version: a peer speaking another is refused, naming both.
PROTOCOL = 1
# Bounds on one message. A handshake message is tiny; a call carries at most a pull's
# piece list (a 2,000-leaf model over 256 devices is ~2 MB); a reply at most a manifest.
MAX_HANDSHAKE_BYTES = 4096
MAX_MESSAGE_BYTES = 64 << 20
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


def hex_field(message: dict[str, Any], name: str, nbytes: int) -> bytes:
  """A field holding exactly `nbytes` bytes as lowercase hex."""
  text = field(message, name, str, max_len=2 * nbytes)
  what = message.get("type") or "message"
  if len(text) != 2 * nbytes:
    raise ProtocolError(f"{what}: field {name!r} must be {2 * nbytes} hex digits; got "
                        f"{len(text)}.")
  try:
    return bytes.fromhex(text)
  except ValueError:
    raise ProtocolError(f"{what}: field {name!r} must be hex; got {_short(text)}.") from None


def int_list(value: Any, what: str, lo: int, hi: int, max_len: int = MAX_LIST) -> list[int]:
  """A list of ints in [lo, hi]."""
  if not isinstance(value, list) or len(value) > max_len:
    raise ProtocolError(f"{what}: must be a list of at most {max_len} ints; got "
                        f"{type(value).__name__}.")
  for v in value:
    if type(v) is not int or not lo <= v <= hi:
      raise ProtocolError(f"{what}: must hold ints in [{lo}, {hi}]; got {_short(v)}.")
  return value

