"""The token between jobs: challenge-response, session keys and message MACs.

Owns proving the token without sending it (HMAC-SHA256 over both sides' random nonces,
checked with `hmac.compare_digest`), deriving a per-session key, and sealing / opening
the messages of a session (a MAC over direction, sequence number and body, so a message
can be neither forged, altered, replayed nor reordered). Knows no sockets.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from typing import Any

from jax_m2n._src.errors import ReshardTypeError, ReshardValueError
from jax_m2n._src.jobs import messages
from jax_m2n._src.jobs.messages import ProtocolError

NONCE_BYTES = 16
SESSION_BYTES = 16
MAC_BYTES = 32


def as_key(api: str, token: Any) -> bytes:
  """The token as key bytes; refuses what is not a non-empty str or bytes."""
  if isinstance(token, str):
    token = token.encode()
  if not isinstance(token, (bytes, bytearray)):
    raise ReshardTypeError(
        f"{api}: token must be a str or bytes shared by both jobs; got "
        f"{type(token).__name__}. Hint: token=secrets.token_hex(16), handed to both.")
  if not token:
    raise ReshardValueError(
        f"{api}: token must not be empty; got ''. Hint: secrets.token_hex(16).")
  return bytes(token)


def nonce() -> bytes:
  return secrets.token_bytes(NONCE_BYTES)


def _mac(key: bytes, *parts: bytes) -> bytes:
  return hmac.new(key, b"|".join(parts), hashlib.sha256).digest()


def server_proof(key: bytes, client_nonce: bytes, server_nonce: bytes,
                 session: bytes) -> bytes:
  """What the publisher shows: it holds the token too (a subscriber never talks to an
  impostor that merely listens on the address)."""
  return _mac(key, b"m2n-server", client_nonce, server_nonce, session)


def client_proof(key: bytes, client_nonce: bytes, server_nonce: bytes,
                 session: bytes) -> bytes:
  return _mac(key, b"m2n-client", client_nonce, server_nonce, session)


def session_key(key: bytes, client_nonce: bytes, server_nonce: bytes,
                session: bytes) -> bytes:
  return _mac(key, b"m2n-session", client_nonce, server_nonce, session)


def verify(expected: bytes, got: bytes) -> bool:
  return hmac.compare_digest(expected, got)


# Directions of a sealed message: a reply can never pass for a request.
TO_SERVER, TO_CLIENT = b"c2s", b"s2c"


def seal(key: bytes, session: bytes, direction: bytes, seq: int,
         body: dict[str, Any]) -> bytes:
  """An authenticated message: the body as a JSON string, its MAC over (direction,
  session, seq, body)."""
  text = messages.encode(body).decode()
  mac = _mac(key, direction, session, str(seq).encode(), text.encode())
  return messages.encode({"m2n": messages.PROTOCOL, "type": "sealed",
                          "session": session.hex(), "seq": seq, "body": text,
                          "mac": mac.hex()})


def session_of(message: dict[str, Any]) -> bytes:
  """The session a sealed message names (before its MAC is checked)."""
  return messages.hex_field(message, "session", SESSION_BYTES)


def open_sealed(key: bytes, direction: bytes, message: dict[str, Any]
                ) -> tuple[int, dict[str, Any]]:
  """(seq, body) of a sealed message whose MAC holds; the body is parsed only then.

  Raises:
    ProtocolError: a malformed envelope, a MAC that does not hold, a bad body.
  """
  session = session_of(message)
  seq = messages.field(message, "seq", int, lo=0, hi=(1 << 62))
  text = messages.field(message, "body", str, max_len=messages.MAX_MESSAGE_BYTES)
  mac = messages.hex_field(message, "mac", MAC_BYTES)
  if not verify(_mac(key, direction, session, str(seq).encode(), text.encode()), mac):
    raise ProtocolError("sealed: the MAC must hold for the session's key; it does not.")
  body = messages.parse_object(text.encode())
  return seq, body
