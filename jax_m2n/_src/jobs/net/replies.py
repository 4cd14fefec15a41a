"""The "net" transport's replies on the serving socket: a status alone, or an offer's
arrays read to the host and sent without a copy (inline in the HEAD message when
small, else as CHUNK messages).

Owns the sending half of wire.py's reply format; it holds no state (which request
gets which offer, and when, is offers.py's).
"""

from __future__ import annotations

import struct
from typing import Any

import jax
import numpy as np

from jax_m2n._src.jobs.net import wire


def _host_bytes(a: Any) -> np.ndarray:
  """An offered array's bytes as flat uint8 (on CPU the array's own buffer; on an
  accelerator a device-to-host copy, which JAX keeps with the array while it lives)."""
  return np.ascontiguousarray(np.asarray(a)).reshape(-1).view(np.uint8)


def read(arrays: list[Any]) -> list[np.ndarray]:
  """The arrays' bytes on the host; raises what reading them raises (an array deleted
  or donated meanwhile)."""
  for a in arrays:  # every device-to-host copy starts before one is awaited
    if isinstance(a, jax.Array) and a.devices().pop().platform != "cpu":
      a.copy_to_host_async()
  return [_host_bytes(a) for a in arrays]


def send_status(router: Any, zmq: Any, ident: bytes, rid: int, status: int) -> None:
  """A HEAD with `status` and no arrays (nothing where the peer is gone)."""
  try:
    router.send_multipart([ident, wire.HEAD.pack(wire.HEAD_MAGIC, rid, status, 0)],
                          zmq.NOBLOCK)
  except zmq.ZMQError:
    pass  # the peer is gone: nothing to answer


def send_arrays(router: Any, zmq: Any, ident: bytes, rid: int, hosts: list[np.ndarray],
                nbytes: int) -> list[Any] | None:
  """A HEAD OK and the bytes of `hosts` (`nbytes` in all); zmq holds the buffers until
  sent. Returns zmq's trackers of what was queued (done once zmq let go of the
  buffers); None where the peer left before its HEAD (nothing was sent)."""
  head = wire.HEAD.pack(wire.HEAD_MAGIC, rid, wire.OK, len(hosts)) + struct.pack(
      f"<{len(hosts)}Q", *(h.size for h in hosts))
  inline = nbytes <= wire.INLINE_BYTES
  try:
    trackers = [router.send_multipart([ident, head] + (hosts if inline else []),
                                      zmq.NOBLOCK, copy=False, track=True)]
  except zmq.ZMQError:
    return None
  try:
    for a, h in enumerate([] if inline else hosts):
      for at in range(0, h.size, wire.CHUNK_BYTES):
        trackers.append(router.send_multipart(
            [ident, wire.CHUNK.pack(wire.CHUNK_MAGIC, rid, a, at),
             h[at:at + wire.CHUNK_BYTES]], zmq.NOBLOCK, copy=False, track=True))
  except zmq.ZMQError:
    pass  # the peer left mid-reply: its fetch failed with its connection
  return trackers
