"""CurveZMQ keys of the "net" transport: checked, normalized to z85, never printed.

Owns `CurveKeys`; how keys are derived (e.g. from the jobs' token) is the caller's.
"""

from __future__ import annotations

import dataclasses
import hmac
import secrets
from typing import Any

from jax_m2n._src.errors import ReshardTypeError, ReshardValueError
from jax_m2n._src.jobs.net import wire

_API = "CurveKeys"
_NAMES = ("server_secret", "server_public", "client_secret", "client_public")


def z85_key(name: str, key: Any) -> bytes:
  """A CurveZMQ key as z85 (40 bytes) from z85 (str or bytes) or raw 32 bytes."""
  zmq = wire.zmq_module()
  if isinstance(key, str):
    key = key.encode("ascii", "replace")
  if not isinstance(key, (bytes, bytearray)):
    raise ReshardTypeError(f"{_API}: {name} must be a CurveZMQ key (40 z85 characters "
                           f"or 32 raw bytes); got {type(key).__name__}.")
  key = bytes(key)
  if len(key) == 32:
    return zmq.utils.z85.encode(key)
  if len(key) == 40:
    try:
      zmq.utils.z85.decode(key)
    except (ValueError, KeyError, TypeError):
      pass
    else:
      return key
  raise ReshardValueError(f"{_API}: {name} must be a CurveZMQ key (40 z85 characters or "
                          f"32 raw bytes); got {len(key)} bytes that are neither.")


@dataclasses.dataclass(frozen=True)
class CurveKeys:
  """The CurveZMQ keys of a "net" transport (encryption and mutual authentication).

  The serving socket proves `server_secret` and admits only clients proving
  `client_secret`; fetching sockets prove `client_secret` and accept only a server
  proving the secret behind `server_public`. Every process of both jobs holds the same
  four keys (e.g. derived from the shared token: `from_secrets`). Each key is 40 z85
  characters or 32 raw bytes; they are kept as z85 bytes. Hashable: equal keys share
  one transport in `transports.acquire`.

  Example:
    >>> keys = CurveKeys.generate()
    >>> keys == CurveKeys(keys.server_secret, keys.server_public,
    ...                   keys.client_secret, keys.client_public)
    True
    >>> "secret" in repr(keys)
    False
  """

  server_secret: bytes
  server_public: bytes
  client_secret: bytes
  client_public: bytes

  def __post_init__(self):
    zmq = wire.zmq_module()
    for name in _NAMES:
      object.__setattr__(self, name, z85_key(name, getattr(self, name)))
    for side in ("server", "client"):
      public = zmq.curve_public(getattr(self, f"{side}_secret"))
      if not hmac.compare_digest(public, getattr(self, f"{side}_public")):
        raise ReshardValueError(f"{_API}: {side}_public must be the public key of "
                                f"{side}_secret; got another key.")

  @classmethod
  def from_secrets(cls, server_secret: Any, client_secret: Any) -> "CurveKeys":
    """The keys of two secrets (any 32 bytes are a Curve25519 secret key, e.g. a KDF's
    output); the public keys are computed."""
    zmq = wire.zmq_module()
    s, c = z85_key("server_secret", server_secret), z85_key("client_secret", client_secret)
    return cls(s, zmq.curve_public(s), c, zmq.curve_public(c))

  @classmethod
  def generate(cls) -> "CurveKeys":
    """Fresh random keys."""
    return cls.from_secrets(secrets.token_bytes(32), secrets.token_bytes(32))

  def client_public_raw(self) -> bytes:
    """The client's public key as the 32 bytes a ZAP request carries."""
    return wire.zmq_module().utils.z85.decode(self.client_public)

  def __repr__(self) -> str:  # never print a secret
    return (f"CurveKeys(server_public={self.server_public!r}, "
            f"client_public={self.client_public!r})")
