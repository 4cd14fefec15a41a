"""The "net" transport's serving sockets: the ROUTER bound to a free port with its
bounds, and under CurveZMQ the context's ZAP endpoint with its rule (only the client
key of `CurveKeys` is admitted).

Owns how those sockets are set up and how a handshake is judged; it never reads a
request or an offer (offers.py).
"""

from __future__ import annotations

import hmac
from typing import Any

from jax_m2n._src.errors import ReshardRuntimeError
from jax_m2n._src.jobs import channel, handshake
from jax_m2n._src.jobs.net import wire
from jax_m2n._src.jobs.net.curve import CurveKeys

API = wire.API


def bind(ctx: Any, zmq: Any, host: str, curve: CurveKeys | None) -> tuple[Any, str]:
  """(The ROUTER socket bound to a free port of `host`, its address "host:port")."""
  sock = ctx.socket(zmq.ROUTER)
  wire.tune(sock, zmq)
  sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_REQUEST_BYTES)
  sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a vanished peer is an error, not silence
  sock.setsockopt(zmq.SNDHWM, 0)  # replies reference offered arrays: bounded by them
  if curve is not None:
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, curve.server_secret)
    sock.setsockopt(zmq.ZAP_DOMAIN, b"jax_m2n")
  bound = channel.bind_host(API, host)
  if ":" in bound:
    sock.setsockopt(zmq.IPV6, 1)
  try:
    sock.bind(f"tcp://{channel.join_address(bound, 0)[:-1]}*")
  except zmq.ZMQError as e:
    sock.close(0)
    raise ReshardRuntimeError(f"{API}: the data socket must bind {host!r}; got {e}. "
                              "Hint: the host must be an address of this machine.") from None
  port = int(sock.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1])
  return sock, channel.join_address(host, port)


def zap_socket(ctx: Any, zmq: Any) -> Any:
  """The ZAP endpoint of `ctx` (one per context: the transport's context is its own)."""
  sock = ctx.socket(zmq.REP)
  sock.bind(handshake.ZAP_ENDPOINT)
  return sock


def answer_zap(sock: Any, zmq: Any, curve: CurveKeys) -> bool:
  """Answers one ZAP request waiting on `sock`, if any; returns whether it refused a
  handshake (any key but `curve`'s client key, any mechanism but CURVE)."""
  try:
    frames = sock.recv_multipart(zmq.NOBLOCK)
  except zmq.Again:
    return False
  ok = (len(frames) >= 7 and frames[5] == b"CURVE"
        and hmac.compare_digest(frames[6], curve.client_public_raw()))
  request_id = frames[1] if len(frames) > 1 else b""
  sock.send_multipart([b"1.0", request_id, b"200" if ok else b"400",
                       b"OK" if ok else b"unknown client key", b"", b""])
  return not ok
