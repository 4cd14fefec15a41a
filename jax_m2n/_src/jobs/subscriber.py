"""`Subscriber`: a generator job's side of weight sync between separate jobs.

Owns a pull's lifecycle: choosing the version (newest not yet pulled, or the one
asked; in a multi-process job process 0 chooses and tells the others through the job's
key-value store), fetching its manifest, matching `dst` and `dtype=` onto the published
pytree (every check before any byte moves), the cached plan, the engine run, assembling
the global arrays, quantizing, donation. Connections to the publisher's processes are
made on first need and remade after a failure.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import Sharding

from jax_m2n._src import jax_compat
from jax_m2n._src import quantize
from jax_m2n._src import checks
from jax_m2n._src.errors import (PeerFailed, ReshardError, ReshardRuntimeError,
                                 ReshardTimeoutError, ReshardTypeError, ReshardValueError)
from jax_m2n._src.jobs import auth, channel, engine, manifest as manifest_lib, messages
from jax_m2n._src.jobs import delta as delta_lib, planning, relay as relay_lib
from jax_m2n._src.jobs.manifest import Manifest
from jax_m2n._src.processes import sequence

_API = "Subscriber"
logger = logging.getLogger("jax_m2n")
# The routes a pull runs (gather_bcast, reshard's legacy baseline, gathers on a trainer
# device first: the trainer job would have to run part of the plan itself).
ROUTES = ("hierarchical", "flat")
# A waiting pull asks the publisher every POLL_S and allows ANSWER_S more for the
# answer: a publisher that died or stalled is named within POLL_S + ANSWER_S = 1.5 s.
POLL_S = 0.5
ANSWER_S = 1.0
# A control request that is not a long poll (manifests, pieces) must be answered within
# this long (a pieces request waits for a lagging trainer process to publish).
REQUEST_S = 60.0


def _is_dst_leaf(v: Any) -> bool:
  return isinstance(v, (Sharding, jax.Array, jax.ShapeDtypeStruct))


def _is_spec_leaf(v: Any) -> bool:
  return isinstance(v, quantize.Quantize) or checks.is_dtype_leaf(v)


class Subscriber:
  """Pulls versions a `Publisher` published, into this job's layouts.

  Every process of the generator job (one process, or a `jax.distributed` job of its
  own, never shared with the trainer) creates its Subscriber and calls `pull` alike;
  each receives only its own devices' shards.

  Args:
    address: process 0 of the trainer job's Publisher address, "host:port".
    token: the publisher's token (str or bytes). A wrong one raises here.
    timeout_s: how long to wait for the publisher to answer the handshake.
    relay: True: this job (one process) relays with the other subscriber jobs that
      pull the same version with the same dst layouts and dtypes: the trainer sends
      each byte once per version to the first of them, and each forwards it, chunk by
      chunk, to the next (docs/jobs.md, "Relays"). Its arrays are then held
      (forwarded) until the group starts the next version. A job of several processes
      pulls directly whatever this says.

  Raises:
    ReshardValueError: a wrong token (either side's proof fails), a malformed address.
    ReshardRuntimeError: nothing answered at `address` within `timeout_s`.

  Example (both jobs in one program here; normally two):
    >>> import jax, jax.numpy as jnp, numpy as np
    >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    >>> pub = jax_m2n.Publisher(token="s3cret")
    >>> mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
    >>> w = jax.device_put(np.arange(32.0).reshape(8, 4), NamedSharding(mesh, P("x")))
    >>> _ = pub.publish({"w": w})
    >>> sub = jax_m2n.Subscriber(pub.address, token="s3cret")
    >>> gen = Mesh(np.array(jax.devices()[4:]), ("y",))
    >>> out = sub.pull(NamedSharding(gen, P(None, "y")), dtype=jnp.bfloat16)
    >>> sub.version, out["w"].dtype, out["w"].sharding.spec == P(None, "y")
    (1, dtype(bfloat16), True)
    >>> sub.close(); pub.close()
  """

  def __init__(self, address: str, *, token: Any, timeout_s: float = 60.0,
               relay: bool = False):
    self._key = auth.as_key(_API, token)
    self._host, _ = channel.split_address(_API, address)
    if not isinstance(relay, bool):
      raise ReshardTypeError(f"{_API}: relay must be a bool; got {type(relay).__name__}.")
    # A one-process job relays (docs/jobs.md, "Relays"); a multi-process job pulls
    # directly (its processes already forward among themselves).
    self._relay = relay_lib.Member(
        _API, engine.local_host_towards(self._host), self._new_root,
    ) if relay and jax.process_count() == 1 else None
    self._address = address
    self._connect_s = checks.options(_API, timeout_s=timeout_s).timeout_ms / 1000
    self._root: channel.Client | None = None
    self._links: dict[int, engine.Link] = {}
    self._manifests: dict[str, Manifest] = {}
    self._closed = False
    self._last: delta_lib.Last | None = None  # what a delta pull applies to
    self.version = 0
    """The version of the last successful pull (0 before the first)."""
    self._root_client()

  # Connections ------------------------------------------------------------------------

  def _root_client(self) -> channel.Client:
    if self._root is None or self._root.broken is not None:
      if self._root is not None:
        self._drop_links()
      self._root = self._new_root()
    return self._root

  def _new_root(self) -> channel.Client:
    """A new control client to the publisher's process 0 (a relay's forwarding thread
    has its own: a zmq socket serves one thread)."""
    return channel.Client(_API, self._address, self._key, self._connect_s,
                          f"the publisher at {self._address}")

  def _drop_links(self) -> None:
    for k, link in self._links.items():
      if link.client is not self._root:
        link.client.close()
    self._links.clear()

  def _reachable(self, address: str) -> str:
    """A manifest's address as this job reaches it: a wildcard host (the trainer
    bound every interface) is the host this subscriber was given."""
    host, port = channel.split_address(_API, address)
    return channel.join_address(self._host if channel.is_wildcard(host) else host, port)

  def _link(self, k: int, m: Manifest) -> engine.Link:
    link = self._links.get(k)
    if link is not None and link.client.broken is None:
      return link
    control, transfer = (self._reachable(a) for a in m.processes[k])
    name = f"trainer process {k} (publisher at {control})"
    client = self._root_client() if k == 0 else channel.Client(
        _API, control, self._key, self._connect_s, name)
    thost, _ = channel.split_address(_API, transfer)
    server = engine.transfer_server(engine.local_host_towards(thost))
    link = self._links[k] = engine.Link(client, server.connect(transfer), name)
    return link

  def close(self) -> None:
    """Closes the connections (the publisher forgets this subscriber's session)."""
    if self._closed:
      return
    self._closed = True
    if self._relay is not None:
      self._relay.close(self._root if self._root and self._root.broken is None
                        else None, ANSWER_S)
    self._drop_links()
    if self._root is not None:
      self._root.close()

  def __enter__(self) -> "Subscriber":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  # The pull ---------------------------------------------------------------------------

  def pull(self, dst: Any, *, dtype: Any = None, version: int | None = None,
           donate: Any = None, route: str = "hierarchical",
           timeout_s: float | None = None, delta: bool = False) -> Any:
    """Returns a published version in this job's layouts.

    Without `version`, the newest version published after this subscriber's last
    pull (waiting up to `timeout_s` for one); with it, that version (held by the
    publisher, or published within `timeout_s`). The result's leaves are global
    jax.Arrays in the dst layouts, bitwise equal to
    `jax.device_put(x.astype(dtype), dst)` of the published x.

    Collective over the generator job: every process calls pull with the same
    arguments, in the same order.

    Args:
      dst: where each leaf goes: a `Sharding`, an array or a `ShapeDtypeStruct`
        whose sharding to use, or a pytree prefix of the published pytree of them
        (matched by key paths). Devices of this job.
      dtype: as reshard's `dtype=`: None (the published dtype), a dtype, a
        `jax_m2n.Quantize` spec, or a pytree prefix of them. A conversion between
        float32, float16, bfloat16 and the float8s crosses in the narrower type;
        others are converted by the publisher first. A Quantize leaf crosses in the
        published dtype and is quantized here, on the dst layout (bitwise qwix's).
      version: a version number to pull, or None (the newest not yet pulled).
      donate: the previous version's arrays (a pytree of jax.Arrays, e.g. the last
        pull's result): deleted once the new version has arrived, so their memory
        serves the next one; kept if the pull fails.
      route: "hierarchical" (default: each byte leaves the trainer once per
        subscriber job and is forwarded and fanned out inside it, its processes being
        the domains) or "flat" (every destination device pulls its pieces from the
        trainer).
      timeout_s: bound on each wait: for a version, for the publisher's answers and
        for the bytes to arrive (default 300 s).
      delta: False (default) or True: the version crosses as only the elements whose
        wire-dtype bits changed since this subscriber's last pull (per chunk of 16 Ki
        elements nothing, a bitmap or index runs with the changed values, or the
        dense chunk: whichever is smallest), applied to that pull's result (in place
        when `donate` is it, off CPU; on CPU to copies of its shards, the donated ones
        then deleted). The result is bitwise what a full pull returns. A full copy
        instead (as delta=False) when there is no earlier delta=True pull, the
        published layouts, dst layouts or dtypes changed, a leaf is quantized, or
        the previous arrays were deleted or donated elsewhere; chunks whose base
        version the publisher no longer holds (beyond `keep`) cross dense. A delta
        pull runs the flat route's pieces (each box once per process). docs/jobs.md
        ("Delta sync") has the measurements behind the default.

    Returns:
      The pytree: the published structure where it is made of dicts, lists, tuples
      and None (or dst's own where dst is a whole tree), of jax.Arrays (QArrays for
      quantized leaves).

    Raises:
      ReshardValueError / ReshardTypeError: dst or dtype that do not fit the published
        pytree (structure, shapes, devices), a version no longer held; before any byte
        moves.
      ReshardTimeoutError: no version (newer than the last pull, or the one asked)
        within timeout_s, or bytes that did not arrive in time.
      ReshardRuntimeError: the publisher died or closed (named, within 2 s of it), a
        transfer failed, another process of this job failed the pull.
    """
    api = "Subscriber.pull"
    if self._closed:
      raise ReshardRuntimeError(f"{api}: the subscriber must be open; got a closed one.")
    options = checks.options(api, route=route, timeout_s=timeout_s)
    if route not in ROUTES:  # gather_bcast gathers on a trainer device: not a pull
      raise ReshardValueError(f"{api}: route must be one of {ROUTES}; got {route!r}.")
    timeout_s = options.timeout_ms / 1000
    if version is not None and (isinstance(version, bool) or not isinstance(version, int)
                                or version < 1):
      raise ReshardValueError(f"{api}: version must be None or an int >= 1; got "
                              f"{version!r}.")
    if not isinstance(delta, bool):
      raise ReshardTypeError(f"{api}: delta must be a bool; got {type(delta).__name__}.")
    donated = _donated(api, donate)
    if jax.process_count() == 1:
      while True:
        number, mid = self._choose(api, version, timeout_s)
        try:
          return self._pull(api, dst, dtype, number, mid, donated, route, timeout_s,
                            None, b"", delta)
        except messages.VersionGone:
          if version is not None:
            raise
          continue  # dropped while we asked for it: the next newest
    return self._pull_job(api, dst, dtype, version, donated, route, timeout_s, delta)

  def _pull_job(self, api, dst, dtype, version, donated, route, timeout_s,
                delta) -> Any:
    """A pull in a multi-process generator job: process 0 chooses the version and a
    random salt (the forwards' uuids) and posts them under the call's key."""
    n = sequence.next_call()
    waits = sequence.CallWaits(n, range(jax.process_count()), int(timeout_s * 1000))
    try:
      if waits.pid == 0:
        number, mid = self._choose(api, version, timeout_s)
        salt = secrets.token_bytes(16)
        waits.post("version", json.dumps([number, mid, salt.hex()]))
      else:
        got = waits.gather("version", [0], "the version process 0 chose")[0]
        number, mid, salt_hex = json.loads(got)
        salt = bytes.fromhex(salt_hex)
      out = self._pull(api, dst, dtype, number, mid, donated, route, timeout_s, waits,
                       salt, delta)
    except BaseException as e:
      if not isinstance(e, PeerFailed):  # the peers fail at once, naming it
        waits.fail(f"{type(e).__name__}: {e}")
      waits.finish(failed=True)
      if isinstance(e, Exception) and not isinstance(e, ReshardError):
        raise ReshardRuntimeError(f"{api}: failed on process {waits.pid}: "
                                  f"{type(e).__name__}: {e}") from e
      raise
    return out

  def _choose(self, api: str, version: int | None, timeout_s: float) -> tuple[int, str]:
    """(version, manifest id): the newest held version after the last pull, or
    `version`; waits for it in long polls of POLL_S."""
    root = self._root_client()
    after = self.version if version is None else version - 1
    deadline = time.monotonic() + timeout_s
    while True:
      wait_s = max(0.0, min(POLL_S, deadline - time.monotonic()))
      reply = root.call({"op": "versions", "after": after,
                         "wait_ms": int(wait_s * 1000)}, wait_s + ANSWER_S,
                        "the list of versions")
      held = reply.get("versions")
      if not isinstance(held, list) or not all(
          isinstance(v, list) and len(v) == 2 and type(v[0]) is int
          and isinstance(v[1], str) for v in held):
        raise ReshardRuntimeError(f"{api}: {root.peer} answered with a malformed list "
                                  "of versions.")
      if reply.get("closed"):
        raise ReshardRuntimeError(f"{api}: {root.peer} closed (the trainer stopped "
                                  "publishing).")
      numbers = {n: mid for n, mid in held}
      if version is None:
        newer = [n for n in numbers if n > after]
        if newer:
          return max(newer), numbers[max(newer)]
      elif version in numbers:
        return version, numbers[version]
      elif numbers and version < max(numbers):
        raise messages.VersionGone(
            f"{api}: version must be one the publisher holds; got {version}, and "
            f"{root.peer} holds {sorted(numbers)} (keep={reply.get('keep')}).")
      if time.monotonic() >= deadline:
        want = (f"a version newer than {after}" if version is None
                else f"version {version}")
        raise ReshardTimeoutError(
            f"{api}: {want} must be published within timeout_s={timeout_s:g}; got none "
            f"({root.peer} is alive and holds {sorted(numbers) or 'no version'}).")

  def _manifest(self, api: str, mid: str) -> Manifest:
    m = self._manifests.get(mid)
    if m is None:
      reply = self._root_client().call({"op": "manifest", "id": mid}, REQUEST_S,
                                       "a manifest")
      m = manifest_lib.from_json(reply.get("manifest"))
      if m.id != mid:
        raise ReshardRuntimeError(f"{api}: the manifest must match its id; got another.")
      if len(self._manifests) >= 16:
        self._manifests.pop(next(iter(self._manifests)))
      self._manifests[mid] = m
    return m

  def _pull(self, api, dst, dtype, number, mid, donated, route, timeout_s, waits,
            salt, delta) -> Any:
    m = self._manifest(api, mid)
    dsts, outs, specs, build = _match(api, m, dst, dtype)
    planning.check_devices(api, dsts)
    base, why = None, "delta=False"
    if delta:  # the previous result, if a delta can apply to it (delta.base_of)
      base, why = delta_lib.base_of(self._last, mid, dsts, outs,
                                    any(s is not None for s in specs))
      logger.debug("Subscriber.pull: version %d %s", number,
                   f"as a delta against {self._last.version}" if base is not None
                   else f"in full ({why})")
    base_version = self._last.version if base is not None else 0
    pp = planning.plan_pull(m, tuple(dsts), tuple(outs),
                            "flat" if base is not None else route)
    if waits is not None:
      delta_lib.agree(waits, base_version)
      waits.post("fp", pp.fingerprint)
      waits.agree(pp.fingerprint, lambda: f"{len(m.leaves)} leaves")
    try:
      links = {k: self._link(k, m) for k in pp.requests}
      if base is not None:  # a delta pull (delta.py): pulled directly, never relayed
        in_place = {id(a) for a in donated} >= {id(a) for a in base}
        shards = delta_lib.run(pp, links, number, base_version, base, in_place,
                               timeout_s, REQUEST_S)
      else:
        pulled = uuids = None
        if self._relay is not None and links:
          pulled = self._relay.receive(self._root_client(), pp, links, number, timeout_s,
                                       REQUEST_S)
        if pulled is None:
          uuids = engine.request_pieces(pp, links, number, timeout_s, REQUEST_S)
        shards = engine.run(pp, links, uuids, waits, salt, timeout_s, pulled)
    except messages.VersionGone:
      raise
    except ReshardError:
      self._forget_broken()
      raise
    if waits is not None:
      waits.end()  # every process of the job done: a pull succeeds or fails everywhere
      waits.finish()
    arrays = [jax.make_array_from_single_device_arrays(l.shape, d, s, dtype=o)
              for l, d, s, o in zip(m.leaves, dsts, shards, outs)]
    self._last = delta_lib.record(number, mid, dsts, outs, arrays) if delta else None
    arrays = _quantized(api, m, arrays, specs)
    keep = {id(a) for a in arrays}
    for a in donated:
      if id(a) not in keep and not a.is_deleted():
        a.delete()
    self.version = max(self.version, number)
    return build(arrays)

  def _forget_broken(self) -> None:
    for k in [k for k, link in self._links.items() if link.client.broken is not None]:
      del self._links[k]


def _donated(api: str, donate: Any) -> list[jax.Array]:
  if donate is None or donate is False:
    return []
  leaves = jax.tree_util.tree_leaves(donate)
  for leaf in leaves:
    if not isinstance(leaf, jax.Array):
      raise ReshardTypeError(f"{api}: donate must be None or a pytree of jax.Arrays (the "
                             f"previous version's); got a {type(leaf).__name__} leaf.")
  return leaves


def _by_prefix(api: str, what: str, m: Manifest, tree: Any,
               is_leaf: Callable[[Any], bool]) -> tuple[list[Any], list[int], Any, list]:
  """Per published leaf, the leaf of `tree` (a pytree prefix, matched by key paths)
  covering it; also its index in tree's leaves, tree's treedef and its key paths."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
  paths = [manifest_lib.key_path(p) for p, _ in flat]
  index = {p: i for i, p in enumerate(paths)}
  picked, used = [], set()
  for leaf in m.leaves:
    i = next((index[leaf.path[:k]] for k in range(len(leaf.path) + 1)
              if leaf.path[:k] in index), None)
    if i is None:
      raise ReshardValueError(
          f"{api}: {what} must be a pytree prefix of the published pytree; got none for "
          f"published leaf {''.join(leaf.path) or 'the root'} ({what} has leaves at "
          f"{[''.join(p) or 'the root' for p in paths][:8]}).")
    picked.append(i)
    used.add(i)
  unused = [''.join(paths[i]) or "the root" for i in range(len(paths)) if i not in used]
  if unused:
    raise ReshardValueError(
        f"{api}: {what} must be a pytree prefix of the published pytree; got leaves that "
        f"name no published leaf: {unused[:8]} (published: "
        f"{[''.join(l.path) for l in m.leaves][:8]}...).")
  return [flat[i][1] for i in picked], picked, treedef, paths


def _match(api: str, m: Manifest, dst: Any, dtype: Any):
  """Per published leaf its dst sharding, delivered dtype and Quantize spec (or
  None), and a function building the result's pytree; checks everything."""
  names = lambda: ["".join(l.path) or "the root" for l in m.leaves]  # noqa: E731
  values, picked, treedef, paths = _by_prefix(api, "dst", m, dst, _is_dst_leaf)
  dsts = []
  for t, (leaf, v) in enumerate(zip(m.leaves, values)):
    name = names()[t]
    sharding = v if isinstance(v, Sharding) else getattr(v, "sharding", None)
    if not isinstance(sharding, Sharding):
      raise ReshardTypeError(f"{api}: dst must hold Shardings, or arrays or "
                             f"ShapeDtypeStructs with one; got {type(v).__name__} for "
                             f"{name}.")
    if not isinstance(v, Sharding) and tuple(v.shape) != leaf.shape:
      raise ReshardValueError(f"{api}: the dst of {name} must have the published shape "
                              f"{leaf.shape}; got {tuple(v.shape)}.")
    checks.check_holds(api, name, sharding, leaf.shape, "destination")
    dsts.append(sharding)
  if dtype is None:
    specs = [None] * len(m.leaves)
  else:
    specs = _by_prefix(api, "dtype", m, dtype, lambda v: v is None or _is_spec_leaf(v))[0]
  outs, quant = [], []
  for t, (leaf, spec) in enumerate(zip(m.leaves, specs)):
    published = manifest_lib.dtype_of(leaf.dtype)
    if isinstance(spec, quantize.Quantize):
      quantize._resolve(api, names, t, spec, leaf.shape, published)  # checked now
      outs.append(published)
      quant.append(spec)
      continue
    out = published if spec is None else np.dtype(checks.as_dtype(api, spec))
    if out.name not in manifest_lib.DTYPES:
      raise ReshardTypeError(f"{api}: dtype must be one of {manifest_lib.DTYPES}; got "
                             f"{out} for {names()[t]}.")
    outs.append(out)
    quant.append(None)
  whole = len(paths) == len(m.leaves) and all(
      paths[i] == l.path for i, l in zip(picked, m.leaves)) and picked == list(
          range(len(m.leaves)))
  if whole:
    build = lambda arrays: jax.tree_util.tree_unflatten(treedef, arrays)  # noqa: E731
  elif m.skeleton is not None:
    manifest_lib.rebuild(m.skeleton, [None] * len(m.leaves))  # checked before moving
    build = lambda arrays: manifest_lib.rebuild(m.skeleton, arrays)  # noqa: E731
  else:
    raise ReshardValueError(
        f"{api}: dst must be the whole pytree (not a prefix) when the published pytree "
        "holds nodes other than dicts, lists, tuples and None (their classes do not "
        "travel); got a prefix. Hint: pass this job's own params (or their shardings) "
        "as dst.")
  return dsts, outs, quant, build


def _quantized(api: str, m: Manifest, arrays: list[jax.Array], specs: list[Any]
               ) -> list[Any]:
  """Quantizes the leaves with a Quantize spec on their dst layouts (one compiled
  program per device assignment, as reshard's quantized path)."""
  todo = [t for t, s in enumerate(specs) if s is not None]
  if not todo:
    return arrays
  names = lambda: ["".join(l.path) or "the root" for l in m.leaves]  # noqa: E731
  groups: dict[tuple[int, ...], list[int]] = {}
  for t in todo:
    key = tuple(d.id for d in jax_compat.device_assignment(arrays[t].sharding))
    groups.setdefault(key, []).append(t)
  out = list(arrays)
  for members in groups.values():
    leaves = [quantize._resolve(api, names, t, specs[t], m.leaves[t].shape,
                                np.dtype(arrays[t].dtype)) for t in members]
    for t, (qvalue, scale), leaf in zip(members, quantize._run_program(
        [arrays[t] for t in members], leaves), leaves):
      out[t] = quantize._wrap(qvalue, scale, leaf.qtype)
  return out
