"""The transports a process has: one per (kind, host, options), shared by the
process's Publishers and Subscribers, made on first use and closed by their last user
(its ports stop listening). Owns only that registry; the interface is transport.py's,
the implementations are transport.TransferServerTransport and net/.
"""

from __future__ import annotations

import threading
from typing import Any

from jax_m2n._src.errors import ReshardValueError
from jax_m2n._src.jobs import auth, net
from jax_m2n._src.jobs.transport import TransferServerTransport, Transport

# What a job's processes serve and fetch through (the manifest names it per publisher
# process): "net" (jobs/net/, the default), "net+curve" (the same, encrypted with
# CurveZMQ keys from the token: Publisher(encrypt=True)), "transfer_server" (JAX's,
# bound to 127.0.0.1 only: its wire format trusts its peers; for comparison on one host).
SPECS = ("net", "net+curve", "transfer_server")

# ---------------------------------------------------------------------------------------
# One transport per (kind, host, options) and process, shared, closed by its last user
# ---------------------------------------------------------------------------------------

_open: dict[tuple[Any, ...], tuple[Transport, int]] = {}
_open_lock = threading.Lock()


def kinds() -> dict[str, type[Transport]]:
  """The transports by kind: "transfer_server" (JAX's) and "net" (jobs/net/)."""
  return {TransferServerTransport.kind: TransferServerTransport,
          net.NetTransport.kind: net.NetTransport}


def acquire(host: str, kind: str = TransferServerTransport.kind,
            **options: Any) -> Transport:
  """This process's transport of `kind` bound to `host` with `options` (the kind's
  constructor's keyword arguments, e.g. "net"'s `curve=`), made on first use: equal
  arguments share one transport. Every acquire is paired with one `release`."""
  made = kinds()
  if kind not in made:
    raise ReshardValueError(f"transport: kind must be one of {sorted(made)}; got "
                            f"{kind!r}.")
  key = (kind, host, tuple(sorted(options.items())))
  with _open_lock:
    got = _open.get(key)
    if got is None:
      got = (made[kind](host, **options), 0)
    _open[key] = (got[0], got[1] + 1)
    return got[0]


def release(transport: Transport) -> None:
  """Gives back one `acquire`; the last closes the transport (its ports close)."""
  with _open_lock:
    for key, (t, users) in list(_open.items()):
      if t is transport:
        if users > 1:
          _open[key] = (t, users - 1)
          return
        del _open[key]
        break
    else:
      return
  transport._close()  # pylint: disable=protected-access


def acquire_spec(spec: str, host: str, key: auth.Keys) -> Transport:
  """`acquire` for a manifest's transport spec (SPECS): "net" on `host`, "net+curve"
  with the token's keys, "transfer_server" on 127.0.0.1 whatever `host` is."""
  if spec == "net":
    return acquire(host, net.NetTransport.kind)
  if spec == "net+curve":
    return acquire(host, net.NetTransport.kind, curve=net.CurveKeys(
        key.server_secret, key.server_public, key.client_secret, key.client_public))
  if spec == TransferServerTransport.kind:
    return acquire("127.0.0.1", TransferServerTransport.kind)
  raise ReshardValueError(f"transport: the spec must be one of {SPECS}; got {spec!r}.")
