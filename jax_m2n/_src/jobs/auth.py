"""The token between jobs: its rules, and the CurveZMQ keys both sides derive from it.

Owns what a token must be (a str of at least 16 characters or bytes of at least 16
bytes; `new_token()` makes one of 256 random bits) and turning it into two Curve25519
keypairs with a slow KDF (scrypt), once per token per process. Knows no sockets: the
keys are used by handshake.py (the publisher's gate) and channel.py (the sockets).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import secrets
from typing import Any

from jax_m2n._src.errors import ReshardRuntimeError, ReshardTypeError, ReshardValueError

# The shortest token accepted, in characters (str) or bytes (bytes). A passive
# eavesdropper of one legitimate handshake can test token guesses offline (below); 16
# characters chosen at random are beyond reach, and new_token() gives 64 hex digits.
MIN_TOKEN = 16
# scrypt's cost: N=2^14, r=8 (16 MiB, ~50 ms on one core of the machines measured),
# once per token per process (cached). It multiplies the cost of every offline guess.
SCRYPT_N = 1 << 14
SCRYPT_R = 8
SCRYPT_P = 1
# A fixed salt: both jobs must derive the same keys from the token alone, before any
# byte is exchanged. It separates these keys from any other use of the token.
SALT = b"jax_m2n jobs control channel: CurveZMQ keys v1"


def zmq_module():
  """pyzmq, or an error saying how to install it (the jobs layer's only extra need)."""
  try:
    import zmq
    import zmq.utils.z85  # noqa: F401 - the keys' text form
  except ImportError:
    raise ReshardRuntimeError(
        "jax_m2n jobs: pyzmq must be installed for Publisher/Subscriber; got no module "
        "zmq. Hint: pip install 'jax_m2n[jobs]' (or pyzmq).") from None
  return zmq


def new_token() -> str:
  """A fresh random token for a Publisher and its Subscribers: 256 random bits as 64
  hex digits (`secrets.token_hex(32)`).

  Hand the same token to both jobs (an environment variable, a secret store, a Ray
  actor's argument); anyone who holds it can pull the weights and impersonate the
  publisher.

  Example:
    >>> token = jax_m2n.new_token()
    >>> len(token), all(c in "0123456789abcdef" for c in token)
    (64, True)
  """
  return secrets.token_hex(32)


@dataclasses.dataclass(frozen=True)
class Keys:
  """The CurveZMQ keys of one token (Z85 text, as zmq's socket options take them).

  The publisher's control socket is a CURVE server with `server_secret`; it accepts
  only clients that prove `client_secret` (its ZAP handler checks `client_public`). A
  subscriber connects to `server_public` with the client keypair. Both keypairs come
  from the token, so each side proves the token to the other and nothing about it is
  sent.
  """

  server_public: bytes
  server_secret: bytes = dataclasses.field(repr=False)
  client_public: bytes
  client_secret: bytes = dataclasses.field(repr=False)

  @property
  def client_public_raw(self) -> bytes:
    """The 32 raw bytes of `client_public` (how a ZAP request carries a key)."""
    return zmq_module().utils.z85.decode(self.client_public)


def as_key(api: str, token: Any) -> Keys:
  """The keys of `token`, checked against the token rules (derived once per token).

  What a weak token costs: nobody can check a guess against a live publisher without
  a connection per guess (a HELLO made without the server key is dropped), but whoever
  records one legitimate handshake can test guesses offline (scrypt, then whether the
  HELLO's box opens with the guessed server key): ~20 per second per core here, so a
  dictionary word falls in hours. Hence at least MIN_TOKEN characters; new_token()'s
  256 random bits are beyond reach. Recorded sessions stay secret even then (CurveZMQ's
  short-term keys), but a found token lets its finder act as either side.

  Raises:
    ReshardTypeError: the token is not a str or bytes.
    ReshardValueError: the token is shorter than MIN_TOKEN characters (str) or bytes.
  """
  if isinstance(token, str):
    length, unit = len(token), "characters"
    raw = token.encode()
  elif isinstance(token, (bytes, bytearray)):
    length, unit = len(token), "bytes"
    raw = bytes(token)
  else:
    raise ReshardTypeError(
        f"{api}: token must be a str or bytes shared by both jobs; got "
        f"{type(token).__name__}. Hint: token=jax_m2n.new_token(), handed to both.")
  if length < MIN_TOKEN:
    raise ReshardValueError(
        f"{api}: token must be at least {MIN_TOKEN} {unit} long (a short token can be "
        f"guessed offline from one recorded handshake); got {length} {unit}. Hint: "
        "token=jax_m2n.new_token() (256 random bits), handed to both jobs.")
  return _derive(raw)


@functools.lru_cache(maxsize=16)
def _derive(token: bytes) -> Keys:
  """Two Curve25519 keypairs from one scrypt output (any 32 bytes are a valid Curve25519
  secret: libsodium clamps them)."""
  zmq = zmq_module()
  seed = hashlib.scrypt(token, salt=SALT, n=SCRYPT_N, r=SCRYPT_R, p=SCRYPT_P, dklen=64,
                        maxmem=64 << 20)
  server_secret = zmq.utils.z85.encode(seed[:32])
  client_secret = zmq.utils.z85.encode(seed[32:])
  return Keys(zmq.curve_public(server_secret), server_secret,
              zmq.curve_public(client_secret), client_secret)
