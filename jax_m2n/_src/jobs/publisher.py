"""`Publisher`: the trainer job's side of weight sync between separate jobs.

Owns the public calls (publish, close) and what one Publisher holds: its versions
(versions.py), its control server (channel.py) answering with serving.py, and its
share of this process's transport. In a multi-process trainer job each process serves
its own shards; the processes' addresses meet through the job's key-value store.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from typing import Any

import jax

from jax_m2n._src import jax_compat
from jax_m2n._src.errors import (ReshardRuntimeError, ReshardTimeoutError,
                                 ReshardTypeError, ReshardValueError)
from jax_m2n._src import local_memory
from jax_m2n._src.jobs import auth, channel, exports, lifetime, records
from jax_m2n._src.jobs import metrics as metrics_lib
from jax_m2n._src.jobs import serving, transports
from jax_m2n._src.jobs.counters import Counters
from jax_m2n._src.jobs.versions import Versions, check_published
from jax_m2n._src.planner.plan import fmt_bytes

logger = logging.getLogger("jax_m2n")
_API = "Publisher"
_instances = itertools.count()


class Publisher(lifetime.Closing):
  """Publishes versions of a pytree to subscriber jobs (separate programs).

  Every process of the trainer job (one process, or a `jax.distributed` job) creates
  its Publisher and calls `publish` alike (the multi-controller convention); each
  serves only its own devices' shards. Subscribers connect to process 0's address and
  learn the others' from the manifest.

  Args:
    address: "host:port" to listen on for subscribers' control messages. None (the
      default): "127.0.0.1:0", loopback only, a free port (`address` says which).
      Process 0 binds it as given; other processes of the job bind the same host on a
      free port (give each process its own host where they run on different hosts).
      The bytes themselves go through this process's transport, bound to the same
      host, or, for a subscriber on this host, straight from this process's memory.
    token: a str of at least 16 characters (or 16 bytes) both jobs hold, e.g.
      `jax_m2n.new_token()`. The control channel is CurveZMQ with keys derived from it
      (scrypt): only a holder completes the handshake, both sides prove it without
      revealing it, and every control message is encrypted (docs/jobs.md,
      "Security").
    keep: how many versions to hold (at least 1): a subscriber can pull any held one.
    timeout_s: how long process k > 0 waits for its peers' addresses at start.
    encrypt: whether the bytes on the network are encrypted too (CurveZMQ, keys from
      the token: "net+curve"); by default they cross in the clear (only authenticated
      subscribers learn the tickets that fetch them). Local pulls never cross a
      network.
    transport: "net" (the default: jax_m2n's ZeroMQ transport) or
      "transfer_server" (JAX's transfer server: no authentication of its own, no
      encryption; loopback or a network you trust).
    metrics: a `prometheus_client.CollectorRegistry` to expose this process's counts
      in (read at every scrape; docs/watching.md), or None. No port is
      opened; instances passing one registry share its metrics.
    lend_limit: None (the default: lend any allocation), or a number >= 1: `publish(...,
      lend=True)` lends an XLA allocation only where it is at most `lend_limit` x the
      bytes lent from it, else snapshots the version (`stats().versions[i].held_as`
      says why). A local reader maps whole allocations: with XLA's preallocation one
      allocation is the whole pool (docs/jobs_security.md).

  Memory: each held version is a snapshot of this process's shards in the published
  dtype (`publish(..., dtype=)`), so at most `keep` x the published bytes, plus the
  pieces cut for subscribers in flight (a subscriber's wire dtype, while it pulls).
  Local subscribers on GPUs map the snapshots' XLA allocations as they are (no second
  copy). `publish(..., lend=True)` holds no copy at all on GPUs: the caller's arrays are
  read in place (`stats().device_bytes` says what is held, per device).

  Example:
    >>> import jax, numpy as np
    >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    >>> pub = jax_m2n.Publisher(token="s3cret-token-0123456789", keep=2)   # 127.0.0.1, a free port
    >>> mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
    >>> w = jax.device_put(np.arange(32.0).reshape(8, 4), NamedSharding(mesh, P("x")))
    >>> pub.publish({"w": w})
    1
    >>> s = pub.stats(); s.last_version, s.held_bytes, s.subscribers
    (1, 128, 0)
    >>> pub.close()
  """

  def __init__(self, address: str | None = None, *, token: Any, keep: int = 2,
               timeout_s: float = 60.0, encrypt: bool = False,
               transport: str = "net", metrics: Any = None,
               lend_limit: float | None = None):
    key = auth.as_key(_API, token)
    prometheus = metrics_lib.of(_API, metrics)
    if not isinstance(encrypt, bool):
      raise ReshardTypeError(f"{_API}: encrypt must be a bool; got "
                             f"{type(encrypt).__name__}.")
    if transport not in ("net", "transfer_server"):
      raise ReshardValueError(f"{_API}: transport must be 'net' or 'transfer_server'; "
                              f"got {transport!r}.")
    if encrypt and transport != "net":
      raise ReshardValueError(f"{_API}: encrypt=True needs transport='net' (the "
                              f"transfer server cannot encrypt); got {transport!r}.")
    spec = "net+curve" if encrypt else transport
    if isinstance(keep, bool) or not isinstance(keep, int):
      raise ReshardTypeError(f"{_API}: keep must be an int >= 1; got "
                             f"{type(keep).__name__} {keep!r}.")
    if keep < 1:
      raise ReshardValueError(f"{_API}: keep must be an int >= 1; got {keep}.")
    if lend_limit is not None and (isinstance(lend_limit, bool) or not isinstance(
        lend_limit, (int, float)) or not lend_limit >= 1):
      raise ReshardValueError(f"{_API}: lend_limit must be None or a number >= 1; got "
                              f"{lend_limit!r}.")
    host, port = channel.split_address(_API, address or "127.0.0.1:0")
    self._pid = jax.process_index()
    self._fds = _FdServers()  # made when a local subscriber asks
    self._versions = Versions(keep, self._fds.get, lend_limit)
    self._transport = transports.acquire_spec(spec, host, key)
    self._counters = Counters()
    self._service = serving.Service(self._pid, self._versions,
                                    self._counters.counting(self._transport),
                                    self._counters)
    try:
      self._server = channel.Server(
          _API, channel.join_address(host, port if self._pid == 0 else 0), key,
          self._service.handle, self._service.tick)
    except BaseException:
      transports.release(self._transport)
      raise
    self._counters.bind(self._pid, self._server, self._versions, self._transport, spec)
    if prometheus is not None:
      prometheus.watch(self._counters)
    mine = (self._server.address, self._transport.address, exports.host_identity(), spec)
    try:
      self._processes = _gather_addresses(mine, next(_instances), timeout_s)
    except BaseException:
      self._server.close()
      transports.release(self._transport)
      raise
    self._close_with(_shut, self._service, self._server, self._versions, self._fds,
                     self._transport)

  @property
  def address(self) -> str:
    """This process's control address (process 0's is the one subscribers use)."""
    return self._server.address

  @property
  def version(self) -> int:
    """The last version published (0 before the first)."""
    return self._versions.published

  def publish(self, tree: Any, *, dtype: Any = None, lend: bool = False) -> int:
    """Publishes a new version of `tree` and returns its number (1, 2, ...) at once.

    By default the version is a snapshot of this process's shards (copied, or
    converted to `dtype`), so the caller may donate, overwrite or delete its arrays as
    soon as publish returns. Beyond `keep` versions the oldest is dropped (a subscriber
    pulling it then gets an error; one pulling the newest moves on to the next).

    With `lend=True` (GPUs) nothing is copied: the version holds the caller's arrays
    (those already in the published dtype) and subscribers read them in place, local
    ones straight from the trainer's GPU memory. JAX arrays change only by donation or
    deletion; once one of the version's arrays is donated or deleted the version is
    gone (a pull of it fails with VersionGone or moves to a newer one; it never returns
    other bytes). A trainer that donates its weights each step calls
    `wait_pulled(version, n)` first. On CPU `lend=True` is accepted and behaves as a
    snapshot (XLA's CPU buffers cannot be shared; the snapshot is already the memory
    readers map): `stats().versions[i].held_as` says which it is.

    Args:
      tree: a pytree of global `jax.Array`s (any shardings, on this job's devices).
      dtype: None (publish as they are), a dtype, or a pytree prefix of `tree` of them
        (as reshard's `dtype=`): the published values are `x.astype(dtype)`, held in
        that dtype (e.g. bfloat16 halves the memory of float32 weights). Subscribers
        then get, bitwise, `jax.device_put(x.astype(dtype).astype(theirs), dst)`.
      lend: whether to lend the arrays instead of snapshotting them (see above;
        `Publisher(lend_limit=)` may refuse pooled memory).

    Returns:
      The version number: every process of the trainer job numbers alike.

    Raises:
      ReshardTypeError: a leaf that is no jax.Array, or of a dtype that cannot be
        published (not numbers or bool); `lend` not a bool.
      ReshardValueError: a deleted array, a rank above 8, a bad dtype prefix.
      ReshardRuntimeError: the publisher is closed.
    """
    api = "Publisher.publish"
    if self._closed:
      raise ReshardRuntimeError(f"{api}: the publisher must be open; got a closed one.")
    if not isinstance(lend, bool):
      raise ReshardTypeError(f"{api}: lend must be a bool; got {type(lend).__name__}.")
    paths, leaves, dtypes = check_published(api, tree, dtype)
    version = self._versions.add(tree, paths, leaves, dtypes, self._processes, lend)
    self._server.wake()  # answers the waiting long polls at once
    self._counters.published(version.number)
    logger.info("Publisher: version %d published: %d leaves, %s held here%s",
                version.number, len(leaves), fmt_bytes(version.nbytes),
                "" if version.how == "snapshot" else f" ({version.how})")
    return version.number

  def wait_pulled(self, version: int, n: int = 1, timeout_s: float = 60.0) -> int:
    """Waits until `n` subscriber connections pulled `version` (or a newer one) from
    this process, then stops lending it: the caller may donate or delete its arrays
    (a pull of it still in flight fails its confirmation and moves to a newer version,
    never returning other bytes). A subscriber counts once its pull's copy is done (it
    says so after the copy, on every path; one connection per subscriber process).

    Args:
      version: a version this process published.
      n: how many subscriber connections (>= 0; 0: stop lending at once).
      timeout_s: the longest wait.

    Returns:
      How many had pulled it (>= n).

    Raises:
      ReshardValueError: a version not published yet, n < 0.
      ReshardTimeoutError: fewer than `n` pulled it within `timeout_s` (the version is
        still lent then: call again, or `wait_pulled(version, 0)` to stop lending).
    """
    api = "Publisher.wait_pulled"
    if isinstance(version, bool) or not isinstance(version, int) or not (
        1 <= version <= self._versions.published):
      raise ReshardValueError(f"{api}: version must be one published so far (1.."
                              f"{self._versions.published}); got {version!r}.")
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
      raise ReshardValueError(f"{api}: n must be an int >= 0; got {n!r}.")
    have = self._counters.wait_pulled(version, n, timeout_s)
    if have < n:
      raise ReshardTimeoutError(f"{api}: {n} subscriber(s) must pull version {version} "
                                f"within timeout_s={timeout_s:g}; {have} did.")
    self._versions.release(version)
    self._server.wake()
    return have

  def stats(self) -> records.PublisherStats:
    """This process's state and counts now: the versions held and their bytes, the
    subscribers heard from, the requests answered and failed, the bytes offered per
    version, the local exports (`records.PublisherStats`; docs/watching.md). Any thread; also after close."""
    return self._counters.stats()

  def close(self) -> None:
    """Stops serving: waiting subscribers are told at once (they raise, naming this
    publisher), later requests get no answer; held versions are dropped and this
    process's transport is released (its ports close with the last user). Also when
    a `with` block ends and when the last reference goes."""
    super().close()


class _FdServers:
  """The publisher's fd server, made on first use (a local subscriber asked)."""

  def __init__(self):
    self.made: list[local_memory.FdServer] = []

  def get(self) -> local_memory.FdServer:
    if not self.made:
      self.made.append(local_memory.FdServer())
    return self.made[0]


def _shut(service: serving.Service, server: channel.Server, versions: Versions,
          fds: _FdServers, transport: Any) -> None:
  """A publisher's close (at most once: weakref.finalize): waiting subscribers are told
  (up to 1 s), then the port, the held versions, the fd server and this process's share
  of the transport go."""
  service.closed = True
  server.wake()
  deadline = time.monotonic() + 1.0
  while service.waiting and time.monotonic() < deadline:
    time.sleep(0.01)
  server.close()
  service.close()
  versions.clear()
  for f in fds.made:
    f.close()
  transports.release(transport)


def _gather_addresses(mine: tuple[str, ...], instance: int, timeout_s: float
                      ) -> tuple[tuple[str, ...], ...]:
  """Every trainer process's (control address, transport address, host identity,
  transport spec), through the job's
  key-value store (one process: its own)."""
  if jax.process_count() == 1:
    return (mine,)
  kv = jax_compat.distributed_client()
  if kv is None:
    raise ReshardRuntimeError(
        f"{_API}: a trainer job of {jax.process_count()} processes must run under "
        "jax.distributed (its processes exchange addresses through its key-value "
        "store); got no distributed client.")
  prefix = f"jax_m2n/jobs/publisher/{instance}"
  kv.key_value_set(f"{prefix}/{jax.process_index()}", json.dumps(list(mine)),
                   allow_overwrite=True)
  out = []
  for p in range(jax.process_count()):
    try:
      value = kv.blocking_key_value_get(f"{prefix}/{p}", int(timeout_s * 1000))
    except Exception as e:  # noqa: BLE001 - the store's timeout
      raise ReshardRuntimeError(
          f"{_API}: every trainer process must create its Publisher within "
          f"timeout_s={timeout_s:g}; got no address from process {p} ({e}).") from None
    out.append(tuple(json.loads(value)))
  return tuple(out)
