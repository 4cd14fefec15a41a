"""`Publisher`: the trainer job's side of weight sync between separate jobs.

Owns versions (a snapshot of this process's shards per `publish`, at most `keep` held),
their manifests, this process's control server (versions, manifests, pieces) and
transfer server, and cutting the pieces a subscriber asks for (a box of a held shard,
in the wire dtype) into offers under random uuids. In a multi-process trainer job each
process serves its own shards; the processes' addresses meet through the job's
key-value store. Plans nothing; a request's every field is checked before use.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import json
import logging
import secrets
import threading
import time
from typing import Any

import jax
import numpy as np

from jax_m2n._src import jax_compat
from jax_m2n._src import checks
from jax_m2n._src.errors import (ReshardRuntimeError, ReshardTypeError,
                                 ReshardValueError)
from jax_m2n._src.jobs import auth, channel, engine, manifest as manifest_lib, messages
from jax_m2n._src.jobs import delta, pieces, relay
from jax_m2n._src.jobs.messages import ProtocolError
from jax_m2n._src.layout import MAX_RANK, Box, Layout
from jax_m2n._src.planner import DST_SHARD, SRC_SHARD
from jax_m2n._src.processes import transfer_engine

logger = logging.getLogger("jax_m2n")
_API = "Publisher"

# The longest a subscriber may ask the publisher to hold a long poll or an offer.
MAX_WAIT_MS = 60_000
MAX_OFFER_MS = 1 << 31
# A pieces request may ask for at most this many times the bytes this process holds of
# the version (flat routes send a box once per destination replica), plus 1 MiB.
MAX_REQUEST_FACTOR = 64

_instances = itertools.count()


@dataclasses.dataclass
class _Version:
  number: int
  manifest: manifest_lib.Manifest
  # (leaf, publisher device index) -> (box, snapshot array on that device)
  shards: dict[tuple[int, int], tuple[Box, jax.Array]]
  nbytes: int
  # Per wire dtype asked for, the shards converted to it (made once per version on
  # the first request, dropped with the version): a conversion costs one pass per
  # version, not one per subscriber, and the pieces are then cut without converting.
  wire: dict[Any, dict[tuple[int, int], jax.Array]] = dataclasses.field(
      default_factory=dict)

  def shard(self, t: int, k: int, dtype: np.dtype) -> tuple[Box, jax.Array]:
    box, array = self.shards[(t, k)]
    if array.dtype == dtype:
      return box, array
    converted = self.wire.setdefault(dtype, {})
    got = converted.get((t, k))
    if got is None:
      got = converted[(t, k)] = _converter(np.dtype(dtype))(array)
    return box, got


@functools.lru_cache(maxsize=64)
def _converter(dtype: Any):
  return jax.jit(lambda a: a.astype(dtype))


def _snapshot(array: jax.Array, dtype: np.dtype) -> jax.Array:
  """A copy of one single-device array in `dtype`, never aliasing it (the trainer may
  donate or overwrite its arrays once publish returns)."""
  if array.dtype == dtype:
    return jax.device_put(array, may_alias=False)
  return _converter(np.dtype(dtype))(array)


class Publisher:
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
      The bytes themselves go through JAX's transfer server, bound to the same host.
    token: a str or bytes both jobs hold; subscribers prove it by challenge-response
      (HMAC-SHA256; the token itself never travels) and every control message is
      authenticated with a per-session key. The transfer server authenticates nobody:
      its offers are named by random 64-bit uuids handed only to authenticated
      subscribers (docs/jobs.md, "Security").
    keep: how many versions to hold (at least 1): a subscriber can pull any held one.
    timeout_s: how long process k > 0 waits for its peers' addresses at start.

  Memory: each held version is a snapshot of this process's shards in the published
  dtype (`publish(..., dtype=)`), so at most `keep` x the published bytes, plus the
  pieces cut for subscribers in flight (a subscriber's wire dtype, while it pulls).

  Example:
    >>> import jax, numpy as np
    >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    >>> pub = jax_m2n.Publisher(token="s3cret", keep=2)   # 127.0.0.1, a free port
    >>> mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
    >>> w = jax.device_put(np.arange(32.0).reshape(8, 4), NamedSharding(mesh, P("x")))
    >>> pub.publish({"w": w})
    1
    >>> pub.close()
  """

  def __init__(self, address: str | None = None, *, token: Any, keep: int = 2,
               timeout_s: float = 60.0):
    key = auth.as_key(_API, token)
    if isinstance(keep, bool) or not isinstance(keep, int):
      raise ReshardTypeError(f"{_API}: keep must be an int >= 1; got "
                             f"{type(keep).__name__} {keep!r}.")
    if keep < 1:
      raise ReshardValueError(f"{_API}: keep must be an int >= 1; got {keep}.")
    host, port = channel.split_address(_API, address or "127.0.0.1:0")
    self._keep = keep
    self._pid = jax.process_index()
    self._lock = threading.Lock()
    self._versions: collections.OrderedDict[int, _Version] = collections.OrderedDict()
    self._published = 0
    self._polls: list[tuple[channel.Caller, int, float]] = []
    self._deferred: list[tuple[channel.Caller, dict[str, Any], float]] = []
    # (structure, avals, shardings, dtypes) -> (manifest, per leaf device -> box,
    # device id -> publisher device index)
    self._manifests: dict[Any, tuple[Any, ...]] = {}
    self._closed = False
    # Relays among subscribers (process 0 coordinates; every process offers chunks).
    self._relay = relay.Coordinator(self._held)
    self._transfer = engine.transfer_server(host)
    transfer_port = channel.split_address(_API, self._transfer.address())[1]
    self._server = channel.Server(_API, channel.join_address(host, port if self._pid == 0
                                                             else 0),
                                  key, self._handle, self._tick)
    mine = (self._server.address, channel.join_address(host, transfer_port))
    try:
      self._processes = _gather_addresses(mine, next(_instances), timeout_s)
    except BaseException:
      self._server.close()
      raise

  # The trainer's calls ------------------------------------------------------------------

  @property
  def address(self) -> str:
    """This process's control address (process 0's is the one subscribers use)."""
    return self._server.address

  @property
  def version(self) -> int:
    """The last version published (0 before the first)."""
    return self._published

  def publish(self, tree: Any, *, dtype: Any = None) -> int:
    """Publishes a new version of `tree` and returns its number (1, 2, ...) at once.

    The version is a snapshot of this process's shards (copied, or converted to
    `dtype`), so the caller may donate, overwrite or delete its arrays as soon as
    publish returns. Beyond `keep` versions the oldest is dropped (a subscriber
    pulling it then gets an error; one pulling the newest moves on to the next).

    Args:
      tree: a pytree of global `jax.Array`s (any shardings, on this job's devices).
      dtype: None (publish as they are), a dtype, or a pytree prefix of `tree` of them
        (as reshard's `dtype=`): the published values are `x.astype(dtype)`, held in
        that dtype (e.g. bfloat16 halves the memory of float32 weights). Subscribers
        then get, bitwise, `jax.device_put(x.astype(dtype).astype(theirs), dst)`.

    Returns:
      The version number: every process of the trainer job numbers alike.

    Raises:
      ReshardTypeError: a leaf that is no jax.Array, or of a dtype that cannot be
        published (not numbers or bool).
      ReshardValueError: a deleted array, a rank above 8, a bad dtype prefix.
      ReshardRuntimeError: the publisher is closed.
    """
    api = "Publisher.publish"
    if self._closed:
      raise ReshardRuntimeError(f"{api}: the publisher must be open; got a closed one.")
    with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
    leaves = [v for _, v in with_path]
    for (path, leaf) in with_path:
      name = jax.tree_util.keystr(path)
      if not isinstance(leaf, jax.Array) or isinstance(leaf, jax.core.Tracer):
        raise ReshardTypeError(
            f"{api}: every leaf must be a global jax.Array; got {type(leaf).__name__} at "
            f"{name or 'the root'}. Hint: jax.device_put it onto the trainer's devices.")
      if leaf.is_deleted():
        raise ReshardValueError(f"{api}: every leaf must be alive; got a deleted array at "
                                f"{name or 'the root'}.")
      if np.dtype(leaf.dtype).name not in manifest_lib.DTYPES:
        raise ReshardTypeError(
            f"{api}: every leaf must hold numbers or bools ({', '.join(manifest_lib.DTYPES)}); "
            f"got {leaf.dtype} at {name or 'the root'}.")
      if leaf.ndim > MAX_RANK:
        raise ReshardValueError(f"{api}: a leaf's rank must be at most {MAX_RANK}; got "
                                f"shape {leaf.shape} at {name or 'the root'}.")
    outs = checks.dtypes_per_leaf(api, dtype, tree, treedef, len(leaves))
    dtypes = [np.dtype(o) if o is not None else np.dtype(l.dtype)
              for o, l in zip(outs, leaves)]
    for d, (path, _) in zip(dtypes, with_path):
      if d.name not in manifest_lib.DTYPES:
        raise ReshardTypeError(f"{api}: dtype must be one of {manifest_lib.DTYPES}; got "
                               f"{d} for {jax.tree_util.keystr(path) or 'the root'}.")
    key = (treedef, tuple((l.shape, l.dtype, l.sharding) for l in leaves), tuple(dtypes))
    got = self._manifests.get(key)
    if got is None:
      paths = [manifest_lib.key_path(p) for p, _ in with_path]
      m = manifest_lib.build(leaves, paths, dtypes, manifest_lib.skeleton_of(tree),
                             self._processes)
      index = {i: k for k, i in enumerate(
          sorted({d.id for l in leaves for d in l.sharding.device_set}))}
      boxes = []
      for leaf in leaves:
        layout = Layout.from_sharding(leaf.sharding, leaf.shape)
        boxes.append({index[d]: b for d, b in zip(layout.devices, layout.boxes)})
      if len(self._manifests) >= 16:
        self._manifests.pop(next(iter(self._manifests)))
      got = self._manifests[key] = (m, boxes, index)
    m, boxes, index = got
    shards = {}
    nbytes = 0
    for t, (leaf, dt) in enumerate(zip(leaves, dtypes)):
      devices = jax_compat.addressable_device_assignment(leaf.sharding)
      for dev, arr in zip(devices, jax_compat.single_device_arrays(leaf)):
        k = index[dev.id]
        snap = _snapshot(arr, dt)
        shards[(t, k)] = (boxes[t][k], snap)
        nbytes += snap.nbytes
    with self._lock:
      self._published += 1
      number = self._published
      self._versions[number] = _Version(number, m, shards, nbytes)
      while len(self._versions) > self._keep:
        self._versions.popitem(last=False)
    self._server.wake()
    logger.debug("Publisher: version %d, %d leaves, %d bytes held here", number,
                 len(leaves), nbytes)
    return number

  def close(self) -> None:
    """Stops serving: waiting subscribers are told at once (they raise, naming this
    publisher), later requests get no answer; held versions are dropped."""
    if self._closed:
      return
    self._closed = True
    self._server.wake()
    deadline = time.monotonic() + 1.0
    while (self._polls or self._deferred) and time.monotonic() < deadline:
      time.sleep(0.01)
    self._server.close()
    with self._lock:
      self._versions.clear()

  def __enter__(self) -> "Publisher":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def __del__(self):
    try:
      self.close()
    except Exception:  # noqa: BLE001 - interpreter shutdown
      pass

  # The server thread ------------------------------------------------------------------

  def _handle(self, caller: channel.Caller, body: dict[str, Any]) -> None:
    op = messages.field(body, "op", str, max_len=32)
    if op == "versions":
      after = messages.field(body, "after", int, lo=0, hi=1 << 62)
      wait_ms = messages.field(body, "wait_ms", int, lo=0, hi=MAX_WAIT_MS)
      self._polls.append((caller, after, time.monotonic() + wait_ms / 1000))
    elif op == "manifest":
      want = messages.field(body, "id", str, max_len=64)
      with self._lock:
        found = next((v.manifest for v in self._versions.values()
                      if v.manifest.id == want), None)
      if found is None:
        caller.reply({"error": f"manifest {messages._short(want)} must belong to a held "
                      "version; got an unknown one (dropped: pull again).",
                      "kind": "runtime"})
      else:
        caller.reply({"manifest": found.to_json()})
    elif op in ("pieces", "delta"):
      messages.field(body, "version", int, lo=1, hi=1 << 62)
      if op == "delta":  # the version the subscriber holds (0: none)
        messages.field(body, "base", int, lo=0, hi=1 << 62)
      timeout_ms = messages.field(body, "timeout_ms", int, lo=1, hi=MAX_OFFER_MS)
      self._deferred.append((caller, body, time.monotonic() + min(
          timeout_ms, MAX_WAIT_MS) / 1000))
    elif op in relay.OPS and self._pid == 0:
      self._relay.handle(caller, body)
    else:
      raise ProtocolError(f"call: op must be versions, manifest, pieces, delta, relay_* or "
                          f"bye; got {messages._short(op)}.")
    self._tick()

  def _held(self) -> list[int]:
    with self._lock:
      return list(self._versions)

  def _tick(self) -> None:
    now = time.monotonic()
    with self._lock:
      held = [[n, v.manifest.id] for n, v in self._versions.items()]
      published = self._published
    keep = []
    for caller, after, deadline in self._polls:
      if self._closed or any(n > after for n, _ in held) or now >= deadline:
        caller.reply({"versions": held, "closed": self._closed, "keep": self._keep})
      else:
        keep.append((caller, after, deadline))
    self._polls = keep
    keep = []
    for caller, body, deadline in self._deferred:
      version = body["version"]
      if self._closed:
        caller.reply({"error": "the publisher closed.", "kind": "runtime"})
      elif version <= published:
        try:
          caller.reply(self._pieces(body) if body["op"] == "pieces"
                       else self._delta(body))
        except ProtocolError as e:
          caller.reply({"error": str(e), "kind": "value"})
      elif now >= deadline:
        caller.reply({"error": f"version {version} must be published by trainer process "
                      f"{self._pid} in time; it has published {published} so far.",
                      "kind": "timeout"})
      else:
        keep.append((caller, body, deadline))  # this process has not published it yet
    self._deferred = keep
    self._relay.tick(self._closed)

  def _pieces(self, body: dict[str, Any]) -> dict[str, Any]:
    """Cuts the asked boxes of a held version (in their wire dtypes), offers each
    group to the transfer server under a random uuid, and returns the uuids."""
    number = body["version"]
    with self._lock:
      version = self._versions.get(number)
      held = list(self._versions)
    if version is None:
      return {"error": f"version {number} must be held to be pulled; trainer process "
              f"{self._pid} holds {held} (keep={self._keep}).", "kind": "gone"}
    m = version.manifest
    wire = manifest_lib.wire_field(body, "pieces", len(m.leaves))
    groups = body.get("groups")
    if not isinstance(groups, list) or not groups or len(groups) > 1 << 16:
      raise ProtocolError("pieces: groups must be a non-empty list of piece lists.")
    budget = MAX_REQUEST_FACTOR * version.nbytes + (1 << 20)
    offers = []
    for group in groups:
      if not isinstance(group, list) or not group:
        raise ProtocolError("pieces: every group must be a non-empty list of packs.")
      packs = []
      for pack in group:
        if not isinstance(pack, list) or not pack:
          raise ProtocolError("pieces: every pack must be a non-empty list of pieces.")
        ops = []
        for piece in pack:
          t, k, box, nbytes = manifest_lib.piece_field(piece, "pieces", m.leaves,
                                                       version.shards, wire)
          budget -= nbytes
          if budget < 0:
            raise ProtocolError(f"pieces: a request must ask for at most "
                                f"{MAX_REQUEST_FACTOR} x the version's bytes here.")
          ops.append(transfer_engine.Op(t, k, -1, SRC_SHARD, DST_SHARD, box, "inject"))
        if len({op.src for op in ops}) != 1 or len({wire[op.tensor] for op in ops}) != 1:
          raise ProtocolError("pieces: the pieces of a pack must share a device and a "
                              "wire dtype.")
        packs.append(ops)
      offers.append(packs)
    timeout_s = body["timeout_ms"] / 1000
    if "chunk_bytes" in body:  # a relay's head (or a re-route): chunks, one offer each
      return relay.offer_chunks(self._transfer, [_cut(version, ops, wire)
                                                 for ops in offers], body, timeout_s)
    uuids = []
    for ops in offers:
      uuid = secrets.randbits(64)
      self._transfer.await_pull(uuid, _cut(version, ops, wire),
                                timeout=engine.offer_deadline(timeout_s))
      uuids.append(uuid)
    return {"uuids": uuids}

  def _delta(self, body: dict[str, Any]) -> dict[str, Any]:
    """The asked boxes of a held version as a delta against the subscriber's base
    version (`delta.serve`; every chunk dense when the base is no longer held)."""
    with self._lock:
      version = self._versions.get(body["version"])
      base = self._versions.get(body["base"])
      held = list(self._versions)
    if version is None:
      return {"error": f"version {body['version']} must be held to be pulled; trainer "
              f"process {self._pid} holds {held} (keep={self._keep}).", "kind": "gone"}
    return delta.serve(version, base, body, self._transfer)


