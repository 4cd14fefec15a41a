"""JAX's transfer server (`jax.experimental.transfer`): the only module that imports it.

Owns starting a server, connecting to a peer's, offering arrays under a uuid until a
deadline, pulling them, and failing what is pending on a connection. It knows nothing of
plans, shardings, processes or jobs: processes/ (one jax.distributed job) and jobs/
(between jobs) decide who offers what to whom, and how long they wait.

What it papers over (jax 0.10-0.11; tests/transfer_server_test.py fails when one changes):
- the module is experimental: it is imported on first use, never at jax_m2n's import;
- `start_transfer_server`'s bulk transport takes its own addresses; left empty, a peer's
  pull fails ("SocketServer: Connection closed") and the process aborts at exit, so
  `start` binds the bulk transport on the same host as the server;
- an offer's deadline is an absolute, naive local `datetime.datetime`, not seconds;
  everywhere else jax_m2n counts in `time.monotonic()`, so `await_pull` converts;
- an offer that expires unpulled leaves a later pull of its uuid pending for good (a
  pull's own `timeout` does not end it), and no public call ends a pending pull: `cancel`
  uses the connection's private `TransferConnection._poison_connection`, which fails
  them at once.
"""

from __future__ import annotations

import datetime
import time
from typing import Any, Sequence

import jax


def bind_address(host: str, port: int = 0) -> str:
  """"host:port", with an IPv6 host in brackets (what the server's addresses take)."""
  return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def start(host: str) -> Any:
  """A new transfer server of this process's devices, listening on `host`.

  The server and its bulk transport both bind `host` on a free port: the peer that
  pulls connects back to the bulk transport, so `host` must be an address that peer
  reaches (the caller's rule: processes/bootstrap.transfer_host, jobs' route lookup).

  Args:
    host: an IP address of this machine ("127.0.0.1", "::1", "10.0.0.2").

  Returns:
    The server; `server.address()` is the "host:port" peers `connect` to.
  """
  from jax.experimental import transfer  # experimental: imported on first use
  client = jax.local_devices()[0].client
  address = bind_address(host)
  return transfer.start_transfer_server(client, address, [address])


def connect(server: Any, address: str) -> Any:
  """A connection from `server` to the peer server at `address` ("host:port")."""
  return server.connect(address)


def _wall_clock(deadline: float) -> datetime.datetime:
  """A `time.monotonic()` deadline as the server takes it (naive local wall clock)."""
  return datetime.datetime.now() + datetime.timedelta(seconds=deadline - time.monotonic())


def await_pull(server: Any, uuid: int, arrays: Sequence[jax.Array],
               deadline: float) -> None:
  """Offers `arrays` under `uuid` to one pull, until `deadline` (a `time.monotonic()`
  value): the server drops the offer then if nobody pulled it, so a peer that died
  mid-call leaks nothing. Returns at once.

  Example (one process, the server pulling from itself):
    >>> import time, jax, numpy as np
    >>> server = start("127.0.0.1")
    >>> x = jax.device_put(np.arange(4.0), jax.devices()[0])
    >>> await_pull(server, 7, [x], time.monotonic() + 30)
    >>> spec = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    >>> pull(connect(server, server.address()), 7, [spec])[0].tolist()
    [0.0, 1.0, 2.0, 3.0]
  """
  server.await_pull(uuid, list(arrays), timeout=_wall_clock(deadline))


def pull(connection: Any, uuid: int, specs: Sequence[jax.ShapeDtypeStruct],
         deadline: float | None = None) -> list[jax.Array]:
  """The arrays the peer offered under `uuid`, one per spec (each with a
  `SingleDeviceSharding` naming the device it lands on). Returns at once with arrays
  that become ready as their bytes arrive; the caller bounds that wait: a uuid never
  offered (or whose offer expired) stays pending until `cancel`. With `deadline` (a
  `time.monotonic()` value) the peer's server drops the request then if it is still
  waiting there for the offer."""
  if deadline is None:
    return list(connection.pull(uuid, list(specs)))
  return list(connection.pull(uuid, list(specs), timeout=_wall_clock(deadline)))


def cancel(connection: Any) -> None:
  """Fails every pull still pending on `connection` and closes it (a pull on a cut link
  otherwise waits until TCP gives up, many minutes later)."""
  connection._poison_connection()  # noqa: SLF001 - no public spelling in 0.10-0.11