def _cut(version: _Version, packs: list[list[transfer_engine.Op]],
         wire: dict[int, np.dtype]) -> list[jax.Array]:
  """One array per pack: its one box in the wire dtype (the snapshot itself where that
  is a whole shard in its own dtype), or its boxes flattened and concatenated; one
  compiled program per source device."""
  batches: dict[int, pieces.Batch] = {}
  slots = []
  for ops in packs:
    k, dtype = ops[0].src, wire[ops[0].tensor]
    batch = batches.setdefault(k, pieces.Batch())
    boxes = []
    for op in ops:
      held, array = version.shard(op.tensor, k, dtype)
      starts = tuple(lo - h for (lo, _), (h, _) in zip(op.box, held))
      limits = tuple(hi - h for (_, hi), (h, _) in zip(op.box, held))
      shape = pieces.shape_of(op.box)
      boxes.append(([((array, -1, pieces.shape_of(held)), starts, limits,
                      (0,) * len(shape))], shape))
    if len(ops) == 1:
      slots.append((k, batch.box(boxes[0][0], boxes[0][1], dtype, dtype)))
    else:
      slots.append((k, batch.pack(boxes, dtype)))
  results = {k: b.run() for k, b in batches.items()}
  return [results[k][j] for k, j in slots]


def _gather_addresses(mine: tuple[str, str], instance: int, timeout_s: float
                      ) -> tuple[tuple[str, str], ...]:
  """Every trainer process's (control, transfer) addresses, through the job's
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
